// The planning half of the scheduler: groups without communication, the plan's orders,
// overlaps and memory (against hand-computed values, and against the engine's measured pool
// peak), determinism, the cost model and its JSON form.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "error_check.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/comm/mpi_communicator.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "fullshard/schedule/executor.hpp"
#include "fullshard/schedule/plan.hpp"
#include "lib/fsdp/group_access.hpp"
#include "lib/graph/json_forms.hpp"
#include "lib/schedule/planner_entry.hpp"
#include "test_support.hpp"

using namespace fullshard;
using namespace fullshard::schedule;

namespace {

using fullshard::test::contains;
using fullshard::test::error_of;

// The seed's example: model[m1[a] -> m2[b] -> m3[c] -> m4[d]], fully_shard on m2, m3 and the
// root (same as test/data/seed_m1m4.json).
const char* const kSeed = R"({
  "name": "model",
  "fully_shard": true,
  "modules": [
    {"name": "m1", "params": {"a": {"shape": [64, 256]}},
     "cost": {"forward_ms": 1.0, "backward_ms": 2.0}},
    {"name": "m2", "fully_shard": true, "params": {"b": {"shape": [1024, 256]}},
     "cost": {"forward_ms": 1.0, "backward_ms": 2.0}},
    {"name": "m3", "fully_shard": true, "params": {"c": {"shape": [1024, 256]}},
     "cost": {"forward_ms": 1.0, "backward_ms": 2.0}},
    {"name": "m4", "params": {"d": {"shape": [64, 256]}},
     "cost": {"forward_ms": 1.0, "backward_ms": 2.0}}
  ]
})";

// Uneven shards, nested groups, an ignored parameter, a module outside every group's own
// request, mixed precision on one group.
const char* const kMixed = R"({
  "name": "net",
  "fully_shard": {"ignored_params": ["bias"]},
  "params": {"bias": {"shape": [5]}, "scale": {"shape": [3, 2]}},
  "modules": [
    {"name": "embed", "params": {"weight": {"shape": [37, 8]}},
     "cost": {"forward_ms": 0.5, "backward_ms": 1.0}},
    {"name": "blocks", "modules": [
      {"name": "0", "fully_shard": true, "params": {"w": {"shape": [13, 7]}},
       "cost": {"forward_ms": 0.3, "backward_ms": 0.6},
       "modules": [{"name": "inner", "fully_shard": {"reshard_after_forward": false},
                    "params": {"v": {"shape": [5, 3]}}}]},
      {"name": "1", "fully_shard": {"param_dtype": "bf16"},
       "params": {"w": {"shape": [13, 7]}, "u": {"shape": [2]}}}
    ]},
    {"name": "head", "fully_shard": true, "params": {"w": {"shape": [3, 8]}}}
  ]
})";

// No request on the graph's root: two FSDP roots, each with its own pool.
const char* const kTwoRoots = R"({
  "name": "pair",
  "params": {"free": {"shape": [4]}},
  "modules": [
    {"name": "enc", "fully_shard": true, "params": {"w": {"shape": [33, 4]}},
     "modules": [{"name": "l", "fully_shard": true, "params": {"w": {"shape": [9, 9]}}}]},
    {"name": "dec", "fully_shard": true, "params": {"w": {"shape": [17, 4]}},
     "cost": {"forward_ms": 0.2, "backward_ms": 0.4}}
  ]
})";

// A list group (FSDP2's fully_shard([embed, head]): tied ends of a model) under the root,
// formed where head comes, after the blocks; embed holds a group of its own below it.
const char* const kLists = R"({
  "name": "lm",
  "fully_shard": true,
  "params": {"scale": {"shape": [5, 4]}},
  "modules": [
    {"name": "embed", "fully_shard": {"group_with": ["head"], "param_dtype": "bf16"},
     "params": {"e": {"shape": [17, 8]}},
     "modules": [{"name": "pos", "fully_shard": true, "params": {"p": {"shape": [11, 8]}}}]},
    {"name": "blocks", "modules": [
      {"name": "0", "fully_shard": true, "params": {"w": {"shape": [29, 8]}},
       "cost": {"forward_ms": 0.3, "backward_ms": 0.6}},
      {"name": "1", "fully_shard": true, "params": {"w": {"shape": [31, 8]}}}]},
    {"name": "head", "params": {"h": {"shape": [23, 8]}}}
  ]
})";

// A list group of two siblings inside a fully_shard'ed module below the root; a group below
// one of its modules.
const char* const kListNested = R"({
  "name": "net",
  "fully_shard": true,
  "params": {"free": {"shape": [3]}},
  "modules": [{"name": "enc", "fully_shard": true, "params": {"x": {"shape": [6, 4]}},
    "modules": [
      {"name": "a", "fully_shard": {"group_with": ["enc.b"]}, "params": {"w": {"shape": [13, 4]}}},
      {"name": "b", "params": {"w": {"shape": [9, 4]}},
       "modules": [{"name": "c", "fully_shard": true, "params": {"w": {"shape": [7, 4]}}}]}]}]
})";

// A list declared by its later module (an output layer tied to the embedding).
const char* const kTied = R"({
  "name": "tied",
  "fully_shard": true,
  "modules": [
    {"name": "embed", "params": {"weight": {"shape": [37, 8]}}},
    {"name": "block", "fully_shard": true, "params": {"w": {"shape": [19, 8]}}},
    {"name": "head", "fully_shard": {"group_with": ["embed"]}, "params": {"bias": {"shape": [37]}},
     "cost": {"forward_ms": 0.1, "backward_ms": 0.2}}
  ]
})";

std::unique_ptr<graph::Module> load(const char* text) {
  return graph::parse_graph_json(text, "graph.json");
}

std::vector<const Op*> phase_ops(const Plan& p, OpKind k, Phase ph) {
  std::vector<const Op*> out;
  for (const Op* op : p.find(k))
    if (op->phase == ph) out.push_back(op);
  return out;
}

std::vector<std::string> group_names(const Plan& p, const std::vector<const Op*>& ops) {
  std::vector<std::string> out;
  for (const Op* op : ops)
    out.push_back(p.groups[static_cast<std::size_t>(op->group)].name);
  return out;
}

const Op& only(const Plan& p, OpKind k, Phase ph, const std::string& module) {
  const Op* found = nullptr;
  for (const Op* op : phase_ops(p, k, ph))
    if (op->module() == module) {
      REQUIRE_MESSAGE(!found, "two ops of kind " << op_kind_name(k) << " for " << module);
      found = op;
    }
  REQUIRE_MESSAGE(found, "no op of kind " << op_kind_name(k) << " for " << module);
  return *found;
}

const Op& group_op(const Plan& p, OpKind k, Phase ph, const std::string& group) {
  const int g = p.group_index(group);
  REQUIRE(g >= 0);
  const Op* found = nullptr;
  for (const Op* op : phase_ops(p, k, ph))
    if (op->group == g) {
      REQUIRE(!found);
      found = op;
    }
  REQUIRE_MESSAGE(found, "no op of kind " << op_kind_name(k) << " for group " << group);
  return *found;
}

bool overlaps(const Op& a, const Op& b) {
  return a.start_ms < b.end_ms && b.start_ms < a.end_ms;
}

// Largest number of gather buffers alive at once during `phase`.
int max_live_gathers(const Plan& p, Phase ph) {
  int live = 0;
  int best = 0;
  for (const BufferEvent& e : p.events) {
    if (e.kind != fsdp::engine::BufKind::ag_buffer) continue;
    live += e.action == BufferAction::alloc ? 1 : -1;
    if (p.ops[static_cast<std::size_t>(e.op)].phase == ph) best = std::max(best, live);
  }
  return best;
}

constexpr std::size_t R = 131072;   // the root group's gather buffer / unsharded bytes (W=4)
constexpr std::size_t M = 1048576;  // m2's and m3's

}  // namespace

TEST_CASE("DepList: inline up to three, heap beyond, copies and moves keep the values") {
  fsdp::engine::DepList d;
  std::vector<int> want;
  for (int x : {9, 4, 7, 4, 1, 9, 12, 3}) {
    d.push_back(x);
    want.push_back(x);
    CHECK(d == want);
  }
  fsdp::engine::DepList copy = d;
  CHECK(copy == want);
  fsdp::engine::DepList moved = std::move(copy);
  CHECK(moved == want);
  CHECK(copy.empty());  // NOLINT(bugprone-use-after-move): a moved-from list is empty
  moved.sort_unique();
  CHECK(moved == std::vector<int>{1, 3, 4, 7, 9, 12});
  while (moved.size() > 2)
    moved.pop_back();  // across the heap -> inline boundary
  CHECK(moved == std::vector<int>{1, 3});
  fsdp::engine::DepList dup{5, 5, 5, 5, 2};
  dup.sort_unique();  // heap -> inline by dropping duplicates
  CHECK(dup == std::vector<int>{2, 5});
  fsdp::engine::DepList two{8, 6};
  two.sort_unique();
  CHECK(two == std::vector<int>{6, 8});
  two = d;  // inline <- heap
  CHECK(two == want);
  two = fsdp::engine::DepList{1};  // heap <- inline
  CHECK(two == std::vector<int>{1});
  d.swap(two);
  CHECK(d == std::vector<int>{1});
  CHECK(two == want);
}

TEST_CASE("plan_groups forms the groups apply_fully_shard_requests forms") {
  auto g = load(kSeed);
  const auto groups = plan_groups(*g, 4);
  REQUIRE(groups.size() == 3);
  CHECK(groups[0].name == "m2");
  CHECK(groups[1].name == "m3");
  CHECK(groups[2].name == "<root>");
  CHECK(groups[2].param_fqns() == std::vector<std::string>{"m1.a", "m4.d"});
  CHECK(groups[0].param_fqns() == std::vector<std::string>{"m2.b"});
  CHECK(groups[2].is_root);
  CHECK(!groups[0].is_root);
  CHECK(groups[0].root_group == 2);
  CHECK(groups[2].reshard_after_forward == fsdp::ReshardAfterForward::never());   // root: false
  CHECK(groups[0].reshard_after_forward == fsdp::ReshardAfterForward::always());  // others: true
  CHECK(groups[2].layout.shard_numel == 2 * 16 * 256);
  CHECK(groups[2].layout.arena_numel == 2 * 64 * 256);
  CHECK(groups[2].shard_bytes() == 32768);
  CHECK(groups[2].unsharded_bytes() == R);
  CHECK(groups[2].gather_bytes() == R);
  CHECK(groups[0].gather_bytes() == M);

  // Uneven shards (torch.chunk padding), nested groups, ignored params, mixed precision.
  auto mixed = load(kMixed);
  const auto mg = plan_groups(*mixed, 4);
  REQUIRE(mg.size() == 5);
  CHECK(mg[0].name == "blocks.0.inner");
  CHECK(mg[1].name == "blocks.0");
  CHECK(mg[1].param_fqns() == std::vector<std::string>{"blocks.0.w"});
  CHECK(mg[1].layout.shard_numel == 4 * 7);  // ceil(13/4) = 4 rows of 7
  CHECK(mg[1].layout.arena_numel == 13 * 7);
  CHECK(mg[0].reshard_after_forward == fsdp::ReshardAfterForward::never());
  CHECK(mg[0].root_group == 4);
  CHECK(mg[2].name == "blocks.1");
  CHECK(mg[2].param_dtype == DType::bf16);
  CHECK(mg[2].reduce_dtype == DType::bf16);
  CHECK(mg[2].gather_bytes() == 4 * (4 * 7 + 1) * 2);
  CHECK(mg[3].name == "head");
  CHECK(mg[4].name == "<root>");
  // The root's own "bias" is ignored; head's parameter went to head's group first.
  CHECK(mg[4].param_fqns() == std::vector<std::string>{"scale", "embed.weight"});
  CHECK(mg[4].is_root);

  // Defaults apply to every group; a request's keys override them.
  fsdp::FullyShardOptions d;
  d.mp_policy.param_dtype = DType::bf16;
  d.mp_policy.reduce_dtype = DType::f32;
  d.reshard_after_forward = fsdp::ReshardAfterForward(true);
  const auto dg = plan_groups(*mixed, 4, d);
  CHECK(dg[4].reshard_after_forward ==
        fsdp::ReshardAfterForward::always());  // root set explicitly: true
  CHECK(dg[0].reshard_after_forward ==
        fsdp::ReshardAfterForward::never());  // its request says false
  CHECK(dg[4].param_dtype == DType::bf16);
  CHECK(dg[4].reduce_dtype == DType::f32);
  // The `true` requests (blocks.0, head) share one copy of the defaults; each object request
  // has its own options: the defaults with its keys.
  REQUIRE(dg[1].options);
  CHECK(dg[1].options == dg[3].options);
  CHECK(dg[1].options->mp_policy.param_dtype == DType::bf16);
  CHECK(dg[1].options->ignored_params.empty());
  for (std::size_t i : {0, 2, 4})
    CHECK(dg[i].options != dg[1].options);
  CHECK(dg[0].options->reshard_after_forward.value() == fsdp::ReshardAfterForward(false).value());
  CHECK(dg[0].options->mp_policy.param_dtype == DType::bf16);  // from the defaults
  CHECK(dg[4].options->ignored_params == std::vector<std::string>{"bias"});
  CHECK(dg[4].options->mp_policy.reduce_dtype == DType::f32);
}

TEST_CASE("reshard_after_forward: one form, its JSON and its checks") {
  using R = fsdp::ReshardAfterForward;
  // An int does not convert (it would have converted to bool: 2 meaning true).
  static_assert(!std::is_convertible_v<int, R>);
  static_assert(std::is_convertible_v<bool, R>);
  CHECK(R::group_size(4).for_shard_group(4, "g") == R::always());
  CHECK(R::group_size(1).for_shard_group(4, "g") == R::never());
  CHECK(R::group_size(2).for_shard_group(4, "g").value() == 2);
  CHECK(R::automatic().for_shard_group(4, "g").is_automatic());
  CHECK(R::automatic().resolved(true) == R::never());
  CHECK(R::automatic().resolved(false) == R::always());
  CHECK(R::group_size(2).resolved(true) == R::group_size(2));
  CHECK(R::never().resolved(false) == R::never());
  CHECK(contains(error_of<InvalidArgument>([] { R::group_size(3).for_shard_group(4, "g"); }),
                 "fully_shard(g): reshard_after_forward=3 must divide the shard group size 4"));
  CHECK(contains(error_of<InvalidArgument>([] { R::group_size(-2).for_shard_group(4, "g"); }),
                 "fully_shard(g): bad reshard_after_forward"));
  CHECK(graph::reshard_json(R::always()) == nlohmann::json(true));
  CHECK(graph::reshard_json(R::never()) == nlohmann::json(false));
  CHECK(graph::reshard_json(R::automatic()).is_null());
  CHECK(graph::reshard_json(R::group_size(2)) == nlohmann::json(2));
  for (const R v : {R::automatic(), R::always(), R::never(), R::group_size(2)})
    CHECK(graph::reshard_from_json(graph::reshard_json(v), "x") == v);
  CHECK(R::group_size(2).to_string() == "2");
  CHECK(R::never().to_string() == "false");
  for (const nlohmann::json& bad : {nlohmann::json(0), nlohmann::json(-1), nlohmann::json(1.5),
                                    nlohmann::json("2"), nlohmann::json(std::int64_t(1) << 40)})
    CHECK(contains(error_of<ConfigError>([&] { graph::reshard_from_json(bad, "a.b"); }),
                   "a.b: expected true, false, null or an integer >= 1"));
}

