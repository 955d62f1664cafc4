// The executor runs a plan's iteration: measured peak memory equals the plan's, the measured
// timeline has the plan's collectives, the plan is identical on every rank, and gradients are
// the full-batch mean. Written once for a device tag D and compiled once per device
// (test/support/test_devices.hpp).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/state_dict.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "fullshard/schedule/executor.hpp"
#include "test_devices.hpp"
#include "test_support.hpp"

using namespace fullshard;
using namespace fullshard::schedule;

namespace {

const char* kSeed = R"({"name": "model", "fully_shard": true, "modules": [
  {"name": "m1", "params": {"a": {"shape": [13, 8]}}, "cost": {"forward_ms": 1, "backward_ms": 2}},
  {"name": "m2", "fully_shard": true, "params": {"b": {"shape": [29, 8]}}},
  {"name": "m3", "fully_shard": true, "params": {"c": {"shape": [31, 8]}}},
  {"name": "m4", "params": {"d": {"shape": [7, 8]}}}]})";

// Every leaf's forward checks it sees full parameters in `space`; its backward adds
// (rank + 1) * value to the gradient (which must be in `space` too).
struct Callbacks {
  int mismatches = 0;
  int wrong_space = 0;
};

void attach_callbacks(graph::Module& root, Callbacks& seen, MemorySpace space) {
  for (graph::Module* m : root.modules_preorder()) {
    if (m->num_params() == 0 || m->is_root()) continue;
    m->on_forward([&seen, space](graph::Module& mod) {
      for (std::size_t i = 0; i < mod.num_params(); ++i) {
        if (mod.param(i).data().shape() != mod.param(i).shape()) ++seen.mismatches;
        seen.wrong_space += mod.param(i).data().space() != space;
      }
    });
    m->on_backward([&seen, space](graph::Module& mod) {
      for (std::size_t i = 0; i < mod.num_params(); ++i) {
        seen.wrong_space += mod.param(i).grad().space() != space;
        Tensor g = test::host_copy(mod.param(i).grad());
        const Tensor v = test::host_copy(mod.param(i).data());
        for (std::int64_t e = 0; e < g.numel(); ++e)
          g.set(e, g.at(e) + (test::world_rank() + 1) * v.at(e));
        test::write_back(mod.param(i).grad(), g);
      }
    });
  }
}

// The seed graph's initial values (e % 11), its callbacks, and its 3 fully_shard requests
// applied on `mesh` with the plan's defaults.
void shard_seed(graph::Module& graph, const DeviceMesh& mesh, const PlanOptions& o, Callbacks& seen,
                MemorySpace space) {
  for (graph::Parameter* p : graph.parameters())
    p->init([](std::int64_t e) { return double(e % 11); });
  attach_callbacks(graph, seen, space);
  CHECK(fsdp::apply_fully_shard_requests(graph, mesh, o.defaults) == 3);
}

int count_labels(const Timeline& t, StreamKind s, const std::string& prefix) {
  int n = 0;
  for (const MeasuredOp& op : t.ops())
    n += op.stream == s && op.label.rfind(prefix, 0) == 0;
  return n;
}

}  // namespace

