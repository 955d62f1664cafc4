#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "lib/comm/cuda/cuda_check.hpp"
#include "lib/comm/cuda/device_divide.hpp"

namespace fullshard::comm {
namespace {

struct F32 {
  using storage = float;
  using acc = float;
  __device__ static acc load(storage x) { return x; }
  __device__ static storage store(acc v) { return v; }
};
struct F64 {
  using storage = double;
  using acc = double;
  __device__ static acc load(storage x) { return x; }
  __device__ static storage store(acc v) { return v; }
};
struct F16 {
  using storage = std::uint16_t;
  using acc = float;
  __device__ static acc load(storage x) { return f16_to_float(x); }
  __device__ static storage store(acc v) { return float_to_f16(v); }
};
struct BF16 {
  using storage = std::uint16_t;
  using acc = float;
  __device__ static acc load(storage x) { return bf16_to_float(x); }
  __device__ static storage store(acc v) { return float_to_bf16(v); }
};

template <class T>
__global__ void divide_kernel(typename T::storage* data, std::size_t n, typename T::acc divisor) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    data[i] = T::store(T::load(data[i]) / divisor);
}

template <class T>
void launch(void* data, std::size_t n, double divisor, cudaStream_t s) {
  constexpr unsigned threads = 256;
  const std::size_t want = (n + threads - 1) / threads;
  const unsigned blocks = static_cast<unsigned>(want < 65535 ? want : 65535);
  divide_kernel<T><<<blocks, threads, 0, s>>>(static_cast<typename T::storage*>(data), n,
                                              static_cast<typename T::acc>(divisor));
}

}  // namespace

void device_divide(void* data, std::size_t n, DType dtype, double divisor, void* stream) {
  if (n == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::f32:
      launch<F32>(data, n, divisor, s);
      break;
    case DType::f64:
      launch<F64>(data, n, divisor, s);
      break;
    case DType::f16:
      launch<F16>(data, n, divisor, s);
      break;
    case DType::bf16:
      launch<BF16>(data, n, divisor, s);
      break;
  }
  cuda_check(cudaGetLastError(), "divide kernel launch",
             "dividing " + std::to_string(n) + " x " + dtype_name(dtype) + " on a device stream");
}

}  // namespace fullshard::comm