TEST_CASE("a table of typed calls plans as the graph's requests do, and leaves them alone") {
  auto g = load(kMixed);
  const std::string before = graph::graph_to_json(*g);  // with its requests
  fsdp::FullyShardOptions defaults;
  defaults.mp_policy.param_dtype = DType::bf16;
  PlanOptions po;
  po.defaults = defaults;
  const MeshShape mesh = MeshShape::hsdp(2, 4);
  const Plan from_graph = Scheduler::plan(*g, mesh, po);

  // The same calls, typed: one entry per module in pre-order.
  std::vector<std::shared_ptr<const fsdp::FullyShardOptions>> owned;
  const std::vector<graph::Module*> modules = g->modules_preorder();
  owned.reserve(modules.size());
  detail::RequestTable table;
  for (graph::Module* m : modules) {
    if (!m->requests_fully_shard()) {
      table.calls.push_back(nullptr);
      continue;
    }
    owned.push_back(std::make_shared<const fsdp::FullyShardOptions>(
        fsdp::options_from_request(*m->fully_shard_request(), defaults)));
    table.calls.push_back(&owned.back());
  }
  Plan typed;
  detail::replan_calls(typed, *g, mesh, po, &table);
  CHECK(typed.to_text() == from_graph.to_text());
  CHECK(typed.fingerprint() == from_graph.fingerprint());

  // Other calls (the root alone, reshard_after_forward 2): planned, the graph untouched.
  auto two = std::make_shared<fsdp::FullyShardOptions>(defaults);
  two->reshard_after_forward = fsdp::ReshardAfterForward::group_size(2);
  const std::shared_ptr<const fsdp::FullyShardOptions> root_call = two;
  detail::RequestTable only_root;
  only_root.calls.assign(modules.size(), nullptr);
  only_root.calls[0] = &root_call;
  detail::replan_calls(typed, *g, mesh, po, &only_root);
  REQUIRE(typed.groups.size() == 1);
  CHECK(typed.groups[0].name == "<root>");
  CHECK(typed.groups[0].reshard_after_forward == fsdp::ReshardAfterForward::group_size(2));
  CHECK(typed.groups[0].params.size() == g->parameters().size());
  CHECK(graph::graph_to_json(*g) == before);

  detail::RequestTable short_table;
  short_table.calls.assign(2, nullptr);
  CHECK(contains(
      error_of<InvalidArgument>([&] { detail::replan_calls(typed, *g, mesh, po, &short_table); }),
      "a request table of 2 entries for a graph of"));
}

TEST_CASE("list groups: formed where fully_shard applies them, their errors") {
  auto g = load(kLists);
  const auto groups = plan_groups(*g, 4);
  std::vector<std::string> names;
  for (const auto& pg : groups)
    names.push_back(pg.name);
  CHECK(names ==
        std::vector<std::string>{"embed.pos", "blocks.0", "blocks.1", "embed+head", "<root>"});
  const PlannedGroup& list = groups[3];
  REQUIRE(list.modules.size() == 2);
  CHECK(list.modules[0]->fqn() == "embed");
  CHECK(list.modules[1]->fqn() == "head");
  CHECK(list.param_fqns() == std::vector<std::string>{"embed.e", "head.h"});
  CHECK(list.param_dtype == DType::bf16);  // the declaring module's options
  CHECK(list.forward_index == 1);          // its pre-forward: at embed, after the root's
  CHECK(!list.is_root);
  CHECK(list.root_group == 4);
  CHECK(list.reshard_after_forward == fsdp::ReshardAfterForward::always());
  CHECK(groups[4].param_fqns() == std::vector<std::string>{"scale"});
  CHECK(groups[4].reshard_after_forward == fsdp::ReshardAfterForward::never());
  CHECK(list.layout.shard_numel == 5 * 8 + 6 * 8);  // ceil(17/4) and ceil(23/4) rows
  CHECK(list.where() == "modules[0].fully_shard");

  // Declared by the later module: its parameters first, gathered where the first module runs.
  auto t = load(kTied);
  const auto tg = plan_groups(*t, 2);
  REQUIRE(tg.size() == 3);
  CHECK(tg[1].name == "head+embed");
  CHECK(tg[1].param_fqns() == std::vector<std::string>{"head.bias", "embed.weight"});
  CHECK(tg[1].forward_index == 1);  // <root>, then the list at embed, then block
  CHECK(tg[0].forward_index == 2);
  CHECK(tg[1].where() == "modules[2].fully_shard");

  auto r = load(kListNested);
  const auto rg = plan_groups(*r, 2);
  std::vector<std::string> rnames;
  for (const auto& pg : rg)
    rnames.push_back(pg.name);
  CHECK(rnames == std::vector<std::string>{"enc.b.c", "enc.a+enc.b", "enc", "<root>"});
  CHECK(rg[1].param_fqns() == std::vector<std::string>{"enc.a.w", "enc.b.w"});
  CHECK(rg[2].param_fqns() == std::vector<std::string>{"enc.x"});
  CHECK(rg[1].root_group == 3);
  CHECK(rg[1].forward_index == 2);  // <root>, enc, then the list at a
  const Plan p = Scheduler::plan(*r, MeshShape::fsdp(2));
  CHECK(p.pool_roots == std::vector<int>{3});
  CHECK(p.find(OpKind::all_gather, 1).size() == 2);  // forward and backward

  // The auto-planner keeps a list as it is (searching its reshard_after_forward) and the
  // graph untouched; its choice, applied, plans to the same plan.
  AutoPlanOptions ao;
  ao.memory_budget_bytes = std::size_t(1) << 30;
  const AutoPlan a = auto_plan(*r, MeshShape::fsdp(2), ao);
  graph::ShardRequest declared;
  declared.group_with = {"enc.b"};
  REQUIRE(r->module("enc.a").fully_shard_request() != nullptr);
  CHECK(*r->module("enc.a").fully_shard_request() == declared);
  CHECK(r->module("enc.b").fully_shard_request() == nullptr);
  CHECK(a.plan.group_index("enc.a+enc.b") >= 0);
  int list_calls = 0;
  for (const auto& c : a.choice.calls) {
    CHECK(c.fqn != "enc.b");  // no call of its own
    if (c.fqn == "enc.a") {
      ++list_calls;
      CHECK(c.request.group_with == std::vector<std::string>{"enc.b"});
    }
  }
  CHECK(list_calls == 1);
  auto applied = load(kListNested);
  apply_auto_plan(*applied, a.choice);
  CHECK(Scheduler::plan(*applied, MeshShape::fsdp(2), a.options).fingerprint() ==
        a.plan.fingerprint());

  auto bad = [](const std::string& a_request, const std::string& b_request = "false",
                const std::string& c_request = "false") {
    auto gr = graph::parse_graph_json(
        R"({"name": "m", "fully_shard": true, "modules": [{"name": "a", "fully_shard": )" +
            a_request + R"(, "params": {"w": {"shape": [8]}}}, {"name": "b", "fully_shard": )" +
            b_request +
            R"(, "params": {"w": {"shape": [8]}}, "modules": [{"name": "c", "fully_shard": )" +
            c_request + R"(, "params": {"w": {"shape": [8]}}}]}]})",
        "g.json");
    plan_groups(*gr, 2);
  };
  CHECK_NOTHROW(bad(R"({"group_with": ["b"]})"));
  CHECK(contains(error_of<ConfigError>([&] { bad(R"({"group_with": "b"})"); }),
                 "modules[0].fully_shard.group_with: expected a non-empty array of module FQNs"));
  CHECK(contains(error_of<ConfigError>([&] { bad(R"({"group_with": ["x"]})"); }),
                 "modules[0].fully_shard.group_with[0]: no module \"x\" in the graph"));
  CHECK(contains(error_of<ConfigError>([&] { bad(R"({"group_with": ["b", "b"]})"); }),
                 "group_with[1]: module 'b' is listed twice in this group"));
  CHECK(contains(error_of<ConfigError>([&] { bad(R"({"group_with": ["a"]})"); }),
                 "group_with[0]: module 'a' is listed twice in this group"));
  CHECK(contains(error_of<ConfigError>([&] { bad(R"({"group_with": ["b"]})", "true"); }),
                 "group_with[0]: module 'b' has its own fully_shard request "
                 "(modules[1].fully_shard)"));
  CHECK(contains(error_of<ConfigError>([&] { bad(R"({"group_with": ["b", "b.c"]})"); }),
                 "module 'b.c' is inside module 'b', also in this group"));
  CHECK(contains(
      error_of<ConfigError>([&] { bad(R"({"group_with": ["b.c"]})", R"({"group_with": ["a"]})"); }),
      "module 'a' is already in the list group of 'a'"));
  // Under no fully_shard'ed module (a list group is never a root).
  CHECK(contains(error_of<ConfigError>([] {
                   plan_groups(*graph::parse_graph_json(
                                   R"({"name": "m", "modules": [
                                         {"name": "a", "fully_shard": {"group_with": ["b"]}},
                                         {"name": "b"}]})",
                                   "g.json"),
                               2);
                 }),
                 "modules[0].fully_shard.group_with: module 'a' is under no fully_shard'ed "
                 "module"));
  // fully_shard applies the requests with the same checks.
  {
    auto gr = graph::parse_graph_json(
        R"({"name": "m", "modules": [{"name": "a", "fully_shard": {"group_with": ["b"]}},
                                      {"name": "b"}]})",
        "g.json");
    const DeviceMesh dm(MPI_COMM_WORLD, {test::world_size()}, {"shard"}, 60.0,
                        HostProgress::inline_);
    CHECK(contains(error_of<ConfigError>([&] { fsdp::apply_fully_shard_requests(*gr, dm); }),
                   "modules[0].fully_shard.group_with: module 'a' is under no fully_shard'ed "
                   "module"));
  }
  // a is in b's list under x (fully_shard'ed), b is not: x's group would take a's parameters
  // before the list is formed at b.
  CHECK(contains(
      error_of<ConfigError>([] {
        plan_groups(*graph::parse_graph_json(
                        R"({"name": "m", "fully_shard": true, "modules": [
                              {"name": "x", "fully_shard": true, "modules": [
                                {"name": "a", "fully_shard": {"group_with": ["b"]},
                                 "params": {"w": {"shape": [8]}}}]},
                              {"name": "b", "params": {"w": {"shape": [8]}}}]})",
                        "g.json"),
                    2);
      }),
      "modules[0].modules[0].fully_shard.group_with: module 'x' is fully_shard'ed and holds "
      "'x.a' of this group but not 'b'"));
  CHECK(contains(error_of<ConfigError>([&] { bad("true", R"({"group_with": ["a"]})"); }),
                 "has its own fully_shard request"));
}

TEST_CASE("plan_groups reports bad requests like fully_shard") {
  auto bad = [](const std::string& req, int W = 4) {
    auto g = graph::parse_graph_json(
        R"({"name": "m", "fully_shard": true, "modules": [{"name": "l", "fully_shard": )" + req +
            R"(, "params": {"w": {"shape": [8, 2]}, "h": {"shape": [4], "dtype": "f64"}}}]})",
        "g.json");
    plan_groups(*g, W);
  };
  CHECK(
      contains(error_of<ConfigError>([&] { bad(R"({"reshard_aftr_forward": true})"); }),
               "g.json: modules[0].fully_shard.reshard_aftr_forward: unknown fully_shard option"));
  CHECK(contains(error_of<ConfigError>([&] { bad(R"({"reshard_after_forward": 0})"); }),
                 "modules[0].fully_shard.reshard_after_forward: expected true, false, null or "
                 "an integer >= 1"));
  CHECK(contains(error_of<ConfigError>([&] { bad(R"({"param_dtype": "f8"})"); }),
                 "modules[0].fully_shard.param_dtype"));
  CHECK(contains(error_of<ConfigError>([&] { bad(R"({"ignored_params": "h"})"); }),
                 "modules[0].fully_shard.ignored_params: expected an array"));
  CHECK(contains(error_of<InvalidArgument>([&] { bad(R"({"ignored_params": ["x"]})"); }),
                 "fully_shard(l): ignored parameter 'x' does not exist in the module"));
  CHECK(contains(error_of<InvalidArgument>([&] { bad("true"); }),
                 "fully_shard(l): parameters 'l.w' (f32) and 'l.h' (f64) have different dtypes"));
  CHECK(contains(error_of<InvalidArgument>(
                     [&] { bad(R"({"ignored_params": ["h"], "reshard_after_forward": 3})"); }),
                 "fully_shard(l): reshard_after_forward=3 must divide the shard group size 4"));
  CHECK_NOTHROW(bad(R"({"ignored_params": ["h"], "reshard_after_forward": 2})"));
  CHECK(contains(error_of<InvalidArgument>([] {
                   auto g = load(kSeed);
                   plan_groups(*g, 0);
                 }),
                 "shard group size must be >= 1"));
}

