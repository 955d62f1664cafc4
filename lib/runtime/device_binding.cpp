#include "lib/runtime/device_binding.hpp"

#include <cstdint>
#include <cstdlib>
#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/config.hpp"

#if FULLSHARD_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace fullshard::detail {

int select_device(int index_in_group, int group_size, int visible, const char* cvd) {
  if (visible <= 0) return -1;
  if (group_size > visible) {
    const std::string where =
        cvd ? "CUDA_VISIBLE_DEVICES='" + std::string(cvd) + "'" : "CUDA_VISIBLE_DEVICES unset";
    throw ConfigError(
        "this node runs " + std::to_string(group_size) + " ranks that all see the same " +
        std::to_string(visible) + " GPU" + (visible == 1 ? "" : "s") + " (" + where +
        "); fullshard needs one GPU per rank: launch at most " + std::to_string(visible) +
        " ranks per node (e.g. srun --ntasks-per-node=" + std::to_string(visible) +
        " or --gpus-per-task=1), or set FULLSHARD_BIND_DEVICE=0 to bind devices "
        "yourself");
  }
  return index_in_group;
}

namespace {

// FNV-1a of the CUDA_VISIBLE_DEVICES value ("unset" distinct from ""), as an MPI color (used
// with CUDA only: a build without it must not warn).
[[maybe_unused]] int visibility_color(const char* cvd) {
  std::uint32_t h = 2166136261u;
  const std::string v = cvd ? std::string("=") + cvd : std::string("unset");
  for (unsigned char c : v) {
    h ^= c;
    h *= 16777619u;
  }
  return static_cast<int>(h & 0x7fffffffu);
}

}  // namespace

int bind_local_device(MPI_Comm world, int node_color, int local_rank) {
#if FULLSHARD_HAS_CUDA
  const char* cvd = std::getenv("CUDA_VISIBLE_DEVICES");
  // Collective first (every rank takes part, GPU or not), then the device calls.
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm group = MPI_COMM_NULL;
  int world_rank = 0;
  MPI_Comm_rank(world, &world_rank);
  MPI_Comm_split(world, node_color, world_rank, &node);
  MPI_Comm_split(node, visibility_color(cvd), local_rank, &group);
  int index = 0;
  int size = 1;
  MPI_Comm_rank(group, &index);
  MPI_Comm_size(group, &size);
  MPI_Comm_free(&group);
  MPI_Comm_free(&node);

  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the "no device" error so later CUDA calls do not see it
    return -1;
  }
  const int device = select_device(index, size, count, cvd);
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    throw ConfigError("cudaSetDevice(" + std::to_string(device) +
                      ") failed: " + cudaGetErrorString(e));
  return device;
#else
  (void)world;
  (void)node_color;
  (void)local_rank;
  return -1;
#endif
}

}  // namespace fullshard::detail
