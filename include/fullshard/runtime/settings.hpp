// Run-time settings read from FULLSHARD_* environment variables, validated on read.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace fullshard {

/// How the collectives of a mesh's channel streams (DeviceMesh::stream) make progress on the
/// host. Explicit Stream::worker / Stream::caller streams are not affected.
enum class HostProgress {
  /// Each channel stream owns a thread that runs its operations in order with blocking MPI
  /// calls: streams are independent, at the price of a hand-off per operation, and of two
  /// threads of one rank polling inside MPI at once when all-gathers and reduce-scatters are
  /// in flight together (measured: a backward step on 2 ranks of one core each took 2.3-2.6 ms
  /// per module instead of 6.3 us).
  thread,
  /// Operations run on the calling thread when they are enqueued (the default: no hand-off
  /// and no competing pollers; safe for FSDP, which issues every rank's collectives in the
  /// same order. Host collectives overlap nothing without asynchronous MPI progress anyway).
  inline_,
};

/// Which transport the FSDP host collectives of a mesh dim use (FULLSHARD_HOST_COLLECTIVES).
enum class HostCollectives {
  /// Node-local shared memory for every dim whose ranks share a node, MPI for the others
  /// (the default): an HSDP mesh with its shard dim inside the node is the two-level case.
  auto_,
  /// As auto_, and fully_shard refuses a shard dim that spans nodes (ConfigError).
  shm,
  /// MPI collectives everywhere (the library's shared-memory transport, if any, inside MPI).
  mpi,
};
const char* host_collectives_name(HostCollectives c) noexcept;

/// FULLSHARD_CKPT_FAULT (tests only): "<point>[@<world rank>]" makes a checkpoint save exit the
/// process with std::_Exit at that point of its protocol (on every rank, or on one), to check
/// that a killed writer leaves the previous checkpoint loadable. Points, in protocol order:
/// mid_shard, after_shards, mid_index, after_index, before_latest, mid_latest
/// (docs/checkpoint-format.md). prepare_tensor instead throws an Error where a save prepares a
/// tensor (allocation, host copy), to check that a failure there fails the save on every rank.
/// slow_write makes an asynchronous save's background writers sleep 3 s before they write.
struct CheckpointFault {
  std::string point;  ///< empty: no fault
  int rank = -1;      ///< -1: every rank
};
/// Parses a FULLSHARD_CKPT_FAULT value ("" gives no fault); ConfigError naming the variable
/// and the valid points.
CheckpointFault parse_checkpoint_fault(const std::string& value);

/// The largest FULLSHARD_TIMEOUT accepted: 1e6 s (11.6 days, longer than any job's wall
/// time). A larger value is refused at start rather than overflowing a clock deadline.
constexpr double kMaxTimeoutSetting = 1e6;

/// Every knob that can be set from the environment. The table in docs/guide/settings.md lists them.
struct Settings {
  /// FULLSHARD_TIMEOUT (seconds, 0 < t <= kMaxTimeoutSetting): a collective waited on for
  /// longer than this is reported with rank, communicator, operation and sequence number, and
  /// the job aborts.
  double timeout_s = 600.0;
  /// FULLSHARD_LOG_LEVEL: error | warn | info | debug.
  int log_level = 1;
  /// FULLSHARD_HOST_PROGRESS: inline | thread.
  HostProgress host_progress = HostProgress::inline_;
  /// FULLSHARD_RANKS_PER_NODE (>= 1): pretend this many consecutive ranks share a node
  /// (for tests of node-aware meshes on one machine). 0 = detect with MPI.
  int ranks_per_node = 0;
  /// FULLSHARD_HOST_COLLECTIVES: auto | shm | mpi (see HostCollectives).
  HostCollectives host_collectives = HostCollectives::auto_;
  /// FULLSHARD_BIND_DEVICE (0/1): bind one GPU per local rank when CUDA is enabled.
  bool bind_device = true;
  /// FULLSHARD_CKPT_FAULT: see CheckpointFault (read again by every checkpoint save).
  CheckpointFault checkpoint_fault;

  /// Unknown FULLSHARD_* names seen while reading (printed as warnings by the Runtime).
  std::vector<std::string> warnings;

  /// Reads the process environment. Throws SettingsError (a ConfigError) naming the variable
  /// on a bad value.
  static Settings from_environment();
  /// Same, from an explicit map (used by tests).
  static Settings from_map(const std::map<std::string, std::string>& vars);
};

const char* log_level_name(int level) noexcept;

}  // namespace fullshard
