// Node-local shared memory for host collectives: MPI-3 shared-memory windows over the ranks of
// one node, with per-rank sequence counters in the window for synchronisation.
//
// A ShmComm is a duplicate of a communicator whose ranks all share a node (a mesh dim that
// lies inside one node: DeviceMesh::shm). Its windows give every rank a segment that every
// other rank of the node can read and write with plain loads and stores. The host
// collectives built on it (lib/fsdp's running backend) read peers' shards straight into
// their own buffers, so a collective and its copy kernels become one pass.
//
// Synchronisation is by counters, not messages: each rank's segment begins with kCounters
// 64-bit counters on cache lines of their own. A rank publishes (stores with release) a new
// value of one of its counters; a peer that waits for it polls (loads with acquire), spinning
// briefly, then yielding, then sleeping (BackOff), so that ranks on an oversubscribed node do
// not starve each other. Every wait is bounded by FULLSHARD_TIMEOUT; an expired wait prints
// the common timeout message and throws CommError (a shared-memory wait, unlike a blocked MPI
// call, can be given up), so that every waiting rank reports it.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "fullshard/comm/communicator.hpp"

namespace fullshard::comm {

// Opaque: the shared-memory segments and their synchronisation (lib/comm/shm/shm_comm.cpp).
struct ShmCommState;
struct ShmWindowState;

class ShmWindow;

class ShmComm {
 public:
  /// True when every rank of `comm` shares memory with every other (MPI_Comm_split_type
  /// SHARED keeps the whole communicator together). Collective over `comm`.
  static bool node_local(MPI_Comm comm);

  /// Duplicates `comm` (collective over it); its ranks must share a node (node_local).
  /// `name` and `timeout_s` (0: unbounded) are those of the communicator it serves: they
  /// appear in timeout messages.
  ShmComm(MPI_Comm comm, std::string name, double timeout_s);

  int rank() const noexcept;
  int size() const noexcept;
  const std::string& name() const noexcept;
  double timeout_s() const noexcept;

  /// Allocates a window with `bytes` bytes per rank (MPI_Win_allocate_shared; each rank's
  /// segment aligned to 64 bytes, its counters zero). Collective over the communicator, in
  /// the same order on every rank; bounded by FULLSHARD_TIMEOUT (a Watchdog). The segment is
  /// charged to the memory ledger as MemoryPart::windows while the window lives, but for its
  /// first `shard_bytes`, which hold this rank's shards (MemoryPart::shards).
  ShmWindow allocate(std::size_t bytes, const std::string& label,
                     std::size_t shard_bytes = 0) const;

  /// Bytes of the collectives run over this shared memory, counted as Communicator's
  /// traffic is (the whole collective buffer); DeviceMesh::traffic adds them in.
  void count(const Traffic& t) const noexcept;
  Traffic traffic() const noexcept;
  /// Bytes of this rank's segments of the windows alive on this communicator (as allocate
  /// was asked: the FSDP groups' all-gather windows, which hold the shards, and the gradient
  /// windows of the reductions in flight).
  std::uint64_t window_bytes() const noexcept;

 private:
  std::shared_ptr<ShmCommState> s_;
};

/// A shared-memory window: one segment per rank of a ShmComm. Copies share it; the last copy
/// frees it (MPI_Win_free: collective, so every rank must drop its windows in the same order).
class ShmWindow {
 public:
  /// Counters per rank.
  static constexpr int kCounters = 4;

  ShmWindow() = default;
  bool valid() const noexcept { return s_ != nullptr; }
  int rank() const noexcept;
  int size() const noexcept;
  /// Bytes of each rank's segment (as allocated).
  std::size_t bytes() const noexcept;
  /// Rank `r`'s segment (this rank's: local()).
  std::byte* segment(int r) const noexcept;
  std::byte* local() const noexcept { return segment(rank()); }
  /// Keeps the window alive (for Tensor::from_owner over a segment).
  std::shared_ptr<void> owner() const noexcept;

  /// Counter `c` of rank `r`.
  std::atomic<std::uint64_t>& counter(int r, int c) const noexcept;
  /// Sets this rank's counter `c` to `v` (release: what this rank wrote before is visible to
  /// a peer that sees `v`).
  void publish(int c, std::uint64_t v) const noexcept;
  /// Waits until counter `c` of every other rank (and this rank's too with `include_self`:
  /// a worker thread of this rank may publish it) is at least `v` (acquire). On timeout: the
  /// message "<operation> on shared memory of communicator '<name>' (rank r/n, seq v,
  /// <about>, waiting for rank q) did not finish within FULLSHARD_TIMEOUT=..." is printed on
  /// stderr and thrown as CommError.
  void wait_all(int c, std::uint64_t v, const std::string& operation, const std::string& about,
                bool include_self = false) const;

 private:
  friend class ShmComm;
  explicit ShmWindow(std::shared_ptr<ShmWindowState> s) : s_(std::move(s)) {}
  std::shared_ptr<ShmWindowState> s_;
};

}  // namespace fullshard::comm
