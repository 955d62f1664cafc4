// The node's shared-memory gradient windows hold the reductions in flight, not every group's
// gradients for the group's life: after a step of a root and six equal blocks, the windows
// alive on the shard dim's shared memory are exactly the groups' all-gather windows (their
// shards) plus the root's gradient window and three of a block's size (two written at once,
// and a spare whose readers may still read), counted by ShmComm::window_bytes, where one per
// group for its life held them all; and the gradients are the mean over ranks, as before.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/tensor/sharding.hpp"
#include "lib/comm/shm.hpp"
#include "test_support.hpp"

using namespace fullshard;
using graph::Module;
using graph::Parameter;

TEST_CASE("shared-memory gradient windows: the reductions in flight, reused across groups") {
  const int W = test::world_size();
  if (W < 2) {
    MESSAGE("one rank: no shared-memory transport");
    return;
  }
  DeviceMesh mesh(test::runtime(), {W}, {"dp"});
  const comm::ShmComm* shm = mesh.shm("dp");
  if (!shm) {
    MESSAGE("the dim's collectives are not on shared memory here (FULLSHARD_HOST_COLLECTIVES)");
    return;
  }
  constexpr int kBlocks = 6;
  const Shape block_shape{16 * 4, 32}, root_shape{4 * 4, 8};  // divisible by 2 and 4
  auto root = Module::make_root("model");
  root->add_param("r", root_shape).init_sharded([](std::int64_t e) { return double(e % 5); });
  for (int b = 0; b < kBlocks; ++b)
    root->add_module("b" + std::to_string(b))
        .add_param("w", block_shape)
        .init_sharded([b](std::int64_t e) { return double((e + b) % 7); });
  // Each rank adds (rank + 1) to every gradient element: the reduced mean is (W + 1) / 2.
  const double mine = test::world_rank() + 1;
  auto add = [mine](Module& m) {
    for (std::size_t i = 0; i < m.num_params(); ++i) {
      Tensor& g = const_cast<Tensor&>(m.param(i).grad());
      for (std::int64_t e = 0; e < g.numel(); ++e)
        g.set(e, g.at(e) + mine);
    }
  };
  root->on_backward(add);
  for (int b = 0; b < kBlocks; ++b)
    root->module("b" + std::to_string(b)).on_backward(add);
  const std::uint64_t before = shm->window_bytes();
  for (int b = 0; b < kBlocks; ++b)
    fsdp::fully_shard(root->module("b" + std::to_string(b)), mesh);
  fsdp::fully_shard(*root, mesh);
  for (int step = 0; step < 2; ++step) {
    fsdp::forward(*root);
    fsdp::backward(*root);
  }
  // f32 everywhere, shards divide evenly: a group's shard is numel / W, its arena numel.
  const std::uint64_t block = static_cast<std::uint64_t>(numel(block_shape)) * 4;
  const std::uint64_t rootb = static_cast<std::uint64_t>(numel(root_shape)) * 4;
  const std::uint64_t shards = (kBlocks * block + rootb) / static_cast<std::uint64_t>(W);
  // The root's window, held through the whole backward; two blocks' at once (the engine takes
  // the next group's gradients before it issues this group's reduce-scatter) and a spare.
  const std::uint64_t in_flight = rootb + 3 * block;
  const std::uint64_t windows = shm->window_bytes() - before;
  INFO("windows " << windows << " B: shards " << shards << " + gradients in flight " << in_flight
                  << " (one per group for its life: " << kBlocks * block + rootb << ")");
  CHECK(windows == shards + in_flight);
  // Two steps without zero_grad: the sharded gradients hold both steps' means.
  const float want = static_cast<float>(2 * (W + 1) / 2.0);
  int bad = 0;
  for (const Parameter* p : root->parameters()) {
    const Tensor& g = p->grad();
    REQUIRE(g.data());
    for (std::int64_t e = 0; e < g.numel(); ++e)
      if (static_cast<float>(g.at(e)) != want) ++bad;
  }
  CHECK(bad == 0);
}
