// Binds this rank to one GPU (CUDA builds) — private to lib/runtime.
#pragma once

namespace fullshard::detail {

/// Selects device `local_rank` among the visible devices (CUDA_VISIBLE_DEVICES is honoured by
/// the CUDA runtime itself). Returns the device index, or -1 when CUDA is disabled or no GPU
/// is visible. Throws ConfigError when a node runs more ranks than it has GPUs.
int bind_local_device(int local_rank, int local_size);

}  // namespace fullshard::detail
