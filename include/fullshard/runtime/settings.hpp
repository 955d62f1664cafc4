// Run-time settings read from FULLSHARD_* environment variables, validated on read.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace fullshard {

/// How collectives enqueued on a host (MPI) stream make progress.
enum class HostProgress {
  /// Each worker stream owns a thread that runs its operations in order with blocking MPI
  /// calls (default: least overhead measured here, and streams really are independent).
  thread,
  /// Operations run on the calling thread when they are enqueued (no hand-off at all; two
  /// streams can then not run collectives concurrently).
  inline_,
};

/// Every knob that can be set from the environment. The table in README.md lists them.
struct Settings {
  /// FULLSHARD_TIMEOUT (seconds, > 0): a collective waited on for longer than this is
  /// reported with rank, communicator, operation and sequence number, and the job aborts.
  double timeout_s = 600.0;
  /// FULLSHARD_LOG_LEVEL: error | warn | info | debug.
  int log_level = 1;
  /// FULLSHARD_HOST_PROGRESS: thread | inline.
  HostProgress host_progress = HostProgress::thread;
  /// FULLSHARD_RANKS_PER_NODE (>= 1): pretend this many consecutive ranks share a node
  /// (for tests of node-aware meshes on one machine). 0 = detect with MPI.
  int ranks_per_node = 0;
  /// FULLSHARD_BIND_DEVICE (0/1): bind one GPU per local rank when CUDA is enabled.
  bool bind_device = true;

  /// Unknown FULLSHARD_* names seen while reading (printed as warnings by the Runtime).
  std::vector<std::string> warnings;

  /// Reads the process environment. Throws ConfigError naming the variable on a bad value.
  static Settings from_environment();
  /// Same, from an explicit map (used by tests).
  static Settings from_map(const std::map<std::string, std::string>& vars);
};

const char* log_level_name(int level) noexcept;

}  // namespace fullshard
