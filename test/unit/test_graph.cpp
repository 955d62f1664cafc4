// The module graph: builder, lookups, orders, callbacks, and the JSON format
// (docs/graph-format.md).
#include <doctest/doctest.h>

#include "error_check.hpp"

#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "fullshard/graph/module.hpp"
#include "lib/graph/json_forms.hpp"

using namespace fullshard;
using namespace fullshard::graph;

namespace {

using fullshard::test::contains;
using fullshard::test::error_of;

/// The ConfigError message of parsing `text` as source "graph.json".
std::string json_error(const std::string& text) {
  return error_of<ConfigError>([&] { parse_graph_json(text, "graph.json"); });
}

/// Checks that the message starts (after "fullshard[rank R]: ") with "graph.json: <path>: " and
/// contains `detail`.
void check_json_error(const std::string& text, const std::string& path, const std::string& detail) {
  const std::string msg = json_error(text);
  INFO("message: " << msg);
  CHECK(contains(msg, "]: graph.json: " + path + ": "));
  CHECK(contains(msg, detail));
}

std::vector<std::string> fqns(const std::vector<Module*>& ms) {
  std::vector<std::string> out;
  for (const Module* m : ms)
    out.push_back(m->fqn());
  return out;
}

std::vector<std::string> fqns(const std::vector<Parameter*>& ps) {
  std::vector<std::string> out;
  for (const Parameter* p : ps)
    out.push_back(p->fqn());
  return out;
}

const char* const kExample = R"({
  "name": "model",
  "fully_shard": true,
  "modules": [
    {"name": "embed", "params": {"weight": {"shape": [1000, 256], "dtype": "f32"}},
     "cost": {"forward_ms": 0.2, "backward_ms": 0.4}},
    {"name": "layers", "modules": [
      {"name": "0", "fully_shard": true,
       "params": {"w1": {"shape": [1024, 256]}, "w2": {"shape": [256, 1024]}}},
      {"name": "1", "fully_shard": true,
       "params": {"w1": {"shape": [1024, 256]}, "w2": {"shape": [256, 1024]}}}
    ]},
    {"name": "head", "params": {"weight": {"shape": [10, 256]}, "bias": {"shape": [10]}}}
  ]
})";

/// Whether Module::set_fully_shard_request accepts a T.
template <typename T, typename = void>
struct can_set_request : std::false_type {};
template <typename T>
struct can_set_request<
    T, std::void_t<decltype(std::declval<Module&>().set_fully_shard_request(std::declval<T>()))>>
    : std::true_type {};

/// A `"fully_shard": true` request: fully_shard with the defaults.
bool is_true(const ShardRequest* r) {
  return r != nullptr && *r == ShardRequest();
}

/// Two trees are equal in everything the JSON format describes.
void check_same_tree(const Module& a, const Module& b) {
  INFO("module '" << a.fqn() << "'");
  CHECK(a.name() == b.name());
  CHECK(a.fqn() == b.fqn());
  REQUIRE((a.fully_shard_request() == nullptr) == (b.fully_shard_request() == nullptr));
  if (a.fully_shard_request()) CHECK(*a.fully_shard_request() == *b.fully_shard_request());
  CHECK(a.cost().forward_ms == b.cost().forward_ms);
  CHECK(a.cost().backward_ms == b.cost().backward_ms);
  CHECK(a.cost().declared == b.cost().declared);
  REQUIRE(a.num_params() == b.num_params());
  for (std::size_t i = 0; i < a.num_params(); ++i) {
    CHECK(a.param(i).fqn() == b.param(i).fqn());
    CHECK(a.param(i).shape() == b.param(i).shape());
    CHECK(a.param(i).dtype() == b.param(i).dtype());
    CHECK(a.param(i).requires_grad() == b.param(i).requires_grad());
  }
  REQUIRE(a.num_children() == b.num_children());
  for (std::size_t i = 0; i < a.num_children(); ++i)
    check_same_tree(a.child(i), b.child(i));
}

