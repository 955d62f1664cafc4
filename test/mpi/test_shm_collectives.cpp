// Node-local shared-memory host collectives (fullshard/comm/shm.hpp and the running backend's
// fused all-gather + copy-out and reduce-scatter + divide + copy-out), on 1-4 ranks.
//
// Each FSDP case runs the same training steps twice, on a mesh whose shard dim uses shared
// memory and on one forced to MPI, and checks both against a reference computed here from
// the documented arithmetic (sums exact, rounded once to the reduce dtype, divided in f32 or
// f64, cast to the parameter dtype, accumulated in its arithmetic); the two runs must also
// agree bit for bit, and the shared-memory run must not have used the MPI communicators.
#include <doctest/doctest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "lib/comm/shm.hpp"
#include "lib/kernels/multi_source.hpp"
#include "test_support.hpp"

using namespace fullshard;
using graph::Module;
using graph::Parameter;

namespace {

int W() {
  return test::world_size();
}

double init_value(std::size_t salt, std::int64_t e) {
  return static_cast<double>(static_cast<std::int64_t>((salt * 31 + 7 * e) % 17) - 8);
}
// Rank r's gradient contribution of element e (integers in [-3, 3]).
double x_value(int r, std::size_t salt, std::int64_t e, int step) {
  return static_cast<double>(
      static_cast<std::int64_t>((salt * 13 + 5 * e + 11 * r + 3 * step) % 7) - 3);
}

// Rounds v to dtype t (as stored) and back.
double as(DType t, double v) {
  unsigned char buf[8];
  store_from_double(buf, t, 0, v);
  return load_as_double(buf, t, 0);
}
bool wide(DType a, DType b) {
  return a == DType::f64 || b == DType::f64;
}

struct Dtypes {
  DType orig, param, reduce;
};
std::string name_of(const Dtypes& d) {
  return std::string(dtype_name(d.orig)) + "/" + dtype_name(d.param) + "/" + dtype_name(d.reduce);
}

struct Case {
  Dtypes dt;
  int reshard = 0;  // 0 automatic, -1 true, 1 false, k
};

// Shapes: uneven (5 rows), empty shards (3 rows or 1 row on 4 ranks), one parameter that
// fills the slot exactly (copy-out runs across slots), a non-zero inner size.
const std::vector<std::vector<Shape>> kLayers = {
    {{5, 3}, {3}}, {{1, 4}, {7}}, {{8}}, {{2, 2, 2}, {4, 5}}};

struct Run {
  std::vector<double> values;  // every parameter's shard and grad after the steps, in order
  int forward_mismatch = 0;
  int backward_mismatch = 0;
  int grad_mismatch = 0;
  int data_mismatch = 0;
  comm::Traffic traffic;      // the mesh's (MPI and shared memory)
  comm::Traffic mpi_traffic;  // the shard dim's MPI communicators only
};

// Two accumulated steps with an "optimizer" update of the shards before the second, then a
// zero_grad and a third step; every value checked against the reference.
Run run(const DeviceMesh& mesh, const Case& c) {
  const int world = mesh.size();
  const int rank = mesh.rank();
  const Dtypes dt = c.dt;
  auto root = Module::make_root("model");
  std::map<const Parameter*, std::size_t> salt;
  std::map<const Parameter*, std::vector<double>> full;  // expected full values
  std::vector<Parameter*> order;                         // declaration order
  int step = 0;
  Run out;
  std::vector<Module*> layers;
  for (std::size_t li = 0; li < kLayers.size(); ++li) {
    Module& m = root->add_module("l" + std::to_string(li));
    for (std::size_t pi = 0; pi < kLayers[li].size(); ++pi) {
      Parameter& p = m.add_param("p" + std::to_string(pi), kLayers[li][pi], dt.orig);
      const std::size_t s = li * 10 + pi + 1;
      salt[&p] = s;
      p.init([s](std::int64_t e) { return init_value(s, e); });
      std::vector<double> v(static_cast<std::size_t>(numel(p.shape())));
      for (std::size_t e = 0; e < v.size(); ++e)
        v[e] = init_value(s, static_cast<std::int64_t>(e));
      full[&p] = v;
      order.push_back(&p);
    }
    auto check_full = [&full, &dt](Module& mod, int& mismatches) {
      for (std::size_t i = 0; i < mod.num_params(); ++i) {
        Parameter& p = mod.param(i);
        const auto& want = full.at(&p);
        if (p.data().shape() != p.shape() || p.data().dtype() != dt.param) {
          ++mismatches;
          continue;
        }
        for (std::int64_t e = 0; e < p.data().numel(); ++e)
          if (p.data().at(e) != as(dt.param, want[static_cast<std::size_t>(e)])) ++mismatches;
      }
    };
    m.on_forward([&, check_full](Module& mod) { check_full(mod, out.forward_mismatch); });
    m.on_backward([&, check_full, rank](Module& mod) {
      check_full(mod, out.backward_mismatch);
      for (std::size_t i = 0; i < mod.num_params(); ++i) {
        Parameter& p = mod.param(i);
        Tensor g = p.grad();
        for (std::int64_t e = 0; e < g.numel(); ++e)
          g.set(e, g.at(e) + x_value(rank, salt.at(&p), e, step));
      }
    });
    layers.push_back(&m);
  }
  fsdp::FullyShardOptions o;
  if (dt.param != dt.orig) o.mp_policy.param_dtype = dt.param;
  if (dt.reduce != (dt.param != dt.orig ? dt.param : dt.orig)) o.mp_policy.reduce_dtype = dt.reduce;
  if (c.reshard == -1) o.reshard_after_forward = fsdp::ReshardAfterForward::always();
  if (c.reshard == 1) o.reshard_after_forward = fsdp::ReshardAfterForward::never();
  if (c.reshard > 1) o.reshard_after_forward = fsdp::ReshardAfterForward::group_size(c.reshard);
  for (Module* m : layers)
    fsdp::fully_shard(*m, mesh, o);
  fsdp::fully_shard(*root, mesh, o);

  const std::string shard_dim = mesh.names().back();
  const int Ws = mesh.size(shard_dim);
  const int rs = mesh.coordinate(shard_dim);
  // Expected sharded gradient of element gidx after `steps` (accumulated).
  auto expected_grad = [&](const Parameter& p, std::int64_t gidx, const std::vector<int>& steps) {
    double acc = 0.0;
    bool first = true;
    for (int st : steps) {
      double sum = 0.0;
      for (int r = 0; r < world; ++r)
        sum += x_value(r, salt.at(&p), gidx, st);
      const double reduced = as(dt.reduce, sum);
      const double divided =
          wide(dt.reduce, dt.orig)
              ? reduced / world
              : static_cast<double>(static_cast<float>(reduced) / static_cast<float>(world));
      const double t = as(dt.orig, divided);
      if (first) {
        acc = t;
        first = false;
      } else {
        const double s = dt.orig == DType::f64
                             ? acc + t
                             : static_cast<double>(static_cast<float>(acc) + static_cast<float>(t));
        acc = as(dt.orig, s);
      }
    }
    return acc;
  };
  auto check_shards = [&](const std::vector<int>& steps) {
    for (Parameter* p : order) {
      const std::vector<double>& want = full.at(p);
      const std::int64_t D = p->shape()[0];
      const std::int64_t chunk = (D + Ws - 1) / Ws;
      const std::int64_t inner = numel(p->shape()) / D;
      const std::int64_t first_row = std::min<std::int64_t>(D, rs * chunk);
      const Tensor& d = p->data();
      const Tensor& g = p->grad();
      for (std::int64_t e = 0; e < d.numel(); ++e) {
        const std::int64_t gidx = first_row * inner + e;
        if (d.at(e) != as(dt.orig, want[static_cast<std::size_t>(gidx)])) ++out.data_mismatch;
        if (!g.data() || g.at(e) != expected_grad(*p, gidx, steps)) ++out.grad_mismatch;
        out.values.push_back(d.at(e));
        out.values.push_back(g.data() ? g.at(e) : -1e30);
      }
    }
  };

  step = 0;
  fsdp::forward(*root);
  fsdp::backward(*root);
  check_shards({0});
  // The "optimizer": every shard element + 1 (the next gathers must see it).
  for (auto& [p, want] : full) {
    const std::int64_t D = p->shape()[0];
    const std::int64_t chunk = (D + Ws - 1) / Ws;
    const std::int64_t inner = numel(p->shape()) / D;
    const std::int64_t first_row = std::min<std::int64_t>(D, rs * chunk);
    Tensor d = p->data();
    for (std::int64_t e = 0; e < d.numel(); ++e)
      d.set(e, d.at(e) + 1.0);
    // Every rank's rows change: the expected full values too.
    (void)first_row;
    (void)inner;
    for (double& v : want)
      v += 1.0;
  }
  step = 1;
  fsdp::forward(*root);
  fsdp::backward(*root);
  check_shards({0, 1});
  fsdp::fsdp_state(*root)->zero_grad();
  for (Module* m : layers)
    fsdp::fsdp_state(*m)->zero_grad();
  step = 2;
  fsdp::forward(*root);
  fsdp::backward(*root);
  check_shards({2});
  out.traffic = mesh.traffic();
  for (comm::StreamKind ch :
       {comm::StreamKind::compute, comm::StreamKind::all_gather, comm::StreamKind::reduce_scatter})
    out.mpi_traffic += mesh.comm(shard_dim, ch).traffic();
  return out;
}

DeviceMesh mesh_1d(HostCollectives c, HostProgress progress = HostProgress::inline_,
                   int ranks_per_node = 0) {
  return DeviceMesh(MPI_COMM_WORLD, {W()}, {"dp"}, 60.0, progress, c, ranks_per_node);
}

// `two_level`: the shard dim spans nodes (node_split): shared memory inside, MPI across.
void compare(const DeviceMesh& shm_mesh, const DeviceMesh& mpi_mesh, const Case& c, bool expect_shm,
             bool two_level = false) {
  CAPTURE(name_of(c.dt));
  CAPTURE(c.reshard);
  const std::string shard_dim = shm_mesh.names().back();
  REQUIRE((shm_mesh.shm(shard_dim) != nullptr) == expect_shm);
  REQUIRE((shm_mesh.node_split(shard_dim) != nullptr) == two_level);
  REQUIRE(mpi_mesh.shm(shard_dim) == nullptr);
  const NodeSplit* split = shm_mesh.node_split(shard_dim);
  auto across = [split] {
    comm::Traffic t;
    for (comm::StreamKind ch : {comm::StreamKind::all_gather, comm::StreamKind::reduce_scatter})
      t += split->across(ch).traffic();
    return t;
  };
  const comm::Traffic across_before = split ? across() : comm::Traffic();
  const comm::Traffic shm_before = shm_mesh.traffic();
  const Run a = run(shm_mesh, c);
  const comm::Traffic across_after = split ? across() : comm::Traffic();
  const comm::Traffic mpi_before = mpi_mesh.traffic();
  const Run b = run(mpi_mesh, c);
  CHECK(a.forward_mismatch == 0);
  CHECK(a.backward_mismatch == 0);
  CHECK(a.data_mismatch == 0);
  CHECK(a.grad_mismatch == 0);
  CHECK(b.forward_mismatch == 0);
  CHECK(b.grad_mismatch == 0);
  REQUIRE(a.values.size() == b.values.size());
  CHECK(std::memcmp(a.values.data(), b.values.data(), a.values.size() * sizeof(double)) == 0);
  if (expect_shm && c.reshard <= 1) {
    // Every all-gather and reduce-scatter went through shared memory, and counts as the MPI
    // path's would.
    CHECK(a.mpi_traffic.all_gather == 0);
    CHECK(a.mpi_traffic.reduce_scatter == 0);
    CHECK(a.traffic.all_gather - shm_before.all_gather ==
          b.traffic.all_gather - mpi_before.all_gather);
    CHECK(a.traffic.reduce_scatter - shm_before.reduce_scatter ==
          b.traffic.reduce_scatter - mpi_before.reduce_scatter);
  }
  if (two_level && c.reshard <= 1) {
    // Nothing on the dim's own communicators: the node's shared memory and the communicators
    // across nodes carried it, each node's part sent across once per node.
    CHECK(a.mpi_traffic.all_gather == 0);
    CHECK(a.mpi_traffic.reduce_scatter == 0);
    const auto L = static_cast<std::uint64_t>(split->ranks_per_node());
    CHECK((across_after.all_gather - across_before.all_gather) * L ==
          b.traffic.all_gather - mpi_before.all_gather);
    // (the reduce-scatter across the nodes is an all-to-all of the nodes' sums)
    CHECK((across_after.all_to_all - across_before.all_to_all) * L ==
          b.traffic.reduce_scatter - mpi_before.reduce_scatter);
    CHECK(across_after.reduce_scatter == across_before.reduce_scatter);
    // In all (the node's part and the part across), what MPI's collectives count.
    CHECK(a.traffic.all_gather - shm_before.all_gather ==
          b.traffic.all_gather - mpi_before.all_gather);
    CHECK(a.traffic.reduce_scatter - shm_before.reduce_scatter + a.traffic.all_to_all -
              shm_before.all_to_all ==
          b.traffic.reduce_scatter - mpi_before.reduce_scatter);
  }
  if (shm_mesh.size(shard_dim) > 1) {
    CHECK(b.traffic.all_gather > 0);
    CHECK(b.traffic.reduce_scatter > 0);
  }
}

const std::vector<Dtypes> kDtypes = {
    {DType::f32, DType::f32, DType::f32},  {DType::f64, DType::f64, DType::f64},
    {DType::f16, DType::f16, DType::f16},  {DType::bf16, DType::bf16, DType::bf16},
    {DType::f32, DType::bf16, DType::f32}, {DType::f32, DType::bf16, DType::bf16},
    {DType::f32, DType::f16, DType::f32},  {DType::f64, DType::f32, DType::f64},
    {DType::bf16, DType::f32, DType::f32}, {DType::f32, DType::f32, DType::bf16},
    {DType::f16, DType::f32, DType::f64}};

}  // namespace

