// fullshard-train's residual MLP on the GPU (apps/common/residual_mlp_cuda: cuBLAS products,
// Kokkos element-wise kernels on a CUDA mesh's compute stream) against the host MLP (OpenBLAS
// on a CPU mesh): the same initial values and data, one forward and backward each, the same
// sum of squared errors and the same sharded gradients (f32: within 1e-5 of the largest
// gradient element, summation order apart; bf16 parameters: within two bf16 roundings).
#include <cuda_runtime.h>
#include <doctest/doctest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>  // KOKKOS_ENABLE_CUDA
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "fullshard/mesh/device_mesh.hpp"
#include "gpu_support.hpp"
#include "residual_mlp.hpp"
#include "residual_mlp_cuda.hpp"

using namespace fullshard;
using gpu_test::check;
using gpu_test::world_rank;
using gpu_test::world_size;

namespace {

std::vector<float> host_values(const Tensor& t) {
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  if (t.space() == MemorySpace::device) {
    REQUIRE(t.dtype() == DType::f32);
    check(cudaMemcpy(out.data(), t.data(), t.nbytes(), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  } else {
    for (std::int64_t i = 0; i < t.numel(); ++i)
      out[static_cast<std::size_t>(i)] = float(t.at(i));
  }
  return out;
}

// One forward and backward of the same model on a CPU mesh (host MLP) and on a CUDA mesh
// (CUDA MLP); every sharded gradient compared, relative to its largest element.
void compare(const schedule::PlanOptions& options, double tol) {
  const int W = world_size(), R = world_rank();
  const apps::MlpShape shape{12, 48, 5, 3};  // inputs, hidden, outputs, blocks
  const int rows = 24;
  const std::int64_t global_rows = std::int64_t{rows} * W;
  std::vector<float> x(static_cast<std::size_t>(rows) * shape.inputs),
      t(static_cast<std::size_t>(rows) * shape.outputs);
  for (std::size_t e = 0; e < x.size(); ++e)
    x[e] = float(apps::normal01(7, 100 + static_cast<std::uint64_t>(R), e));
  for (std::size_t e = 0; e < t.size(); ++e)
    t[e] = float(apps::normal01(7, 200 + static_cast<std::uint64_t>(R), e));

  apps::ResidualMlp host(shape, 3);
  DeviceMesh cpu_mesh(MPI_COMM_WORLD, {W}, {"dp"}, 60.0);
  host.shard(cpu_mesh, options);
  const double host_sse = host.forward_backward(x.data(), t.data(), rows, global_rows);

  apps::ResidualMlp dev(shape, 3);
  DeviceMesh cuda_mesh(DeviceType::cuda, MPI_COMM_WORLD, {W}, {"dp"}, 60.0);
  dev.shard(cuda_mesh, options);
  apps::CudaResidualMlp cuda(dev, cuda_mesh, 2);
  cuda.upload(x.data(), t.data(), rows, 1);
  cuda.forward_backward(0, global_rows, 1);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const double dev_sse = cuda.sse(1, 1).at(0);
  CHECK(host_sse > 0.0);
  CHECK(std::abs(dev_sse - host_sse) <= 1e-5 * host_sse);

  const auto hp = host.root().parameters();
  const auto dp = dev.root().parameters();
  REQUIRE(hp.size() == dp.size());
  REQUIRE(hp.size() == static_cast<std::size_t>(4 + 4 * shape.blocks));
  for (std::size_t i = 0; i < hp.size(); ++i) {
    CAPTURE(hp[i]->fqn());
    REQUIRE(dp[i]->fqn() == hp[i]->fqn());
    CHECK(dp[i]->grad().space() == MemorySpace::device);
    CHECK(dp[i]->data().space() == MemorySpace::device);
    const std::vector<float> h = host_values(hp[i]->grad());
    const std::vector<float> d = host_values(dp[i]->grad());
    REQUIRE(h.size() == d.size());
    double scale = 0.0, err = 0.0;
    for (std::size_t e = 0; e < h.size(); ++e) {
      scale = std::max(scale, double(std::abs(h[e])));
      err = std::max(err, double(std::abs(d[e] - h[e])));
    }
    CAPTURE(err);
    CAPTURE(scale);
    if (!h.empty()) CHECK(scale > 0.0);
    CHECK(err <= tol * scale);
  }
}

}  // namespace

TEST_CASE("the CUDA MLP's forward and backward equal the host MLP's (f32)") {
#if !defined(KOKKOS_ENABLE_CUDA)
  gpu_test::skip("this Kokkos has no CUDA backend, so there is no CUDA MLP to test");
  return;
#else
  compare(schedule::PlanOptions{}, 1e-5);
#endif
}

TEST_CASE(
    "the CUDA MLP with bf16 parameters (f32 products on converted copies) equals the host's") {
#if !defined(KOKKOS_ENABLE_CUDA)
  gpu_test::skip("this Kokkos has no CUDA backend, so there is no CUDA MLP to test");
  return;
#else
  schedule::PlanOptions o;
  o.defaults.mp_policy.param_dtype = DType::bf16;
  o.defaults.mp_policy.reduce_dtype = DType::f32;
  // bf16 gradients: a product that differs in the last f32 bits may round to the
  // neighbouring bf16 value (2^-8 relative).
  compare(o, 8e-3);
#endif
}
