// LibTorch's intra-op threads per rank, from the cores the launcher gave it.
#pragma once

#include "fullshard/runtime/runtime.hpp"

namespace fullshard::torch {

/// Sets LibTorch's intra-op threads (at::set_num_threads) to the cores this rank may use
/// (Runtime::cores(): its affinity mask's CPUs divided among the node's ranks bound to the
/// same mask, at most srun -c) and returns the count. FULLSHARD_TORCH_THREADS overrides it;
/// OMP_NUM_THREADS, which LibTorch reads itself, is kept. LibTorch's own default (every
/// core in every rank) oversubscribes a node that runs several ranks.
int use_launcher_cores(const Runtime& runtime);

}  // namespace fullshard::torch