/// root: bias; layers { 0 {w1, w2}, 1 {w1, w2} }; head {weight}.
std::unique_ptr<Module> build_model() {
  auto root = Module::make_root();
  root->add_param("bias", {4});
  Module& layers = root->add_module("layers");
  for (const char* n : {"0", "1"}) {
    Module& l = layers.add_module(n);
    l.add_param("w1", {8, 4});
    l.add_param("w2", {4, 8}, DType::bf16, false);
  }
  root->add_module("head").add_param("weight", {2, 4}, DType::f64);
  return root;
}

}  // namespace

TEST_CASE("builder: names, FQNs and parents") {
  auto root = build_model();
  CHECK(root->name() == "model");
  CHECK(root->fqn() == "");
  CHECK(root->is_root());
  CHECK(root->parent() == nullptr);
  CHECK(root->json_path() == "");

  CHECK(root->param("bias").fqn() == "bias");
  CHECK(&root->param("bias").module() == root.get());
  Module& l0 = root->module("layers.0");
  CHECK(l0.name() == "0");
  CHECK(l0.fqn() == "layers.0");
  CHECK(!l0.is_root());
  CHECK(l0.parent() == &root->module("layers"));
  CHECK(&l0.root() == root.get());
  CHECK(root->module("layers").fqn() == "layers");

  const Parameter& w2 = l0.param("w2");
  CHECK(w2.name() == "w2");
  CHECK(w2.fqn() == "layers.0.w2");
  CHECK(w2.shape() == Shape{4, 8});
  CHECK(w2.dtype() == DType::bf16);
  CHECK(!w2.requires_grad());
  CHECK(l0.param("w1").requires_grad());
  CHECK(l0.param("w1").dtype() == DType::f32);
  CHECK(!w2.data().defined());
  CHECK(!w2.grad().defined());

  CHECK(root->num_children() == 2);
  CHECK(root->child(0).name() == "layers");
  CHECK(root->child(1).name() == "head");
  CHECK(l0.num_params() == 2);
  CHECK(l0.param(0).name() == "w1");
  CHECK(l0.param(1).name() == "w2");

  auto custom = Module::make_root("net");
  CHECK(custom->name() == "net");
  CHECK(custom->add_module("a").fqn() == "a");
}

TEST_CASE("builder: traversal orders") {
  auto root = build_model();
  CHECK(fqns(root->modules_preorder()) ==
        std::vector<std::string>{"", "layers", "layers.0", "layers.1", "head"});
  CHECK(fqns(root->modules_postorder()) ==
        std::vector<std::string>{"layers.0", "layers.1", "layers", "head", ""});
  CHECK(fqns(root->parameters()) == std::vector<std::string>{"bias", "layers.0.w1", "layers.0.w2",
                                                             "layers.1.w1", "layers.1.w2",
                                                             "head.weight"});
  Module& layers = root->module("layers");
  CHECK(fqns(layers.modules_preorder()) ==
        std::vector<std::string>{"layers", "layers.0", "layers.1"});
  CHECK(fqns(layers.parameters()) ==
        std::vector<std::string>{"layers.0.w1", "layers.0.w2", "layers.1.w1", "layers.1.w2"});
}