TEST_CASE("seed m1..m4: FSDP2's orders, overlaps and memory (root not resharded)") {
  auto g = load(kSeed);
  const Plan p = Scheduler::plan(*g, MeshShape::fsdp(4));

  // Forward: AG(a,d) [root], AG(b), AG(c); compute fwd(m1) | fwd(m2) | fwd(m3,m4).
  const auto fwd_ag = phase_ops(p, OpKind::all_gather, Phase::forward);
  CHECK(group_names(p, fwd_ag) == std::vector<std::string>{"<root>", "m2", "m3"});
  CHECK(overlaps(group_op(p, OpKind::all_gather, Phase::forward, "m2"),
                 only(p, OpKind::forward, Phase::forward, "m1")));
  CHECK(overlaps(group_op(p, OpKind::all_gather, Phase::forward, "m3"),
                 only(p, OpKind::forward, Phase::forward, "m2")));
  // Compute waits for the first all-gather only.
  CHECK(group_op(p, OpKind::copy_out, Phase::forward, "<root>").start_ms ==
        doctest::Approx(group_op(p, OpKind::all_gather, Phase::forward, "<root>").end_ms));

  // Backward: the root group kept its parameters, so only AG(c) then AG(b); AG(c) is
  // prefetched by the root's pre-backward and runs under bwd(m4), AG(b) under bwd(m3).
  const auto bwd_ag = phase_ops(p, OpKind::all_gather, Phase::backward);
  CHECK(group_names(p, bwd_ag) == std::vector<std::string>{"m3", "m2"});
  CHECK(p.find(OpKind::all_gather).size() == 5);
  CHECK(overlaps(group_op(p, OpKind::all_gather, Phase::backward, "m3"),
                 only(p, OpKind::backward, Phase::backward, "m4")));
  CHECK(overlaps(group_op(p, OpKind::all_gather, Phase::backward, "m2"),
                 only(p, OpKind::backward, Phase::backward, "m3")));
  // RS(c) after bwd(m3), overlapping bwd(m2); RS(b) overlapping bwd(m1); then RS(root).
  const auto rs = p.find(OpKind::reduce_scatter);
  CHECK(group_names(p, rs) == std::vector<std::string>{"m3", "m2", "<root>"});
  const Op& rs_c = group_op(p, OpKind::reduce_scatter, Phase::backward, "m3");
  CHECK(rs_c.start_ms >= only(p, OpKind::backward, Phase::backward, "m3").end_ms);
  CHECK(overlaps(rs_c, only(p, OpKind::backward, Phase::backward, "m2")));
  CHECK(overlaps(group_op(p, OpKind::reduce_scatter, Phase::backward, "m2"),
                 only(p, OpKind::backward, Phase::backward, "m1")));
  CHECK(group_op(p, OpKind::reduce_scatter, Phase::backward, "<root>").start_ms >=
        only(p, OpKind::backward, Phase::backward, "m1").end_ms);
  // Backward compute in reverse: bwd(m4), bwd(m3), bwd(m2), bwd(m1).
  std::vector<std::string> bwd;
  for (const Op* op : p.find(OpKind::backward))
    bwd.push_back(std::string(op->module()));
  CHECK(bwd == std::vector<std::string>{"m4", "m3", "m2", "m1"});

  // Memory, by hand (docs/plan-format.md walks through it): forward holds the root's
  // parameters plus one group's gather buffer and unsharded parameters; the backward peak is
  // at m3's reduce-scatter copy-in: root params + root grads + m3 params + m3 grads + AG(b)'s
  // buffer (prefetched) + m3's reduce-scatter input. The unsharded gradients go back to the
  // pool right after the copy-in, before the output is taken.
  CHECK(p.forward_peak_bytes == R + 2 * M);
  CHECK(p.peak_bytes == 2 * R + 4 * M);
  CHECK(p.backward_peak_bytes == p.peak_bytes);
  CHECK(p.end_bytes == 0);
  CHECK(p.sharded_bytes == 2 * 262144 + 32768);
  CHECK(p.grad_bytes == p.sharded_bytes);
  // Step time: the last op (the root's wait for its reduce-scatter).
  CHECK(p.step_ms == doctest::Approx(p.ops.back().end_ms));
  CHECK(p.ops.back().kind == OpKind::wait);
}

TEST_CASE("seed m1..m4 with the root resharded after forward (the seed's picture)") {
  auto g = load(kSeed);
  PlanOptions o;
  o.defaults.reshard_after_forward = fsdp::ReshardAfterForward(true);
  const Plan p = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  CHECK(p.groups[static_cast<std::size_t>(p.group_index("<root>"))].reshard_after_forward ==
        fsdp::ReshardAfterForward::always());
  // The seed draws backward AG(c), AG(b), AG(a,d). m4's parameter d is in the root group, so
  // the root's pre-backward gathers (a,d) before bwd(m4) can run, and prefetches AG(c).
  const auto bwd_ag = phase_ops(p, OpKind::all_gather, Phase::backward);
  CHECK(group_names(p, bwd_ag) == std::vector<std::string>{"<root>", "m3", "m2"});
  CHECK(p.find(OpKind::all_gather).size() == 6);
  CHECK(only(p, OpKind::backward, Phase::backward, "m4").start_ms >=
        group_op(p, OpKind::all_gather, Phase::backward, "<root>").end_ms);
  // The rest of the picture holds: AG(c) before bwd(m3), AG(b) prefetched while bwd(m4, m3)
  // run, RS(c) after bwd(m3) overlapping bwd(m2), RS order c, b, (a,d).
  const Op& ag_c = group_op(p, OpKind::all_gather, Phase::backward, "m3");
  CHECK(ag_c.end_ms <= only(p, OpKind::backward, Phase::backward, "m3").start_ms);
  CHECK(overlaps(ag_c, only(p, OpKind::backward, Phase::backward, "m4")));
  CHECK(overlaps(group_op(p, OpKind::all_gather, Phase::backward, "m2"),
                 only(p, OpKind::backward, Phase::backward, "m3")));
  CHECK(overlaps(group_op(p, OpKind::reduce_scatter, Phase::backward, "m3"),
                 only(p, OpKind::backward, Phase::backward, "m2")));
  CHECK(group_names(p, p.find(OpKind::reduce_scatter)) ==
        std::vector<std::string>{"m3", "m2", "<root>"});
  // The root's parameters are freed after forward: the forward ends with nothing in the pool.
  std::size_t in_use = 0, at_forward_end = 0;
  for (const BufferEvent& e : p.events) {
    in_use = e.in_use_after(in_use);
    if (p.ops[static_cast<std::size_t>(e.op)].phase == Phase::forward) at_forward_end = in_use;
  }
  CHECK(at_forward_end == 0);
  CHECK(p.forward_peak_bytes == R + 2 * M);
  CHECK(p.peak_bytes == 2 * R + 4 * M);
}

TEST_CASE("reshard_after_forward false / automatic / true: 3, 5, 6 all-gathers") {
  auto g = load(kSeed);
  PlanOptions o;
  o.defaults.reshard_after_forward = fsdp::ReshardAfterForward(false);
  const Plan keep = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  const Plan automatic = Scheduler::plan(*g, MeshShape::fsdp(4));
  o.defaults.reshard_after_forward = fsdp::ReshardAfterForward(true);
  const Plan all = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  CHECK(keep.find(OpKind::all_gather).size() == 3);
  CHECK(phase_ops(keep, OpKind::all_gather, Phase::backward).empty());
  CHECK(automatic.find(OpKind::all_gather).size() == 5);
  CHECK(all.find(OpKind::all_gather).size() == 6);
  // Keeping everything holds m2's and m3's parameters to the end of forward.
  CHECK(keep.forward_peak_bytes == R + 3 * M);
  CHECK(automatic.forward_peak_bytes == R + 2 * M);
  CHECK(keep.forward_peak_bytes > automatic.forward_peak_bytes);
  // Overall, equal here: where the default holds AG(b)'s prefetched buffer at m3's
  // reduce-scatter, keeping holds m2's unsharded parameters, of the same size (no padding).
  CHECK(keep.peak_bytes == automatic.peak_bytes);
  CHECK(keep.step_ms < automatic.step_ms);

  // reshard_after_forward=2 on 4 ranks: a 2-slot slice kept after forward, backward gathers
  // in 2-rank groups; the slice lives until the post-backward reshard.
  o.defaults.reshard_after_forward = fsdp::ReshardAfterForward::group_size(2);
  const Plan k2 = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  CHECK(k2.find(OpKind::all_gather).size() == 6);
  const Op& ag = group_op(k2, OpKind::all_gather, Phase::backward, "m2");
  CHECK(ag.bytes == 2 * 262144);
  CHECK(k2.label(ag) == "AG(m2)/2");
  bool slice = false;
  for (const BufferEvent& e : k2.events)
    if (k2.buffer_name(e) == "post_forward[m2]") slice = true;
  CHECK(slice);
  CHECK(k2.forward_peak_bytes > automatic.forward_peak_bytes);
}

TEST_CASE("forward prefetch depth 2 keeps two all-gathers in flight") {
  auto g = load(kSeed);
  PlanOptions o;
  o.forward_prefetch_depth = 1;
  const Plan d1 = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  o.forward_prefetch_depth = 2;
  const Plan d2 = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  const Plan d0 = Scheduler::plan(*g, MeshShape::fsdp(4));

  const int root = d2.group_index("<root>");
  CHECK(d2.forward_prefetch[static_cast<std::size_t>(root)] ==
        std::vector<int>{d2.group_index("m2"), d2.group_index("m3")});
  CHECK(d1.forward_prefetch[static_cast<std::size_t>(root)] ==
        std::vector<int>{d1.group_index("m2")});

  CHECK(max_live_gathers(d0, Phase::forward) == 1);
  CHECK(max_live_gathers(d1, Phase::forward) == 1);
  CHECK(max_live_gathers(d2, Phase::forward) == 2);
  // In flight together: AG(c) issued (by the root's pre-forward) before AG(b)'s copy-out,
  // and its interval from issue to copy-out overlaps AG(b)'s.
  const Op& ag_b = group_op(d2, OpKind::all_gather, Phase::forward, "m2");
  const Op& ag_c = group_op(d2, OpKind::all_gather, Phase::forward, "m3");
  const Op& out_b = group_op(d2, OpKind::copy_out, Phase::forward, "m2");
  const Op& out_c = group_op(d2, OpKind::copy_out, Phase::forward, "m3");
  CHECK(ag_c.id < out_b.id);
  CHECK(ag_c.start_ms < out_b.start_ms);
  CHECK(ag_b.start_ms < out_c.start_ms);
  // Both gathers start as soon as the root's copy-out ends, back to back on the AG stream.
  CHECK(ag_c.start_ms == doctest::Approx(ag_b.end_ms));
  // Exactly one more gather buffer at the forward peak; the iteration's peak is backward's.
  CHECK(d2.forward_peak_bytes == d1.forward_peak_bytes + M);
  CHECK(d1.forward_peak_bytes == d0.forward_peak_bytes);
  CHECK(d2.peak_bytes == std::max(d2.forward_peak_bytes, d2.backward_peak_bytes));
  // Prefetching earlier never slows the step down in this model.
  CHECK(d2.step_ms <= d0.step_ms + 1e-9);
}

TEST_CASE("reduce-scatter buffer cap, no backward prefetch, HSDP") {
  auto g = load(kSeed);
  PlanOptions o;
  o.reduce_scatter_max_input_buffers = 2;
  const Plan k2 = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  const Plan k1 = Scheduler::plan(*g, MeshShape::fsdp(4));
  // With K=2, m3's reduce-scatter buffers are still held at m2's: m2's input and output come
  // on top of them, where K=1 waited for m3's first (peak at m2's: +M/4 over m3's).
  CHECK(k2.peak_bytes == k1.peak_bytes + M / 4);

  o = PlanOptions{};
  o.backward_prefetch = BackwardPrefetch::none;
  const Plan none = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  CHECK(phase_ops(none, OpKind::all_gather, Phase::backward).size() == 2);
  CHECK(max_live_gathers(none, Phase::backward) == 1);
  // No AG(b) buffer at m3's reduce-scatter: the peak moves to m2's own backward copy-out (its
  // gather buffer and unsharded parameters, m3's reduce-scatter buffers still pending).
  CHECK(none.peak_bytes == 2 * R + 3 * M + M / 4);
  CHECK(none.step_ms > k1.step_ms);

  // HSDP 2 x 2: an all-reduce after each reduce-scatter, on its own stream.
  const Plan h = Scheduler::plan(*g, MeshShape::hsdp(2, 2));
  CHECK(h.find(OpKind::all_reduce).size() == 3);
  for (const Op* ar : h.find(OpKind::all_reduce)) {
    CHECK(ar->stream == StreamKind::all_reduce);
    REQUIRE(ar->deps.size() == 1);
    CHECK(h.ops[static_cast<std::size_t>(ar->deps[0])].kind == OpKind::reduce_scatter);
  }
  CHECK(h.end_bytes == 0);
  o = PlanOptions{};
  o.requires_all_reduce = false;
  const Plan defer = Scheduler::plan(*g, MeshShape::hsdp(2, 2), o);
  CHECK(defer.find(OpKind::all_reduce).empty());
  // The deferred partial reductions stay in the pool: one reduce-scatter output per group.
  CHECK(defer.end_bytes == 2 * (2 * 65536 * 4) + 2 * 8192 * 4);
}

namespace {

std::size_t sum_unsharded(const Plan& p) {
  std::size_t n = 0;
  for (const PlannedGroup& g : p.groups)
    n += g.unsharded_bytes();
  return n;
}

std::vector<std::string> ops_text(const Plan& p, Phase ph) {
  std::vector<std::string> out;
  for (const Op& op : p.ops)
    if (op.phase == ph) out.push_back(p.label(op));
  return out;
}

}  // namespace

TEST_CASE("reshard_after_backward false keeps every group's parameters to the end") {
  for (const char* json : {kSeed, kMixed}) {
    auto g = load(json);
    const Plan base = Scheduler::plan(*g, MeshShape::fsdp(4));
    PlanOptions o;
    o.reshard_after_backward = false;
    const Plan p = Scheduler::plan(*g, MeshShape::fsdp(4), o);
    CHECK(ops_text(p, Phase::forward) == ops_text(base, Phase::forward));
    CHECK(!phase_ops(base, OpKind::reshard, Phase::backward).empty());
    CHECK(phase_ops(p, OpKind::reshard, Phase::backward).empty());
    CHECK(p.find(OpKind::all_gather).size() == base.find(OpKind::all_gather).size());
    CHECK(p.find(OpKind::reduce_scatter).size() == base.find(OpKind::reduce_scatter).size());
    // Every group was unsharded in backward and stays so: its arena is in the pool at the end.
    CHECK(base.end_bytes == 0);
    CHECK(p.end_bytes == sum_unsharded(p));
    CHECK(p.peak_bytes >= base.peak_bytes);
    CHECK(contains(p.to_text(), "reshard_after_backward=false"));
    CHECK(contains(base.to_text(), "reshard_after_backward=true"));
  }
  // Seed, by hand: m3's parameters stay while m2's backward runs; the backward peak is then
  // at m2's reduce-scatter: root params + grads, m3 params, m2 params + grads, m2's
  // reduce-scatter input and output (m3's were waited for: K = 1).
  auto g = load(kSeed);
  PlanOptions o;
  o.reshard_after_backward = false;
  const Plan p = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  CHECK(p.end_bytes == R + 2 * M);
  CHECK(p.peak_bytes == 2 * R + 4 * M + M / 4);
}

