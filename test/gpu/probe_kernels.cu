#include <cuda_runtime.h>

#include <cstddef>

#include "gpu_support.hpp"

namespace fullshard::gpu_test {
namespace {

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

__global__ void fill(float* d, std::size_t n, float v) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    d[i] = v;
}

}  // namespace

void launch_spin(double ms, cudaStream_t stream) {
  int dev = 0;
  int khz = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev);
  spin<<<1, 1, 0, stream>>>(static_cast<long long>(ms * khz));
}

void launch_fill(float* data, std::size_t n, float value, cudaStream_t stream) {
  fill<<<256, 256, 0, stream>>>(data, n, value);
}

}  // namespace fullshard::gpu_test
