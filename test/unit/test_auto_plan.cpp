// The auto-planner against an exhaustive search written here (every subset of free modules,
// every reshard_after_forward per group, every prefetch depth and reduce-scatter buffer
// count, each planned with Scheduler::plan): same optimum, never over the budget, the
// smallest feasible memory in the infeasible message, determinism, the user's requests kept.
#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "lib/graph/json_forms.hpp"

using namespace fullshard;
using namespace fullshard::schedule;

namespace {

// model[m1 -> m2 -> m3 -> m4] with compute costs; only the root has a request.
const char* const kFour = R"({
  "name": "model", "fully_shard": true, "params": {"s": {"shape": [16, 16]}},
  "modules": [
    {"name": "m1", "params": {"a": {"shape": [256, 256]}}, "cost": {"forward_ms": 0.3, "backward_ms": 0.6}},
    {"name": "m2", "params": {"b": {"shape": [1024, 256]}}, "cost": {"forward_ms": 1.0, "backward_ms": 2.0}},
    {"name": "m3", "params": {"c": {"shape": [1024, 256]}}, "cost": {"forward_ms": 1.0, "backward_ms": 2.0}},
    {"name": "m4", "params": {"d": {"shape": [512, 256]}}, "cost": {"forward_ms": 0.4, "backward_ms": 0.8}}
  ]
})";

// Nested: blocks container of three blocks, each with an inner module.
const char* const kNested = R"({
  "name": "net", "fully_shard": true, "params": {"embed": {"shape": [300, 64]}},
  "modules": [
    {"name": "blocks", "modules": [
      {"name": "0", "params": {"w": {"shape": [512, 128]}}, "cost": {"forward_ms": 0.5, "backward_ms": 1.0},
       "modules": [{"name": "ff", "params": {"w": {"shape": [512, 256]}}, "cost": {"forward_ms": 0.6, "backward_ms": 1.2}}]},
      {"name": "1", "params": {"w": {"shape": [512, 128]}}, "cost": {"forward_ms": 0.5, "backward_ms": 1.0}}
    ]},
    {"name": "head", "params": {"w": {"shape": [64, 300]}}, "cost": {"forward_ms": 0.1, "backward_ms": 0.2}}
  ]
})";

std::unique_ptr<graph::Module> load(const char* text) {
  return graph::parse_graph_json(text, "graph.json");
}

struct Point {
  double step_ms;
  std::size_t memory;
};

struct Best {
  bool feasible = false;
  double step_ms = std::numeric_limits<double>::infinity();
  std::size_t memory = std::numeric_limits<std::size_t>::max();
  std::size_t min_memory = std::numeric_limits<std::size_t>::max();
  std::size_t max_memory = 0;
  std::size_t candidates = 0;
  // Largest violation of the planner's per-grouping memory bound (must stay 0).
  bool bound_violated = false;
  std::vector<Point> points;

  // The optimum within `budget`: lowest step time, then lowest memory.
  Best within(std::size_t budget) const {
    Best b = *this;
    b.feasible = false;
    b.step_ms = std::numeric_limits<double>::infinity();
    b.memory = std::numeric_limits<std::size_t>::max();
    for (const Point& p : points) {
      if (p.memory > budget) continue;
      if (!b.feasible || p.step_ms < b.step_ms || (p.step_ms == b.step_ms && p.memory < b.memory)) {
        b.feasible = true;
        b.step_ms = p.step_ms;
        b.memory = p.memory;
      }
    }
    return b;
  }
};

fsdp::ReshardAfterForward reshard(int v) {
  if (v == -1) return true;
  if (v == 1) return false;
  return fsdp::ReshardAfterForward::group_size(v);
}

// The planner's default measure of a plan's memory (no optimizer state, nothing reserved).
std::size_t default_measure(const Plan& p) {
  return p.sharded_bytes + p.grad_bytes + p.peak_bytes;
}

