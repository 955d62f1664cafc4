// GPU benchmarks for scripts/gpu-check (one rank, one GPU):
// - copy: the shard copy kernels' all-gather copy-out (run_copies, f32 -> f32) against
//   cudaMemcpy device-to-device of the same bytes (target: ratio of bandwidths >= 0.85);
// - all_gather: NcclCommunicator::all_gather through Stream/Work against a raw ncclAllGather
//   on the same communicator and buffers (target: time ratio <= 1.05).
// Prints one "GPU-BENCH <name> <value>" line per number; exits 77 with a message without a GPU.
#include <cuda_runtime.h>
#include <nccl.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "fullshard/comm/stream.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/runtime/runtime.hpp"
#include "fullshard/tensor/sharding.hpp"
#include "lib/comm/nccl_communicator.hpp"

using namespace fullshard;

namespace {

// Median time in seconds of `reps` runs of `body` on `stream`, measured with CUDA events.
double time_on(cudaStream_t stream, int reps, const std::function<void()>& body) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  body();  // warm-up
  cudaStreamSynchronize(stream);
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a, stream);
    body();
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms * 1e-3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  // Before the Runtime: a CUDA-enabled Kokkos cannot even initialise without a device.
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device; fullshard-bench-gpu needs a GPU (scripts/gpu-check)\n");
    return 77;
  }
  Runtime runtime(argc, argv);
  const std::size_t elems = std::size_t{64} << 20;  // 256 MiB of f32
  const int reps = 20;
  comm::Stream stream = comm::Stream::device("bench");
  auto s = static_cast<cudaStream_t>(stream.native_handle());
  void* src = nullptr;
  void* dst = nullptr;
  cudaMalloc(&src, elems * 4);
  cudaMalloc(&dst, elems * 4);
  cudaMemset(src, 0, elems * 4);

  const double t_memcpy =
      time_on(s, reps, [&] { cudaMemcpyAsync(dst, src, elems * 4, cudaMemcpyDeviceToDevice, s); });
  std::printf("GPU-BENCH memcpy_d2d_GBps %.2f\n", 2.0 * elems * 4 / t_memcpy / 1e9);
#if defined(KOKKOS_ENABLE_CUDA)
  {
    // A group of 8 parameters sharded over 8 ranks: the copy-out of an all-gather buffer.
    std::vector<ShardLayout> layouts;
    const std::int64_t rows = static_cast<std::int64_t>(elems / 8 / 1024);
    for (int p = 0; p < 8; ++p)
      layouts.push_back(shard_layout({rows, 1024}, Placement::Shard(0), 8, 0, "p"));
    const auto g = kernels::make_group_layout(layouts);
    const kernels::CopyPlan plan(kernels::ExecTarget::device, kernels::all_gather_copy_out_runs(g));
    // run_copies uses the default CUDA instance and fences it: timed on the host.
    const double t_copy = time_on(
        nullptr, reps, [&] { kernels::run_copies(plan, src, DType::f32, dst, DType::f32); });
    const double bytes = 2.0 * static_cast<double>(g.arena_numel) * 4;
    std::printf("GPU-BENCH copy_kernel_GBps %.2f\n", bytes / t_copy / 1e9);
    std::printf("GPU-BENCH copy_vs_memcpy %.3f\n", (bytes / t_copy) / (2.0 * elems * 4 / t_memcpy));
  }
#else
  std::printf("GPU-BENCH copy_kernel_GBps skipped (Kokkos has no CUDA backend)\n");
#endif
  {
    auto comm = comm::NcclCommunicator::create(MPI_COMM_WORLD, "bench", 60.0);
    const std::size_t n = elems / static_cast<std::size_t>(comm->size());
    auto raw = static_cast<ncclComm_t>(comm->native_handle());
    const double t_raw = time_on(s, reps, [&] { ncclAllGather(src, dst, n, ncclFloat32, raw, s); });
    const double t_ours =
        time_on(s, reps, [&] { comm->all_gather(src, dst, n, DType::f32, stream).wait(); });
    std::printf("GPU-BENCH nccl_allgather_raw_ms %.3f\n", t_raw * 1e3);
    std::printf("GPU-BENCH nccl_allgather_fullshard_ms %.3f\n", t_ours * 1e3);
    std::printf("GPU-BENCH allgather_vs_raw %.3f\n", t_ours / t_raw);
  }
  cudaFree(src);
  cudaFree(dst);
  return 0;
}
