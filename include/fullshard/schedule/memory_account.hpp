// The memory account of one rank (docs/memory.md): what a training step holds, by part, as the
// plan predicts it and as the memory ledger (fullshard/base/memory_ledger.hpp) counts it. The
// planned parts are computed from the plan alone (the same on every rank of a uniform mesh),
// before anything is created, so a job that cannot fit is refused before it allocates.
#pragma once

#include <cstddef>
#include <string>

#include "fullshard/base/memory_ledger.hpp"
#include "fullshard/schedule/plan.hpp"

namespace fullshard::schedule {

/// Bytes per rank, by part.
struct MemoryAccount {
  /// The process before the model: runtime, libraries, MPI (measured by the caller: the
  /// resident memory before creation, or the same program building no model).
  std::size_t baseline = 0;
  /// Sharded parameters (padded slot layout, the parameters' dtype).
  std::size_t shards = 0;
  /// Sharded gradients; with the optimizer inside backward only its scratch.
  std::size_t gradients = 0;
  /// Optimizer state: its arrays per parameter (SGD 0, momentum 1, AdamW 2), f32, over the
  /// rank's rows (inside backward: over the padded group shards).
  std::size_t optimizer_state = 0;
  /// The buffer pool's blocks: the in-use peak plus what the pool keeps cached beside it
  /// (a block is reused only by a request of its own byte size).
  std::size_t pool = 0;
  /// This rank's shared-memory window segments besides the shards: the gradient windows the
  /// reductions in flight hold (shared by the groups) and the all-gather windows of a cast
  /// or of two levels.
  std::size_t windows = 0;
  /// The model's activations and the front end's scratch (declared by the caller).
  std::size_t activations = 0;
  /// What the process holds at a step's peak beyond the baseline and every other part: mostly
  /// the heap glibc keeps from freed tensors (under its dynamic mmap threshold, up to 32 MiB a
  /// block), then LibTorch's and the BLAS's own buffers. Measured by a LibTorch session's
  /// steps from the second on (the largest); 0 where nothing measures it.
  std::size_t untracked = 0;

  /// The library's own parts (what MemoryCounts counts): shards to windows.
  std::size_t library() const noexcept {
    return shards + gradients + optimizer_state + pool + windows;
  }
  /// The process's peak: the library's parts, the activations, the untracked and the baseline.
  std::size_t process_peak() const noexcept {
    return library() + activations + untracked + baseline;
  }
  /// One line per part, then the process peak ("shards 256.00 MiB", ...).
  std::string to_text() const;
};

struct MemoryInputs {
  /// Optimizer state arrays per parameter (SGD 0, SGD with momentum 1, AdamW 2).
  int optimizer_states = 0;
  /// The shard dim's collectives run on node-local shared memory (DeviceMesh::shm): its
  /// all-gather windows hold the shards, gradient windows the reductions in flight.
  bool shared_memory = false;
  /// Nodes the shard dim spans (two levels when > 1 with shared memory).
  int nodes = 1;
  /// This rank's place in the shard dim: an optimizer stepping after backward keeps its state
  /// per parameter over the rank's own rows (uneven shards: the last ranks hold fewer).
  int rank = 0;
  std::size_t activations = 0;
  std::size_t baseline = 0;
};

/// The account `plan` predicts for one rank: the steady state after the first steps (the
/// pool and the gradient windows replayed over the plan's events until they stop growing).
MemoryAccount plan_memory(const Plan& plan, const MemoryInputs& in);

/// Which of the ledger's counts measured_memory reads.
enum class Counted { peak, now };

/// The library's parts as the ledger counted them (host memory): their peaks, or what it holds
/// now. Baseline and activations are the caller's.
MemoryAccount measured_memory(const MemoryCounts& counts, Counted which = Counted::peak);

}  // namespace fullshard::schedule
