// A CUDA DeviceMesh (init_device_mesh("cuda", ...)) on any number of ranks, one GPU each
// (scripts/gpu-check runs it on one): the device type, NCCL communicators per dim and channel
// on the channel's CUDA stream, the compute stream, a stream-ordered pool on those streams,
// and the compute stream as a Kokkos instance. Values are integers: sums are exact.
#include <cuda_runtime.h>
#include <doctest/doctest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/mesh/compute_space.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "gpu_support.hpp"
#include "lib/tensor/stream_pool.hpp"

using namespace fullshard;
using gpu_test::check;
using gpu_test::world_rank;
using gpu_test::world_size;

namespace {

bool is_device_pointer(const void* p) {
  cudaPointerAttributes a{};
  check(cudaPointerGetAttributes(&a, p), "cudaPointerGetAttributes");
  return a.type == cudaMemoryTypeDevice;
}

std::vector<float> download(const Tensor& t) {
  std::vector<float> h(static_cast<std::size_t>(t.numel()));
  check(cudaMemcpy(h.data(), t.data(), t.nbytes(), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  return h;
}

// A CUDA mesh needs a CUDA-enabled Kokkos (a host-Kokkos build refuses it: test/mpi/test_mesh).
bool no_cuda_kokkos() {
#if defined(KOKKOS_ENABLE_CUDA)
  return false;
#else
  gpu_test::skip("this Kokkos has no CUDA backend, so there is no CUDA mesh to test");
  return true;
#endif
}

}  // namespace

TEST_CASE("a CUDA mesh: device type, NCCL per dim and channel, streams; a pool on them") {
  if (no_cuda_kokkos()) return;
  const int W = world_size();
  const int R = world_rank();
  DeviceMesh mesh(DeviceType::cuda, MPI_COMM_WORLD, {W}, {"dp"}, 60.0);
  CHECK(mesh.device_type() == DeviceType::cuda);
  CHECK(mesh.describe().find("on cuda") != std::string::npos);
  CHECK(mesh.compute_stream().is_device());
  // NCCL communicators are created on first use only.
  CHECK(mesh.device_comms_created() == 0);
  CHECK(mesh.device_comm("dp", comm::StreamKind::all_gather).size() == W);
  CHECK(mesh.device_comms_created() == 1);
  CHECK(&mesh.device_comm("dp", comm::StreamKind::all_gather) ==
        &mesh.device_comm("dp", comm::StreamKind::all_gather));  // created once
  CHECK(mesh.device_comms_created() == 1);
  for (comm::StreamKind c : {comm::StreamKind::compute, comm::StreamKind::all_gather,
                             comm::StreamKind::reduce_scatter, comm::StreamKind::all_reduce}) {
    CAPTURE(comm::stream_name(c));
    CHECK(mesh.device_stream(c).is_device());
    CHECK(mesh.device_comm("dp", c).size() == W);
    CHECK(mesh.device_comm("dp", c).rank() == R);
    CHECK(mesh.device_comm("dp", c).name().find(".nccl") != std::string::npos);
    // The MPI communicators stay (host memory, control messages).
    CHECK(mesh.comm("dp", c).name().find(".nccl") == std::string::npos);
  }
  CHECK(mesh.device_comms_created() == 4);
  CHECK(&mesh.device_comm("dp", comm::StreamKind::all_gather) !=
        &mesh.device_comm("dp", comm::StreamKind::reduce_scatter));
  // Distinct streams per channel and for compute.
  CHECK(mesh.device_stream(comm::StreamKind::all_gather).id() !=
        mesh.device_stream(comm::StreamKind::reduce_scatter).id());
  CHECK(mesh.compute_stream().id() != mesh.device_stream(comm::StreamKind::all_gather).id());

  // An all-gather and a divided reduce-scatter of pool buffers on the channels' streams.
  StreamOrderedPool pool(MemorySpace::device, "test");  // as the FSDP engine keeps one per root
  comm::Stream& ag = mesh.device_stream(comm::StreamKind::all_gather);
  comm::Stream& rs = mesh.device_stream(comm::StreamKind::reduce_scatter);
  const std::int64_t n = 4096;
  Tensor gathered = pool.acquire({W * n}, DType::f32, ag, "gathered");
  CHECK(gathered.space() == MemorySpace::device);
  CHECK(is_device_pointer(gathered.data()));
  float* slot = gathered.data_as<float>() + static_cast<std::size_t>(R) * n;
  gpu_test::launch_fill(slot, static_cast<std::size_t>(n), static_cast<float>(R + 1),
                        static_cast<cudaStream_t>(ag.native_handle()));
  mesh.device_comm("dp", comm::StreamKind::all_gather)
      .all_gather(slot, gathered.data(), static_cast<std::size_t>(n), DType::f32, ag)
      .wait();
  const std::vector<float> g = download(gathered);
  int bad = 0;
  for (int r = 0; r < W; ++r)
    for (std::int64_t i = 0; i < n; ++i)
      bad += g[static_cast<std::size_t>(r * n + i)] != static_cast<float>(r + 1);
  CHECK(bad == 0);

  Tensor out = pool.acquire({n}, DType::f32, rs, "out");
  // The reduce-scatter stream reads what the all-gather stream wrote: ordered by its event.
  rs.wait(ag.record());
  pool.used_on(gathered, rs);
  mesh.device_comm("dp", comm::StreamKind::reduce_scatter)
      .reduce_scatter_divided(gathered.data(), out.data(), static_cast<std::size_t>(n), DType::f32,
                              2.0 * W, rs)
      .wait();
  // Chunk R of every rank's input is slot R of the gathered buffer, R + 1 on every rank: the
  // sum over W ranks divided by 2W is (R + 1) / 2 (exact).
  const std::vector<float> o = download(out);
  bad = 0;
  for (std::int64_t i = 0; i < n; ++i)
    bad += o[static_cast<std::size_t>(i)] != static_cast<float>(R + 1) / 2.0f;
  CHECK(bad == 0);
  const auto before = pool.stats();
  gathered = Tensor();
  out = Tensor();
  CHECK(pool.stats().bytes_in_use + static_cast<std::size_t>((W + 1) * n) * 4 ==
        before.bytes_in_use);

  // Sub-meshes keep the device type.
  DeviceMesh sub = mesh.sub_mesh("dp");
  CHECK(sub.device_type() == DeviceType::cuda);
  CHECK(sub.device_comm("dp").size() == W);
}

TEST_CASE("the compute stream as a Kokkos execution-space instance") {
  if (no_cuda_kokkos()) return;
  DeviceMesh mesh(DeviceType::cuda, MPI_COMM_WORLD, {world_size()}, {"dp"}, 60.0);
  auto space = compute_space(mesh);
#if defined(KOKKOS_ENABLE_CUDA)
  CHECK(space.cuda_stream() == compute_cuda_stream(mesh));
  // One instance per mesh (a copy of the mesh shares it), not one per call.
  const DeviceMesh copy = mesh;
  CHECK(compute_space(mesh).impl_internal_space_instance() == space.impl_internal_space_instance());
  CHECK(compute_space(copy).impl_internal_space_instance() == space.impl_internal_space_instance());
#endif
  const int n = 1000;
  Kokkos::View<float*, Kokkos::DefaultExecutionSpace::memory_space> v("v", n);
  Kokkos::parallel_for(
      "fill", Kokkos::RangePolicy<Kokkos::DefaultExecutionSpace>(space, 0, n),
      KOKKOS_LAMBDA(int i) { v(i) = static_cast<float>(3 * i); });
  mesh.compute_stream().synchronize();  // this stream only
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  int bad = 0;
  for (int i = 0; i < n; ++i)
    bad += h(i) != static_cast<float>(3 * i);
  CHECK(bad == 0);
}

TEST_CASE("the caller's stream as the compute stream, ordered after the old one") {
  if (no_cuda_kokkos()) return;
  cudaStream_t mine = nullptr;  // outlives the mesh (fullshard does not destroy it)
  check(cudaStreamCreateWithFlags(&mine, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  {
    DeviceMesh mesh(DeviceType::cuda, MPI_COMM_WORLD, {world_size()}, {"dp"}, 60.0);
    const int n = 1 << 20;
    Kokkos::View<float*, Kokkos::DefaultExecutionSpace::memory_space> v("v", n);
    Kokkos::parallel_for(
        "fill", Kokkos::RangePolicy<Kokkos::DefaultExecutionSpace>(compute_space(mesh), 0, n),
        KOKKOS_LAMBDA(int i) { v(i) = static_cast<float>(i); });
    const DeviceMesh copy = mesh;
    copy.set_compute_stream(mine);  // the mesh and its copies: one compute stream
    CHECK(mesh.compute_stream().native_handle() == static_cast<void*>(mine));
#if defined(KOKKOS_ENABLE_CUDA)
    CHECK(compute_cuda_stream(mesh) == mine);
#endif
    // On the new stream, after the old one's fill.
    Kokkos::parallel_for(
        "double", Kokkos::RangePolicy<Kokkos::DefaultExecutionSpace>(compute_space(mesh), 0, n),
        KOKKOS_LAMBDA(int i) { v(i) *= 2; });
    check(cudaStreamSynchronize(mine), "cudaStreamSynchronize");
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
    int bad = 0;
    for (int i = 0; i < n; ++i)
      bad += h(i) != static_cast<float>(2 * i);
    CHECK(bad == 0);
    mesh.set_compute_stream(mine);  // the stream in use: nothing changes
    CHECK(mesh.compute_stream().native_handle() == static_cast<void*>(mine));
  }
  check(cudaStreamDestroy(mine), "cudaStreamDestroy");
}

TEST_CASE("init_device_mesh takes torch's device type strings") {
  CHECK(parse_device_type("cuda") == DeviceType::cuda);
  CHECK(parse_device_type("cpu") == DeviceType::cpu);
  CHECK_THROWS_WITH_AS(parse_device_type("gpu"), doctest::Contains("unknown device type 'gpu'"),
                       InvalidArgument);
}