TEST_CASE("shm: a mesh dim inside one node gets shared memory unless MPI is forced") {
  const DeviceMesh a = mesh_1d(HostCollectives::auto_);
  const DeviceMesh m = mesh_1d(HostCollectives::mpi);
  CHECK((a.shm("dp") != nullptr) == (W() > 1));
  CHECK(m.shm("dp") == nullptr);
  CHECK(a.host_collectives() == HostCollectives::auto_);
  if (W() > 1) {
    CHECK(a.shm("dp")->size() == W());
    CHECK(a.shm("dp")->rank() == a.coordinate("dp"));
  }
  // From the environment: FULLSHARD_HOST_COLLECTIVES is parsed and checked.
  CHECK(Settings::from_map({{"FULLSHARD_HOST_COLLECTIVES", "mpi"}}).host_collectives ==
        HostCollectives::mpi);
  CHECK(Settings::from_map({}).host_collectives == HostCollectives::auto_);
  CHECK_THROWS_WITH_AS(Settings::from_map({{"FULLSHARD_HOST_COLLECTIVES", "nvlink"}}),
                       doctest::Contains("FULLSHARD_HOST_COLLECTIVES='nvlink' is invalid: "
                                         "expected auto, shm or mpi"),
                       SettingsError);
}

TEST_CASE("shm: windows give every rank its peers' segments and ordered counters") {
  if (W() == 1) return;
  const DeviceMesh mesh = mesh_1d(HostCollectives::auto_);
  const comm::ShmComm& sc = *mesh.shm("dp");
  const std::size_t n = 1000;
  comm::ShmWindow w = sc.allocate(n * sizeof(int), "test");
  CHECK(w.size() == W());
  CHECK(w.bytes() == n * sizeof(int));
  for (int round = 1; round <= 3; ++round) {
    // Writer waits until every peer read the last round, writes, publishes.
    w.wait_all(1, static_cast<std::uint64_t>(round - 1), "test write", "");
    auto* mine = reinterpret_cast<int*>(w.local());
    for (std::size_t i = 0; i < n; ++i)
      mine[i] = round * 100000 + sc.rank() * 1000 + static_cast<int>(i);
    w.publish(0, static_cast<std::uint64_t>(round));
    w.wait_all(0, static_cast<std::uint64_t>(round), "test read", "");
    int bad = 0;
    for (int q = 0; q < W(); ++q) {
      const auto* theirs = reinterpret_cast<const int*>(w.segment(q));
      for (std::size_t i = 0; i < n; ++i)
        bad += theirs[i] != round * 100000 + q * 1000 + static_cast<int>(i);
    }
    CHECK(bad == 0);
    w.publish(1, static_cast<std::uint64_t>(round));
  }
  w.wait_all(1, 3, "test end", "");
}

