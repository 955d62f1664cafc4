// The auto-plan executed: the measured pool peak equals the plan's prediction, the predicted
// memory stays within the budget, and every rank makes the same choice.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "fullshard/schedule/executor.hpp"
#include "test_support.hpp"

using namespace fullshard;
using namespace fullshard::schedule;

namespace {

const char* const kModel = R"({
  "name": "model", "fully_shard": true, "params": {"s": {"shape": [16, 16]}},
  "modules": [
    {"name": "m1", "params": {"a": {"shape": [64, 32]}}, "cost": {"forward_ms": 0.3, "backward_ms": 0.6}},
    {"name": "m2", "params": {"b": {"shape": [256, 32]}}, "cost": {"forward_ms": 1.0, "backward_ms": 2.0}},
    {"name": "m3", "params": {"c": {"shape": [256, 32]}}, "cost": {"forward_ms": 1.0, "backward_ms": 2.0}},
    {"name": "m4", "params": {"d": {"shape": [128, 32]}}, "cost": {"forward_ms": 0.4, "backward_ms": 0.8}}
  ]
})";

bool same_on_all_ranks(std::uint64_t v) {
  std::uint64_t lo = 0, hi = 0;
  MPI_Allreduce(&v, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&v, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return lo == hi;
}

}  // namespace

TEST_CASE("auto-plan executed: measured peak equals the prediction, same choice on every rank") {
  const int W = test::world_size();
  // Budgets from generous down to the smallest feasible one.
  std::size_t smallest = 0;
  {
    auto g = graph::parse_graph_json(kModel, "model.json");
    AutoPlanOptions o;
    o.memory_budget_bytes = 1;
    try {
      auto_plan(*g, MeshShape::fsdp(W), o);
    } catch (const AutoPlanInfeasible& e) {
      smallest = e.smallest_bytes();
    }
  }
  REQUIRE(smallest > 0);
  for (std::size_t budget : {smallest, smallest + smallest / 4, std::size_t(1) << 30}) {
    CAPTURE(budget);
    auto g = graph::parse_graph_json(kModel, "model.json");
    AutoPlanOptions o;
    o.memory_budget_bytes = budget;
    const AutoPlan a = auto_plan(*g, MeshShape::fsdp(W), o);
    CHECK(a.memory_bytes <= budget);
    CHECK(same_on_all_ranks(a.plan.fingerprint()));
    CHECK(same_on_all_ranks(fnv1a64(a.choice.to_json())));

    DeviceMesh mesh(test::runtime(), {W}, {"dp"});
    apply_auto_plan(*g, a.choice);
    for (graph::Parameter* p : g->parameters())
      p->init([](std::int64_t e) { return double(e % 7); });
    CHECK(fsdp::apply_fully_shard_requests(*g, mesh, a.options.defaults) ==
          static_cast<int>(a.choice.calls.size()));
    Executor ex(*g, mesh, a.plan);
    for (int step = 0; step < 2; ++step) {
      ex.reset_measurement();
      ex.step();
      CHECK(ex.measured_peak_bytes() == a.plan.peak_bytes);
      fsdp::fsdp_state(*g)->zero_grad();
    }
  }
}