// Exhaustive search over the modules that have no request in the graph (root: reshard only),
// each candidate's memory by `measure`.
Best exhaustive(const char* json, MeshShape mesh,
                const std::function<std::size_t(const Plan&)>& measure = default_measure) {
  auto g = load(json);
  std::vector<graph::Module*> free_modules;
  for (graph::Module* m : g->modules_preorder()) {
    bool params = false;
    for (graph::Module* d : m->modules_preorder())
      params = params || d->num_params() > 0;
    if (!m->is_root() && params) free_modules.push_back(m);
  }
  std::vector<int> values = {-1};
  if (mesh.shard_size > 1) values.push_back(1);
  for (int k = 2; k < mesh.shard_size; ++k)
    if (mesh.shard_size % k == 0) values.push_back(k);
  Best b;
  for (std::uint64_t mask = 0; mask < (std::uint64_t(1) << free_modules.size()); ++mask) {
    std::vector<graph::Module*> on = {g.get()};
    for (std::size_t f = 0; f < free_modules.size(); ++f)
      if ((mask >> f) & 1) on.push_back(free_modules[f]);
    std::size_t combos = 1;
    for (std::size_t i = 0; i < on.size(); ++i)
      combos *= values.size();
    for (std::size_t idx = 0; idx < combos; ++idx) {
      for (graph::Module* m : g->modules_preorder())
        m->clear_fully_shard_request();
      std::size_t rest = idx;
      for (graph::Module* m : on) {
        graph::ShardRequest r;
        r.reshard_after_forward = reshard(values[rest % values.size()]);
        m->set_fully_shard_request(r);
        rest /= values.size();
      }
      for (int pf : {0, 1, 2})
        for (int rs : {1, 2}) {
          PlanOptions o;
          o.forward_prefetch_depth = pf;
          o.reduce_scatter_max_input_buffers = rs;
          const Plan p = Scheduler::plan(*g, mesh, o);
          const std::size_t mem = measure(p);
          ++b.candidates;
          b.min_memory = std::min(b.min_memory, mem);
          b.max_memory = std::max(b.max_memory, mem);
          for (const PlannedGroup& pg : p.groups)
            if (pg.layout.arena_numel > 0 &&
                p.peak_bytes < pg.gather_bytes() + pg.unsharded_bytes())
              b.bound_violated = true;
          b.points.push_back({p.step_ms, mem});
        }
    }
  }
  return b;
}

AutoPlanOptions auto_options(std::size_t budget) {
  AutoPlanOptions o;
  o.memory_budget_bytes = budget;
  return o;
}

// Every module's request as the graph file writes it (null: none).
std::vector<nlohmann::json> requests(graph::Module& root) {
  std::vector<nlohmann::json> out;
  for (graph::Module* m : root.modules_preorder())
    out.push_back(m->fully_shard_request() ? graph::shard_request_json(*m->fully_shard_request())
                                           : nlohmann::json());
  return out;
}

}  // namespace