TEST_CASE("shm: reduce_sources casts, sums in f32 or f64, rounds once, divides, accumulates") {
  const std::int64_t n = 5000;  // more than one block
  const DType all[] = {DType::f32, DType::f64, DType::f16, DType::bf16};
  for (DType p : all)
    for (DType s : all)
      for (DType d : all)
        for (int nsrc : {1, 3}) {
          // Every (reduce, dst) pair with the source in the reduce dtype, and every source
          // dtype for one pair.
          if (p != s && !(s == DType::f32 && d == DType::f32) &&
              !(s == DType::bf16 && d == DType::f32))
            continue;
          for (double divisor : {1.0, 3.0}) {
            for (bool acc : {false, true}) {
              CAPTURE(dtype_name(p));
              CAPTURE(dtype_name(s));
              CAPTURE(dtype_name(d));
              CAPTURE(nsrc);
              CAPTURE(divisor);
              CAPTURE(acc);
              std::vector<std::vector<unsigned char>> src(static_cast<std::size_t>(nsrc));
              std::vector<const void*> ptr;
              for (int q = 0; q < nsrc; ++q) {
                src[q].resize(static_cast<std::size_t>(n) * dtype_size(p));
                for (std::int64_t i = 0; i < n; ++i)
                  store_from_double(src[q].data(), p, static_cast<std::size_t>(i),
                                    test::sample(q, static_cast<std::size_t>(i), 1, false));
                ptr.push_back(src[q].data());
              }
              std::vector<unsigned char> dst(static_cast<std::size_t>(n) * dtype_size(d));
              for (std::int64_t i = 0; i < n; ++i)
                store_from_double(dst.data(), d, static_cast<std::size_t>(i),
                                  test::sample(9, static_cast<std::size_t>(i), 2, false));
              std::vector<double> want(static_cast<std::size_t>(n));
              for (std::int64_t i = 0; i < n; ++i) {
                const auto k = static_cast<std::size_t>(i);
                // Each source rounded to s, summed in f32 (f64 for f64) in source order;
                // the sum rounded once to s.
                double sum = 0.0;
                if (s == DType::f64) {
                  for (int q = 0; q < nsrc; ++q)
                    sum += as(s, load_as_double(ptr[q], p, k));
                } else {
                  float f = 0.0f;
                  for (int q = 0; q < nsrc; ++q)
                    f += static_cast<float>(as(s, load_as_double(ptr[q], p, k)));
                  sum = f;
                }
                double v = as(s, sum);
                if (divisor != 1.0)
                  v = wide(s, d) ? v / divisor
                                 : static_cast<double>(static_cast<float>(v) /
                                                       static_cast<float>(divisor));
                double t = as(d, v);
                if (acc) {
                  const double old = load_as_double(dst.data(), d, k);
                  t = as(d, d == DType::f64 ? old + t
                                            : static_cast<double>(static_cast<float>(old) +
                                                                  static_cast<float>(t)));
                }
                want[k] = t;
              }
              kernels::reduce_sources(ptr.data(), nsrc, p, s, dst.data(), d, n, divisor, acc);
              int bad = 0;
              for (std::int64_t i = 0; i < n; ++i)
                bad += load_as_double(dst.data(), d, static_cast<std::size_t>(i)) !=
                       want[static_cast<std::size_t>(i)];
              CHECK(bad == 0);
            }
          }
        }
  const void* none[1] = {nullptr};
  float out = 0;
  CHECK_THROWS_AS(
      kernels::reduce_sources(none, 1, DType::f32, DType::f32, &out, DType::f32, 1, 1.0, false),
      InvalidArgument);
}