TEST_CASE("requires_gradient_sync false: no reduction, the unsharded gradients stay") {
  for (const char* json : {kSeed, kMixed}) {
    for (MeshShape mesh : {MeshShape::fsdp(4), MeshShape::hsdp(2, 2)}) {
      auto g = load(json);
      PlanOptions o;
      o.requires_gradient_sync = false;
      const Plan p = Scheduler::plan(*g, mesh, o);
      const Plan base = Scheduler::plan(*g, mesh);
      CHECK(!base.find(OpKind::reduce_scatter).empty());
      CHECK(p.find(OpKind::reduce_scatter).empty());
      CHECK(p.find(OpKind::all_reduce).empty());
      CHECK(p.find(OpKind::reduce_copy_out).empty());
      CHECK(p.stream_ops(StreamKind::reduce_scatter).empty());
      CHECK(p.stream_ops(StreamKind::all_reduce).empty());
      for (const BufferEvent& e : p.events)
        CHECK(p.buffer_name(e).rfind("rs_", 0) != 0);
      // The gathers and the gradient arenas are the same; the arenas stay.
      CHECK(p.find(OpKind::all_gather).size() == base.find(OpKind::all_gather).size());
      CHECK(p.find(OpKind::grad_init).size() == p.groups.size());
      CHECK(p.end_bytes == sum_unsharded(p));
      CHECK(p.find(OpKind::wait).size() == 1);  // the root still waits (for nothing)
      CHECK(p.find(OpKind::wait)[0]->deps.empty());
      CHECK(contains(p.to_text(), "requires_gradient_sync=false"));
    }
  }
  // Seed: without the reduce-scatter buffers, the backward peak is lower.
  auto g = load(kSeed);
  PlanOptions o;
  o.requires_gradient_sync = false;
  const Plan p = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  CHECK(p.peak_bytes < Scheduler::plan(*g, MeshShape::fsdp(4)).peak_bytes);
  CHECK(p.end_bytes == R + 2 * M);
  // And with the parameters kept too: both arenas of every group stay.
  o.reshard_after_backward = false;
  CHECK(Scheduler::plan(*g, MeshShape::fsdp(4), o).end_bytes == 2 * (R + 2 * M));
}

TEST_CASE("unshard_in_backward false: no backward all-gather, never prefetched in backward") {
  auto g = load(kSeed);
  PlanOptions o;
  o.no_unshard_in_backward = {"m2"};
  const Plan p = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  CHECK(group_names(p, phase_ops(p, OpKind::all_gather, Phase::backward)) ==
        std::vector<std::string>{"m3"});
  CHECK(group_names(p, phase_ops(p, OpKind::all_gather, Phase::forward)) ==
        std::vector<std::string>{"<root>", "m2", "m3"});
  // m2's backward runs without parameters: no backward copy-out for it.
  CHECK(group_names(p, phase_ops(p, OpKind::copy_out, Phase::backward)) ==
        std::vector<std::string>{"m3"});
  // Its gradients are still made and reduced.
  CHECK(group_names(p, p.find(OpKind::reduce_scatter)) ==
        std::vector<std::string>{"m3", "m2", "<root>"});
  CHECK(p.end_bytes == 0);
  CHECK(contains(p.to_text(), "unshard_in_backward=false: m2\n"));
  CHECK(contains(p.to_text(), "reshard_after_forward=true unshard_in_backward=false\n"));

  // m3 is what the root's pre-backward prefetches: excluded, nothing is prefetched there;
  // m3's own pre-backward prefetches m2.
  o.no_unshard_in_backward = {"m3"};
  const Plan q = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  const auto bwd = phase_ops(q, OpKind::all_gather, Phase::backward);
  CHECK(group_names(q, bwd) == std::vector<std::string>{"m2"});
  REQUIRE(bwd.size() == 1);
  CHECK(bwd[0]->id < only(q, OpKind::backward, Phase::backward, "m3").id);

  // The root resharded after forward and excluded: m4's and m1's backward run without
  // parameters; the other two still gather (m3 prefetched by the root's pre-backward).
  o.defaults.reshard_after_forward = fsdp::ReshardAfterForward(true);
  o.no_unshard_in_backward = {"<root>"};
  const Plan r = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  CHECK(group_names(r, phase_ops(r, OpKind::all_gather, Phase::backward)) ==
        std::vector<std::string>{"m3", "m2"});
  CHECK(group_names(r, phase_ops(r, OpKind::copy_out, Phase::backward)) ==
        std::vector<std::string>{"m3", "m2"});

  // Mixed: excluded groups never gather in backward; the others do as before.
  auto mixed = load(kMixed);
  PlanOptions m;
  m.no_unshard_in_backward = {"blocks.0", "head"};
  const Plan mp = Scheduler::plan(*mixed, MeshShape::fsdp(4), m);
  const Plan mbase = Scheduler::plan(*mixed, MeshShape::fsdp(4));
  auto bwd_names = group_names(mp, phase_ops(mp, OpKind::all_gather, Phase::backward));
  auto base_names = group_names(mbase, phase_ops(mbase, OpKind::all_gather, Phase::backward));
  CHECK(std::count(base_names.begin(), base_names.end(), "head") == 1);
  CHECK(std::count(base_names.begin(), base_names.end(), "blocks.0") == 1);
  base_names.erase(
      std::remove_if(base_names.begin(), base_names.end(),
                     [](const std::string& n) { return n == "head" || n == "blocks.0"; }),
      base_names.end());
  CHECK(bwd_names == base_names);
  CHECK(mp.backward_peak_bytes <= mbase.backward_peak_bytes);
  // The names resolved once, to the groups' indices (what an executor applies).
  CHECK(mp.no_unshard_in_backward ==
        std::vector<int>{mp.group_index("blocks.0"), mp.group_index("head")});
  CHECK(mbase.no_unshard_in_backward.empty());

  // Unknown names are errors.
  m.no_unshard_in_backward = {"blocks.7"};
  CHECK(contains(error_of<InvalidArgument>([&] { Scheduler::plan(*mixed, MeshShape::fsdp(4), m); }),
                 "no_unshard_in_backward: no group named 'blocks.7' (groups: blocks.0.inner, "
                 "blocks.0, blocks.1, head, <root>)"));
}

TEST_CASE("is_last_backward false: no final wait, the pending reduce-scatters stay") {
  auto g = load(kSeed);
  PlanOptions o;
  o.is_last_backward = false;
  const Plan p = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  const Plan base = Scheduler::plan(*g, MeshShape::fsdp(4));
  CHECK(base.find(OpKind::wait).size() == 1);
  CHECK(p.find(OpKind::wait).empty());
  CHECK(p.find(OpKind::reduce_scatter).size() == 3);
  // K = 1: each reduce-scatter still waits for the one before; the root's stays: its input
  // (R: 4 x 8192 f32) and output (R/4).
  CHECK(p.end_bytes == R + R / 4);
  CHECK(p.peak_bytes == base.peak_bytes);
  CHECK(p.ops.size() == base.ops.size() - 1);
  CHECK(contains(p.to_text(), "is_last_backward=false"));
  // K = 2: m2's and the root's stay; the cap still waited for m3's at the root's.
  o.reduce_scatter_max_input_buffers = 2;
  const Plan k2 = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  CHECK(k2.end_bytes == (M + M / 4) + (R + R / 4));
  const Op& rs_in_root = [&]() -> const Op& {
    for (const Op* op : k2.find(OpKind::copy_in, k2.group_index("<root>")))
      if (op->stream == StreamKind::reduce_scatter) return *op;
    FAIL("no reduce-scatter copy-in of the root");
    return k2.ops[0];
  }();
  bool waits_for_m3 = false;
  for (int d : rs_in_root.deps)
    waits_for_m3 |= k2.ops[static_cast<std::size_t>(d)].group == k2.group_index("m3");
  CHECK(waits_for_m3);
  // K large enough for all three: nothing is waited for.
  o.reduce_scatter_max_input_buffers = 3;
  CHECK(Scheduler::plan(*g, MeshShape::fsdp(4), o).end_bytes == 2 * (M + M / 4) + (R + R / 4));

  // Mixed: exactly the last K groups' reduce-scatter buffers remain.
  auto mixed = load(kMixed);
  o = PlanOptions{};
  o.is_last_backward = false;
  const Plan mp = Scheduler::plan(*mixed, MeshShape::fsdp(4), o);
  CHECK(mp.find(OpKind::wait).empty());
  const auto rs = mp.find(OpKind::reduce_scatter);
  REQUIRE(!rs.empty());
  const PlannedGroup& last = mp.groups[static_cast<std::size_t>(rs.back()->group)];
  CHECK(last.name == "<root>");
  const std::size_t rb = dtype_size(last.reduce_dtype);
  CHECK(mp.end_bytes == 4 * static_cast<std::size_t>(last.layout.shard_numel) * rb +
                            static_cast<std::size_t>(last.layout.shard_numel) * rb);
}

TEST_CASE("several FSDP roots: one pool each") {
  auto g = load(kTwoRoots);
  const Plan p = Scheduler::plan(*g, MeshShape::fsdp(2));
  REQUIRE(p.groups.size() == 3);
  CHECK(p.groups[0].name == "enc.l");
  CHECK(p.groups[1].name == "enc");
  CHECK(p.groups[2].name == "dec");
  CHECK(p.pool_roots == std::vector<int>{1, 2});
  CHECK(p.groups[1].is_root);
  CHECK(p.groups[2].is_root);
  CHECK(p.groups[0].root_group == 1);
  CHECK(p.groups[2].reshard_after_forward == fsdp::ReshardAfterForward::never());  // a root: kept
  REQUIRE(p.pool_peak_bytes.size() == 2);
  CHECK(p.peak_bytes >= std::max(p.pool_peak_bytes[0], p.pool_peak_bytes[1]));
  CHECK(p.peak_bytes <= p.pool_peak_bytes[0] + p.pool_peak_bytes[1]);
  // Each root's end of backward waits for its own reduce-scatters.
  CHECK(p.find(OpKind::wait).size() == 2);
  CHECK(contains(p.to_text(), "pool peaks per FSDP root: enc="));
}

TEST_CASE("the plan is deterministic") {
  auto g1 = load(kMixed);
  auto g2 = load(kMixed);
  PlanOptions o;
  o.forward_prefetch_depth = 1;
  const Plan a = Scheduler::plan(*g1, MeshShape::hsdp(2, 2), o);
  const Plan b = Scheduler::plan(*g1, MeshShape::hsdp(2, 2), o);
  const Plan c = Scheduler::plan(*g2, MeshShape::hsdp(2, 2), o);
  CHECK(a.to_text() == b.to_text());
  CHECK(a.to_text() == c.to_text());
  CHECK(a.fingerprint() == c.fingerprint());
  CHECK(a.fingerprint() == fnv1a64(a.to_text()));
  CHECK(a.to_chrome_trace() == c.to_chrome_trace());
  o.forward_prefetch_depth = 0;
  CHECK(Scheduler::plan(*g1, MeshShape::hsdp(2, 2), o).fingerprint() != a.fingerprint());
  CHECK(fnv1a64("") == 0xcbf29ce484222325ull);
  CHECK(fnv1a64("a") == 0xaf63dc4c8601ec8cull);

  const std::string text = a.to_text();
  CHECK(contains(
      text,
      "[2] blocks.1: params=2 shard=200 B/rank unsharded=186 B gather=200 B dtypes=f32/bf16/bf16"));
  CHECK(contains(text, "step time: "));
  CHECK(contains(text, "peak memory per rank: pool="));
}

TEST_CASE("Chrome trace: one thread per stream, X events, pool counter") {
  auto g = load(kSeed);
  const Plan p = Scheduler::plan(*g, MeshShape::fsdp(4));
  const nlohmann::json t = nlohmann::json::parse(p.to_chrome_trace());
  REQUIRE(t.contains("traceEvents"));
  const auto parsed = nlohmann::json::parse(t.dump());
  std::size_t x = 0;
  std::size_t counters = 0;
  std::size_t peak = 0;
  for (const auto& e : parsed["traceEvents"]) {
    if (e["ph"] == "X") {
      ++x;
      CHECK(e["dur"].get<double>() >= 0);
      CHECK(e["args"].contains("bytes"));
      CHECK(e["args"].contains("group"));
      CHECK(e["args"].contains("module"));
    } else if (e["ph"] == "C") {
      ++counters;
      peak = std::max(peak, e["args"]["bytes"].get<std::size_t>());
    }
  }
  CHECK(x == p.ops.size());
  CHECK(counters == p.events.size() + 1);
  CHECK(peak == p.peak_bytes);
  const Op& ag = group_op(p, OpKind::all_gather, Phase::forward, "m2");
  bool found = false;
  for (const auto& e : parsed["traceEvents"])
    if (e["ph"] == "X" && e["args"]["op"] == ag.id) {
      found = true;
      CHECK(e["tid"] == 1);
      CHECK(e["ts"].get<double>() == doctest::Approx(ag.start_ms * 1000));
      CHECK(e["args"]["group"] == "m2");
    }
  CHECK(found);
}

