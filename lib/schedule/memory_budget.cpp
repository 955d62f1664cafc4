#include "fullshard/schedule/memory_budget.hpp"

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "fullshard/schedule/auto_plan.hpp"
#include "lib/comm/shm.hpp"

namespace fullshard::schedule {
namespace {

constexpr std::uint64_t kNone = std::numeric_limits<std::uint64_t>::max();

// A number of bytes from the first line of `path`; kNone for "max", a missing file or a
// value so large that it means no limit (v1 writes PAGE_COUNTER_MAX pages).
std::uint64_t limit_in(const std::string& path) {
  std::ifstream in(path);
  std::string v;
  if (!(in >> v) || v == "max") return kNone;
  try {
    const unsigned long long b = std::stoull(v);
    return b >= (std::uint64_t{1} << 60) ? kNone : b;
  } catch (const std::exception&) {
    return kNone;
  }
}

// The smallest memory limit of this process's cgroup and its parents.
std::uint64_t cgroup_limit() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  std::uint64_t best = kNone;
  while (std::getline(in, line)) {
    // "0::/path" (v2) or "N:memory:/path" (v1)
    const auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    const bool v2 = controllers.empty();
    if (!v2 && controllers.find("memory") == std::string::npos) continue;
    const std::string root = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
    const char* file = v2 ? "/memory.max" : "/memory.limit_in_bytes";
    for (;;) {
      best = std::min(best, limit_in(root + (path == "/" ? "" : path) + file));
      if (path.empty() || path == "/") break;
      path = path.substr(0, path.rfind('/'));
      if (path.empty()) path = "/";
    }
  }
  return best;
}

// MemAvailable from /proc/meminfo, kNone where it is missing.
std::uint64_t mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return kNone;
}

std::string parts_text(const MemoryAccount& a) {
  return "baseline " + format_bytes(a.baseline) + ", shards " + format_bytes(a.shards) +
         ", gradients " + format_bytes(a.gradients) + ", optimizer state " +
         format_bytes(a.optimizer_state) + ", pool " + format_bytes(a.pool) + ", windows " +
         format_bytes(a.windows) + ", activations " + format_bytes(a.activations);
}

}  // namespace

ProcessMemory process_memory() {
  ProcessMemory m;
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string key;
    std::size_t kib = 0;
    if (!(f >> key >> kib)) continue;
    if (key == "VmRSS:") m.resident = kib * 1024;
    if (key == "RssAnon:") m.anonymous = kib * 1024;
    if (key == "RssShmem:") m.shared = kib * 1024;
    if (key == "VmHWM:") m.peak = kib * 1024;
  }
  return m;
}

std::size_t own_window_bytes(const DeviceMesh& mesh) {
  std::size_t bytes = 0;
  for (const std::string& dim : mesh.names()) {
    if (const comm::ShmComm* shm = mesh.shm(dim))
      bytes += static_cast<std::size_t>(shm->window_bytes());
    if (const NodeSplit* split = mesh.node_split(dim))  // two levels: the node's part
      bytes += static_cast<std::size_t>(split->local().window_bytes());
  }
  return bytes;
}

std::size_t process_peak_share(const ProcessMemory& now, std::size_t own_window_bytes,
                               std::size_t shared_max) {
  const std::size_t shared = std::max(shared_max, now.shared);
  const std::size_t peers = shared > own_window_bytes ? shared - own_window_bytes : 0;
  return now.peak > peers ? now.peak - peers : 0;
}

MemoryBudget rank_memory_budget(const BoundedComm& comm, std::size_t explicit_bytes,
                                const std::string& explicit_source) {
  if (explicit_bytes > 0) return {explicit_bytes, explicit_source};
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(comm.get(), MPI_COMM_TYPE_SHARED, comm.rank(), MPI_INFO_NULL, &node);
  int ranks = 1;
  if (node != MPI_COMM_NULL) {
    MPI_Comm_size(node, &ranks);
    MPI_Comm_free(&node);
  }
  const std::string over =
      " over " + std::to_string(ranks) + " rank" + (ranks == 1 ? "" : "s") + " of the node";
  MemoryBudget b;
  if (const std::uint64_t limit = cgroup_limit(); limit != kNone) {
    b.bytes = static_cast<std::size_t>(limit / static_cast<std::uint64_t>(ranks));
    b.source = "the cgroup memory limit " + format_bytes(limit) + over;
  }
  if (const std::uint64_t avail = mem_available(); avail != kNone) {
    const std::size_t own = process_memory().resident;
    const auto bytes = static_cast<std::size_t>(avail / static_cast<std::uint64_t>(ranks)) + own;
    if (b.bytes == 0 || bytes < b.bytes) {
      b.bytes = bytes;
      b.source = "MemAvailable " + format_bytes(avail) + over + " plus this rank's resident " +
                 format_bytes(own);
    }
  }
  return b;
}

std::string check_memory_budget(BoundedComm& comm, const MemoryAccount& planned,
                                const MemoryBudget& budget, MemoryCheck check,
                                const std::string& advice) {
  if (check == MemoryCheck::off) return {};
  // The largest predicted peak (and its rank), the smallest known budget (and its rank).
  struct {
    double value;
    int rank;
  } peak{static_cast<double>(planned.process_peak()), comm.rank()},
      least{budget.bytes > 0 ? static_cast<double>(budget.bytes)
                             : std::numeric_limits<double>::infinity(),
            comm.rank()};
  comm.allreduce(&peak, 1, MPI_DOUBLE_INT, MPI_MAXLOC, "memory check (predicted peaks)");
  comm.allreduce(&least, 1, MPI_DOUBLE_INT, MPI_MINLOC, "memory check (budgets)");
  if (!(least.value < std::numeric_limits<double>::infinity()) || peak.value <= least.value)
    return {};
  // The parts of the largest peak and the source of the smallest budget, from their ranks.
  std::uint64_t parts[7] = {planned.baseline,        planned.shards, planned.gradients,
                            planned.optimizer_state, planned.pool,   planned.windows,
                            planned.activations};
  comm.bcast(parts, 7, MPI_UINT64_T, peak.rank, "memory check (parts)");
  MemoryAccount a;
  a.baseline = parts[0], a.shards = parts[1], a.gradients = parts[2];
  a.optimizer_state = parts[3], a.pool = parts[4], a.windows = parts[5], a.activations = parts[6];
  std::string source = budget.source;
  comm.bcast(source, least.rank, "memory check (budget)");
  const std::string message = "the planned peak of rank " + std::to_string(peak.rank) + ", " +
                              format_bytes(a.process_peak()) + " (" + parts_text(a) +
                              "), exceeds the memory a rank can have: " +
                              format_bytes(static_cast<std::size_t>(least.value)) + " on rank " +
                              std::to_string(least.rank) + " (" + source + "); " + advice;
  if (check == MemoryCheck::refuse) throw MemoryBudgetExceeded(message);
  if (comm.rank() == 0) {
    std::fprintf(stderr, "fullshard: warning: %s\n", message.c_str());
    std::fflush(stderr);
  }
  return message;
}

}  // namespace fullshard::schedule