TEST_CASE("shm: FSDP on shared memory equals the MPI path and the reference, every dtype") {
  const DeviceMesh shm_mesh = mesh_1d(HostCollectives::auto_);
  const DeviceMesh mpi_mesh = mesh_1d(HostCollectives::mpi);
  for (const Dtypes& dt : kDtypes)
    compare(shm_mesh, mpi_mesh, {dt, 0}, W() > 1);
}

TEST_CASE("shm: reshard_after_forward true, false and k") {
  const DeviceMesh shm_mesh = mesh_1d(HostCollectives::auto_);
  const DeviceMesh mpi_mesh = mesh_1d(HostCollectives::mpi);
  const Dtypes f32{DType::f32, DType::f32, DType::f32};
  const Dtypes mixed{DType::f32, DType::bf16, DType::f32};
  for (const Dtypes& dt : {f32, mixed}) {
    compare(shm_mesh, mpi_mesh, {dt, -1}, W() > 1);
    compare(shm_mesh, mpi_mesh, {dt, 1}, W() > 1);
    if (W() == 4) compare(shm_mesh, mpi_mesh, {dt, 2}, true);
  }
}

TEST_CASE("shm: worker-thread streams") {
  const DeviceMesh shm_mesh = mesh_1d(HostCollectives::auto_, HostProgress::thread);
  const DeviceMesh mpi_mesh = mesh_1d(HostCollectives::mpi, HostProgress::thread);
  compare(shm_mesh, mpi_mesh, {{DType::f32, DType::f32, DType::f32}, 0}, W() > 1);
  compare(shm_mesh, mpi_mesh, {{DType::f32, DType::bf16, DType::bf16}, 0}, W() > 1);
}

