// Collectives on two worker streams at once, issued in opposite orders on different ranks:
// this completes only if the streams really are independent. And the one-stream-per-
// communicator rule is enforced with a clear error.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "test_support.hpp"

using namespace fullshard;
using comm::ReduceOp;
using comm::Stream;

TEST_CASE("two streams run collectives concurrently on separate communicators") {
  const int W = test::world_size();
  const int r = test::world_rank();
  DeviceMesh mesh(test::runtime(), {W}, {"dp"});
  auto& ag = mesh.comm("dp", comm::StreamKind::all_gather);
  auto& rs = mesh.comm("dp", comm::StreamKind::reduce_scatter);
  Stream ag_stream = Stream::worker("all_gather");
  Stream rs_stream = Stream::worker("reduce_scatter");
  const std::size_t n = 1 << 14;
  for (int round = 0; round < 5; ++round) {
    std::vector<float> gathered(W * n, -1.0f);
    for (std::size_t i = 0; i < n; ++i)
      gathered[r * n + i] = float(r * 10 + round);
    std::vector<float> grads(W * n);
    for (std::size_t i = 0; i < grads.size(); ++i)
      grads[i] = float(r + 1) * float(i % 5);
    std::vector<float> shard(n);
    comm::Work a, b;
    auto issue_ag = [&] {
      a = ag.all_gather(gathered.data() + r * n, gathered.data(), n, DType::f32, ag_stream);
    };
    auto issue_rs = [&] {
      b = rs.reduce_scatter(grads.data(), shard.data(), n, DType::f32, ReduceOp::sum, rs_stream);
    };
    // Even ranks issue the all-gather first, odd ranks the reduce-scatter, and each waits for
    // its first operation before issuing the second: on one shared queue (or one thread)
    // this deadlocks.
    if (r % 2 == 0) {
      issue_ag();
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      issue_rs();
    } else {
      issue_rs();
      issue_ag();
    }
    a.wait();
    b.wait();
    bool ok = true;
    for (int q = 0; q < W; ++q)
      ok &= gathered[q * n + 7] == float(q * 10 + round);
    for (std::size_t i = 0; i < n; ++i)
      ok &= shard[i] == float(W * (W + 1) / 2) * float((r * n + i) % 5);
    CHECK(ok);
  }
}

TEST_CASE("one communicator in flight on two streams is refused") {
  const int W = test::world_size();
  DeviceMesh mesh(test::runtime(), {W}, {"dp"});
  auto& c = mesh.comm("dp");
  Stream first = Stream::worker("first");
  Stream second = Stream::worker("second");
  Stream gate = Stream::worker("gate");
  std::atomic<bool> open{false};
  gate.submit("gate", [&] {
    while (!open.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  first.wait(gate.record());
  float x = 1.0f;
  comm::Work w = c.all_reduce(&x, &x, 1, DType::f32, ReduceOp::sum, first);  // held by the gate
  float y = 1.0f;
  CHECK_THROWS_WITH_AS(c.all_reduce(&y, &y, 1, DType::f32, ReduceOp::sum, second),
                       doctest::Contains("while operations are in flight on stream 'first'"),
                       InvalidArgument);
  open = true;
  w.wait();
  CHECK(x == float(W));
  // Once the first stream's work is done, another stream may use the communicator.
  c.all_reduce(&y, &y, 1, DType::f32, ReduceOp::sum, second).wait();
  CHECK(y == float(W));
}

TEST_CASE("events order a collective after work on another stream") {
  const int W = test::world_size();
  const int r = test::world_rank();
  DeviceMesh mesh(test::runtime(), {W}, {"dp"});
  auto& c = mesh.comm("dp", comm::StreamKind::all_reduce);
  Stream compute = Stream::worker("compute");
  Stream comm_stream = Stream::worker("comm");
  std::vector<double> v(100, 0.0);
  compute.submit("produce", [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    for (auto& x : v)
      x = r + 1;
  });
  comm_stream.wait(compute.record());
  c.all_reduce(v.data(), v.data(), v.size(), DType::f64, ReduceOp::sum, comm_stream).wait();
  CHECK(v[0] == W * (W + 1) / 2.0);
  CHECK(v[99] == W * (W + 1) / 2.0);
}
