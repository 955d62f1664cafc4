// DeviceMesh: coordinates, per-dim communicators, sub-meshes, flattening, node-aware meshes
// and every bad input.
#include <doctest/doctest.h>

#include "fullshard/comm/mpi_communicator.hpp"

#include <Kokkos_Core.hpp>  // KOKKOS_ENABLE_CUDA
#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "test_support.hpp"

using namespace fullshard;
using comm::ReduceOp;
using comm::Stream;

namespace {
// Sum of world ranks over a communicator.
int rank_sum(comm::Communicator& c) {
  Stream s = Stream::caller();
  double v = test::world_rank();
  c.all_reduce(&v, &v, 1, DType::f64, ReduceOp::sum, s).wait();
  return static_cast<int>(v);
}
}  // namespace

TEST_CASE("1-D mesh over the world") {
  const int W = test::world_size();
  DeviceMesh mesh(test::runtime(), {W}, {"dp"});
  CHECK(mesh.ndim() == 1);
  CHECK(mesh.size() == W);
  CHECK(mesh.size("dp") == W);
  CHECK(mesh.rank() == test::world_rank());
  CHECK(mesh.coordinate("dp") == test::world_rank());
  for (comm::StreamKind ch : {comm::StreamKind::compute, comm::StreamKind::all_gather,
                              comm::StreamKind::reduce_scatter, comm::StreamKind::all_reduce}) {
    CHECK(mesh.comm("dp", ch).size() == W);
    CHECK(mesh.comm("dp", ch).rank() == test::world_rank());
    CHECK(rank_sum(mesh.comm("dp", ch)) == W * (W - 1) / 2);
  }
  // Every channel is its own MPI communicator.
  CHECK(dynamic_cast<comm::MpiCommunicator&>(mesh.comm("dp", comm::StreamKind::all_gather))
            .handle() !=
        dynamic_cast<comm::MpiCommunicator&>(mesh.comm("dp", comm::StreamKind::reduce_scatter))
            .handle());
}

TEST_CASE("2-D mesh: coordinates, dim communicators, sub-meshes and flattening") {
  const int W = test::world_size();
  if (W % 2 != 0) {
    MESSAGE("needs an even number of ranks; skipped on " << W);
    return;
  }
  const int S = W / 2;  // shape (2, S)
  const int r = test::world_rank();
  DeviceMesh mesh(test::runtime(), {2, S}, {"replicate", "shard"});
  CHECK(mesh.coordinates() == std::vector<int>{r / S, r % S});
  auto& shard = mesh.comm("shard");
  auto& rep = mesh.comm("replicate");
  CHECK(shard.size() == S);
  CHECK(shard.rank() == r % S);
  CHECK(rep.size() == 2);
  CHECK(rep.rank() == r / S);
  // shard groups: ranks with the same replicate coordinate.
  const int base = (r / S) * S;
  CHECK(rank_sum(shard) == S * base + S * (S - 1) / 2);
  // replicate groups: r % S and r % S + S.
  CHECK(rank_sum(rep) == 2 * (r % S) + S);

  DeviceMesh sub = mesh.sub_mesh("shard");
  CHECK(sub.ndim() == 1);
  CHECK(sub.names() == std::vector<std::string>{"shard"});
  CHECK(sub.size() == S);
  CHECK(sub.rank() == r % S);
  CHECK(rank_sum(sub.world_comm()) == rank_sum(shard));

  DeviceMesh dp = mesh.flatten({"replicate", "shard"});
  CHECK(dp.names() == std::vector<std::string>{"replicate_shard"});
  CHECK(dp.size() == W);
  CHECK(dp.rank() == r);
  // Flattened in the other order: rank = shard * 2 + replicate.
  DeviceMesh swapped = mesh.flatten({"shard", "replicate"}, "dp");
  CHECK(swapped.rank() == (r % S) * 2 + r / S);
  CHECK(rank_sum(swapped.world_comm()) == W * (W - 1) / 2);
  // Flattening one dim is its sub-mesh.
  CHECK(mesh.flatten({"replicate"}).rank() == r / S);
}

TEST_CASE("3-D mesh with a dim of size 1") {
  const int W = test::world_size();
  DeviceMesh mesh(test::runtime(), {1, W, 1}, {"pp", "dp", "tp"});
  CHECK(mesh.coordinates() == std::vector<int>{0, test::world_rank(), 0});
  CHECK(mesh.comm("tp").size() == 1);
  CHECK(mesh.comm("dp").size() == W);
  CHECK(mesh.flatten({"pp", "tp"}).size() == 1);
}

TEST_CASE("node-aware mesh, detected and with a pretend ranks-per-node") {
  const int W = test::world_size();
  const int r = test::world_rank();
  DeviceMesh detected = DeviceMesh::node_aware(test::runtime());
  CHECK(detected.names() == std::vector<std::string>{"node", "local"});
  CHECK(detected.size() == W);
  // One machine here, unless FULLSHARD_RANKS_PER_NODE says otherwise.
  if (test::runtime().settings().ranks_per_node == 0)
    CHECK(detected.shape() == std::vector<int>{1, W});
  if (W % 2 == 0) {
    DeviceMesh two = DeviceMesh::node_aware(MPI_COMM_WORLD, 2, 30.0);
    CHECK(two.shape() == std::vector<int>{W / 2, 2});
    CHECK(two.coordinates() == std::vector<int>{r / 2, r % 2});
    CHECK(rank_sum(two.comm("local")) == (r / 2) * 4 + 1);
  }
  if (W > 1 && W % 2 == 1)
    CHECK_THROWS_WITH_AS(DeviceMesh::node_aware(MPI_COMM_WORLD, 2, 30.0),
                         doctest::Contains("do not divide"), InvalidArgument);
}

