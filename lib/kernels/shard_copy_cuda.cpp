// The shard copy kernels instantiated for Kokkos::Cuda (the team/flat algorithms of
// shard_copy_impl.hpp). Empty unless Kokkos has the CUDA backend; then this file is compiled
// by Kokkos' CUDA compiler (nvcc_wrapper) like the rest of the library. Verified on a GPU by
// test/gpu/test_gpu_kernels.cpp (scripts/gpu-check); compiled here only without CUDA Kokkos.
#include <Kokkos_Core.hpp>

#if defined(KOKKOS_ENABLE_CUDA)
#define FULLSHARD_KERNELS_INSTANTIATE_CUDA 1
#include "lib/kernels/shard_copy_impl.hpp"

namespace fullshard::kernels::detail {
FULLSHARD_KERNELS_CUDA_ALL()
}  // namespace fullshard::kernels::detail
#endif