TEST_CASE("builder: lookups by FQN") {
  auto root = build_model();
  CHECK(&root->module("") == root.get());
  CHECK(root->find_module("layers.1") == &root->module("layers").child(1));
  CHECK(root->module("layers").module("1").fqn() == "layers.1");
  CHECK(root->find_module("layers.2") == nullptr);
  CHECK(root->find_module("layers..0") == nullptr);
  CHECK(root->find_module("layers.0.w1") == nullptr);

  CHECK(root->find_param("layers.1.w2").fqn() == "layers.1.w2");
  CHECK(root->find_param("bias").fqn() == "bias");
  CHECK(root->module("layers").find_param("0.w1").fqn() == "layers.0.w1");
  CHECK(root->try_find_param("head.weight") == &root->module("head").param("weight"));
  CHECK(root->try_find_param("head.bias") == nullptr);
  CHECK(root->try_find_param("nope.weight") == nullptr);
  CHECK(root->try_find_param("") == nullptr);

  std::string msg = error_of<InvalidArgument>([&] { root->module("layers.5"); });
  CHECK(contains(msg, "root module 'model' has no submodule 'layers.5'"));
  CHECK(contains(msg, "module 'layers' has no child '5' (it has 0, 1)"));
  msg = error_of<InvalidArgument>([&] { root->module("body"); });
  CHECK(contains(msg, "has no submodule 'body' (it has layers, head)"));

  msg = error_of<InvalidArgument>([&] { root->find_param("layers.0.w3"); });
  CHECK(contains(msg, "module 'layers.0' has no parameter 'w3' (it has w1, w2)"));
  msg = error_of<InvalidArgument>([&] { root->module("layers.0").param("w3"); });
  CHECK(contains(msg, "module 'layers.0' has no parameter 'w3' (it has w1, w2)"));
  msg = error_of<InvalidArgument>([&] { root->find_param("layers.9.w1"); });
  CHECK(contains(msg, "no child '9'"));
  CHECK(contains(msg, "'layers.9.w1'"));
  msg = error_of<InvalidArgument>([&] { root->module("layers").param("w"); });
  CHECK(contains(msg, "module 'layers' has no parameter 'w' (it has no parameters)"));
  CHECK_THROWS_AS(root->child(2), InvalidArgument);
  CHECK_THROWS_AS(root->param(1), InvalidArgument);
}

TEST_CASE("builder: callbacks by reference and by FQN") {
  auto root = build_model();
  std::vector<std::string> ran;
  Module& head = root->module("head");
  CHECK(!head.forward_callback());
  CHECK(!head.backward_callback());

  head.on_forward([&](Module& m) { ran.push_back("fwd " + m.fqn()); }).on_backward([&](Module& m) {
    ran.push_back("bwd " + m.fqn());
  });
  Module& r = root->on_forward("layers.0", [&](Module& m) { ran.push_back("fwd " + m.fqn()); });
  CHECK(&r == root.get());
  root->on_backward("layers.1", [&](Module& m) { ran.push_back("bwd " + m.fqn()); });

  for (Module* m : root->modules_preorder())
    if (m->forward_callback()) m->forward_callback()(*m);
  for (Module* m : root->modules_postorder())
    if (m->backward_callback()) m->backward_callback()(*m);
  CHECK(ran == std::vector<std::string>{"fwd layers.0", "fwd head", "bwd layers.1", "bwd head"});

  // A second call replaces; an empty callback removes.
  head.on_forward([&](Module&) { ran.push_back("second"); });
  head.forward_callback()(head);
  CHECK(ran.back() == "second");
  head.on_forward(Callback());
  CHECK(!head.forward_callback());

  const std::string msg =
      error_of<InvalidArgument>([&] { root->on_forward("layers.7", [](Module&) {}); });
  CHECK(contains(msg, "no submodule 'layers.7'"));
}

