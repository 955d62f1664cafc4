// A divide kernel on a device stream (lib/comm/cuda/device_divide.cu): the "sum, then
// scale" path of the NCCL backend's averaging reduce-scatter and all-reduce.
#pragma once

#include <cstddef>

#include "fullshard/base/dtype.hpp"

namespace fullshard::comm {

/// data[i] = data[i] / divisor for i < n, on the cudaStream_t `stream` (asynchronous). The
/// division is done in f32 (f64 for f64) and rounded once to the dtype, as the host
/// reduce-scatter copy-out does. Throws CommError when the launch fails.
void device_divide(void* data, std::size_t n, DType dtype, double divisor, void* stream);

}  // namespace fullshard::comm
