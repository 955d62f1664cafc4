// Command-line parsing shared by the apps: "--flag value" or "--flag=value", typed values
// checked with errors that name the flag. A UsageError is what the apps print (with a
// pointer to --help) before exiting with status 2.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/fsdp/options.hpp"
#include "fullshard/mesh/device_mesh.hpp"

namespace fullshard::apps {

struct UsageError {
  std::string message;
};

class ArgParser {
 public:
  ArgParser(int argc, char** argv) : args_(argv + 1, argv + argc) {}
  /// argv followed by `more` (arguments take_flag took out before the Runtime started).
  ArgParser(int argc, char** argv, const std::vector<std::string>& more) : ArgParser(argc, argv) {
    args_.insert(args_.end(), more.begin(), more.end());
  }

  /// Advances to the next flag; false at the end. A positional argument (no leading "--")
  /// is a UsageError unless positional() is used to take it.
  bool next();
  /// The current flag, without any "=value" part.
  const std::string& flag() const noexcept { return flag_; }
  /// The current flag's value (the "=value" part or the next argument).
  std::string value();
  /// For switches: a UsageError when the flag was given as "--flag=value".
  void no_value() const;

  int int_value(std::int64_t min, std::int64_t max = (1ll << 30));
  std::int64_t int64_value(std::int64_t min, std::int64_t max = (1ll << 62));
  double double_value(double min, double max);
  /// true/false/1/0/yes/no.
  bool bool_value();
  /// A dtype name (f32, f16, bf16, f64).
  DType dtype_value();
  /// reshard_after_forward: true, false, auto or an integer k >= 1.
  fsdp::ReshardAfterForward reshard_value();
  /// "N" (FSDP over N ranks) or "RxN" (HSDP: R replicas of N-rank shard groups): {R, N}.
  std::pair<int, int> mesh_value();
  /// cpu or cuda.
  DeviceType device_value();

  [[noreturn]] void unknown() const;

 private:
  std::vector<std::string> args_;
  std::size_t i_ = 0;
  std::string flag_;
  std::optional<std::string> inline_value_;
};

/// Takes every "--help" out of argv (in place; argc shrinks) and says whether there was one.
/// Call it before the Runtime starts: Kokkos would otherwise answer --help with its own help.
bool take_help(int& argc, char** argv);

/// Takes every "--flag VALUE" and "--flag=VALUE" out of argv (in place; argc shrinks) and
/// returns those arguments in their order, for parsing after the Runtime started. Call it
/// before the Runtime starts for flags that Kokkos would claim too (Kokkos 3 reads --device
/// as its device number).
std::vector<std::string> take_flag(int& argc, char** argv, const std::string& flag);

/// Whether the --device arguments that take_flag took ask for cuda (the last one wins, as when
/// they are parsed): for the check of a visible GPU made before the Runtime starts.
bool asks_for_cuda(const std::vector<std::string>& device_args);

/// An exception's message on one line, without the "fullshard[rank R]: " prefix.
std::string one_line(std::string s);

/// Exit status for an exception thrown while the Runtime starts: kBadSettingExit (2, like a
/// bad option) for a bad FULLSHARD_* variable (fullshard::SettingsError), `other` otherwise.
constexpr int kBadSettingExit = 2;
int startup_exit_code(const std::exception& e, int other) noexcept;

}  // namespace fullshard::apps