TEST_CASE("builder: name and shape errors") {
  auto root = build_model();
  Module& l0 = root->module("layers.0");

  std::string msg = error_of<InvalidArgument>([&] { l0.add_module(""); });
  CHECK(contains(msg, "module 'layers.0': cannot add a child module with an empty name"));
  msg = error_of<InvalidArgument>([&] { l0.add_module("a.b"); });
  CHECK(contains(msg, "module 'layers.0': invalid child module name 'a.b'"));
  msg = error_of<InvalidArgument>([&] { root->module("layers").add_module("1"); });
  CHECK(contains(msg, "module 'layers': cannot add child module '1'"));
  CHECK(contains(msg, "a child module of that name exists"));
  msg = error_of<InvalidArgument>([&] { l0.add_module("w1"); });
  CHECK(contains(msg, "module 'layers.0': cannot add child module 'w1'"));
  CHECK(contains(msg, "a parameter of that name exists"));

  msg = error_of<InvalidArgument>([&] { l0.add_param("", {1}); });
  CHECK(contains(msg, "module 'layers.0': cannot add a parameter with an empty name"));
  msg = error_of<InvalidArgument>([&] { l0.add_param("w.3", {1}); });
  CHECK(contains(msg, "module 'layers.0': invalid parameter name 'w.3'"));
  msg = error_of<InvalidArgument>([&] { l0.add_param("w2", {1}); });
  CHECK(contains(msg, "module 'layers.0': cannot add parameter 'w2'"));
  CHECK(contains(msg, "a parameter of that name exists"));
  msg = error_of<InvalidArgument>([&] { root->add_param("layers", {1}); });
  CHECK(contains(msg, "root module 'model': cannot add parameter 'layers'"));
  CHECK(contains(msg, "a child module of that name exists"));

  msg = error_of<InvalidArgument>([&] { l0.add_param("s", {}); });
  CHECK(contains(msg, "module 'layers.0': parameter 's' has a 0-d shape"));
  CHECK(contains(msg, "use shape (1,)"));
  msg = error_of<InvalidArgument>([&] { l0.add_param("n", {4, -1}); });
  CHECK(contains(msg, "module 'layers.0': parameter 'n' has shape (4, -1)"));
  CHECK(contains(msg, "negative extent -1 in dim 1"));

  CHECK(l0.add_param("empty", {0, 3}).shape() == Shape{0, 3});  // zero extents are fine
  CHECK(l0.num_params() == 3);                                  // failed adds added nothing
  CHECK(l0.num_children() == 0);
  CHECK_THROWS_AS(Module::make_root(""), InvalidArgument);

  // A request is typed: an int (which would convert to bool) does not compile.
  static_assert(can_set_request<bool>::value && can_set_request<ShardRequest>::value);
  static_assert(!can_set_request<int>::value && !can_set_request<std::string>::value);
  CHECK(l0.fully_shard_request() == nullptr);
  ShardRequest r;
  r.reshard_after_forward = false;
  l0.set_fully_shard_request(r);
  REQUIRE(l0.fully_shard_request() != nullptr);
  CHECK(l0.requests_fully_shard());
  CHECK(l0.fully_shard_request()->reshard_after_forward == ReshardAfterForward(false));
  l0.set_fully_shard_request(false);
  CHECK(!l0.requests_fully_shard());
  CHECK(*l0.fully_shard_request() == ShardRequest::never());
  l0.clear_fully_shard_request();
  CHECK(l0.fully_shard_request() == nullptr);
}

TEST_CASE("Parameter::init, set_data, set_grad, extension") {
  auto root = Module::make_root();
  Parameter& p = root->add_param("w", {2, 3}, DType::f64);
  CHECK(&p.init([](std::int64_t i) { return 0.5 * static_cast<double>(i); }) == &p);
  REQUIRE(p.data().defined());
  CHECK(p.data().shape() == Shape{2, 3});
  CHECK(p.data().dtype() == DType::f64);
  CHECK(p.data().space() == MemorySpace::host);
  for (std::int64_t i = 0; i < 6; ++i)
    CHECK(p.data().at(i) == 0.5 * static_cast<double>(i));

  Parameter& h = root->add_param("h", {3}, DType::bf16);
  h.init([](std::int64_t i) { return 1.0 + static_cast<double>(i); });
  CHECK(h.data().dtype() == DType::bf16);
  CHECK(h.data().at(2) == 3.0);

  // set_data checks nothing about the shape (the fsdp layer swaps shards in).
  p.set_data(Tensor::zeros({1, 3}, DType::f64));
  CHECK(p.data().shape() == Shape{1, 3});
  CHECK(p.shape() == Shape{2, 3});
  p.set_grad(Tensor::zeros({1, 3}, DType::f32));
  CHECK(p.grad().defined());
  p.set_grad(Tensor());
  CHECK(!p.grad().defined());

  CHECK(root->extension() == nullptr);
  root->extension() = std::make_shared<int>(7);
  CHECK(*static_cast<int*>(root->extension().get()) == 7);
}