TEST_CASE("shm: HSDP, shard dim on shared memory, replicate all-reduce over MPI") {
  if (W() % 2 != 0) return;
  const DeviceMesh shm_mesh(MPI_COMM_WORLD, {2, W() / 2}, {"replicate", "shard"}, 60.0,
                            HostProgress::inline_, HostCollectives::auto_);
  const DeviceMesh mpi_mesh(MPI_COMM_WORLD, {2, W() / 2}, {"replicate", "shard"}, 60.0,
                            HostProgress::inline_, HostCollectives::mpi);
  for (const Dtypes& dt :
       {Dtypes{DType::f32, DType::f32, DType::f32}, Dtypes{DType::f32, DType::bf16, DType::f32},
        Dtypes{DType::bf16, DType::bf16, DType::bf16}})
    compare(shm_mesh, mpi_mesh, {dt, 0}, W() / 2 > 1);
}

TEST_CASE("shm: two levels (FULLSHARD_RANKS_PER_NODE=2 on 4 ranks)") {
  if (W() != 4) return;
  // A flat mesh spans the two pretended nodes: shared memory inside each, MPI across
  // (node_split). HSDP with the shard dim inside a node: shared memory inside, MPI across.
  const DeviceMesh flat = mesh_1d(HostCollectives::auto_, HostProgress::inline_, 2);
  CHECK(flat.shm("dp") == nullptr);
  REQUIRE(flat.node_split("dp") != nullptr);
  CHECK(flat.node_split("dp")->nodes() == 2);
  CHECK(flat.node_split("dp")->ranks_per_node() == 2);
  CHECK(flat.node_split("dp")->node() == test::world_rank() / 2);
  CHECK(flat.node_split("dp")->dim_rank(1, 0) == 2);
  const DeviceMesh hsdp(MPI_COMM_WORLD, {2, 2}, {"replicate", "shard"}, 60.0, HostProgress::inline_,
                        HostCollectives::auto_, 2);
  CHECK(hsdp.shm("shard") != nullptr);
  CHECK(hsdp.shm("replicate") == nullptr);
  const DeviceMesh node = DeviceMesh::node_aware(MPI_COMM_WORLD, 2, 60.0);
  CHECK(node.shm("local") != nullptr);
  CHECK(node.shm("node") == nullptr);
  const DeviceMesh mpi_mesh(MPI_COMM_WORLD, {2, 2}, {"replicate", "shard"}, 60.0,
                            HostProgress::inline_, HostCollectives::mpi, 2);
  compare(hsdp, mpi_mesh, {{DType::f32, DType::f32, DType::f32}, 0}, true);
  compare(hsdp, mpi_mesh, {{DType::f32, DType::bf16, DType::bf16}, 0}, true);
  const DeviceMesh flat_mpi = mesh_1d(HostCollectives::mpi, HostProgress::inline_, 2);
  CHECK(flat_mpi.node_split("dp") == nullptr);
  for (const Dtypes& dt : kDtypes)
    compare(flat, flat_mpi, {dt, 0}, false, true);
  const Dtypes mixed{DType::f32, DType::bf16, DType::f32};
  for (int reshard : {-1, 1, 2})
    compare(flat, flat_mpi, {mixed, reshard}, false, true);
  const DeviceMesh threads = mesh_1d(HostCollectives::auto_, HostProgress::thread, 2);
  compare(threads, flat_mpi, {mixed, 0}, false, true);
  // Nodes whose ranks are not consecutive in the dim: dim ranks 0..3 are world ranks
  // 0, 2, 1, 3, so nodes {0, 1} and {2, 3} of the world hold dim ranks {0, 2} and {1, 3}.
  MPI_Comm shuffled = MPI_COMM_NULL;
  const int me = test::world_rank();
  MPI_Comm_split(MPI_COMM_WORLD, 0, (me % 2) * 2 + me / 2, &shuffled);
  {
    const DeviceMesh crossed(shuffled, {4}, {"dp"}, 60.0, HostProgress::inline_,
                             HostCollectives::auto_, 2);
    const DeviceMesh crossed_mpi(shuffled, {4}, {"dp"}, 60.0, HostProgress::inline_,
                                 HostCollectives::mpi, 2);
    REQUIRE(crossed.node_split("dp") != nullptr);
    CHECK(crossed.node_split("dp")->dim_rank(0, 1) == 2);
    CHECK(crossed.node_split("dp")->dim_rank(1, 0) == 1);
    for (const Dtypes& dt : {Dtypes{DType::f32, DType::f32, DType::f32}, mixed})
      compare(crossed, crossed_mpi, {dt, 0}, false, true);
    compare(crossed, crossed_mpi, {mixed, 2}, false, true);
  }
  MPI_Comm_free(&shuffled);
  // Forcing shared memory on a dim that spans nodes runs two levels; with one rank per node
  // it is refused at fully_shard.
  const DeviceMesh forced = mesh_1d(HostCollectives::shm, HostProgress::inline_, 2);
  CHECK(forced.node_split("dp") != nullptr);
  const DeviceMesh single = mesh_1d(HostCollectives::shm, HostProgress::inline_, 1);
  CHECK(single.node_split("dp") == nullptr);
  auto root = Module::make_root("model");
  root->add_param("w", {4});
  CHECK_THROWS_WITH_AS(fsdp::fully_shard(*root, single),
                       doctest::Contains("FULLSHARD_HOST_COLLECTIVES=shm, but the shard dim "
                                         "'dp'"),
                       ConfigError);
}

