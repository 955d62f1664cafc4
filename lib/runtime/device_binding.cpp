#include "lib/runtime/device_binding.hpp"

#include "fullshard/base/error.hpp"
#include "fullshard/config.hpp"

#if FULLSHARD_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

#include <string>

namespace fullshard::detail {

int bind_local_device(int local_rank, int local_size) {
#if FULLSHARD_HAS_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the "no device" error so later CUDA calls do not see it
    return -1;
  }
  if (local_size > count)
    throw ConfigError("this node runs " + std::to_string(local_size) + " ranks but only " +
                      std::to_string(count) +
                      " GPUs are visible (CUDA_VISIBLE_DEVICES); launch one rank per GPU, "
                      "e.g. srun --ntasks-per-node=" +
                      std::to_string(count) + ", or set FULLSHARD_BIND_DEVICE=0");
  if (const cudaError_t e = cudaSetDevice(local_rank); e != cudaSuccess)
    throw ConfigError("cudaSetDevice(" + std::to_string(local_rank) +
                      ") failed: " + cudaGetErrorString(e));
  return local_rank;
#else
  (void)local_rank;
  (void)local_size;
  return -1;
#endif
}

}  // namespace fullshard::detail