TEST_CASE("cost model: defaults, JSON round trip and errors, one all-gather's time") {
  const CostModel d = CostModel::defaults(MeshShape::hsdp(2, 4));
  CHECK(d.collective(CollectiveKind::all_gather, MeshDim::shard).alpha_ms == doctest::Approx(0.02));
  CHECK(d.collective(CollectiveKind::all_gather, MeshDim::shard).beta_ms_per_byte ==
        doctest::Approx(3e-6));
  CHECK(d.collective(CollectiveKind::all_reduce, MeshDim::replicate).beta_ms_per_byte ==
        doctest::Approx(1e-6));
  CHECK(d.copy_ms(1e7) == doctest::Approx(1.0));
  CHECK(d.time_ms(CollectiveKind::reduce_scatter, MeshDim::shard, 1e6) == doctest::Approx(3.02));

  CostModel c = d;
  c.collective(CollectiveKind::reduce_scatter, MeshDim::replicate) = {0.125, 2.5e-7};
  c.set_copy_gb_per_s(42.0);
  c.set_quant_ns_per_element(2.5);
  CHECK(c.quant_ms(1e6) == doctest::Approx(2.5));
  CHECK(c != d);
  const CostModel back = CostModel::parse_json(c.to_json(), d);
  CHECK(back == c);
  CHECK(CostModel::parse_json("{}", c) == c);
  const CostModel partial = CostModel::parse_json(
      R"({"all_gather": {"shard": {"alpha_ms": 0.5}}, "copy_gb_per_s": 20})", d, "cost.json");
  CHECK(partial.collective(CollectiveKind::all_gather, MeshDim::shard).alpha_ms == 0.5);
  CHECK(partial.collective(CollectiveKind::all_gather, MeshDim::shard).beta_ms_per_byte ==
        doctest::Approx(3e-6));
  CHECK(partial.copy_gb_per_s() == 20);

  auto err = [&](const std::string& text) {
    return error_of<ConfigError>([&] { CostModel::parse_json(text, d, "cost.json"); });
  };
  CHECK(contains(err(R"({"all_gathr": {}})"),
                 "cost.json: all_gathr: unknown key 'all_gathr' (allowed: all_gather, "
                 "reduce_scatter, all_reduce, copy_gb_per_s, quant_ns_per_element, transport, "
                 "shm)"));
  CHECK(contains(err(R"({"quant_ns_per_element": 0})"),
                 "cost.json: quant_ns_per_element: expected a time > 0 ns"));
  CHECK(contains(err(R"({"all_gather": {"shrd": {}}})"),
                 "cost.json: all_gather.shrd: unknown key 'shrd' (allowed: shard, replicate)"));
  CHECK(contains(err(R"({"all_reduce": {"replicate": {"alpha": 1}}})"),
                 "cost.json: all_reduce.replicate.alpha: unknown key 'alpha'"));
  CHECK(
      contains(err(R"({"reduce_scatter": {"shard": {"beta_ms_per_byte": -1}}})"),
               "cost.json: reduce_scatter.shard.beta_ms_per_byte: expected a finite number >= 0"));
  CHECK(contains(err(R"({"all_gather": {"shard": {"alpha_ms": "fast"}}})"),
                 "cost.json: all_gather.shard.alpha_ms: expected a number"));
  CHECK(contains(err(R"({"copy_gb_per_s": 0})"),
                 "cost.json: copy_gb_per_s: expected a bandwidth > 0"));
  CHECK(contains(err(R"({"all_gather": 3})"), "cost.json: all_gather: expected an object"));
  CHECK(contains(err(R"([1, 2])"), "cost.json: (top level): expected an object"));
  CHECK(contains(err(R"({"all_gather": )"), "cost.json: invalid JSON at byte"));
  CHECK(contains(error_of<ConfigError>([&] { CostModel::load_json("/nonexistent/cost.json", d); }),
                 "/nonexistent/cost.json: cannot read the cost model file"));

  // A graph with one group: its all-gather takes exactly alpha + beta * shard bytes.
  auto g = graph::parse_graph_json(
      R"({"name": "one", "fully_shard": true, "params": {"w": {"shape": [10, 100]}}})");
  PlanOptions o;
  CostModel cm = CostModel::defaults(MeshShape::fsdp(4));
  cm.collective(CollectiveKind::all_gather, MeshDim::shard) = {0.5, 1e-3};
  o.cost = cm;
  const Plan p = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  const auto ags = p.find(OpKind::all_gather);
  REQUIRE(ags.size() == 1);
  const std::size_t shard_bytes = 3 * 100 * 4;  // ceil(10/4) = 3 rows
  CHECK(ags[0]->bytes == shard_bytes);
  CHECK(ags[0]->start_ms == 0.0);
  CHECK(ags[0]->end_ms - ags[0]->start_ms == doctest::Approx(0.5 + 1e-3 * shard_bytes));

  // Least squares.
  const AlphaBeta ab = fit_alpha_beta({1000, 2000, 4000}, {1.5, 2.5, 4.5});
  CHECK(ab.alpha_ms == doctest::Approx(0.5));
  CHECK(ab.beta_ms_per_byte == doctest::Approx(1e-3));
  const AlphaBeta flat = fit_alpha_beta({1000, 2000}, {2.0, 1.0});
  CHECK(flat.beta_ms_per_byte == 0.0);
  CHECK(flat.alpha_ms == doctest::Approx(1.5));
}

TEST_CASE("cost model: measured points replace the line between and around them") {
  AlphaBeta ab(0.5, 1e-3);
  ab.set_points({{1000, 2.0}, {2000, 10.0}, {4000, 12.0}});
  // Between two points: the segment joining them (not the line: 0.5 + 1.5 = 2.0 at 1500).
  CHECK(ab.time_ms(1000) == doctest::Approx(2.0));
  CHECK(ab.time_ms(1500) == doctest::Approx(6.0));
  CHECK(ab.time_ms(2000) == doctest::Approx(10.0));
  CHECK(ab.time_ms(3000) == doctest::Approx(11.0));
  CHECK(ab.time_ms(4000) == doctest::Approx(12.0));
  // Above the largest: the last point plus the line's slope; below the smallest: the
  // segment from (0, alpha) to the first point (not the line, which the large sizes steer).
  CHECK(ab.time_ms(5000) == doctest::Approx(13.0));
  CHECK(ab.time_ms(500) == doctest::Approx(1.25));
  CHECK(ab.time_ms(0) == doctest::Approx(0.5));
  AlphaBeta steep(30.0, 1.0);  // alpha above the first point's time: capped at it
  steep.set_points({{100, 10.0}, {200, 20.0}});
  CHECK(steep.time_ms(50) == doctest::Approx(10.0));
  // One point: the line alone.
  AlphaBeta one(0.5, 1e-3);
  one.set_points({{1000, 7.0}});
  CHECK(one.time_ms(2000) == doctest::Approx(2.5));
  // The cost model's time is the pair's: the planner sees the points.
  CostModel c = CostModel::defaults(MeshShape::fsdp(4));
  c.collective(CollectiveKind::reduce_scatter, MeshDim::shard) = ab;
  CHECK(c.time_ms(CollectiveKind::reduce_scatter, MeshDim::shard, 3000) == doctest::Approx(11.0));
  CHECK(c != CostModel::defaults(MeshShape::fsdp(4)));

  CHECK(contains(error_of<InvalidArgument>([&] {
                   ab.set_points({{2000, 1.0}, {1000, 2.0}});
                 }),
                 "the points' bytes must increase (point 1 has 1000"));
  CHECK(contains(error_of<InvalidArgument>([&] {
                   ab.set_points({{1000, -1.0}});
                 }),
                 "point 0 must have finite bytes and ms >= 0"));
  CHECK(ab.points.size() == 3);  // a refused set leaves the points

  // JSON: written when present, read back equal; errors name the path.
  const std::string j = c.to_json();
  CHECK(contains(j, R"("points":[[1000.0,2.0],[2000.0,10.0],[4000.0,12.0]])"));
  CHECK(!contains(CostModel::defaults(MeshShape::fsdp(4)).to_json(), "points"));
  CHECK(CostModel::parse_json(j, CostModel::defaults(MeshShape::fsdp(2))) == c);
  auto err = [](const std::string& text) {
    return error_of<ConfigError>([&] { CostModel::parse_json(text, CostModel(), "cost.json"); });
  };
  CHECK(contains(err(R"({"all_gather": {"shard": {"points": 3}}})"),
                 "cost.json: all_gather.shard.points: expected an array of [bytes, ms] pairs"));
  CHECK(contains(err(R"({"all_gather": {"shard": {"points": [[1, 2, 3]]}}})"),
                 "cost.json: all_gather.shard.points[0]: expected a [bytes, ms] pair"));
  CHECK(contains(err(R"({"all_gather": {"shard": {"points": [[10, 1], [5, 2]]}}})"),
                 "cost.json: all_gather.shard.points[1][0]: the points' bytes must increase (5 "
                 "after 10)"));
  CHECK(contains(err(R"({"shm": {"all_gather": {"shard": {"points": [[10, -1]]}}}})"),
                 "cost.json: shm.all_gather.shard.points[0][1]: expected a finite number >= 0"));
}

TEST_CASE("cost model: shared-memory transport, JSON keys and the defaults of old files") {
  const CostModel d = CostModel::defaults(MeshShape::hsdp(2, 4), 0.02, 1.0, 8.0);
  // Documented defaults: mpi on every dim; shm alpha 5 us, beta n / copy bandwidth.
  CHECK(d.transport(MeshDim::shard) == Transport::mpi);
  CHECK(d.transport(MeshDim::replicate) == Transport::mpi);
  CHECK(d.shm_collective(CollectiveKind::all_gather, MeshDim::shard).alpha_ms ==
        doctest::Approx(0.005));
  CHECK(d.shm_collective(CollectiveKind::all_gather, MeshDim::shard).beta_ms_per_byte ==
        doctest::Approx(4.0 / 8e6));
  CHECK(d.shm_collective(CollectiveKind::reduce_scatter, MeshDim::replicate).beta_ms_per_byte ==
        doctest::Approx(2.0 / 8e6));
  CHECK(d.shm_time_ms(CollectiveKind::reduce_scatter, MeshDim::shard, 8e6) ==
        doctest::Approx(4.005));
  CHECK(contains(error_of<InvalidArgument>(
                     [&] { d.shm_collective(CollectiveKind::all_reduce, MeshDim::replicate); }),
                 "all_reduce has no shared-memory form"));

  // A file written before the shared-memory keys (test/fuzz/corpus/cost_model/full.json)
  // loads: its keys replace the base's, the new ones keep the defaults.
  const char* const old_file = R"({
    "all_gather": {"shard": {"alpha_ms": 0.02, "beta_ms_per_byte": 1e-06},
                   "replicate": {"alpha_ms": 0.02, "beta_ms_per_byte": 1e-06}},
    "reduce_scatter": {"shard": {"alpha_ms": 0.03, "beta_ms_per_byte": 2e-06},
                       "replicate": {"alpha_ms": 0.0, "beta_ms_per_byte": 0.0}},
    "all_reduce": {"shard": {"alpha_ms": 0.05, "beta_ms_per_byte": 1e-06},
                   "replicate": {"alpha_ms": 0.05, "beta_ms_per_byte": 1.5e-06}},
    "copy_gb_per_s": 10.0})";
  const CostModel old = CostModel::parse_json(old_file, d, "old.json");
  CHECK(old.collective(CollectiveKind::reduce_scatter, MeshDim::shard).alpha_ms == 0.03);
  CHECK(old.copy_gb_per_s() == 10.0);
  CHECK(old.transport(MeshDim::shard) == Transport::mpi);
  CHECK(old.transport(MeshDim::replicate) == Transport::mpi);
  for (CollectiveKind k : {CollectiveKind::all_gather, CollectiveKind::reduce_scatter})
    for (MeshDim m : {MeshDim::shard, MeshDim::replicate}) {
      CHECK(old.shm_collective(k, m).alpha_ms == d.shm_collective(k, m).alpha_ms);
      CHECK(old.shm_collective(k, m).beta_ms_per_byte == d.shm_collective(k, m).beta_ms_per_byte);
    }

  // The new keys: written by to_json, read back, partial updates over the base.
  CostModel c = d;
  c.set_transport(MeshDim::shard, Transport::shm);
  c.shm_collective(CollectiveKind::all_gather, MeshDim::shard) = {0.25, 3e-7};
  c.shm_collective(CollectiveKind::reduce_scatter, MeshDim::replicate) = {0.5, 5e-7};
  const nlohmann::json j = nlohmann::json::parse(c.to_json());
  CHECK(j.at("transport").at("shard") == "shm");
  CHECK(j.at("transport").at("replicate") == "mpi");
  CHECK(j.at("shm").at("all_gather").at("shard").at("alpha_ms") == 0.25);
  CHECK(CostModel::parse_json(j.dump(), d) == c);
  CHECK(c != d);
  const CostModel partial = CostModel::parse_json(
      R"({"transport": {"shard": "shm"}, "shm": {"reduce_scatter": {"shard": {"alpha_ms": 1}}}})",
      d, "cost.json");
  CHECK(partial.transport(MeshDim::shard) == Transport::shm);
  CHECK(partial.shm_collective(CollectiveKind::reduce_scatter, MeshDim::shard).alpha_ms == 1.0);
  CHECK(partial.shm_collective(CollectiveKind::reduce_scatter, MeshDim::shard).beta_ms_per_byte ==
        d.shm_collective(CollectiveKind::reduce_scatter, MeshDim::shard).beta_ms_per_byte);
  auto err = [&](const std::string& text) {
    return error_of<ConfigError>([&] { CostModel::parse_json(text, d, "cost.json"); });
  };
  CHECK(contains(
      err(R"({"transport": {"shard": "nccl"}})"),
      "cost.json: transport.shard: expected \"mpi\", \"shm\" or \"shm+mpi\", got \"nccl\""));
  CHECK(contains(err(R"({"transport": {"node": "shm"}})"),
                 "cost.json: transport.node: unknown key 'node' (allowed: shard, replicate)"));
  CHECK(contains(err(R"({"transport": "shm"})"), "cost.json: transport: expected an object"));
  CHECK(contains(err(R"({"shm": {"all_reduce": {}}})"),
                 "cost.json: shm.all_reduce: unknown key 'all_reduce' (allowed: all_gather, "
                 "reduce_scatter)"));
  CHECK(
      contains(err(R"({"shm": {"all_gather": {"shard": {"beta_ms_per_byte": -2}}}})"),
               "cost.json: shm.all_gather.shard.beta_ms_per_byte: expected a finite number >= 0"));
}