TEST_CASE("bad meshes are errors naming what is wrong") {
  const auto& rt = test::runtime();
  const int W = test::world_size();
  CHECK_THROWS_WITH_AS(DeviceMesh(rt, {W + 1}, {"dp"}),
                       doctest::Contains(("holds " + std::to_string(W + 1) +
                                          " ranks but the communicator has " + std::to_string(W))
                                             .c_str()),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(DeviceMesh(rt, {1, W}, {"dp", "dp"}),
                       doctest::Contains("duplicate dim name 'dp'"), InvalidArgument);
  CHECK_THROWS_WITH_AS(DeviceMesh(rt, {}, {}), doctest::Contains("shape is empty"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(DeviceMesh(rt, {W}, {"a", "b"}), doctest::Contains("1 dims but 2 names"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(DeviceMesh(rt, {0, W}, {"a", "b"}), doctest::Contains("dim 'a' has size 0"),
                       InvalidArgument);
  DeviceMesh mesh(rt, {W}, {"dp"});
  CHECK_THROWS_WITH_AS(mesh.comm("shard"),
                       doctest::Contains("unknown dim 'shard' (this mesh has dims dp)"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(mesh.size("tp"), doctest::Contains("unknown dim 'tp'"), InvalidArgument);
  CHECK_THROWS_WITH_AS(mesh.flatten({"dp", "dp"}), doctest::Contains("given twice"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(mesh.sub_mesh("x"), doctest::Contains("unknown dim 'x'"), InvalidArgument);
  // Messages carry the rank.
  try {
    mesh.comm("nope");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("fullshard[rank " + std::to_string(test::world_rank()) +
                                     "]") == 0);
  }
}

TEST_CASE("ranks that build different meshes get an error on every rank, not a hang") {
  const auto& rt = test::runtime();
  const int W = test::world_size();
  if (W < 2) return;  // one rank always agrees with itself
  const bool odd = test::world_rank() == W - 1;
  // Dim names differ on the last rank: the splits below would pair mismatched calls.
  const std::string expected = "the ranks do not all build the same mesh (this rank: shape " +
                               std::to_string(W) + ", dims " + (odd ? "b" : "a");
  CHECK_THROWS_WITH_AS(DeviceMesh(rt, {W}, {odd ? "b" : "a"}), doctest::Contains(expected.c_str()),
                       RankMismatch);
  // The same shape and names on every rank still agree afterwards.
  DeviceMesh mesh(rt, {W}, {"dp"});
  CHECK(mesh.size() == W);
  // A flatten whose name differs on one rank.
  CHECK_THROWS_WITH_AS(mesh.flatten({"dp"}, odd ? "x" : "y"),
                       doctest::Contains("DeviceMesh::flatten: the ranks do not all build the same "
                                         "mesh"),
                       RankMismatch);
  CHECK(mesh.flatten({"dp"}, "flat").size() == W);
}

TEST_CASE("device types: CPU by default, torch's strings, a CUDA mesh needs a CUDA Kokkos") {
  const int W = test::world_size();
  DeviceMesh mesh(test::runtime(), {W}, {"dp"});
  CHECK(mesh.device_type() == DeviceType::cpu);
  CHECK(mesh.describe().find("cuda") == std::string::npos);
  // A CPU mesh's device resources are its host ones.
  CHECK(&mesh.device_comm("dp", comm::StreamKind::all_gather) ==
        &mesh.comm("dp", comm::StreamKind::all_gather));
  CHECK(&mesh.device_stream(comm::StreamKind::reduce_scatter) ==
        &mesh.stream(comm::StreamKind::reduce_scatter));
  CHECK(mesh.compute_stream().kind() == comm::StreamType::caller);
  CHECK_THROWS_WITH_AS(mesh.set_compute_stream(nullptr),
                       doctest::Contains("set_compute_stream needs a CUDA mesh"), InvalidArgument);
  DeviceMesh cpu = init_device_mesh(test::runtime(), "cpu", {W}, {"dp"});
  CHECK(cpu.device_type() == DeviceType::cpu);
  CHECK(rank_sum(cpu.device_comm("dp")) == W * (W - 1) / 2);
  CHECK_THROWS_WITH_AS(init_device_mesh(test::runtime(), "gpu", {W}, {"dp"}),
                       doctest::Contains("unknown device type 'gpu' (use \"cpu\" or \"cuda\")"),
                       InvalidArgument);
#if !defined(KOKKOS_ENABLE_CUDA)
  // This build's Kokkos runs on the host only: a CUDA mesh is refused on every rank, naming
  // what is missing (before any communicator is made).
  CHECK_THROWS_WITH_AS(DeviceMesh(test::runtime(), DeviceType::cuda, {W}, {"dp"}),
                       doctest::Contains("a CUDA-enabled Kokkos (this Kokkos"), ConfigError);
  CHECK_THROWS_WITH_AS(init_device_mesh(test::runtime(), "cuda", {W}, {"dp"}),
                       doctest::Contains("use a CPU mesh"), ConfigError);
#endif
}
