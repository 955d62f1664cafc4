// A run's claim on its checkpoint directory: nothing a user owns is lost to another run.
//
//   checkpoint::DirectoryClaim claim(dir, mesh, {resume});  // before the first step
//   SaveOptions so; claim.apply(so);                         // every save of the run
//   if (resuming) claim.resumed_from(checkpoint::load(dir, model, &opt).step_dir);
//
// - **One run per directory.** Rank 0 creates DIR/.fullshard-lock with O_CREAT|O_EXCL (no
//   flock: unreliable on Lustre and NFS), naming the run, its Slurm job (SLURM_JOB_ID), host
//   and process, and renews its modification time every FULLSHARD_LOCK_HEARTBEAT seconds
//   (default 30) from a thread. A second run on the directory is refused at start, naming the
//   owner. A lock is stale, and taken over with a line on stderr saying so, when its heartbeat
//   is older than three of its intervals, when it names this Slurm job (a requeue, perhaps on
//   another host), or when it names a process of this host that is gone (an exiting one is
//   waited for, up to 3 s: an aborted job's processes outlive its launcher). Saves into a
//   directory another run holds are refused (checkpoint::save, convert).
// - **A fresh run does not inherit another run's checkpoints.** A directory that holds
//   checkpoints (a `latest`) is refused unless the run resumes them (ClaimOptions::resume) or
//   starts over (ClaimOptions::start_over; the earlier checkpoints are kept).
// - **Retention deletes only this run's lineage**: the checkpoints this run wrote and those of
//   the chain it resumed from (each checkpoint records its run and lineage in its index's
//   `saved_by`), never another run's.
//
// The lock is released when the claim is destroyed. Errors are ConfigError on every rank
// naming the directory. Collective constructor.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/mesh/device_mesh.hpp"

namespace fullshard::checkpoint {

struct ClaimOptions {
  /// The run continues the directory's checkpoints (loads the latest when there is one).
  bool resume = false;
  /// A fresh run on a directory holding checkpoints: they are kept (retention never deletes
  /// them), and `latest` names this run's checkpoints once it saves.
  bool start_over = false;
  /// How the user asks for resume and start_over, named in the refusal (a program's options,
  /// a configuration's keys).
  std::string resume_hint = "resume", start_over_hint = "start over";
};

class DirectoryClaim {
 public:
  /// Takes `dir` (which must exist: check_directory first) for this run. Collective over the
  /// mesh.
  DirectoryClaim(const std::string& dir, const DeviceMesh& mesh, ClaimOptions options = {});
  ~DirectoryClaim();
  DirectoryClaim(const DirectoryClaim&) = delete;
  DirectoryClaim& operator=(const DirectoryClaim&) = delete;

  const std::string& dir() const noexcept;
  /// This run's id (16 hex digits, the same on every rank).
  const std::string& run() const noexcept;
  /// The runs whose checkpoints retention may delete: those of the chain this run resumed
  /// from, and this run.
  const std::vector<std::string>& lineage() const noexcept;
  /// Whether the directory held checkpoints when it was claimed (a `latest`).
  bool had_checkpoints() const noexcept;
  /// After loading `step_dir` (of this directory): its lineage becomes this run's too.
  /// Collective (rank 0 reads the index).
  void resumed_from(const std::string& step_dir);
  /// Sets `options`' run and lineage: saves are this run's, retention spares other runs.
  void apply(SaveOptions& options) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fullshard::checkpoint