TEST_CASE("cost model calibration over MPI") {
  auto comm = comm::MpiCommunicator::duplicate(MPI_COMM_WORLD, "calib", 60.0);
  const CostModel base = CostModel::defaults(MeshShape::fsdp(test::world_size()));
  const CostModel c = CostModel::calibrate(*comm, base, nullptr, {4096, 65536}, 2);
  const AlphaBeta ag = c.collective(CollectiveKind::all_gather, MeshDim::shard);
  const AlphaBeta rs = c.collective(CollectiveKind::reduce_scatter, MeshDim::shard);
  CHECK(ag.alpha_ms >= 0);
  CHECK(ag.beta_ms_per_byte >= 0);
  CHECK(rs.alpha_ms >= 0);
  // The measured times are kept: the model's time at a measured size is the measurement.
  for (const AlphaBeta* m : {&ag, &rs}) {
    REQUIRE(m->points.size() == 2);
    CHECK(m->points[0].bytes == 4096);
    CHECK(m->points[1].bytes == 65536);
    CHECK(m->time_ms(65536) == m->points[1].ms);
  }
  CHECK(c.copy_gb_per_s() > 0);
  // Untouched values come from the base.
  CHECK(c.collective(CollectiveKind::all_reduce, MeshDim::replicate).alpha_ms ==
        base.collective(CollectiveKind::all_reduce, MeshDim::replicate).alpha_ms);
  CHECK(c.collective(CollectiveKind::all_reduce, MeshDim::replicate).beta_ms_per_byte ==
        base.collective(CollectiveKind::all_reduce, MeshDim::replicate).beta_ms_per_byte);
  // Every rank got the same model.
  const std::string j = c.to_json();
  unsigned long long h = fnv1a64(j);
  unsigned long long hmax = 0;
  MPI_Allreduce(&h, &hmax, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  CHECK(h == hmax);
}

TEST_CASE("cost model calibration on shared memory") {
  const int W = test::world_size();
  const DeviceMesh mesh(MPI_COMM_WORLD, {W}, {"shard"}, 60.0, HostProgress::inline_,
                        HostCollectives::auto_);
  const comm::ShmComm* shm = mesh.shm("shard");
  CostModel base = CostModel::defaults(MeshShape::fsdp(W));
  base.set_transport(MeshDim::shard, Transport::shm);
  // Without the shared memory the shard dim is measured (and marked) as MPI.
  const CostModel plain =
      CostModel::calibrate(mesh.comm("shard"), base, nullptr, {4096, 65536}, 1, nullptr);
  CHECK(plain.transport(MeshDim::shard) == Transport::mpi);
  CHECK(plain.shm_collective(CollectiveKind::all_gather, MeshDim::shard).alpha_ms ==
        base.shm_collective(CollectiveKind::all_gather, MeshDim::shard).alpha_ms);
  if (W == 1) {
    CHECK(shm == nullptr);  // a dim of one rank has no collectives to share memory for
    return;
  }
  REQUIRE(shm);  // the test's ranks share a node
  const CostModel c =
      CostModel::calibrate(mesh.comm("shard"), base, nullptr, {4096, 1 << 21}, 3, shm);
  CHECK(c.transport(MeshDim::shard) == Transport::shm);
  for (CollectiveKind k : {CollectiveKind::all_gather, CollectiveKind::reduce_scatter}) {
    CAPTURE(collective_kind_name(k));
    const AlphaBeta ab = c.shm_collective(k, MeshDim::shard);
    CHECK(std::isfinite(ab.alpha_ms));
    CHECK(ab.alpha_ms >= 0);
    CHECK(std::isfinite(ab.beta_ms_per_byte));
    // >= 0, not > 0: the fit clamps a negative slope, which a descheduled 4 KiB round on an
    // oversubscribed machine can give (no timing assertion). Measured, not the defaults.
    CHECK(ab.beta_ms_per_byte >= 0);
    CHECK(ab.beta_ms_per_byte != base.shm_collective(k, MeshDim::shard).beta_ms_per_byte);
    // The replicate dim was not measured.
    CHECK(c.shm_collective(k, MeshDim::replicate).beta_ms_per_byte ==
          base.shm_collective(k, MeshDim::replicate).beta_ms_per_byte);
  }
  // The JSON form round-trips, and every rank got the same model.
  const std::string j = c.to_json();
  CHECK(CostModel::parse_json(j, CostModel::defaults(MeshShape::fsdp(W))) == c);
  unsigned long long h = fnv1a64(j);
  unsigned long long hmax = 0;
  MPI_Allreduce(&h, &hmax, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  CHECK(h == hmax);
  // The shard communicator and the shared memory must be the same ranks.
  if (W == 4) {
    const DeviceMesh pairs(MPI_COMM_WORLD, {W / 2, 2}, {"a", "b"}, 60.0, HostProgress::inline_,
                           HostCollectives::auto_);
    if (pairs.shm("b"))
      CHECK(contains(error_of<InvalidArgument>([&] {
                       CostModel::calibrate(mesh.comm("shard"), base, nullptr, {4096}, 1,
                                            pairs.shm("b"));
                     }),
                     "the shared memory '"));
  }
}

TEST_CASE("cost model: a mesh's defaults run its transport; scaled multiplies every time") {
  const int W = test::world_size();
  const DeviceMesh shared(MPI_COMM_WORLD, {W}, {"shard"}, 60.0, HostProgress::inline_,
                          HostCollectives::auto_);
  const DeviceMesh mpi(MPI_COMM_WORLD, {W}, {"shard"}, 60.0, HostProgress::inline_,
                       HostCollectives::mpi);
  const CostModel s = mesh_defaults(shared), m = mesh_defaults(mpi);
  // Shared memory where the ranks share a node (a dim of one rank has none).
  CHECK(s.transport(MeshDim::shard) == (W > 1 ? Transport::shm : Transport::mpi));
  CHECK(m.transport(MeshDim::shard) == Transport::mpi);
  CostModel want = CostModel::defaults(MeshShape::fsdp(W));
  want.set_transport(MeshDim::shard, s.transport(MeshDim::shard));
  CHECK(s == want);
  if (W == 4) {
    const DeviceMesh hsdp(MPI_COMM_WORLD, {2, 2}, {"r", "s"}, 60.0, HostProgress::inline_,
                          HostCollectives::mpi);
    CHECK(mesh_defaults(hsdp) == CostModel::defaults(MeshShape::hsdp(2, 2)));
    const DeviceMesh split(MPI_COMM_WORLD, {4}, {"shard"}, 60.0, HostProgress::inline_,
                           HostCollectives::auto_, 2);
    CHECK(mesh_defaults(split).transport(MeshDim::shard) == Transport::two_level);
  }

  CostModel c = CostModel::defaults(MeshShape::hsdp(2, 4));
  c.collective(CollectiveKind::all_gather, MeshDim::shard).set_points({{1000, 0.5}, {2000, 0.7}});
  const CostModel x = c.scaled(2.5);
  for (CollectiveKind k :
       {CollectiveKind::all_gather, CollectiveKind::reduce_scatter, CollectiveKind::all_reduce})
    for (MeshDim d : {MeshDim::shard, MeshDim::replicate})
      for (double bytes : {0.0, 1500.0, 1e6}) {
        CAPTURE(collective_kind_name(k));
        CAPTURE(bytes);
        CHECK(x.time_ms(k, d, bytes) == doctest::Approx(2.5 * c.time_ms(k, d, bytes)));
        if (k != CollectiveKind::all_reduce)
          CHECK(x.shm_time_ms(k, d, bytes) == doctest::Approx(2.5 * c.shm_time_ms(k, d, bytes)));
      }
  CHECK(x.copy_ms(1e6) == doctest::Approx(2.5 * c.copy_ms(1e6)));
  CHECK(x.quant_ms(1e6) == doctest::Approx(2.5 * c.quant_ms(1e6)));
  CHECK(contains(error_of<InvalidArgument>([&] { c.scaled(0); }), "CostModel::scaled"));
}

TEST_CASE("cost model calibration of the two-level path (2 pretended nodes of 2 ranks)") {
  if (test::world_size() != 4) return;
  const DeviceMesh mesh(MPI_COMM_WORLD, {4}, {"shard"}, 60.0, HostProgress::inline_,
                        HostCollectives::auto_, 2);
  const NodeSplit* split = mesh.node_split("shard");
  REQUIRE(split);
  const CostModel base = CostModel::defaults(MeshShape::fsdp(4));
  const CostModel c = CostModel::calibrate(mesh.comm("shard"), base, nullptr, {4096, 1 << 20}, 2,
                                           nullptr, false, split);
  CHECK(c.transport(MeshDim::shard) == Transport::two_level);
  for (CollectiveKind k : {CollectiveKind::all_gather, CollectiveKind::reduce_scatter}) {
    CAPTURE(collective_kind_name(k));
    // Both parts measured: the shared-memory pair and the collective across the nodes.
    CHECK(c.shm_collective(k, MeshDim::shard) != base.shm_collective(k, MeshDim::shard));
    CHECK(c.collective(k, MeshDim::shard) != base.collective(k, MeshDim::shard));
    CHECK(c.collective(k, MeshDim::shard).points.size() == 2);
  }
  const std::string j = c.to_json();
  CHECK(contains(j, "\"shard\":\"shm+mpi\""));
  CHECK(CostModel::parse_json(j, base) == c);
  // Not with the one-node shared memory as well, and only over the shard dim's ranks.
  CHECK(contains(error_of<InvalidArgument>([&] {
                   CostModel::calibrate(mesh.comm("shard"), base, nullptr, {4096}, 1,
                                        split ? &split->local() : nullptr, false, split);
                 }),
                 "not both"));
  const DeviceMesh pairs(MPI_COMM_WORLD, {2, 2}, {"a", "b"}, 60.0, HostProgress::inline_,
                         HostCollectives::auto_, 2);
  CHECK(contains(error_of<InvalidArgument>([&] {
                   CostModel::calibrate(pairs.comm("b"), base, nullptr, {4096}, 1, nullptr, false,
                                        split);
                 }),
                 "the node split has 4 ranks"));
}

TEST_CASE("Scheduler::plan rejects bad meshes and options") {
  auto g = load(kSeed);
  CHECK(contains(error_of<InvalidArgument>([&] { Scheduler::plan(*g, MeshShape::fsdp(0)); }),
                 "mesh sizes must be >= 1"));
  PlanOptions o;
  o.forward_prefetch_depth = -1;
  CHECK(contains(error_of<InvalidArgument>([&] { Scheduler::plan(*g, MeshShape::fsdp(2), o); }),
                 "forward_prefetch_depth must be >= 0"));
  o = PlanOptions{};
  o.reduce_scatter_max_input_buffers = 0;
  CHECK(contains(error_of<InvalidArgument>([&] { Scheduler::plan(*g, MeshShape::fsdp(2), o); }),
                 "reduce_scatter_max_input_buffers must be >= 1"));
}

namespace {

// Runs one iteration of the engine (fsdp::forward / fsdp::backward on the root, configured as
// the plan says) and compares its operations, one by one, and its pool's peak and end bytes
// with the plan's.
void check_engine_matches(const char* json, const MeshShape& mesh, const PlanOptions& o,
                          const std::string& what, HostProgress progress);

// One operation as both sides describe it: stream, kind, module, bytes, phase, and (with one
// root, where plan and run number operations alike) its dependencies.
std::string describe_op(StreamKind s, OpKind k, std::string_view module, std::size_t bytes,
                        Phase ph, const fsdp::engine::DepList& deps, bool with_deps) {
  std::string d = std::string(stream_name(s)) + " " + op_kind_name(k) + " " + std::string(module) +
                  " " + std::to_string(bytes) + (ph == Phase::forward ? " fwd" : " bwd");
  if (with_deps)
    for (int x : deps)
      d += " <" + std::to_string(x);
  return d;
}

// The recorded run's operations, per root, equal the plan's, operation by operation. With
// several roots, each run log is compared with the plan's operations of that root's groups
// (the plan numbers all roots together, so dependencies are compared with one root only).
void check_operations_match(const Plan& plan,
                            const std::vector<std::vector<fsdp::engine::OpDesc>>& logs) {
  const bool one = logs.size() == 1;
  for (std::size_t r = 0; r < logs.size(); ++r) {
    CAPTURE(r);
    const int root_group = plan.pool_roots[r];
    std::vector<std::string> planned, ran;
    for (const Op& op : plan.ops) {
      const bool mine =
          op.group >= 0 && plan.groups[static_cast<std::size_t>(op.group)].root_group == root_group;
      if (one || mine)
        planned.push_back(
            describe_op(op.stream, op.kind, op.module(), op.bytes, op.phase, op.deps, one));
    }
    for (const fsdp::engine::OpDesc& d : logs[r]) {
      const std::string module = d.source->fqn().empty() ? "<root>" : d.source->fqn();
      ran.push_back(describe_op(d.stream, d.kind, module, d.bytes, d.phase, d.deps, one));
    }
    REQUIRE(planned.size() == ran.size());
    for (std::size_t i = 0; i < ran.size(); ++i) {
      CAPTURE(i);
      CHECK(planned[i] == ran[i]);
    }
  }
}

// Both ways of running host streams must free memory at the same points.
void check_engine_matches(const char* json, const MeshShape& mesh, const PlanOptions& o,
                          const std::string& what) {
  check_engine_matches(json, mesh, o, what + " (worker threads)", HostProgress::thread);
  check_engine_matches(json, mesh, o, what + " (inline)", HostProgress::inline_);
}

void check_engine_matches(const char* json, const MeshShape& mesh, const PlanOptions& o,
                          const std::string& what, HostProgress progress) {
  CAPTURE(what);
  auto root = load(json);
  const Plan plan = Scheduler::plan(*root, mesh, o);

  auto g = load(json);
  const DeviceMesh dm =
      mesh.replicate_size > 1
          ? DeviceMesh(MPI_COMM_WORLD, {mesh.replicate_size, mesh.shard_size},
                       {"replicate", "shard"}, 60.0, progress)
          : DeviceMesh(MPI_COMM_WORLD, {mesh.shard_size}, {"shard"}, 60.0, progress);
  REQUIRE(fsdp::apply_fully_shard_requests(*g, dm, o.defaults) ==
          static_cast<int>(plan.groups.size()));
  std::vector<graph::Module*> modules;
  for (const PlannedGroup& pg : plan.groups) {
    graph::Module& m = g->module(pg.modules.front()->fqn());
    fsdp::FSDPModule* st = fsdp::fsdp_state(m);
    REQUIRE(st);
    CHECK(st->group_fqns() == pg.param_fqns());
    CHECK(st->group_layout().shard_numel == pg.layout.shard_numel);
    CHECK(st->group_layout().arena_numel == pg.layout.arena_numel);
    // The full layout the plan computes on demand is the engine's, member by member.
    const kernels::GroupLayout& ran = st->group_layout();
    const int rank = ran.members.empty() ? 0 : ran.members.front().layout.rank;
    const kernels::GroupLayout planned = pg.group_layout(rank);
    REQUIRE(planned.members.size() == ran.members.size());
    CHECK(planned.world == ran.world);
    for (std::size_t i = 0; i < ran.members.size(); ++i) {
      CHECK(planned.members[i].slot_offset == ran.members[i].slot_offset);
      CHECK(planned.members[i].arena_offset == ran.members[i].arena_offset);
      CHECK(planned.members[i].layout.local_shape == ran.members[i].layout.local_shape);
      CHECK(planned.members[i].layout.global_offset == ran.members[i].layout.global_offset);
    }
    modules.push_back(&m);
  }
  for (std::size_t i = 0; i < plan.groups.size(); ++i) {
    fsdp::FSDPModule* st = fsdp::fsdp_state(*modules[i]);
    std::vector<graph::Module*> targets;
    for (int t : plan.forward_prefetch[i])
      targets.push_back(modules[static_cast<std::size_t>(t)]);
    if (!targets.empty()) st->set_modules_to_forward_prefetch(targets);
    if (o.backward_prefetch == BackwardPrefetch::none) st->set_modules_to_backward_prefetch({});
    if (o.no_unshard_in_backward.count(plan.groups[i].name)) st->set_unshard_in_backward(false);
    if (auto it = o.backward_prefetch_targets.find(plan.groups[i].name);
        it != o.backward_prefetch_targets.end()) {
      std::vector<graph::Module*> bt;
      for (const std::string& t : it->second)
        bt.push_back(modules[static_cast<std::size_t>(plan.group_index(t))]);
      st->set_modules_to_backward_prefetch(bt);
    }
  }
  std::vector<fsdp::FSDPModule*> roots;
  for (int r : plan.pool_roots) {
    fsdp::FSDPModule* st = fsdp::fsdp_state(*modules[static_cast<std::size_t>(r)]);
    REQUIRE(st->is_root());
    st->set_reduce_scatter_max_input_buffers(o.reduce_scatter_max_input_buffers);
    if (!o.requires_all_reduce) st->set_requires_all_reduce(false);
    if (!o.reshard_after_backward) st->set_reshard_after_backward(false);
    if (!o.requires_gradient_sync) st->set_requires_gradient_sync(false);
    if (!o.is_last_backward) st->set_is_last_backward(false);
    if (o.fresh_gradients) st->set_fresh_gradients(true);
    roots.push_back(st);
  }
  // An optimizer inside backward with the planned number of state arrays.
  std::unique_ptr<optim::Optimizer> opt;
  if (o.optimizer_in_backward_states == 2)
    opt = std::make_unique<optim::AdamW>(g->parameters(), 1e-3);
  else if (o.optimizer_in_backward_states >= 0)
    opt = std::make_unique<optim::SGD>(g->parameters(), 0.1,
                                       o.optimizer_in_backward_states == 1 ? 0.9 : 0.0);
  if (opt) opt->run_in_backward();

  std::vector<std::vector<fsdp::engine::OpDesc>> logs(roots.size());
  for (std::size_t i = 0; i < roots.size(); ++i)
    fsdp::detail::record_operations(*roots[i], &logs[i]);
  fsdp::forward(*g);
  fsdp::backward(*g);
  for (fsdp::FSDPModule* r : roots)
    fsdp::detail::record_operations(*r, nullptr);
  check_operations_match(plan, logs);
  std::size_t end = 0;
  for (std::size_t i = 0; i < roots.size(); ++i) {
    CHECK(roots[i]->pool_peak_bytes() == plan.pool_peak_bytes[i]);
    end += roots[i]->pool_bytes_in_use();
  }
  if (roots.size() == 1) CHECK(plan.pool_peak_bytes[0] == plan.peak_bytes);
  CHECK(end == plan.end_bytes);
  // Not the last backward: the reduce-scatters are still pending; finish them here.
  for (fsdp::FSDPModule* r : roots)
    r->zero_grad();
}

}  // namespace

TEST_CASE("a plan on a shared-memory cost model: the times of the shm path, the MPI path's ops") {
  // One group (w: (10, 100), 3 rows per rank on 4 ranks) and an m2 with reshard_after_forward
  // 2 (its backward all-gather runs in the 2-rank group, on MPI).
  const char* const json = R"({"name": "two", "fully_shard": true,
    "params": {"w": {"shape": [10, 100]}},
    "cost": {"forward_ms": 1.0, "backward_ms": 2.0},
    "modules": [{"name": "m2", "fully_shard": {"reshard_after_forward": 2},
                 "params": {"b": {"shape": [16, 100]}},
                 "cost": {"forward_ms": 1.0, "backward_ms": 2.0}}]})";
  for (const MeshShape mesh : {MeshShape::fsdp(4), MeshShape::hsdp(2, 4)}) {
    CAPTURE(mesh.replicate_size);
    CostModel cm = CostModel::defaults(mesh);
    cm.set_copy_gb_per_s(1.0);  // copy_ms(bytes) = bytes / 1e6
    cm.collective(CollectiveKind::all_gather, MeshDim::shard) = {0.5, 1e-3};
    cm.shm_collective(CollectiveKind::all_gather, MeshDim::shard) = {0.25, 2e-3};
    cm.shm_collective(CollectiveKind::reduce_scatter, MeshDim::shard) = {0.125, 4e-3};
    PlanOptions o;
    o.cost = cm;
    auto g = graph::parse_graph_json(json);
    const Plan on_mpi = Scheduler::plan(*g, mesh, o);
    cm.set_transport(MeshDim::shard, Transport::shm);
    o.cost = cm;
    const Plan on_shm = Scheduler::plan(*g, mesh, o);

    // The same operations (what the running backend records on either transport).
    REQUIRE(on_shm.ops.size() == on_mpi.ops.size());
    for (std::size_t i = 0; i < on_shm.ops.size(); ++i) {
      const Op& a = on_shm.ops[i];
      const Op& b = on_mpi.ops[i];
      CAPTURE(i);
      CHECK(describe_op(a.stream, a.kind, a.module(), a.bytes, a.phase, a.deps, true) ==
            describe_op(b.stream, b.kind, b.module(), b.bytes, b.phase, b.deps, true));
      CHECK(a.k == b.k);
    }
    CHECK(on_shm.peak_bytes == on_mpi.peak_bytes);

    // Each op's time from the coefficients, by hand. Group shards: w 3 x 100, b 4 x 100 f32.
    const auto shard_bytes = [&](const Op& op) {
      return on_shm.groups[static_cast<std::size_t>(op.group)].name == "m2" ? 1600.0 : 1200.0;
    };
    int k_rank = 0, gathers = 0, scatters = 0;
    std::map<int, int> gather_k;  // group -> k of its last all-gather
    for (const Op& op : on_shm.ops) {
      if (op.kind == OpKind::all_gather) gather_k[op.group] = op.k;
      CAPTURE(op_kind_name(op.kind));
      CAPTURE(op.module());
      const double ms = op.end_ms - op.start_ms;
      const double b = shard_bytes(op);
      switch (op.kind) {
        case OpKind::all_gather:
          if (op.k > 0) {  // the 2-rank gather of (W/k) shards: on MPI, W-rank share
            ++k_rank;
            CHECK(ms == doctest::Approx(0.5 + 1e-3 * (2 * b) * (2 - 1) / (4 - 1)));
          } else {
            ++gathers;
            CHECK(ms == 0.0);  // a publish: the copy-out gathers
          }
          break;
        case OpKind::copy_out:
          // After a k-rank gather: the plain copy-out of the arena bytes.
          if (gather_k[op.group] > 0)
            CHECK(ms == doctest::Approx(double(op.bytes) / 1e6));
          else
            CHECK(ms == doctest::Approx(0.25 + 2e-3 * b));
          break;
        case OpKind::copy_in:
          // Shared memory reads the gradients in place (no cast in this graph: no gather copy-in).
          CHECK(op.stream == StreamKind::reduce_scatter);
          CHECK(ms == 0.0);
          break;
        case OpKind::reduce_scatter:
          ++scatters;
          CHECK(ms == doctest::Approx(0.125 + 4e-3 * b));
          break;
        case OpKind::reduce_copy_out:
          // Fused into the reduce-scatter without HSDP; after the all-reduce a copy.
          CHECK(ms == doctest::Approx(mesh.replicate_size == 1 ? 0.0 : double(op.bytes) / 1e6));
          break;
        case OpKind::all_reduce:
          CHECK(ms ==
                doctest::Approx(cm.time_ms(CollectiveKind::all_reduce, MeshDim::replicate, b)));
          break;
        default:
          break;
      }
    }
    CHECK(k_rank == 1);
    CHECK(gathers >= 2);
    CHECK(scatters == 2);
    // The forward, by hand: the root's gather (publish) and copy-out, then m2's (prefetched
    // by the CPU running ahead: its publish at 0, its copy-out on the compute stream after
    // the root's copy-out), the two forwards.
    const Op& root_out = group_op(on_shm, OpKind::copy_out, Phase::forward, "<root>");
    const Op& m2_out = group_op(on_shm, OpKind::copy_out, Phase::forward, "m2");
    CHECK(root_out.start_ms == 0.0);
    CHECK(root_out.end_ms == doctest::Approx(0.25 + 2e-3 * 1200));
    CHECK(m2_out.end_ms >= doctest::Approx(root_out.end_ms + 0.25 + 2e-3 * 1600));
    CHECK(on_shm.step_ms != doctest::Approx(on_mpi.step_ms));
  }
}

