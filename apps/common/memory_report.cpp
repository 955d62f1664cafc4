#include "memory_report.hpp"

#include <algorithm>
#include <cstdio>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "fullshard/base/memory_ledger.hpp"
#include "fullshard/schedule/memory_budget.hpp"

namespace fullshard::apps {
namespace {
const double kMiB = 1024.0 * 1024.0;
}

void MemoryReport::sample() {
  const schedule::ProcessMemory now = schedule::process_memory();
  anon_max_ = std::max(anon_max_, now.anonymous);
  shmem_max_ = std::max(shmem_max_, now.shared);
  if (!steady_) memory_ledger::reset_peaks();
  steady_ = true;
}

void MemoryReport::print(const DeviceMesh& mesh, MPI_Comm world,
                         const schedule::MemoryAccount& planned,
                         std::size_t activations_measured) const {
  const MemoryCounts counts = memory_ledger::counts();
  schedule::MemoryAccount m = schedule::measured_memory(counts);
  m.baseline = planned.baseline;
  m.activations = activations_measured;
  m.untracked = planned.untracked;  // measured by the steps
  const schedule::ProcessMemory proc = schedule::process_memory();
  // This rank's window segments (its shards in them too), summed over the ranks.
  const std::size_t own = schedule::own_window_bytes(mesh);
  const double own_windows = double(own);
  double all_windows = own_windows;
  MPI_Allreduce(MPI_IN_PLACE, &all_windows, 1, MPI_DOUBLE, MPI_SUM, world);
  int rank = 0;
  MPI_Comm_rank(world, &rank);
  if (rank != 0) return;
  auto row = [](const char* part, double p, double measured) {
    std::printf("  %-16s %10.1f %10.1f %7s\n", part, p / kMiB, measured / kMiB,
                p > 0 ? fmt_ratio(measured / p).c_str() : "-");
  };
  std::printf("memory (rank 0, MiB)    planned   measured   ratio\n");
  row("baseline", double(planned.baseline), double(m.baseline));
  row("shards", double(planned.shards), double(m.shards));
  row("gradients", double(planned.gradients), double(m.gradients));
  row("optimizer state", double(planned.optimizer_state), double(m.optimizer_state));
  row("pool", double(planned.pool), double(m.pool));
  row("windows", double(planned.windows), double(m.windows));
  row("activations", double(planned.activations), double(m.activations));
  row("untracked", double(planned.untracked), double(m.untracked));
  row("other (library)", 0.0, double(counts.peak_of(MemoryPart::other)));
  // The rank's share of the node at its peak: VmHWM less the peers' window pages it maps.
  const double share = double(schedule::process_peak_share(proc, own, shmem_max_));
  const double peers = double(proc.peak) - share;
  row("process peak", double(planned.process_peak()), share);
  const double heap = heap_in_use_mib();
  std::printf(
      "  (process peak measured: VmHWM %.1f MiB less the peers' shared-memory pages it maps, "
      "%.1f MiB; RssAnon max %.1f MiB%s; shared-memory windows: this rank %.1f MiB, all "
      "ranks %.1f MiB)\n",
      double(proc.peak) / kMiB, peers / kMiB, double(std::max(anon_max_, proc.anonymous)) / kMiB,
      heap >= 0 ? (", heap in use " + fmt_mib(heap) + " MiB").c_str() : "", own_windows / kMiB,
      all_windows / kMiB);
}

double heap_in_use_mib() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const struct mallinfo2 m = mallinfo2();
  return static_cast<double>(m.uordblks + m.hblkhd) / kMiB;
#else
  return -1.0;
#endif
}

std::string fmt_ratio(double r) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3f", r);
  return b;
}

std::string fmt_mib(double mib) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", mib);
  return b;
}

}  // namespace fullshard::apps