TEST_CASE("shm: two levels with HSDP (FULLSHARD_RANKS_PER_NODE=2 on 8 ranks)") {
  if (W() != 8) return;
  // Two shard groups of 4, each over two pretended nodes of 2: shared memory inside each
  // node, MPI across, then the replicate all-reduce over MPI.
  const DeviceMesh hsdp(MPI_COMM_WORLD, {2, 4}, {"replicate", "shard"}, 60.0, HostProgress::inline_,
                        HostCollectives::auto_, 2);
  const DeviceMesh mpi_mesh(MPI_COMM_WORLD, {2, 4}, {"replicate", "shard"}, 60.0,
                            HostProgress::inline_, HostCollectives::mpi, 2);
  REQUIRE(hsdp.node_split("shard") != nullptr);
  CHECK(hsdp.node_split("replicate") == nullptr);  // one rank per node
  for (const Dtypes& dt :
       {Dtypes{DType::f32, DType::f32, DType::f32}, Dtypes{DType::f32, DType::bf16, DType::f32},
        Dtypes{DType::bf16, DType::bf16, DType::bf16}})
    compare(hsdp, mpi_mesh, {dt, 0}, false, true);
  compare(hsdp, mpi_mesh, {{DType::f32, DType::f32, DType::f32}, 2}, false, true);
}
