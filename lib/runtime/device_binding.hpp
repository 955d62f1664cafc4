// Binds this rank to one GPU (CUDA builds) — private to lib/runtime.
#pragma once

#include <mpi.h>

#include <string>

namespace fullshard::detail {

/// The device this rank uses among the `visible` devices it sees. The ranks of a node are
/// grouped by what they see (the value of CUDA_VISIBLE_DEVICES, `cvd`, nullptr when unset):
/// a launcher that gives each rank its own GPU (srun --gpus-per-task=1) makes groups of one,
/// each rank using its device 0; ranks that see the same devices use them in turn, rank
/// `index_in_group` of `group_size` taking device `index_in_group`. Returns -1 when no device
/// is visible. ConfigError when a group has more ranks than devices, naming the counts and
/// CUDA_VISIBLE_DEVICES.
int select_device(int index_in_group, int group_size, int visible, const char* cvd);

/// Collective over `world`: groups the ranks of each node (`node_color`: ranks with the same
/// value share a node) by their CUDA_VISIBLE_DEVICES, then select_device and cudaSetDevice.
/// Returns the device, or -1 when CUDA is disabled or no GPU is visible.
int bind_local_device(MPI_Comm world, int node_color, int local_rank);

}  // namespace fullshard::detail
