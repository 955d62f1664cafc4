// CUDA runtime results as fullshard errors (private to the CUDA parts of lib/).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "fullshard/base/error.hpp"

namespace fullshard::comm {

/// Throws CommError("<context>: <call> failed: <cudaGetErrorName> (<cudaGetErrorString>)")
/// unless `e` is cudaSuccess.
inline void cuda_check(cudaError_t e, const char* call, const std::string& context) {
  if (e == cudaSuccess) return;
  throw CommError(context + ": " + call + " failed: " + cudaGetErrorName(e) + " (" +
                  cudaGetErrorString(e) + ")");
}

}  // namespace fullshard::comm