TEST_CASE("auto-plan: the exhaustive optimum, within budget, on small graphs") {
  for (const char* json : {kFour, kNested})
    for (MeshShape mesh : {MeshShape::fsdp(2), MeshShape::fsdp(4), MeshShape::hsdp(2, 2)}) {
      // kNested on 4 ranks has 18,432 candidates: the other cases keep the test short.
      if (json == kNested && mesh.shard_size == 4) continue;
      CAPTURE(json);
      CAPTURE(mesh.shard_size);
      CAPTURE(mesh.replicate_size);
      const Best all = exhaustive(json, mesh);
      CHECK_FALSE(all.bound_violated);
      REQUIRE(all.min_memory < all.max_memory);  // the budget matters
      for (std::size_t budget :
           {all.min_memory, all.min_memory + (all.max_memory - all.min_memory) / 3,
            all.min_memory + 2 * (all.max_memory - all.min_memory) / 3, all.max_memory}) {
        CAPTURE(budget);
        const Best ref = all.within(budget);
        REQUIRE(ref.feasible);
        auto g = load(json);
        const auto before = requests(*g);
        const AutoPlan a = auto_plan(*g, mesh, auto_options(budget));
        CHECK(requests(*g) == before);  // restored
        CHECK(a.exact);
        CHECK(a.space == ref.candidates);
        CHECK(a.evaluations <= a.space);
        CHECK(a.memory_bytes <= budget);
        CHECK(a.plan.step_ms == ref.step_ms);
        CHECK(a.memory_bytes == ref.memory);
        CHECK(a.memory_bytes == a.plan.sharded_bytes + a.plan.grad_bytes + a.plan.peak_bytes);
        // Applying the choice and planning again gives the same plan.
        apply_auto_plan(*g, a.choice);
        const Plan again = Scheduler::plan(*g, mesh, a.options);
        CHECK(again.fingerprint() == a.plan.fingerprint());
        // The hand-written default (every block + root) is no better within the budget.
        if (a.baseline_memory_bytes <= budget) CHECK(a.plan.step_ms <= a.baseline.step_ms);

        // The local search (forced) stays within the budget and is no worse than the default.
        auto g2 = load(json);
        AutoPlanOptions lo = auto_options(budget);
        lo.max_exhaustive = 0;
        const AutoPlan l = auto_plan(*g2, mesh, lo);
        CHECK_FALSE(l.exact);
        CHECK(l.memory_bytes <= budget);
        CHECK(l.plan.step_ms >= ref.step_ms);
        if (l.baseline_memory_bytes <= budget) CHECK(l.plan.step_ms <= l.baseline.step_ms);
      }
    }
}

TEST_CASE("auto-plan: an infeasible budget names the smallest feasible peak") {
  const MeshShape mesh = MeshShape::fsdp(4);
  const Best all = exhaustive(kFour, mesh);
  auto g = load(kFour);
  const auto before = requests(*g);
  std::string what;
  std::size_t smallest = 0;
  try {
    auto_plan(*g, mesh, auto_options(all.min_memory - 1));
  } catch (const AutoPlanInfeasible& e) {
    what = e.what();
    smallest = e.smallest_bytes();
  }
  CHECK(smallest == all.min_memory);
  CHECK(what.find("smallest feasible peak is") != std::string::npos);
  CHECK(what.find("(" + std::to_string(all.min_memory) + " B)") != std::string::npos);
  CHECK(what.find("budget of") != std::string::npos);
  CHECK(requests(*g) == before);
  // The exact budget is feasible and uses the least memory.
  const AutoPlan a = auto_plan(*g, mesh, auto_options(all.min_memory));
  CHECK(a.memory_bytes == all.min_memory);
}

TEST_CASE("auto-plan: a caller's memory measure (memory_of) is the one held to the budget") {
  // Another weighting than the planner's own, with a fixed baseline, as the memory account's
  // process peak has: the optimum under it differs from the default's.
  const auto measure = [](const Plan& p) {
    return p.sharded_bytes + 2 * p.grad_bytes + 3 * p.peak_bytes + (std::size_t(1) << 20);
  };
  for (MeshShape mesh : {MeshShape::fsdp(2), MeshShape::fsdp(4)}) {
    CAPTURE(mesh.shard_size);
    const Best all = exhaustive(kFour, mesh, measure);
    REQUIRE(all.min_memory < all.max_memory);
    for (std::size_t budget : {all.min_memory, (all.min_memory + all.max_memory) / 2}) {
      CAPTURE(budget);
      const Best ref = all.within(budget);
      REQUIRE(ref.feasible);
      for (std::size_t max_exhaustive : {std::size_t(1) << 20, std::size_t(0)}) {
        auto g = load(kFour);
        AutoPlanOptions o = auto_options(budget);
        o.memory_of = measure;
        o.max_exhaustive = max_exhaustive;
        const AutoPlan a = auto_plan(*g, mesh, o);
        CHECK(a.memory_bytes == measure(a.plan));
        CHECK(a.memory_bytes <= budget);
        CHECK(a.baseline_memory_bytes == measure(a.baseline));
        if (a.exact) {
          CHECK(a.plan.step_ms == ref.step_ms);
          CHECK(a.memory_bytes == ref.memory);
        } else {
          CHECK(a.plan.step_ms >= ref.step_ms);
        }
      }
    }
    // One byte under the smallest is infeasible and names the smallest by the same measure.
    auto g = load(kFour);
    AutoPlanOptions o = auto_options(all.min_memory - 1);
    o.memory_of = measure;
    std::size_t smallest = 0;
    try {
      auto_plan(*g, mesh, o);
    } catch (const AutoPlanInfeasible& e) {
      smallest = e.smallest_bytes();
    }
    CHECK(smallest == all.min_memory);
  }
}