TEST_CASE("JSON: the documented example") {
  auto root = parse_graph_json(kExample, "graph.json");
  CHECK(root->name() == "model");
  CHECK(is_true(root->fully_shard_request()));
  CHECK(fqns(root->modules_preorder()) ==
        std::vector<std::string>{"", "embed", "layers", "layers.0", "layers.1", "head"});
  CHECK(fqns(root->parameters()) ==
        std::vector<std::string>{"embed.weight", "layers.0.w1", "layers.0.w2", "layers.1.w1",
                                 "layers.1.w2", "head.weight", "head.bias"});
  CHECK(root->find_param("embed.weight").shape() == Shape{1000, 256});
  CHECK(root->find_param("layers.1.w2").shape() == Shape{256, 1024});
  CHECK(root->find_param("head.bias").shape() == Shape{10});
  for (Parameter* p : root->parameters()) {
    CHECK(p->dtype() == DType::f32);
    CHECK(p->requires_grad());
    CHECK(!p->data().defined());
  }

  const Module& embed = root->module("embed");
  CHECK(embed.fully_shard_request() == nullptr);
  CHECK(embed.cost().declared);
  CHECK(embed.cost().forward_ms == 0.2);
  CHECK(embed.cost().backward_ms == 0.4);
  CHECK(!root->module("head").cost().declared);
  CHECK(root->module("head").cost().forward_ms == 0.0);
  CHECK(root->module("layers").fully_shard_request() == nullptr);
  CHECK(is_true(root->module("layers.0").fully_shard_request()));
  CHECK(is_true(root->module("layers.1").fully_shard_request()));

  CHECK(root->json_path() == "");
  CHECK(embed.json_path() == "modules[0]");
  CHECK(root->module("layers.1").json_path() == "modules[1].modules[1]");
  CHECK(root->module("head").json_path() == "modules[2]");
}

TEST_CASE("JSON: defaults, options and parameter order") {
  auto root = parse_graph_json(R"({
    "params": {"z": {"shape": [3]}, "a": {"shape": [2, 2], "dtype": "bfloat16",
                                          "requires_grad": false}},
    "modules": [{"name": "blk", "fully_shard": {"reshard_after_forward": false},
                 "cost": {"backward_ms": 1.5},
                 "params": {"w2": {"shape": [4, 0]}, "w1": {"shape": [1]}}}]
  })");
  CHECK(root->name() == "model");
  CHECK(root->fully_shard_request() == nullptr);
  CHECK(root->param(0).name() == "z");
  CHECK(root->param(1).name() == "a");
  CHECK(root->param("a").dtype() == DType::bf16);
  CHECK(!root->param("a").requires_grad());
  const Module& blk = root->module("blk");
  CHECK(blk.param(0).fqn() == "blk.w2");  // declared first, stays first (not sorted)
  CHECK(blk.param(1).fqn() == "blk.w1");
  CHECK(blk.param(0).shape() == Shape{4, 0});
  ShardRequest keep;
  keep.reshard_after_forward = false;
  REQUIRE(blk.fully_shard_request() != nullptr);
  CHECK(*blk.fully_shard_request() == keep);
  CHECK(blk.cost().declared);
  CHECK(blk.cost().forward_ms == 0.0);
  CHECK(blk.cost().backward_ms == 1.5);
  CHECK(fqns(root->parameters()) == std::vector<std::string>{"z", "a", "blk.w2", "blk.w1"});

  const auto never = parse_graph_json(R"({"name": "net", "fully_shard": false})");
  REQUIRE(never->fully_shard_request() != nullptr);
  CHECK(*never->fully_shard_request() == ShardRequest::never());
}

