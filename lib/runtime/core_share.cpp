#include "fullshard/runtime/core_share.hpp"

#include <algorithm>
#include <cstdlib>

namespace fullshard {

CoreShare share_cores(const LauncherCores& c) {
  const int cpus = std::max(1, c.affinity_cpus);
  const int sharing = std::max(1, c.ranks_sharing_mask);
  CoreShare s;
  s.threads = std::max(1, cpus / sharing);
  const std::string n = std::to_string(cpus) + (cpus == 1 ? " CPU" : " CPUs");
  if (cpus >= c.node_cpus)
    s.why = "the node's " + n +
            (sharing > 1 ? " shared by " + std::to_string(sharing) + " ranks" : " for one rank");
  else
    s.why = "its " + std::to_string(cpus) + " bound " + (cpus == 1 ? "CPU" : "CPUs") +
            (sharing > 1 ? " shared by " + std::to_string(sharing) + " ranks" : "");
  if (c.slurm_cpus_per_task > 0 && c.slurm_cpus_per_task < s.threads) {
    s.threads = c.slurm_cpus_per_task;
    s.why = "srun -c " + std::to_string(c.slurm_cpus_per_task) + " (SLURM_CPUS_PER_TASK)";
  }
  return s;
}

std::string user_thread_setting(const char* const* variables) {
  for (; variables && *variables; ++variables)
    if (const char* v = std::getenv(*variables); v && *v) return std::string(*variables) + "=" + v;
  return {};
}

}  // namespace fullshard