TEST_CASE("auto-plan: deterministic, and the user's requests are kept") {
  const MeshShape mesh = MeshShape::fsdp(4);
  auto ga = load(kNested);
  auto gb = load(kNested);  // a plan refers to its graph: keep both alive
  const AutoPlan a = auto_plan(*ga, mesh, auto_options(std::size_t(1) << 30));
  const AutoPlan b = auto_plan(*gb, mesh, auto_options(std::size_t(1) << 30));
  CHECK(a.choice == b.choice);
  CHECK(a.choice.to_json() == b.choice.to_json());
  CHECK(a.plan.fingerprint() == b.plan.fingerprint());

  // m2 fixed as a group that is not resharded, m3 never a group.
  auto g = load(kFour);
  graph::ShardRequest keep;
  keep.reshard_after_forward = false;
  g->module("m2").set_fully_shard_request(keep);
  g->module("m3").set_fully_shard_request(false);
  const AutoPlan k = auto_plan(*g, mesh, auto_options(std::size_t(1) << 30));
  bool m2 = false;
  for (const auto& c : k.choice.calls) {
    CHECK(c.fqn != "m3");
    if (c.fqn == "m2") {
      m2 = true;
      CHECK(c.request == keep);
    }
  }
  CHECK(m2);
  // The baseline is the graph's requests as written.
  REQUIRE(k.baseline_choice.calls.size() == 2);
  CHECK(k.baseline_choice.calls[0].fqn == "m2");
  CHECK(k.baseline_choice.calls[1].fqn == "");

  // keep_requests = false frees them again: the optimum of the free search.
  AutoPlanOptions o = auto_options(std::size_t(1) << 30);
  o.keep_requests = false;
  const AutoPlan f = auto_plan(*g, mesh, o);
  CHECK(f.plan.step_ms == exhaustive(kFour, mesh).within(std::size_t(1) << 30).step_ms);
}

TEST_CASE("auto-plan: the choice as C++ and as graph requests") {
  auto g = load(kFour);
  const AutoPlan a = auto_plan(*g, MeshShape::fsdp(4), auto_options(std::size_t(1) << 30));
  const std::string cpp = a.choice.to_cpp(a.plan);
  const nlohmann::json j = nlohmann::json::parse(a.choice.to_json());
  REQUIRE(j["fully_shard"].size() == a.choice.calls.size());
  CHECK(j["fully_shard"].back()["module"] == "<root>");
  CHECK(j["forward_prefetch_depth"] == a.options.forward_prefetch_depth);
  CHECK(j["reduce_scatter_max_input_buffers"] == a.options.reduce_scatter_max_input_buffers);
  CHECK(cpp.find("fsdp::fully_shard(root, mesh, opts(") != std::string::npos);
  for (const auto& c : a.choice.calls)
    if (!c.fqn.empty())
      CHECK(cpp.find("fsdp::fully_shard(root.module(\"" + c.fqn + "\")") != std::string::npos);
}

