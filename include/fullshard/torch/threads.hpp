// LibTorch's intra-op threads per rank, from the cores the launcher gave it.
#pragma once

#include "fullshard/runtime/runtime.hpp"

namespace fullshard::torch {

/// Sets LibTorch's intra-op threads (at::set_num_threads) to the cores this rank may use and
/// returns the count: the CPUs of its affinity mask when the launcher bound it to fewer than
/// the machine has (`srun -c K`, `mpirun --map-by slot:PE=K` or `--bind-to core`), else the
/// machine's cores divided among the ranks of the node (at least 1). FULLSHARD_TORCH_THREADS
/// overrides both. LibTorch's own default (every core in every rank) oversubscribes a node
/// that runs several ranks.
int use_launcher_cores(const Runtime& runtime);

}  // namespace fullshard::torch