TEST_CASE("JSON: round trip") {
  SUBCASE("the example") {
    auto a = parse_graph_json(kExample);
    const auto j = graph_document(*a);
    auto b = parse_graph_json(graph_to_json(*a, 2));
    check_same_tree(*a, *b);
    CHECK(graph_document(*b) == j);
    CHECK(graph_to_json(*b) == j.dump());
    CHECK(j.at("modules").at(2).at("params").begin().key() == "weight");
  }
  SUBCASE("a C++-built tree") {
    auto a = build_model();
    ShardRequest two;
    two.reshard_after_forward = ReshardAfterForward::group_size(2);
    two.param_dtype = DType::bf16;
    two.ignored_params = std::vector<std::string>{"w2"};
    two.offload_policy = CPUOffloadPolicy{false};
    two.compression = CompressionPolicy{kernels::QuantCode::fp8_e4m3, std::nullopt, 64};
    a->module("layers.0").set_fully_shard_request(two);
    ShardRequest none_offloaded;
    none_offloaded.offload_policy = std::optional<CPUOffloadPolicy>();
    none_offloaded.group_with = {"layers.0"};
    a->module("head").set_fully_shard_request(none_offloaded);
    a->set_fully_shard_request(true);
    a->module("layers.1").cost() = Cost{1.0, 2.5, true};
    a->module("layers.1").add_param("a", {1});  // after w1, w2
    auto b = parse_graph_json(graph_to_json(*a));
    check_same_tree(*a, *b);
    CHECK(b->module("layers.1").param(2).name() == "a");
    CHECK(b->module("layers.0").json_path() == "modules[0].modules[0]");
    nlohmann::json sorted = graph_document(*a);  // converts (keys sorted)
    CHECK(sorted.at("name") == "model");
  }
}