TEST_CASE("auto-plan: compression chosen where the plan predicts it faster, only if allowed") {
  fsdp::CompressionPolicy int8;
  int8.all_gather = int8.reduce_scatter = kernels::QuantCode::int8;
  int8.block = 64;
  for (double quant_ns : {0.6, 1000.0}) {
    CAPTURE(quant_ns);
    auto g = load(kFour);
    AutoPlanOptions o = auto_options(std::size_t(1) << 30);
    CostModel cost = CostModel::defaults(MeshShape::fsdp(4), 0.02, 0.1);  // a 0.1 GB/s link
    cost.set_quant_ns_per_element(quant_ns);
    o.base.cost = cost;
    const AutoPlan plain = auto_plan(*g, MeshShape::fsdp(4), o);
    o.compressions = {int8};
    const auto before = requests(*g);
    const AutoPlan a = auto_plan(*g, MeshShape::fsdp(4), o);
    CHECK(requests(*g) == before);  // restored
    CHECK(a.plan.step_ms <= plain.plan.step_ms);
    CHECK(a.evaluations > plain.evaluations);  // both searched
    // The same choice planned again from its requests alone (no defaults) gives its plan.
    auto g2 = load(kFour);
    apply_auto_plan(*g2, a.choice);
    PlanOptions again_options = a.options;
    again_options.defaults = fsdp::FullyShardOptions();
    CHECK(Scheduler::plan(*g2, MeshShape::fsdp(4), again_options).fingerprint() ==
          a.plan.fingerprint());
    if (quant_ns < 1) {  // 4 B per element over 0.1 GB/s: 40 ns saved, 1-2 ns of kernels
      CHECK(a.options.defaults.compression.any());
      CHECK(a.plan.step_ms < 0.8 * plain.plan.step_ms);
      for (const auto& c : a.choice.calls)
        CHECK(c.request.compression.value().block == 64);
      CHECK(a.plan.to_text().find("compression=int8/int8/64") != std::string::npos);
    } else {  // kernels slower than the link: stays uncompressed
      CHECK_FALSE(a.options.defaults.compression.any());
      CHECK(a.plan.fingerprint() == plain.plan.fingerprint());
    }
  }
}

TEST_CASE("auto-plan: bad options and sizes") {
  auto g = load(kFour);
  CHECK_THROWS_WITH_AS(auto_plan(*g, MeshShape::fsdp(4), auto_options(0)),
                       doctest::Contains("the memory budget must be > 0"), InvalidArgument);
  AutoPlanOptions o = auto_options(1 << 30);
  o.prefetch_depths = {};
  CHECK_THROWS_WITH_AS(auto_plan(*g, MeshShape::fsdp(4), o), doctest::Contains("prefetch_depths"),
                       InvalidArgument);
  CHECK(parse_byte_size("40GiB") == std::size_t(40) << 30);
  CHECK(parse_byte_size("1.5GB") == 1500000000u);
  CHECK(parse_byte_size("512MiB") == std::size_t(512) << 20);
  CHECK(parse_byte_size("123456") == 123456u);
  CHECK_THROWS_WITH_AS(parse_byte_size("40 GiB", "--memory-budget"),
                       doctest::Contains("--memory-budget: '40 GiB' is not a byte size"),
                       InvalidArgument);
  CHECK_THROWS_AS(parse_byte_size("GiB"), InvalidArgument);
  CHECK(format_bytes(1536) == "1.50 KiB");
  AutoPlanChoice c;
  c.calls.push_back({"nope", graph::ShardRequest()});
  CHECK_THROWS_WITH_AS(apply_auto_plan(*g, c), doctest::Contains("calls[0]: no module 'nope'"),
                       InvalidArgument);
}