TEST_CASE("explicit backward prefetch, and a reshard with its gather in flight: plan = run") {
  const int W = test::world_size();
  PlanOptions o;
  // The root's pre-backward prefetches m3 and m2 at once.
  o.backward_prefetch_targets = {{"<root>", {"m3", "m2"}}};
  check_engine_matches(kSeed, MeshShape::fsdp(W), o, "root prefetches m3 and m2");
  {
    auto g = load(kSeed);
    const Plan p = Scheduler::plan(*g, MeshShape::fsdp(W), o);
    if (W > 1)
      CHECK(group_names(p, phase_ops(p, OpKind::all_gather, Phase::backward)) ==
            std::vector<std::string>{"m3", "m2"});
    REQUIRE(p.backward_prefetch_targets.size() == 1);
    CHECK(p.backward_prefetch_targets[0].first == p.group_index("<root>"));
    CHECK(p.backward_prefetch_targets[0].second ==
          std::vector<int>{p.group_index("m3"), p.group_index("m2")});
  }
  // m2's pre-backward prefetches m3, whose backward already ran: its gather is still in
  // flight when the root's backward ends, which reshards it unused.
  o.backward_prefetch_targets = {{"m2", {"m3"}}};
  check_engine_matches(kSeed, MeshShape::fsdp(W), o,
                       "m2 prefetches m3 (gather in flight at the end)");
  auto g = load(kSeed);
  const Plan p = Scheduler::plan(*g, MeshShape::fsdp(W), o);
  const int m3 = p.group_index("m3");
  const auto reshards = p.find(OpKind::reshard, m3);
  REQUIRE(!reshards.empty());
  if (W > 1) {  // the last reshard of m3 waits for its unused all-gather
    const auto ags = p.find(OpKind::all_gather, m3);
    REQUIRE(!ags.empty());
    CHECK(reshards.back()->deps == std::vector<int>{ags.back()->id});
  }
  CHECK(p.end_bytes == 0);
  o.backward_prefetch_targets = {{"m2", {"nope"}}};
  CHECK(contains(error_of<InvalidArgument>([&] { Scheduler::plan(*g, MeshShape::fsdp(W), o); }),
                 "backward_prefetch_targets: no group named 'nope'"));
}

TEST_CASE("the engine's measured pool peak equals the plan's, byte for byte") {
  const int W = test::world_size();
  for (const char* json : {kSeed, kMixed, kTwoRoots, kLists, kListNested, kTied}) {
    CAPTURE(std::string(json).substr(0, 40));
    PlanOptions o;
    check_engine_matches(json, MeshShape::fsdp(W), o, "default");
    o.defaults.reshard_after_forward = fsdp::ReshardAfterForward(false);
    check_engine_matches(json, MeshShape::fsdp(W), o, "reshard false");
    o.defaults.reshard_after_forward = fsdp::ReshardAfterForward(true);
    check_engine_matches(json, MeshShape::fsdp(W), o, "reshard true");
    o = PlanOptions{};
    o.forward_prefetch_depth = 2;
    check_engine_matches(json, MeshShape::fsdp(W), o, "prefetch 2");
    o.forward_prefetch_depth = 1;
    o.reduce_scatter_max_input_buffers = 2;
    check_engine_matches(json, MeshShape::fsdp(W), o, "prefetch 1, 2 reduce buffers");
    o = PlanOptions{};
    o.backward_prefetch = BackwardPrefetch::none;
    o.defaults.mp_policy.param_dtype = DType::bf16;
    o.defaults.mp_policy.reduce_dtype = DType::f32;
    check_engine_matches(json, MeshShape::fsdp(W), o,
                         "no backward prefetch, bf16 params, f32 reduce");
    if (W % 2 == 0 && W > 2) {
      o = PlanOptions{};
      o.defaults.reshard_after_forward = fsdp::ReshardAfterForward::group_size(2);
      check_engine_matches(json, MeshShape::fsdp(W), o, "reshard_after_forward=2");
    }
    if (W % 2 == 0) {  // HSDP (with W = 2: shard groups of one rank)
      o = PlanOptions{};
      check_engine_matches(json, MeshShape::hsdp(2, W / 2), o, "HSDP");
      o.requires_all_reduce = false;
      o.defaults.mp_policy.param_dtype = DType::bf16;
      check_engine_matches(json, MeshShape::hsdp(2, W / 2), o,
                           "HSDP without all-reduce, bf16 params");
    }
  }
}

namespace {

// Every other group (by index), and every group but the roots.
std::set<std::string> every_other_group(const char* json, int W) {
  auto g = load(json);
  std::set<std::string> out;
  const auto groups = plan_groups(*g, W);
  for (std::size_t i = 0; i < groups.size(); i += 2)
    out.insert(groups[i].name);
  return out;
}
std::set<std::string> non_root_groups(const char* json, int W) {
  auto g = load(json);
  std::set<std::string> out;
  for (const PlannedGroup& pg : plan_groups(*g, W))
    if (!pg.is_root) out.insert(pg.name);
  return out;
}

}  // namespace

TEST_CASE("the engine's pool equals the plan's with the backward and accumulation policies") {
  const int W = test::world_size();
  for (const char* json : {kSeed, kMixed, kTwoRoots}) {
    PlanOptions o;
    o.reshard_after_backward = false;
    check_engine_matches(json, MeshShape::fsdp(W), o, "no reshard after backward");
    o.defaults.reshard_after_forward = fsdp::ReshardAfterForward(true);
    o.forward_prefetch_depth = 1;
    check_engine_matches(json, MeshShape::fsdp(W), o,
                         "no reshard after backward, reshard after forward");

    o = PlanOptions{};
    o.requires_gradient_sync = false;
    check_engine_matches(json, MeshShape::fsdp(W), o, "no gradient sync");
    o.defaults.mp_policy.param_dtype = DType::bf16;
    o.reshard_after_backward = false;
    check_engine_matches(json, MeshShape::fsdp(W), o,
                         "no gradient sync, no reshard after backward, bf16");

    o = PlanOptions{};
    o.no_unshard_in_backward = every_other_group(json, W);
    check_engine_matches(json, MeshShape::fsdp(W), o, "no unshard in backward (every other group)");
    o.defaults.reshard_after_forward = fsdp::ReshardAfterForward(true);
    check_engine_matches(json, MeshShape::fsdp(W), o,
                         "no unshard in backward, reshard after forward");
    o.no_unshard_in_backward = non_root_groups(json, W);
    o.backward_prefetch = BackwardPrefetch::none;
    check_engine_matches(json, MeshShape::fsdp(W), o,
                         "no unshard in backward (non-roots), no prefetch");

    o = PlanOptions{};
    o.is_last_backward = false;
    check_engine_matches(json, MeshShape::fsdp(W), o, "not the last backward");
    o.reduce_scatter_max_input_buffers = 2;
    o.defaults.mp_policy.reduce_dtype = DType::bf16;
    check_engine_matches(json, MeshShape::fsdp(W), o,
                         "not the last backward, 2 reduce buffers, bf16 reduce");
    o.reduce_scatter_max_input_buffers = 8;
    o.reshard_after_backward = false;
    check_engine_matches(json, MeshShape::fsdp(W), o,
                         "not the last backward, 8 reduce buffers, kept");

    if (W % 2 == 0 && W > 2) {
      o = PlanOptions{};
      o.defaults.reshard_after_forward = fsdp::ReshardAfterForward::group_size(2);
      o.no_unshard_in_backward = every_other_group(json, W);
      o.is_last_backward = false;
      check_engine_matches(json, MeshShape::fsdp(W), o,
                           "reshard_after_forward=2, no unshard, not last");
      o.reshard_after_backward = false;
      check_engine_matches(json, MeshShape::fsdp(W), o,
                           "reshard_after_forward=2, kept after backward");
    }
    if (W % 2 == 0) {  // HSDP
      o = PlanOptions{};
      o.requires_gradient_sync = false;
      check_engine_matches(json, MeshShape::hsdp(2, W / 2), o, "HSDP, no gradient sync");
      o = PlanOptions{};
      o.is_last_backward = false;
      o.reshard_after_backward = false;
      o.no_unshard_in_backward = every_other_group(json, W / 2);
      check_engine_matches(json, MeshShape::hsdp(2, W / 2), o, "HSDP, not last, kept, no unshard");
      o.requires_all_reduce = false;
      o.reduce_scatter_max_input_buffers = 2;
      check_engine_matches(json, MeshShape::hsdp(2, W / 2), o,
                           "HSDP deferred, not last, kept, no unshard");
    }
  }
}