TEST_CASE_TEMPLATE(
    "executor: measured peak equals the plan's; timeline and trace; plan equal on all ranks", D,
    FULLSHARD_TEST_DEVICE) {
  const int W = test::world_size();
  for (int depth : {0, 2}) {
    CAPTURE(depth);
    auto graph = graph::parse_graph_json(kSeed, "seed.json");
    PlanOptions o;
    o.forward_prefetch_depth = depth;
    const Plan plan = Scheduler::plan(*graph, MeshShape::fsdp(W), o);

    // The same plan on every rank.
    const std::uint64_t fp = plan.fingerprint();
    std::uint64_t lo = 0, hi = 0;
    MPI_Allreduce(&fp, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&fp, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
    CHECK(lo == hi);

    DeviceMesh mesh = D::mesh({W}, {"dp"});
    Callbacks seen;
    shard_seed(*graph, mesh, o, seen, D::space);
    Executor ex(*graph, mesh, plan);
    ex.step();
    CHECK(ex.measured_peak_bytes() == plan.peak_bytes);
    CHECK(seen.mismatches == 0);
    CHECK(seen.wrong_space == 0);

    // Every planned collective appears once on its stream (one rank: no collectives).
    const int ag = static_cast<int>(plan.find(OpKind::all_gather).size());
    const int rs = static_cast<int>(plan.find(OpKind::reduce_scatter).size());
    if (W > 1) {
      CHECK(count_labels(ex.timeline(), StreamKind::all_gather, "all_gather on") == ag);
      CHECK(count_labels(ex.timeline(), StreamKind::reduce_scatter, "reduce_scatter on") == rs);
    }
    CHECK(count_labels(ex.timeline(), StreamKind::compute, "bwd(") == 4);
    const auto trace = nlohmann::json::parse(ex.timeline().to_chrome_trace());
    int x = 0;
    for (const auto& e : trace["traceEvents"])
      x += e["ph"] == "X";
    CHECK(x == static_cast<int>(ex.timeline().ops().size()));

    // Gradients: mean over ranks of (r + 1) * value = (W + 1) / 2 * value, exactly.
    int bad = 0;
    const auto sd = fsdp::sharded_state_dict(*graph);
    for (graph::Parameter* p : graph->parameters()) {
      const ShardedTensor& st = sd.at(p->fqn());
      const std::int64_t off = st.global_offset()[0] * p->shape()[1];
      CHECK(p->data().space() == D::space);
      CHECK(p->grad().space() == D::space);
      const Tensor grad = test::host_copy(p->grad());
      for (std::int64_t e = 0; e < grad.numel(); ++e)
        bad += grad.at(e) != float((W + 1) * double((off + e) % 11) / 2.0);
    }
    CHECK(bad == 0);

    // A second step measures the same peak (buffers come back to the pool).
    fsdp::fsdp_state(*graph)->zero_grad();
    ex.reset_measurement();
    ex.step();
    CHECK(ex.measured_peak_bytes() == plan.peak_bytes);
  }
}

TEST_CASE_TEMPLATE("executor: two levels (2 pretended nodes of 2 ranks), the plan's collectives", D,
                   FULLSHARD_TEST_DEVICE) {
  if (D::space != MemorySpace::host || test::world_size() != 4) return;
  auto graph = graph::parse_graph_json(kSeed, "seed.json");
  PlanOptions o;
  o.forward_prefetch_depth = 1;
  const Plan plan = Scheduler::plan(*graph, MeshShape::fsdp(4), o);
  const DeviceMesh mesh(MPI_COMM_WORLD, {4}, {"dp"}, 60.0, HostProgress::inline_,
                        HostCollectives::auto_, 2);
  REQUIRE(mesh.node_split("dp") != nullptr);
  Callbacks seen;
  shard_seed(*graph, mesh, o, seen, D::space);
  Executor ex(*graph, mesh, plan);
  for (int step = 0; step < 2; ++step) {
    CAPTURE(step);
    ex.reset_measurement();
    ex.step();
    CHECK(ex.measured_peak_bytes() == plan.peak_bytes);
    CHECK(seen.mismatches == 0);
    // Each planned collective runs once inside the node and once across the nodes (the
    // reduce-scatter's part across: an all-to-all of the nodes' sums).
    const int ag = static_cast<int>(plan.find(OpKind::all_gather).size());
    const int rs = static_cast<int>(plan.find(OpKind::reduce_scatter).size());
    CHECK(count_labels(ex.timeline(), StreamKind::all_gather,
                       "all_gather on shared memory of "
                       "'mesh(dp).dp.node'") == ag);
    CHECK(count_labels(ex.timeline(), StreamKind::all_gather,
                       "all_gather on communicator 'mesh(dp).dp.across.all_gather'") == ag);
    CHECK(count_labels(ex.timeline(), StreamKind::reduce_scatter,
                       "reduce_scatter on shared memory of 'mesh(dp).dp.node'") == rs);
    CHECK(count_labels(ex.timeline(), StreamKind::reduce_scatter,
                       "all_to_all on communicator 'mesh(dp).dp.across.reduce_scatter'") == rs);
    // Gradients: the mean over ranks of (r + 1) * value, exactly.
    int bad = 0;
    const auto sd = fsdp::sharded_state_dict(*graph);
    for (graph::Parameter* p : graph->parameters()) {
      const ShardedTensor& st = sd.at(p->fqn());
      const std::int64_t off = st.global_offset()[0] * p->shape()[1];
      for (std::int64_t e = 0; e < p->grad().numel(); ++e)
        bad += p->grad().at(e) != float(5 * double((off + e) % 11) / 2.0);
    }
    CHECK(bad == 0);
    fsdp::fsdp_state(*graph)->zero_grad();
  }
}

TEST_CASE_TEMPLATE("executor: compressed groups, measured peak equals the plan's", D,
                   FULLSHARD_TEST_DEVICE) {
  const int W = test::world_size();
  struct Case {
    std::optional<kernels::QuantCode> gather, reduce;
    int replicate;
    int reshard;  // reshard_after_forward as a group size (0: automatic)
  };
  for (const Case& c : {Case{kernels::QuantCode::int8, kernels::QuantCode::int8, 1, 0},
                        Case{kernels::QuantCode::fp8_e4m3, std::nullopt, 1, 0},
                        Case{std::nullopt, kernels::QuantCode::int8, 2, 0},
                        Case{kernels::QuantCode::int8, kernels::QuantCode::int8, 1, 2}}) {
    if (W % c.replicate != 0 || (c.reshard > 0 && W % c.reshard != 0)) continue;
    CAPTURE(c.replicate);
    CAPTURE(c.reshard);
    CAPTURE(c.gather.has_value());
    CAPTURE(c.reduce.has_value());
    auto graph = graph::parse_graph_json(kSeed, "seed.json");
    PlanOptions o;
    o.defaults.compression.all_gather = c.gather;
    o.defaults.compression.reduce_scatter = c.reduce;
    o.defaults.compression.block = 32;
    if (c.reshard > 0)
      o.defaults.reshard_after_forward = fsdp::ReshardAfterForward::group_size(c.reshard);
    const MeshShape shape =
        c.replicate > 1 ? MeshShape::hsdp(c.replicate, W / c.replicate) : MeshShape::fsdp(W);
    const Plan plan = Scheduler::plan(*graph, shape, o);
    DeviceMesh mesh = c.replicate > 1
                          ? D::mesh({c.replicate, W / c.replicate}, {"replicate", "shard"})
                          : D::mesh({W}, {"dp"});
    Callbacks seen;
    shard_seed(*graph, mesh, o, seen, D::space);
    Executor ex(*graph, mesh, plan);
    ex.step();
    CHECK(ex.measured_peak_bytes() == plan.peak_bytes);
    CHECK(seen.mismatches == 0);
    const int shard = W / c.replicate;
    if (shard > 1) {  // compressed reduce-scatters run as all-to-alls of packed chunks
      const int rs = static_cast<int>(plan.find(OpKind::reduce_scatter).size());
      CHECK(count_labels(ex.timeline(), StreamKind::reduce_scatter,
                         c.reduce ? "all_to_all on" : "reduce_scatter on") == rs);
    }
    // Gradients: the mean of (r + 1) * value within what the codes lose: the decoded values
    // (int8 or e4m3 of blocks whose largest value is 10) and the int8 chunks of the sums.
    const double v_err =
        c.gather ? (*c.gather == kernels::QuantCode::int8 ? 0.5 * 10 / 127.0 : 10.0 / 16.0) : 0.0;
    const double tol =
        (W + 1) / 2.0 * v_err + (c.reduce ? 0.5 * (W + 1) * 10.5 / 127.0 : 0.0) + 1e-5;
    int bad = 0;
    const auto sd = fsdp::sharded_state_dict(*graph);
    for (graph::Parameter* p : graph->parameters()) {
      const ShardedTensor& st = sd.at(p->fqn());
      const std::int64_t off = st.global_offset()[0] * p->shape()[1];
      const Tensor grad = test::host_copy(p->grad());
      for (std::int64_t e = 0; e < grad.numel(); ++e)
        bad += std::fabs(grad.at(e) - (W + 1) * double((off + e) % 11) / 2.0) > tol;
    }
    CHECK(bad == 0);
    fsdp::fsdp_state(*graph)->zero_grad();
    ex.reset_measurement();
    ex.step();
    CHECK(ex.measured_peak_bytes() == plan.peak_bytes);
  }
}