TEST_CASE("two-level network: spans, hierarchical ring times, bytes per link level, JSON") {
  const TwoLevelNetwork n = TwoLevelNetwork::dgx_h100();
  CHECK(n.gpus_per_node == 8);
  using P = std::pair<int, int>;
  CHECK(n.span(MeshShape::hsdp(16, 64), MeshDim::shard) == P{8, 8});
  CHECK(n.span(MeshShape::hsdp(16, 64), MeshDim::replicate) == P{1, 16});
  CHECK(n.span(MeshShape::hsdp(8, 4), MeshDim::shard) == P{4, 1});
  CHECK(n.span(MeshShape::hsdp(8, 4), MeshDim::replicate) == P{2, 4});  // two replicas per node
  CHECK(n.span(MeshShape::fsdp(16384), MeshDim::shard) == P{8, 2048});

  // All-gather over 8 GPUs x 8 nodes of 1 MB per rank: 7 InfiniBand steps of 1 MB, then 7
  // NVLink steps of 8 MB.
  const MeshShape m = MeshShape::hsdp(16, 64);
  const double ag = 7 * (0.014 + 1e6 / 50e6) + 7 * (0.0034 + 8e6 / 450e6);
  CHECK(n.collective(m, CollectiveKind::all_gather, MeshDim::shard).time_ms(1e6) ==
        doctest::Approx(ag).epsilon(1e-12));
  const auto b = n.link_bytes(m, CollectiveKind::all_gather, MeshDim::shard, 1e6);
  CHECK(b.infiniband == doctest::Approx(7e6));
  CHECK(b.nvlink == doctest::Approx(56e6));
  CHECK(b.infiniband + b.nvlink == doctest::Approx(63e6));  // (n - 1) * bytes in all
  // All-reduce of 16 MB over the 16 replicas (one per node): a tree's 2 log2(16) latencies and
  // a ring's 2 (m - 1) / m of the bytes.
  const double ar = 8 * 0.014 + 2.0 * 1e6 * 15 / 50e6;
  CHECK(n.collective(m, CollectiveKind::all_reduce, MeshDim::replicate).time_ms(16e6) ==
        doctest::Approx(ar).epsilon(1e-12));
  const auto r = n.link_bytes(m, CollectiveKind::all_reduce, MeshDim::replicate, 16e6);
  CHECK(r.infiniband == doctest::Approx(30e6));
  CHECK(r.nvlink == 0.0);

  const CostModel c = n.cost_model(m, 1500.0);
  CHECK(c.copy_gb_per_s() == 1500.0);
  CHECK(c.time_ms(CollectiveKind::reduce_scatter, MeshDim::shard, 1e6) == doctest::Approx(ag));
  // Compiled into the ordinary cost-model JSON, read back unchanged.
  CHECK(CostModel::parse_json(c.to_json(), CostModel()) == c);

  // JSON: round trip, keys over a base, errors naming the path.
  CHECK(TwoLevelNetwork::parse_json(n.to_json(), TwoLevelNetwork()).to_json() == n.to_json());
  const TwoLevelNetwork f =
      TwoLevelNetwork::parse_json(nlohmann::json{{"gpus_per_node", 4}}.dump(), n, "net.json");
  CHECK(f.gpus_per_node == 4);
  CHECK(f.nvlink.alpha_ms == n.nvlink.alpha_ms);
  CHECK_THROWS_WITH_AS(TwoLevelNetwork::parse_json(
                           nlohmann::json{{"nvlink", {{"gb_per_s", 0}}}}.dump(), n, "net.json"),
                       doctest::Contains("net.json: nvlink.gb_per_s: expected a bandwidth > 0"),
                       ConfigError);
  CHECK_THROWS_WITH_AS(
      TwoLevelNetwork::parse_json(nlohmann::json{{"ethernet", 1}}.dump(), n, "net.json"),
      doctest::Contains("net.json: ethernet: unknown key 'ethernet'"), ConfigError);
  CHECK_THROWS_WITH_AS(
      TwoLevelNetwork::parse_json(nlohmann::json{{"gpus_per_node", 0}}.dump(), n, "net.json"),
      doctest::Contains("net.json: gpus_per_node: expected an integer >= 1"), ConfigError);
}
