#include "cli.hpp"

#include <cmath>
#include <cstdio>
#include <exception>

#include "fullshard/base/error.hpp"

namespace fullshard::apps {

namespace {

/// The whole of `v` as an integer, or nothing.
std::optional<long long> to_integer(const std::string& v) {
  std::size_t used = 0;
  long long x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (v.empty() || used != v.size()) return std::nullopt;
  return x;
}

/// %g: "0.25", "1e+30" rather than std::to_string's "0.250000".
std::string short_number(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", x);
  return b;
}

}  // namespace

bool ArgParser::next() {
  inline_value_.reset();
  if (i_ >= args_.size()) return false;
  flag_ = args_[i_++];
  if (flag_.compare(0, 2, "--") != 0)
    throw UsageError{"unexpected argument '" + flag_ + "' (options start with --)"};
  const auto eq = flag_.find('=');
  if (eq != std::string::npos) {
    inline_value_ = flag_.substr(eq + 1);
    flag_ = flag_.substr(0, eq);
  }
  return true;
}

std::string ArgParser::value() {
  if (inline_value_) return *inline_value_;
  if (i_ >= args_.size()) throw UsageError{flag_ + " needs a value"};
  return args_[i_++];
}

void ArgParser::no_value() const {
  if (inline_value_) throw UsageError{flag_ + " takes no value"};
}

std::int64_t ArgParser::int64_value(std::int64_t min, std::int64_t max) {
  const std::string v = value();
  const auto x = to_integer(v);
  if (!x || *x < min || *x > max)
    throw UsageError{flag_ + " expects an integer in [" + std::to_string(min) + ", " +
                     std::to_string(max) + "], got '" + v + "'"};
  return *x;
}

int ArgParser::int_value(std::int64_t min, std::int64_t max) {
  return static_cast<int>(int64_value(min, max));
}

double ArgParser::double_value(double min, double max) {
  const std::string v = value();
  std::size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (v.empty() || used != v.size() || !std::isfinite(x) || x < min || x > max)
    throw UsageError{flag_ + " expects a number in [" + short_number(min) + ", " +
                     short_number(max) + "], got '" + v + "'"};
  return x;
}

bool ArgParser::bool_value() {
  const std::string v = value();
  if (v == "true" || v == "1" || v == "yes") return true;
  if (v == "false" || v == "0" || v == "no") return false;
  throw UsageError{flag_ + " expects true or false, got '" + v + "'"};
}

DType ArgParser::dtype_value() {
  const std::string v = value();
  try {
    return parse_dtype(v, flag_);
  } catch (const std::exception& e) {
    throw UsageError{one_line(e.what())};
  }
}

fsdp::ReshardAfterForward ArgParser::reshard_value() {
  const std::string v = value();
  if (v == "true") return fsdp::ReshardAfterForward::always();
  if (v == "false") return fsdp::ReshardAfterForward::never();
  if (v == "auto") return fsdp::ReshardAfterForward::automatic();
  const auto k = to_integer(v);
  if (!k || *k < 1 || *k > (1 << 30))
    throw UsageError{flag_ + " expects true, false, auto or an integer >= 1, got '" + v + "'"};
  return fsdp::ReshardAfterForward::group_size(static_cast<int>(*k));
}

std::pair<int, int> ArgParser::mesh_value() {
  const std::string v = value();
  auto parse = [&](const std::string& s) {
    const auto x = to_integer(s);
    if (!x || *x < 1 || *x > (1 << 30))
      throw UsageError{flag_ + " expects N or RxN with positive integers, got '" + v + "'"};
    return static_cast<int>(*x);
  };
  const auto x = v.find('x');
  if (x == std::string::npos) return {1, parse(v)};
  return {parse(v.substr(0, x)), parse(v.substr(x + 1))};
}

DeviceType ArgParser::device_value() {
  const std::string v = value();
  if (v == "cpu") return DeviceType::cpu;
  if (v == "cuda") return DeviceType::cuda;
  throw UsageError{flag_ + " expects cpu or cuda, got '" + v + "'"};
}

void ArgParser::unknown() const {
  throw UsageError{"unknown option '" + flag_ + "'"};
}

bool take_help(int& argc, char** argv) {
  bool help = false;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help")
      help = true;
    else
      argv[kept++] = argv[i];
  }
  argc = kept;
  argv[argc] = nullptr;
  return help;
}

std::vector<std::string> take_flag(int& argc, char** argv, const std::string& flag) {
  std::vector<std::string> taken;
  const std::string with_value = flag + "=";
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == flag) {
      taken.push_back(a);
      if (i + 1 < argc) taken.emplace_back(argv[++i]);
    } else if (a.compare(0, with_value.size(), with_value) == 0) {
      taken.push_back(a);
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  argv[argc] = nullptr;
  return taken;
}

bool asks_for_cuda(const std::vector<std::string>& device_args) {
  bool cuda = false;
  for (std::size_t i = 0; i < device_args.size(); ++i) {
    const std::string& a = device_args[i];
    if (a.rfind("--device=", 0) == 0)
      cuda = a.substr(9) == "cuda";
    else if (i + 1 < device_args.size())
      cuda = device_args[++i] == "cuda";
  }
  return cuda;
}

std::string one_line(std::string s) {
  const std::string prefix = "fullshard[rank ";
  if (s.compare(0, prefix.size(), prefix) == 0) {
    const auto end = s.find("]: ");
    if (end != std::string::npos) s = s.substr(end + 3);
  }
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

int startup_exit_code(const std::exception& e, int other) noexcept {
  return dynamic_cast<const SettingsError*>(&e) ? kBadSettingExit : other;
}

}  // namespace fullshard::apps
