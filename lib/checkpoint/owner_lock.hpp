// The lock a run holds on its checkpoint directory (checkpoint::DirectoryClaim): the file
// DIR/.fullshard-lock, created with O_CREAT|O_EXCL (no flock: unreliable on Lustre and NFS),
// holding the owner (run id, Slurm job, host, process, heartbeat interval) as one JSON line;
// its modification time is the owner's heartbeat. Private to lib/checkpoint.
#pragma once

#include <optional>
#include <string>

namespace fullshard::checkpoint::detail {

inline constexpr const char* kLockFile = ".fullshard-lock";

struct LockRecord {
  std::string text;  // the file's content as read
  bool parsed = false;
  std::string run, job, host;
  long long pid = 0;
  double heartbeat_s = 0;  // the owner's interval
  double age_s = 0;        // since the last heartbeat (the file's modification time)
};

/// The heartbeat interval of this process: FULLSHARD_LOCK_HEARTBEAT seconds (default 30).
double heartbeat_interval();
/// SLURM_JOB_ID, or "" outside Slurm.
std::string this_job();
std::string this_host();

/// dir's lock, or nullopt when there is none (or it vanished while read).
std::optional<LockRecord> read_lock(const std::string& dir);
/// Why `lock` no longer holds (empty: its owner is alive): its heartbeat is older than three
/// of its intervals, it names this Slurm job (a requeued job, perhaps on another host), or it
/// names a process of this host that is gone.
std::string stale_reason(const LockRecord& lock);
/// "run R (Slurm job J, host H, process P, heartbeat N s ago)".
std::string describe(const LockRecord& lock);
/// The content of a lock for run `run` of this process.
std::string lock_text(const std::string& run);

/// A save into `dir` (checkpoint::save, convert): Error when another run's live lock holds
/// it (`run`: the saving run's id; empty: a caller without a claim).
void check_not_held_by_another(const std::string& dir, const std::string& run);

}  // namespace fullshard::checkpoint::detail
