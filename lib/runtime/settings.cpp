#include "fullshard/runtime/settings.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>

#include "fullshard/base/error.hpp"

extern char** environ;

namespace fullshard {
namespace {

constexpr const char* kLevels[] = {"error", "warn", "info", "debug"};

const char* const kKnown[] = {"FULLSHARD_TIMEOUT",         "FULLSHARD_LOG_LEVEL",
                              "FULLSHARD_HOST_PROGRESS",   "FULLSHARD_RANKS_PER_NODE",
                              "FULLSHARD_BIND_DEVICE",     "FULLSHARD_CKPT_FAULT",
                              "FULLSHARD_HOST_COLLECTIVES"};

constexpr const char* kFaultPoints[] = {"mid_shard",      "after_shards",  "mid_index",
                                        "after_index",    "before_latest", "mid_latest",
                                        "prepare_tensor", "slow_write"};

std::string known_list() {
  std::string s;
  for (const char* k : kKnown)
    s += (s.empty() ? "" : ", ") + std::string(k);
  return s;
}

[[noreturn]] void bad(const std::string& var, const std::string& value, const std::string& want) {
  throw SettingsError("environment variable " + var + "='" + value + "' is invalid: expected " +
                      want);
}

double parse_timeout_seconds(const std::string& var, const std::string& v) {
  errno = 0;
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);
  // The upper bound keeps every deadline computed from it far inside a steady_clock duration
  // (int64 nanoseconds: 9.2e9 s), also when added to the clock's current value.
  if (v.empty() || *end != '\0' || errno != 0 || !std::isfinite(d) || d <= 0 ||
      d > kMaxTimeoutSetting) {
    char want[96];
    std::snprintf(want, sizeof want, "a positive number of seconds, at most %.0f (%.1f days)",
                  kMaxTimeoutSetting, kMaxTimeoutSetting / 86400.0);
    bad(var, v, want);
  }
  return d;
}

long parse_int(const std::string& var, const std::string& v, long lo, long hi, const char* want) {
  errno = 0;
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0 || n < lo || n > hi) bad(var, v, want);
  return n;
}

}  // namespace

CheckpointFault parse_checkpoint_fault(const std::string& value) {
  CheckpointFault f;
  if (value.empty()) return f;
  const auto at = value.find('@');
  f.point = value.substr(0, at);
  std::string points;
  bool known = false;
  for (const char* p : kFaultPoints) {
    points += (points.empty() ? "" : ", ") + std::string(p);
    known = known || f.point == p;
  }
  if (!known) bad("FULLSHARD_CKPT_FAULT", value, "<point>[@<rank>] with a point among " + points);
  if (at != std::string::npos)
    f.rank = static_cast<int>(
        parse_int("FULLSHARD_CKPT_FAULT", value.substr(at + 1), 0, 1 << 30, "<point>@<rank >= 0>"));
  return f;
}

const char* host_collectives_name(HostCollectives c) noexcept {
  switch (c) {
    case HostCollectives::auto_:
      return "auto";
    case HostCollectives::shm:
      return "shm";
    case HostCollectives::mpi:
      return "mpi";
  }
  return "?";
}

const char* log_level_name(int level) noexcept {
  return level >= 0 && level < 4 ? kLevels[level] : "?";
}

Settings Settings::from_map(const std::map<std::string, std::string>& vars) {
  Settings s;
  for (const auto& [var, v] : vars) {
    if (var.rfind("FULLSHARD_", 0) != 0) continue;
    if (var == "FULLSHARD_TIMEOUT") {
      s.timeout_s = parse_timeout_seconds(var, v);
    } else if (var == "FULLSHARD_LOG_LEVEL") {
      int found = -1;
      for (int i = 0; i < 4; ++i)
        if (v == kLevels[i]) found = i;
      if (found < 0) bad(var, v, "one of error, warn, info, debug");
      s.log_level = found;
    } else if (var == "FULLSHARD_HOST_PROGRESS") {
      if (v == "thread") {
        s.host_progress = HostProgress::thread;
      } else if (v == "inline") {
        s.host_progress = HostProgress::inline_;
      } else {
        bad(var, v, "thread or inline");
      }
    } else if (var == "FULLSHARD_HOST_COLLECTIVES") {
      if (v == "auto") {
        s.host_collectives = HostCollectives::auto_;
      } else if (v == "shm") {
        s.host_collectives = HostCollectives::shm;
      } else if (v == "mpi") {
        s.host_collectives = HostCollectives::mpi;
      } else {
        bad(var, v, "auto, shm or mpi");
      }
    } else if (var == "FULLSHARD_RANKS_PER_NODE") {
      s.ranks_per_node = static_cast<int>(parse_int(var, v, 1, 1 << 20, "an integer >= 1"));
    } else if (var == "FULLSHARD_BIND_DEVICE") {
      s.bind_device = parse_int(var, v, 0, 1, "0 or 1") == 1;
    } else if (var == "FULLSHARD_CKPT_FAULT") {
      s.checkpoint_fault = parse_checkpoint_fault(v);
    } else {
      // Not an error: Spack modules set FULLSHARD_ROOT, sites set their own, and other parts
      // read theirs (the LibTorch front end, the programs). But a typo must not pass
      // unnoticed, so the runtime prints the others on rank 0.
      static const char* const read_elsewhere[] = {"FULLSHARD_ROOT",
                                                   "FULLSHARD_DIR",
                                                   "FULLSHARD_TORCH_THREADS",
                                                   "FULLSHARD_BLAS_KERNEL",
                                                   "FULLSHARD_BLAS_KERNEL_CHOSEN",
                                                   "FULLSHARD_SCHED_SLICE_MS",
                                                   "FULLSHARD_SRUN_RETRIES",
                                                   "FULLSHARD_LOCK_HEARTBEAT"};
      if (std::find(std::begin(read_elsewhere), std::end(read_elsewhere), var) ==
          std::end(read_elsewhere))
        s.warnings.push_back("unknown environment variable " + var +
                             " is ignored (known: " + known_list() + ")");
    }
  }
  return s;
}

Settings Settings::from_environment() {
  std::map<std::string, std::string> vars;
  for (char** e = environ; e && *e; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (!eq) continue;
    std::string name(static_cast<const char*>(*e), eq);
    if (name.rfind("FULLSHARD_", 0) == 0) vars.emplace(std::move(name), eq + 1);
  }
  return from_map(vars);
}

}  // namespace fullshard
