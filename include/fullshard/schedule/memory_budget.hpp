// Refusing a job that cannot fit (docs/memory.md, "The budget"): every rank compares the
// process peak its plan predicts (schedule/memory_account.hpp) with the memory it can have,
// before the model is created; where any rank does not fit, every rank stops with the same
// message, naming the parts, the budget and what to change.
#pragma once

#include <cstddef>
#include <string>

#include "fullshard/base/bounded_comm.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/schedule/memory_account.hpp"

namespace fullshard::schedule {

/// The memory one rank may use: the whole process, baseline included.
struct MemoryBudget {
  std::size_t bytes = 0;  ///< 0: no limit known
  /// Where it comes from, e.g. "--memory-budget", "the cgroup limit 8.00 GiB over 4 ranks of
  /// the node", "MemAvailable 20.10 GiB over 4 ranks of the node plus this rank's 210 MiB".
  std::string source;
};

/// What a rank of `comm` can have: `explicit_bytes` (> 0) named `explicit_source`; else the
/// smaller of the cgroup memory limit (v2 memory.max up the process's cgroup, or v1
/// memory.limit_in_bytes) and MemAvailable plus the resident memory this process has now,
/// each shared equally by the ranks of `comm` on this node. Collective over `comm` (it counts
/// the node's ranks).
MemoryBudget rank_memory_budget(const BoundedComm& comm, std::size_t explicit_bytes = 0,
                                const std::string& explicit_source = "the memory budget");

/// What check_memory_budget does where a rank does not fit.
enum class MemoryCheck {
  refuse,  ///< throw MemoryBudgetExceeded on every rank
  warn,    ///< rank 0 prints the message as a warning; the job goes on
  off,     ///< no check (no communication)
};

/// The job does not fit its budget (the same message on every rank).
class MemoryBudgetExceeded : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

/// The message's parts agreed by every rank of `comm`: the largest predicted process peak
/// (with its rank and parts) against the smallest budget. Returns the message when a rank
/// does not fit ("" when all do, or the budget is unknown), after throwing for
/// MemoryCheck::refuse or printing it on rank 0 (stderr) for warn. `advice` ends the message:
/// what the front end's user can change (its flags or keys). Collective over `comm`.
std::string check_memory_budget(BoundedComm& comm, const MemoryAccount& planned,
                                const MemoryBudget& budget, MemoryCheck check,
                                const std::string& advice);

/// This process's memory now, from /proc/self/status (zeros where it is missing): resident
/// (VmRSS), anonymous (RssAnon), shared memory mapped (RssShmem: also the peers' window pages
/// this rank touched), and the resident peak (VmHWM).
struct ProcessMemory {
  std::size_t resident = 0, anonymous = 0, shared = 0, peak = 0;
};
ProcessMemory process_memory();

/// The bytes of the node-local shared-memory window segments this rank made (its shards in
/// them too), over every dim of `mesh` (0 off shared memory).
std::size_t own_window_bytes(const DeviceMesh& mesh);

/// This process's share of its node at its peak: VmHWM less the pages of the peers' window
/// segments it maps (RssShmem counts every window page the process touched, its peers' too;
/// its own segments, `own_window_bytes`, are its share). `shared_max`: the largest RssShmem
/// the caller saw (0: the one now).
std::size_t process_peak_share(const ProcessMemory& now, std::size_t own_window_bytes,
                               std::size_t shared_max = 0);

}  // namespace fullshard::schedule
