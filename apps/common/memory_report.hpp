// A training program's memory account, planned against measured (docs/memory.md): the
// library's parts as the memory ledger counted them, the activations, and the process's peak
// (VmHWM less the peers' shared-memory pages it maps), printed by rank 0.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <string>

#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/schedule/memory_account.hpp"

namespace fullshard::apps {

class MemoryReport {
 public:
  /// Samples the process's anonymous and shared resident memory (their maxima are reported);
  /// the first call after the first step also starts the ledger's peaks again, so that the
  /// measured parts are the steady state's (the first step moves the shards into the
  /// all-gather windows and makes the pool's blocks).
  void sample();

  /// The table: each part planned, measured and their ratio, then the process peak. The
  /// activations measured are the caller's. Collective over `world` (the windows' sum).
  void print(const DeviceMesh& mesh, MPI_Comm world, const schedule::MemoryAccount& planned,
             std::size_t activations_measured) const;

 private:
  std::size_t anon_max_ = 0, shmem_max_ = 0;
  bool steady_ = false;
};

/// Host heap bytes allocated now in MiB (glibc's mallinfo2: live blocks, not the freed memory
/// the heap keeps, which the max RSS still counts); < 0 where glibc has no mallinfo2.
double heap_in_use_mib();

/// "1.012", "256.0".
std::string fmt_ratio(double r);
std::string fmt_mib(double mib);

}  // namespace fullshard::apps