TEST_CASE("JSON: errors name the source and the JSON path") {
  SUBCASE("unknown keys") {
    check_json_error(R"({"modules": [{"name": "a"}, {"name": "b"}, {"name": "head",
        "params": {"bias": {"shpe": [10]}}}]})",
                     "modules[2].params.bias",
                     "unknown key 'shpe' (allowed: shape, dtype, requires_grad)");
    check_json_error(R"({"modules": [{"name": "a", "children": []}]})", "modules[0]",
                     "unknown key 'children' (allowed: name, params, modules, cost, fully_shard)");
    check_json_error(R"({"modules": [{"name": "a", "cost": {"fwd_ms": 1}}]})", "modules[0].cost",
                     "unknown key 'fwd_ms'");
    const std::string msg = json_error(R"({"nmae": "x"})");
    CHECK(contains(msg, "]: graph.json: unknown key 'nmae'"));
  }
  SUBCASE("shapes") {
    const char* const negative = R"({"modules": [{"name": "e"}, {"name": "layers", "modules": [
        {"name": "0", "params": {"w1": {"shape": [4, -3]}}}]}]})";
    check_json_error(negative, "modules[1].modules[0].params.w1.shape[1]",
                     "expected a non-negative integer, got -3");
    CHECK(contains(json_error(negative),
                   "graph.json: modules[1].modules[0].params.w1.shape[1]: expected a "
                   "non-negative integer, got -3"));
    check_json_error(R"({"params": {"w": {"shape": [2, "3"]}}})", "params.w.shape[1]",
                     "expected a non-negative integer, got \"3\"");
    check_json_error(R"({"params": {"w": {"shape": [2.5]}}})", "params.w.shape[0]", "got 2.5");
    check_json_error(R"({"params": {"w": {"shape": []}}})", "params.w.shape",
                     "expected at least one extent");
    check_json_error(R"({"params": {"w": {"shape": 4}}})", "params.w.shape",
                     "expected an array of non-negative integers, got 4");
    check_json_error(R"({"params": {"w": {"dtype": "f32"}}})", "params.w",
                     "missing required key 'shape'");
  }
  SUBCASE("types") {
    check_json_error(R"({"modules": [{"name": "a", "params": {"w": {"shape": [1],
        "dtype": "int8"}}}]})",
                     "modules[0].params.w.dtype", "unknown dtype 'int8'");
    check_json_error(R"({"params": {"w": {"shape": [1], "dtype": 16}}})", "params.w.dtype",
                     "expected a dtype name string, got 16");
    check_json_error(R"({"params": {"w": {"shape": [1], "requires_grad": "no"}}})",
                     "params.w.requires_grad", "expected true or false");
    check_json_error(R"({"modules": [{"name": "a", "fully_shard": "yes"}]})",
                     "modules[0].fully_shard",
                     "expected true, false or an object of options, got \"yes\"");
    check_json_error(R"({"fully_shard": 1})", "fully_shard", "got 1");
    check_json_error(R"({"modules": [{"name": "a", "cost": {"forward_ms": -1}}]})",
                     "modules[0].cost.forward_ms", "expected a non-negative number");
    check_json_error(R"({"modules": {"name": "a"}})", "modules", "expected an array");
    check_json_error(R"({"modules": [["a"]]})", "modules[0]", "expected a module object");
    check_json_error(R"({"params": [{"shape": [1]}]})", "params", "expected an object");
    check_json_error(R"({"params": {"w": [1]}})", "params.w", "expected an object");
    check_json_error(R"({"modules": [{"params": {}}]})", "modules[0]",
                     "missing required key 'name'");
    check_json_error(R"({"modules": [{"name": "a.b"}]})", "modules[0].name",
                     "invalid module name 'a.b'");
    check_json_error(R"({"modules": [{"name": 3}]})", "modules[0].name", "got 3");
    check_json_error(R"({"params": {"w.x": {"shape": [1]}}})", "params",
                     "invalid parameter name 'w.x'");
    check_json_error(R"({"name": ""})", "name", "root module name");
    CHECK(contains(json_error("[1, 2]"), "]: graph.json: expected a module object"));
  }
  SUBCASE("duplicates") {
    check_json_error(R"({"modules": [{"name": "e"}, {"name": "layers", "modules": [
        {"name": "0"}, {"name": "0"}]}]})",
                     "modules[1].modules[1]",
                     "duplicate module name '0' (also at modules[1].modules[0])");
    check_json_error(R"({"modules": [{"name": "a", "params": {"w1": {"shape": [1]},
        "w2": {"shape": [2]}, "w1": {"shape": [3]}}}]})",
                     "modules[0].params", "duplicate parameter name 'w1'");
    check_json_error(R"({"modules": [{"name": "a", "name": "b"}]})", "modules[0]",
                     "duplicate key 'name'");
    check_json_error(R"({"params": {"head": {"shape": [1]}}, "modules": [{"name": "x"},
        {"name": "head"}]})",
                     "modules[1]",
                     "module name 'head' is also a parameter name (also at "
                     "params.head)");
  }
  SUBCASE("invalid JSON") {
    const std::string msg = json_error("{\"modules\": [}");
    INFO(msg);
    CHECK(contains(msg, "]: graph.json: invalid JSON at byte 14"));
    CHECK(contains(msg, "parse error"));
    CHECK(contains(json_error(""), "graph.json: invalid JSON at byte"));
  }
  SUBCASE("default source name") {
    CHECK(contains(error_of<ConfigError>([] { parse_graph_json("{\"x\": 1}"); }),
                   "<string>: unknown key 'x'"));
  }
}

TEST_CASE("JSON: load_graph_json") {
  const std::string path = "test_graph_example.json";
  {
    std::ofstream out(path);
    out << kExample;
  }
  auto root = load_graph_json(path);
  CHECK(root->find_param("layers.0.w1").shape() == Shape{1024, 256});
  std::remove(path.c_str());

  const std::string missing = "no/such/dir/graph.json";
  const std::string msg = error_of<ConfigError>([&] { load_graph_json(missing); });
  CHECK(contains(msg, missing));
  CHECK(contains(msg, "cannot open"));

  {
    std::ofstream out(path);
    out << R"({"params": {"w": {"shape": [-1]}}})";
  }
  CHECK(contains(error_of<ConfigError>([&] { load_graph_json(path); }),
                 path + ": params.w.shape[0]: expected a non-negative integer, got -1"));
  std::remove(path.c_str());
}