TEST_CASE("the engine's pool equals the plan's with an optimizer inside backward") {
  const int W = test::world_size();
  for (const char* json : {kSeed, kMixed, kTwoRoots}) {
    for (int states : {0, 1, 2}) {
      PlanOptions o;
      o.optimizer_in_backward_states = states;
      const std::string s = " (" + std::to_string(states) + " state arrays)";
      check_engine_matches(json, MeshShape::fsdp(W), o, "optimizer in backward" + s);
      o.defaults.mp_policy.param_dtype = DType::bf16;
      o.reduce_scatter_max_input_buffers = 2;
      check_engine_matches(json, MeshShape::fsdp(W), o,
                           "optimizer in backward, bf16, 2 buffers" + s);
      o.defaults.mp_policy.reduce_dtype = DType::bf16;
      o.defaults.reshard_after_forward = fsdp::ReshardAfterForward(true);
      check_engine_matches(json, MeshShape::fsdp(W), o,
                           "optimizer in backward, bf16 reduce, resharded after forward" + s);
    }
    PlanOptions o;
    o.optimizer_in_backward_states = 1;
    o.requires_gradient_sync = false;
    check_engine_matches(json, MeshShape::fsdp(W), o, "optimizer in backward, no gradient sync");
    o = PlanOptions{};
    o.fresh_gradients = true;
    check_engine_matches(json, MeshShape::fsdp(W), o, "fresh gradients");
    o.optimizer_in_backward_states = 2;
    o.defaults.mp_policy.param_dtype = DType::bf16;
    check_engine_matches(json, MeshShape::fsdp(W), o, "fresh gradients, bf16, optimizer inside");
    o = PlanOptions{};  // the int8 reduce-scatter's decode writes gradients: a separate update
    o.optimizer_in_backward_states = 2;
    o.defaults.compression.reduce_scatter = kernels::QuantCode::int8;
    check_engine_matches(json, MeshShape::fsdp(W), o, "int8 reduce-scatter, optimizer in backward");
    if (W % 2 == 0) {  // HSDP: the update after the all-reduce; deferred with it
      check_engine_matches(json, MeshShape::hsdp(2, W / 2), o,
                           "HSDP, int8 reduce-scatter, optimizer in backward");
      o = PlanOptions{};
      o.optimizer_in_backward_states = 2;
      check_engine_matches(json, MeshShape::hsdp(2, W / 2), o, "HSDP, optimizer in backward");
      o.requires_all_reduce = false;
      check_engine_matches(json, MeshShape::hsdp(2, W / 2), o,
                           "HSDP deferred all-reduce, optimizer in backward");
    }
  }
  // The planned operations: one update per group and reduction, on the reduction's stream,
  // with the bytes the update moves. It runs in the pass that writes the reduced shard
  // (variant 1: no gradient stored or read), except where the backward writes the sharded
  // gradients itself (one rank, no cast) or the int8 reduce-scatter's decode does.
  auto root = load(kSeed);
  std::size_t largest = 0, all = 0;
  for (const bool int8 : {false, true}) {
    CAPTURE(int8);
    PlanOptions o;
    o.optimizer_in_backward_states = 2;
    if (int8) o.defaults.compression.reduce_scatter = kernels::QuantCode::int8;
    const Plan plan = Scheduler::plan(*root, MeshShape::fsdp(W), o);
    const bool fused = W > 1 && !int8;
    int updates = 0;
    for (const Op& op : plan.ops)
      if (op.kind == OpKind::update) {
        ++updates;
        const PlannedGroup& pg = plan.groups[static_cast<std::size_t>(op.group)];
        CHECK(op.variant == (fused ? 1 : 0));
        CHECK(op.bytes == static_cast<std::size_t>(pg.layout.shard_numel) * 4 * (fused ? 6 : 7));
        CHECK(op.stream == StreamKind::reduce_scatter);
      }
    CHECK(updates == static_cast<int>(plan.groups.size()));
    // The sharded gradients: none when fused; else one scratch as large as the largest
    // group's shard (one root), or on one rank (no cast) every group's own, which backward
    // writes.
    largest = all = 0;
    for (const PlannedGroup& g : plan.groups) {
      largest = std::max(largest, g.shard_bytes());
      all += g.shard_bytes();
    }
    CHECK(plan.grad_bytes == (W == 1 ? all : fused ? 0 : largest));
    // The byte account: the update moves its bytes (read: parameters, both moments and,
    // unfused, the gradients; written: parameters and moments); the copy-out running it
    // writes no gradient; every other op's traffic follows its kind.
    double update_bytes = 0;
    for (const Op& op : plan.ops) {
      const ByteCount c = plan.bytes_moved(op);
      if (op.kind == OpKind::update) {
        update_bytes += c.total();
        CHECK(c.total() == static_cast<double>(op.bytes));
        CHECK(c.written * (fused ? 3 : 4) == c.read * 3);
      }
      if (op.kind == OpKind::reduce_copy_out) {
        CHECK(op.variant == (fused ? 3 : 0));
        if (fused) CHECK(c.written == 0);
        if (fused) CHECK(contains(plan.label(op), "RS.copy_out+update("));
      }
      if (op.kind == OpKind::forward || op.kind == OpKind::backward) CHECK(c.total() == 0);
      if (op.kind == OpKind::all_gather && W > 1 && !int8) {  // this rank's slot, W received
        const PlannedGroup& pg = plan.groups[static_cast<std::size_t>(op.group)];
        CHECK(c.read == static_cast<double>(pg.geometry().gather_slot_bytes()));
        CHECK(c.written == W * c.read);
      }
    }
    CHECK(update_bytes == (fused ? 6.0 : 7.0) * static_cast<double>(plan.sharded_bytes));
  }
  PlanOptions o;
  o.optimizer_in_backward_states = 2;
  const Plan plan = Scheduler::plan(*root, MeshShape::fsdp(W), o);
  PlanOptions after;
  CHECK(Scheduler::plan(*root, MeshShape::fsdp(W), after).grad_bytes == all);
  CHECK(plan.byte_floor().optimizer == 7.0 * static_cast<double>(plan.sharded_bytes));
  CHECK(plan.byte_floor(5).optimizer == 5.0 * static_cast<double>(plan.sharded_bytes));
  CHECK((W > 1) == (plan.byte_floor().reduce_scatter > 0));
  CHECK(contains(plan.to_text(), "byte account per rank: "));
  // Fresh gradients: grad_init writes nothing.
  PlanOptions f;
  f.fresh_gradients = true;
  for (const Op& op : Scheduler::plan(*root, MeshShape::fsdp(W), f).ops)
    if (op.kind == OpKind::grad_init) CHECK(op.bytes == 0);
  o.is_last_backward = false;
  CHECK(contains(error_of<InvalidArgument>([&] { Scheduler::plan(*root, MeshShape::fsdp(W), o); }),
                 "optimizer inside backward needs is_last_backward"));
  o.requires_gradient_sync = false;  // micro-batches without sync: nothing is updated
  CHECK(Scheduler::plan(*root, MeshShape::fsdp(W), o).find(OpKind::update).empty());
  o.requires_gradient_sync = true;
  o.is_last_backward = true;
  if (W >
      1) {  // the kept unsharded parameters would miss the update (one rank: they are the shards)
    o.reshard_after_backward = false;
    CHECK(
        contains(error_of<InvalidArgument>([&] { Scheduler::plan(*root, MeshShape::fsdp(W), o); }),
                 "set_reshard_after_backward(true)"));
    o.reshard_after_backward = true;
  }
  {  // an offloaded group: refused as the run refuses it
    PlanOptions off = o;
    off.defaults.offload_policy = fsdp::CPUOffloadPolicy{};
    CHECK(contains(
        error_of<InvalidArgument>([&] { Scheduler::plan(*root, MeshShape::fsdp(W), off); }),
        "an optimizer inside backward needs f32 shards that are not offloaded"));
  }
  o.optimizer_in_backward_states = 3;
  CHECK(contains(error_of<InvalidArgument>([&] { Scheduler::plan(*root, MeshShape::fsdp(W), o); }),
                 "optimizer_in_backward_states must be -1"));
}

TEST_CASE("the executor applies the backward and accumulation policies") {
  const int W = test::world_size();
  PlanOptions o;
  o.reshard_after_backward = false;
  o.is_last_backward = false;
  o.reduce_scatter_max_input_buffers = 2;
  o.no_unshard_in_backward = {"m2"};
  o.defaults.reshard_after_forward = fsdp::ReshardAfterForward(true);
  for (bool sync : {true, false}) {
    CAPTURE(sync);
    o.requires_gradient_sync = sync;
    auto graph = load(kSeed);
    const Plan plan = Scheduler::plan(*graph, MeshShape::fsdp(W), o);
    DeviceMesh mesh(test::runtime(), {W}, {"dp"});
    REQUIRE(fsdp::apply_fully_shard_requests(*graph, mesh, o.defaults) == 3);
    Executor ex(*graph, mesh, plan);
    ex.step();
    CHECK(ex.measured_peak_bytes() == plan.peak_bytes);
    fsdp::FSDPModule* root = fsdp::fsdp_state(*graph);
    CHECK(root->pool_bytes_in_use() == plan.end_bytes);
    root->zero_grad();  // finishes the reduce-scatters the last backward would have waited for
    int collectives = 0;
    for (const MeasuredOp& op : ex.timeline().ops())
      collectives +=
          op.stream == StreamKind::reduce_scatter && op.label.rfind("reduce_scatter on", 0) == 0;
    CHECK(collectives == static_cast<int>(plan.find(OpKind::reduce_scatter).size()));
  }
}

TEST_CASE("plan_groups' extents equal the full shard layouts (dim 0 fast path and the rest)") {
  auto g = graph::Module::make_root("m");
  const std::vector<Shape> shapes = {{13, 7}, {0, 5}, {1, 1}, {3}, {4, 4}, {5, 2, 3}, {8, 12}};
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    auto& m = g->add_module("l" + std::to_string(i));
    m.add_param("w", shapes[i]);
    CHECK(m.param(0).numel() == numel(shapes[i]));
    CHECK(m.param(0).first_extent() == shapes[i][0]);
    m.set_fully_shard_request(true);
  }
  // A zero dim 0 with other dims whose product does not fit int64: no elements.
  auto& z = g->add_module("zero");
  const auto& zp = z.add_param("w", {0, std::int64_t(1) << 62, std::int64_t(1) << 62});
  CHECK(zp.numel() == 0);
  CHECK(zp.inner_numel() == -1);
  fsdp::FullyShardOptions d;  // Shard(1) for the (8, 12) parameter: not the dim-0 path
  d.shard_placement_fn = [](const graph::Parameter& p) -> std::optional<Placement> {
    if (p.fqn() == "l6.w") return Placement::Shard(1);
    return std::nullopt;
  };
  for (int W : {1, 2, 3, 4}) {
    const auto groups = plan_groups(*g, W, d);
    REQUIRE(groups.size() == shapes.size());
    for (const PlannedGroup& pg : groups) {
      CAPTURE(pg.name);
      CAPTURE(W);
      const kernels::GroupLayout full = pg.group_layout(0);
      CHECK(pg.layout.shard_numel == full.shard_numel);
      CHECK(pg.layout.arena_numel == full.arena_numel);
    }
  }
}

TEST_CASE("replan reuses the plan's memory and plans what plan() plans; copies stand alone") {
  auto g = load(kMixed);
  PlanOptions o;
  o.forward_prefetch_depth = 1;
  const Plan fresh = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  const std::string text = fresh.to_text();

  Plan p = Scheduler::plan(*g, MeshShape::fsdp(4));
  const Arena* arena = p.ops.get_allocator().arena().get();
  REQUIRE(arena != nullptr);
  CHECK(p.groups.get_allocator().arena().get() == arena);  // one arena for all records
  CHECK(p.events.get_allocator().arena().get() == arena);
  Scheduler::replan(p, *g, MeshShape::fsdp(4), o);
  CHECK(p.ops.get_allocator().arena().get() == arena);  // nothing else held it: reused
  CHECK(p.to_text() == text);
  CHECK(p.fingerprint() == fresh.fingerprint());
  CHECK(p.peak_bytes == fresh.peak_bytes);

  // Something else holding the memory (the ops moved out): a new arena, the old one intact.
  auto kept = std::move(p.ops);
  const std::size_t kept_size = kept.size();
  Scheduler::replan(p, *g, MeshShape::fsdp(4), o);
  CHECK(p.ops.get_allocator().arena().get() != kept.get_allocator().arena().get());
  CHECK(p.to_text() == text);
  REQUIRE(kept.size() == kept_size);
  CHECK(kept.back().end_ms == p.ops.back().end_ms);

  // A copy lives on the heap and outlives the original.
  std::optional<Plan> original = Scheduler::plan(*g, MeshShape::fsdp(4), o);
  const Plan copy = *original;
  CHECK(!copy.ops.get_allocator().arena());
  CHECK(!copy.groups[0].params.get_allocator().arena());
  original.reset();
  CHECK(copy.to_text() == text);

  // A larger graph than the arena was sized for: a new arena, the same plan as plan() makes.
  auto wide = graph::Module::make_root("wide");
  for (int i = 0; i < 3000; ++i) {
    auto& m = wide->add_module("l" + std::to_string(i));
    m.add_param("w", {8, 4});
    m.cost() = graph::Cost{0.1, 0.2, true};
    m.set_fully_shard_request(true);
  }
  wide->set_fully_shard_request(true);
  CHECK(wide->num_descendants() == 3000);
  const Arena* small = p.ops.get_allocator().arena().get();
  Scheduler::replan(p, *wide, MeshShape::fsdp(4));
  CHECK(p.ops.get_allocator().arena().get() != small);
  const Plan wide_fresh = Scheduler::plan(*wide, MeshShape::fsdp(4));
  CHECK(p.ops.size() == wide_fresh.ops.size());
  CHECK(p.fingerprint() == wide_fresh.fingerprint());
  // And back to the small graph: the large arena is reused.
  const Arena* large = p.ops.get_allocator().arena().get();
  Scheduler::replan(p, *g, MeshShape::fsdp(4), o);
  CHECK(p.ops.get_allocator().arena().get() == large);
  CHECK(p.to_text() == text);

  // A bad option leaves the plan empty.
  PlanOptions bad;
  bad.forward_prefetch_depth = -1;
  CHECK_THROWS_AS(Scheduler::replan(p, *g, MeshShape::fsdp(4), bad), InvalidArgument);
  CHECK(p.ops.empty());
  CHECK(p.groups.empty());
  CHECK(p.events.empty());
}
