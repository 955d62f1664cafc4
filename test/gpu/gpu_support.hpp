// Support of the GPU tests (test/gpu): skip reporting and small device helpers. Each GPU test
// program exits with 77 (CTest SKIP_RETURN_CODE) and prints why when it cannot run.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace fullshard::gpu_test {

/// Marks the program as skipped (exit code 77 unless a check failed) and prints `why`.
void skip(const std::string& why);

/// This process's rank and the number of ranks in MPI_COMM_WORLD.
int world_rank();
int world_size();

/// Throws std::runtime_error naming `what` unless `e` is cudaSuccess.
void check(cudaError_t e, const char* what);

/// A kernel that spins on the device for about `ms` milliseconds (probe_kernels.cu).
void launch_spin(double ms, cudaStream_t stream);
/// data[i] = value for i < n (f32), on `stream`.
void launch_fill(float* data, std::size_t n, float value, cudaStream_t stream);

}  // namespace fullshard::gpu_test
