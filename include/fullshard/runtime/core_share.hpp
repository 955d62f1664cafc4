// How many threads a rank runs: the cores its launcher gave it. Kokkos with OpenMP, OpenBLAS
// and LibTorch each start one thread per core of the node in every rank unless told
// otherwise; four ranks on two cores then run eight threads on each core.
#pragma once

#include <string>

namespace fullshard {

/// What the runtime reads about a rank's cores.
struct LauncherCores {
  /// The node's online CPUs.
  int node_cpus = 1;
  /// The CPUs of this rank's affinity mask (srun --cpu-bind, mpirun --bind-to, taskset).
  int affinity_cpus = 1;
  /// The ranks of this node whose affinity mask is this rank's, itself included: ranks that
  /// were not bound share the whole node.
  int ranks_sharing_mask = 1;
  /// SLURM_CPUS_PER_TASK (srun -c, sbatch --cpus-per-task); 0 when unset.
  int slurm_cpus_per_task = 0;
};

/// A rank's thread count and why.
struct CoreShare {
  int threads = 1;
  /// "srun -c 4", "its 4 bound CPUs", "4 bound CPUs shared by 2 ranks", "the node's 2 CPUs
  /// shared by 4 ranks".
  std::string why;
};

/// The CPUs of the rank's affinity mask divided among the ranks that share that mask (at
/// least 1), and at most SLURM_CPUS_PER_TASK where that is set.
CoreShare share_cores(const LauncherCores& c);

/// The first of `variables` (a null-terminated list) set in the environment, as
/// "NAME=value"; empty when none is: a thread count the user chose.
std::string user_thread_setting(const char* const* variables);

}  // namespace fullshard
