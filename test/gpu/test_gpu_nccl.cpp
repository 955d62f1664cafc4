// NCCL collectives on device buffers (any number of ranks, one GPU each; scripts/gpu-check
// runs it on one). Values are integers, so sums are exact; references are computed here.
#include <cuda_runtime.h>
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/base/error.hpp"
#include "gpu_support.hpp"
#include "lib/comm/nccl_communicator.hpp"

using namespace fullshard;
using comm::DivideMode;
using comm::NcclCommunicator;
using comm::NcclGroup;
using comm::ReduceOp;
using comm::Stream;
using gpu_test::check;
using gpu_test::world_rank;
using gpu_test::world_size;

namespace {

double value(int rank, std::size_t i) {
  return static_cast<double>(static_cast<int>((i * 7 + static_cast<std::size_t>(rank) * 5) % 13) -
                             6);
}

// A device buffer of n elements of dtype t, filled from host values.
struct DeviceBuffer {
  void* p = nullptr;
  std::size_t n = 0;
  DType t = DType::f32;
  DeviceBuffer(std::size_t count, DType dtype) : n(count), t(dtype) {
    check(cudaMalloc(&p, std::max<std::size_t>(1, n * dtype_size(t))), "cudaMalloc");
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void upload(const std::vector<double>& v) {
    std::vector<unsigned char> h(n * dtype_size(t));
    for (std::size_t i = 0; i < n; ++i)
      store_from_double(h.data(), t, i, v[i]);
    check(cudaMemcpy(p, h.data(), h.size(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  std::vector<double> download() const {
    std::vector<unsigned char> h(n * dtype_size(t));
    check(cudaMemcpy(h.data(), p, h.size(), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    std::vector<double> v(n);
    for (std::size_t i = 0; i < n; ++i)
      v[i] = load_as_double(h.data(), t, i);
    return v;
  }
};

// Non-blocking by default (NcclOptions): creation and in-progress calls are polled.
std::unique_ptr<NcclCommunicator> make_comm(bool blocking = false) {
  comm::NcclOptions o;
  o.blocking = blocking;
  return NcclCommunicator::create(MPI_COMM_WORLD, blocking ? "gpu.world.b" : "gpu.world", 60.0, o);
}

const DType kTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

}  // namespace

TEST_CASE("all_gather, out of place and in place, every dtype") {
  auto c = make_comm();
  Stream s = Stream::device("nccl.test");
  const int W = world_size();
  const int R = world_rank();
  const std::size_t n = 1000;
  for (DType t : kTypes) {
    CAPTURE(dtype_name(t));
    DeviceBuffer send(n, t), recv(n * W, t);
    std::vector<double> mine(n);
    for (std::size_t i = 0; i < n; ++i)
      mine[i] = value(R, i);
    send.upload(mine);
    c->all_gather(send.p, recv.p, n, t, s).wait();
    auto got = recv.download();
    int bad = 0;
    for (int r = 0; r < W; ++r)
      for (std::size_t i = 0; i < n; ++i)
        bad += got[r * n + i] != value(r, i);
    CHECK(bad == 0);
    // In place: send is this rank's slot of recv.
    DeviceBuffer inplace(n * W, t);
    std::vector<double> init(n * W, 99.0);
    for (std::size_t i = 0; i < n; ++i)
      init[R * n + i] = value(R, i);
    inplace.upload(init);
    void* slot = static_cast<char*>(inplace.p) + R * n * dtype_size(t);
    c->all_gather(slot, inplace.p, n, t, s).wait();
    got = inplace.download();
    bad = 0;
    for (int r = 0; r < W; ++r)
      for (std::size_t i = 0; i < n; ++i)
        bad += got[r * n + i] != value(r, i);
    CHECK(bad == 0);
  }
}

TEST_CASE("reduce_scatter: sum, avg, pre-mul-sum and sum-then-scale divide factors") {
  auto c = make_comm();
  Stream s = Stream::device("nccl.test");
  const int W = world_size();
  const int R = world_rank();
  const std::size_t n = 512;  // per rank
  for (DType t : kTypes) {
    CAPTURE(dtype_name(t));
    DeviceBuffer send(n * W, t), recv(n, t);
    std::vector<double> in(n * W);
    for (std::size_t i = 0; i < n * W; ++i)
      in[i] = value(R, i);
    std::vector<double> sum(n, 0.0);
    for (int r = 0; r < W; ++r)
      for (std::size_t i = 0; i < n; ++i)
        sum[i] += value(r, R * n + i);
    const double u = dtype_unit_roundoff(t);
    auto compare = [&](double divisor, double tol_units) {
      auto got = recv.download();
      double worst = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const double ref = sum[i] / divisor;
        worst = std::max(worst, std::fabs(got[i] - ref) / std::max(1.0, std::fabs(ref)));
      }
      CHECK(worst <= tol_units * u);
    };
    send.upload(in);
    c->reduce_scatter(send.p, recv.p, n, t, ReduceOp::sum, s).wait();
    compare(1.0, 0.0);
    c->reduce_scatter(send.p, recv.p, n, t, ReduceOp::avg, s).wait();
    compare(W, 2.0);
    c->reduce_scatter_divided(send.p, recv.p, n, t, 3.0, s, DivideMode::pre_mul_sum).wait();
    compare(3.0, 2.0 * W + 2.0);  // each input scaled (one rounding of 1/3 and of each product)
    c->reduce_scatter_divided(send.p, recv.p, n, t, 3.0, s, DivideMode::sum_then_scale).wait();
    compare(3.0, 1.0);
  }
}

TEST_CASE("all_reduce, broadcast, barrier, and a consumer stream ordered by an event") {
  auto c = make_comm();
  Stream s = Stream::device("nccl.test");
  Stream consumer = Stream::device("compute");
  const int W = world_size();
  const int R = world_rank();
  const std::size_t n = 4096;
  DeviceBuffer buf(n, DType::f32);
  std::vector<double> in(n);
  for (std::size_t i = 0; i < n; ++i)
    in[i] = value(R, i);
  buf.upload(in);
  comm::Work w = c->all_reduce(buf.p, buf.p, n, DType::f32, ReduceOp::max, s);
  w.wait(consumer);  // no host block; the copy below runs after the all-reduce
  DeviceBuffer copy(n, DType::f32);
  check(cudaMemcpyAsync(copy.p, buf.p, n * 4, cudaMemcpyDeviceToDevice,
                        static_cast<cudaStream_t>(consumer.native_handle())),
        "cudaMemcpyAsync");
  consumer.synchronize();
  auto got = copy.download();
  int bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double m = value(0, i);
    for (int r = 1; r < W; ++r)
      m = std::max(m, value(r, i));
    bad += got[i] != m;
  }
  CHECK(bad == 0);
  buf.upload(std::vector<double>(n, static_cast<double>(R + 1)));
  c->broadcast(buf.p, n, DType::f32, W - 1, s).wait();
  got = buf.download();
  bad = 0;
  for (double v : got)
    bad += v != W;
  CHECK(bad == 0);
  CHECK_NOTHROW(c->barrier(s).wait());
  // Host streams are refused with a clear message.
  Stream host = Stream::caller("host");
  CHECK_THROWS_WITH_AS(c->barrier(host), doctest::Contains("need a device stream"),
                       InvalidArgument);
}

TEST_CASE("grouped collectives on two communicators (dup), and split") {
  auto ag = make_comm();
  auto rs = ag->dup("gpu.world.rs");
  REQUIRE(rs);
  Stream s1 = Stream::device("ag");
  Stream s2 = Stream::device("rs");
  const int W = world_size();
  const int R = world_rank();
  const std::size_t n = 256;
  DeviceBuffer a_send(n, DType::bf16), a_recv(n * W, DType::bf16);
  DeviceBuffer r_send(n * W, DType::f32), r_recv(n, DType::f32);
  std::vector<double> a(n), r(n * W);
  for (std::size_t i = 0; i < n; ++i)
    a[i] = value(R, i);
  for (std::size_t i = 0; i < n * W; ++i)
    r[i] = value(R, i);
  a_send.upload(a);
  r_send.upload(r);
  comm::Work w1, w2;
  {
    NcclGroup group;
    w1 = ag->all_gather(a_send.p, a_recv.p, n, DType::bf16, s1);
    w2 = rs->reduce_scatter(r_send.p, r_recv.p, n, DType::f32, ReduceOp::sum, s2);
    CHECK_THROWS_AS(w1.wait(), InvalidArgument);  // inside the group
    group.end();
  }
  w1.wait();
  w2.wait();
  auto g = a_recv.download();
  int bad = 0;
  for (int q = 0; q < W; ++q)
    for (std::size_t i = 0; i < n; ++i)
      bad += g[q * n + i] != value(q, i);
  CHECK(bad == 0);
  auto sums = r_recv.download();
  bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double ref = 0;
    for (int q = 0; q < W; ++q)
      ref += value(q, R * n + i);
    bad += sums[i] != ref;
  }
  CHECK(bad == 0);
  // split: even and odd ranks.
  auto half = ag->split(R % 2, R, "gpu.half");
  REQUIRE(half);
  CHECK(half->size() == (W + 1 - R % 2) / 2);
  CHECK(half->rank() == R / 2);
}

TEST_CASE("communicators are non-blocking by default; a blocking one gives the same results") {
  CHECK_FALSE(make_comm()->blocking());
  auto c = make_comm(true);
  CHECK(c->blocking());
  Stream s = Stream::device("b");
  const int W = world_size();
  const std::size_t n = 300;
  DeviceBuffer send(n, DType::f16), recv(n * W, DType::f16);
  send.upload(std::vector<double>(n, 1.5));
  c->all_gather(send.p, recv.p, n, DType::f16, s).wait();
  int bad = 0;
  for (double v : recv.download())
    bad += v != 1.5;
  CHECK(bad == 0);
  CHECK_FALSE(c->aborted());
}
