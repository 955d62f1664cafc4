// Asynchronous checkpoint saves: the ranks copy the state they must write into host staging
// memory and go back to training while a background thread writes the files; the commit (the
// ranks' agreement, rank 0's index, renames and `latest`) runs later on the training thread.
//
//   checkpoint::AsyncSave pending = checkpoint::save_async(dir, *model, &opt, step);
//   for (...) {
//     train_step();
//     pending.test();  // commits at a step boundary once every rank's file is written
//   }
//   pending.wait();     // or the next save waits for it
//
// The files are those save() writes, byte for byte. Protocol and failure cases:
// docs/checkpoint-format.md, "Asynchronous saves".
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "fullshard/checkpoint/checkpoint.hpp"

namespace fullshard::checkpoint {

/// A checkpoint save in flight (save_async). At most one is in flight per process: save() and
/// save_async() first complete the one before (collectively, raising its error). Dropping the
/// handle does not cancel the save: the next save completes it; a process that ends with a
/// save in flight commits nothing (its step directory never appears, `latest` keeps naming
/// the previous checkpoint, and the next save in that directory removes the leftovers).
class AsyncSave {
 public:
  /// No save (valid() is false).
  AsyncSave() = default;

  bool valid() const noexcept { return state_ != nullptr; }

  /// Collective over the save's mesh: every rank calls it at the same point (e.g. after every
  /// training step). When every rank's background write is done, commits the checkpoint (and
  /// applies retention) and returns true; otherwise returns false after one small all-reduce.
  /// A failed write (I/O error, full disk) is thrown on every rank, naming the failing rank's
  /// error, after its temporary step directory was removed; `latest` still names the previous
  /// checkpoint. Once the save is complete: returns true (or throws the same error) without
  /// communicating.
  bool test();

  /// Collective: waits for this rank's background write, then commits as test() does. Returns
  /// the new step directory (the same on every rank).
  std::string wait();

  /// Whether the save is complete (committed or failed) on this rank; local.
  bool done() const noexcept;

  /// The step saved.
  std::int64_t step() const;
  /// Bytes of host staging memory this rank's snapshot uses (0 on ranks that write nothing).
  /// The staging buffer is kept for the next asynchronous save (released at exit).
  std::uint64_t staging_bytes() const;
  /// Seconds save_async spent on this rank (the snapshot: checks, copies into staging).
  double snapshot_seconds() const;
  /// Seconds this rank's background write took (file write, fsync; the checksums of shards
  /// copied from a device); 0 until done.
  double write_seconds() const;

  struct State;

 private:
  explicit AsyncSave(std::shared_ptr<State> s) : state_(std::move(s)) {}
  friend AsyncSave save_async(const std::string&, graph::Module&, const optim::Optimizer*,
                              std::int64_t, const std::string&, const std::string&,
                              const SaveOptions&);
  std::shared_ptr<State> state_;
};

/// Starts a sharded save of what save() would save (same arguments; options.kind must be
/// sharded) and returns once this rank's state (its shards, optimizer state, step, metadata,
/// RNG bytes) is copied into host staging memory: the model and the optimizer may change right
/// after. A background thread (no MPI) writes and fsyncs this rank's data file; test() or
/// wait() commits. Collective over the model's mesh; call outside forward and backward.
/// Errors before the return (bad arguments, the directory) are thrown on every rank, as
/// save()'s.
AsyncSave save_async(const std::string& dir, graph::Module& model,
                     const optim::Optimizer* optimizer, std::int64_t step,
                     const std::string& metadata = std::string(),
                     const std::string& rng_state = std::string(), const SaveOptions& options = {});

/// Allocates and faults in the host staging memory save_async() needs on this rank for `model`
/// and `optimizer` (optimizer state not created yet is counted as f32 of the shard's shape),
/// so that the first asynchronous save costs training no more than later ones (faulting in
/// ~100 MiB takes tens of ms); returns its bytes (0 on ranks that write no data file). Call it
/// before training; local, no communication. Optional: save_async() allocates (or grows) the
/// buffer itself. InvalidArgument when the buffer must grow while a save is in flight.
std::uint64_t reserve_async_staging(graph::Module& model,
                                    const optim::Optimizer* optimizer = nullptr);

}  // namespace fullshard::checkpoint
