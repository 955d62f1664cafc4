// Hostile and extreme graphs (issue 13): checked size arithmetic, nesting limits, names, large
// sibling counts, number overflow, and the cost model's strict JSON. Every case here crashed,
// hung, overflowed or was silently accepted before (docs/graph-format.md, "Limits").
#include <doctest/doctest.h>

#include "error_check.hpp"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "fullshard/base/checked.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/schedule/cost_model.hpp"
#include "fullshard/schedule/groups.hpp"
#include "fullshard/tensor/sharding.hpp"
#include "lib/graph/json_forms.hpp"

using namespace fullshard;
using namespace fullshard::graph;

namespace {

using fullshard::test::contains;
using fullshard::test::error_of;

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

std::string json_error(const std::string& text) {
  return error_of<ConfigError>([&] { parse_graph_json(text, "graph.json"); });
}

/// `n` modules nested in each other, the innermost with `inner` as extra keys.
std::string nested_modules(std::size_t n, const std::string& inner = "") {
  std::string s = "{\"name\": \"root\"";
  for (std::size_t i = 0; i < n; ++i)
    s += ", \"modules\": [{\"name\": \"m\"";
  s += inner;
  for (std::size_t i = 0; i < n; ++i)
    s += "}]";
  return s + "}";
}

std::string one_param(const std::string& shape, const std::string& dtype = "f32") {
  return R"({"modules": [{"name": "layer", "params": {"w": {"shape": )" + shape +
         R"(, "dtype": ")" + dtype + R"("}}}]})";
}

}  // namespace

TEST_CASE("checked arithmetic names its context and never wraps") {
  CHECK(checked_mul(std::int64_t{3}, std::int64_t{4}, "x") == 12);
  CHECK(checked_add(kMax - 1, std::int64_t{1}, "x") == kMax);
  CHECK(checked_mul(std::size_t{1} << 32, std::size_t{1} << 31, "x") == std::size_t{1} << 63);
  std::string msg = error_of<InvalidArgument>(
      [] { checked_mul(std::int64_t{3}, std::int64_t{3074457345618258603}, "ctx A"); });
  CHECK(contains(msg, "ctx A: 3 * 3074457345618258603 does not fit"));
  msg = error_of<InvalidArgument>([] { checked_add(kMax, std::int64_t{1}, std::string("ctx B")); });
  CHECK(contains(msg, "ctx B: 9223372036854775807 + 1 does not fit"));
  msg = error_of<InvalidArgument>(
      [] { checked_mul(std::size_t{1} << 32, std::size_t{1} << 32, "ctx C"); });
  CHECK(contains(msg, "ctx C: 4294967296 * 4294967296 does not fit in a 64-bit size"));
  CHECK_THROWS_AS(checked_add(~std::size_t{0}, std::size_t{1}, "x"), InvalidArgument);
  CHECK_THROWS_AS(checked_mul<ConfigError>(kMax, std::int64_t{2}, "x"), ConfigError);

  // A callable context is only built on overflow.
  int built = 0;
  const auto ctx = [&] {
    ++built;
    return std::string("lazy");
  };
  CHECK(checked_mul(std::int64_t{1} << 31, std::int64_t{1} << 31, ctx) == std::int64_t{1} << 62);
  CHECK(built == 0);
  CHECK(contains(error_of<InvalidArgument>([&] { checked_mul(kMax, std::int64_t{-2}, ctx); }),
                 "lazy: "));
  CHECK(built == 1);

  CHECK(checked_numel({2, 3, 4}, "s") == 24);
  CHECK(checked_numel({0, kMax, kMax}, "s") == 0);  // no elements: nothing overflows
  CHECK(contains(error_of<InvalidArgument>([] {
                   checked_numel({3, 3074457345618258603}, "p");
                 }),
                 "p: shape (3, 3074457345618258603) has more than 2^63-1 elements"));
  CHECK(contains(error_of<InvalidArgument>([] {
                   checked_numel({4294967296, 4294967296}, "p");
                 }),
                 "more than 2^63-1 elements"));
  CHECK(contains(error_of<InvalidArgument>([] {
                   checked_numel({0, -1}, "p");
                 }),
                 "p: shape (0, -1) has negative extent -1 in dim 1"));
}

TEST_CASE("checked_nbytes: the byte count must fit too") {
  CHECK(checked_nbytes({1 << 20, 4}, DType::bf16, "b") == (1 << 20) * 4 * 2);
  CHECK(checked_nbytes({std::int64_t{1} << 60}, DType::f32, "b") == std::int64_t{1} << 62);
  const std::string msg = error_of<InvalidArgument>([] {
    checked_nbytes({std::int64_t{1} << 61, 2}, DType::f32, "b");
  });
  CHECK(contains(msg,
                 "b: shape (2305843009213693952, 2) of f32 has 4611686018427387904 elements, "
                 "more than 2^63-1 bytes"));
}

TEST_CASE("overflowing shapes are refused where they enter, naming the parameter") {
  auto root = Module::make_root("model");
  Module& layer = root->add_module("layer");
  std::string msg = error_of<InvalidArgument>([&] {
    layer.add_param("w", {3, 3074457345618258603});
  });
  CHECK(contains(msg,
                 "module 'layer': parameter 'layer.w': shape (3, 3074457345618258603) has "
                 "more than 2^63-1 elements"));
  msg = error_of<InvalidArgument>([&] { layer.add_param("w", {4294967296, 4294967296}); });
  CHECK(contains(msg, "parameter 'layer.w'"));
  CHECK(contains(msg, "more than 2^63-1 elements"));
  // numel fits, numel * 8 bytes does not.
  msg =
      error_of<InvalidArgument>([&] { layer.add_param("w", {std::int64_t{1} << 61}, DType::f64); });
  CHECK(contains(msg, "parameter 'layer.w'"));
  CHECK(contains(msg, "more than 2^63-1 bytes"));
  CHECK(layer.num_params() == 0);
  CHECK(layer.add_param("w", {std::int64_t{1} << 60}, DType::f32).shape()[0] ==
        std::int64_t{1} << 60);  // 2^62 bytes: fits

  CHECK_THROWS_AS(Tensor::empty({3, 3074457345618258603}, DType::f32, MemorySpace::host, "t"),
                  InvalidArgument);
}

TEST_CASE("JSON: overflowing and negative shapes name the JSON path") {
  std::string msg = json_error(one_param("[3, 3074457345618258603]"));
  INFO(msg);
  CHECK(contains(msg,
                 "]: graph.json: modules[0].params.w.shape: shape (3, 3074457345618258603) "
                 "has more than 2^63-1 elements"));
  msg = json_error(one_param("[4294967296, 4294967296]"));
  CHECK(contains(msg, "graph.json: modules[0].params.w.shape: "));
  CHECK(contains(msg, "more than 2^63-1 elements"));
  msg = json_error(one_param("[1152921504606846976, 2]", "f64"));  // 2^61 elements of 8 bytes
  CHECK(contains(msg, "graph.json: modules[0].params.w.shape: "));
  CHECK(contains(msg, "more than 2^63-1 bytes"));
  msg = json_error(one_param("[2, -3]"));
  CHECK(contains(msg,
                 "graph.json: modules[0].params.w.shape[1]: expected a non-negative integer, "
                 "got -3"));
  msg = json_error(one_param("[18446744073709551615]"));
  CHECK(contains(msg, "graph.json: modules[0].params.w.shape[0]: expected a non-negative integer"));
}

TEST_CASE("sharding, group layouts and planned groups check their sizes") {
  // ceil(D / W) of a huge D used to compute D + W - 1, and the padded shards of all ranks
  // (W * chunk) exceed the tensor.
  std::string msg = error_of<InvalidArgument>(
      [] { shard_layout({kMax}, Placement::Shard(0), 3, 0, "parameter 'big'"); });
  CHECK(contains(msg, "parameter 'big'"));
  CHECK(contains(msg, "does not fit"));
  const ShardLayout ok = shard_layout({kMax - 2}, Placement::Shard(0), 3, 2, "p");
  CHECK(ok.chunk == (kMax - 2) / 3 + 1);
  CHECK(ok.local_rows == kMax - 2 - 2 * ok.chunk);
  CHECK_THROWS_AS(shard_layout({3, -1}, Placement::Shard(0), 1, 0, "p"), InvalidArgument);

  // Two members of 2^62 elements each: the group's arena has 2^63.
  const ShardLayout half = shard_layout({std::int64_t{1} << 62}, Placement::Shard(0), 1, 0, "h");
  msg = error_of<InvalidArgument>([&] { kernels::make_group_layout({half, half}); });
  CHECK(contains(msg, "make_group_layout: member 1"));
  CHECK(contains(msg, "does not fit"));

  // Bytes of a planned group (all-gather buffers, arenas) in the widest dtype.
  auto g = parse_graph_json(
      R"({"fully_shard": true, "params": {"w": {"shape": [1152921504606846976, 1]}}})", "g");
  msg = error_of<InvalidArgument>([&] { schedule::plan_groups(*g, 2); });
  CHECK(contains(msg, "fully_shard(<root>)"));
  CHECK(contains(msg, "does not fit"));
  // The same graph with a small parameter plans.
  auto small = parse_graph_json(R"({"fully_shard": true, "params": {"w": {"shape": [8, 4]}}})");
  const auto groups = schedule::plan_groups(*small, 2);
  REQUIRE(groups.size() == 1);
  CHECK(groups[0].gather_bytes() == 2 * 4 * 4 * 4);
}

TEST_CASE("nesting: modules nest at most kMaxModuleDepth levels") {
  // The deepest allowed graph loads, round-trips, and its deepest module knows its path.
  auto deep =
      parse_graph_json(nested_modules(kMaxModuleDepth, R"(, "params": {"w": {"shape": [2]}})"));
  Module* m = deep.get();
  while (m->num_children() > 0)
    m = &m->child(0);
  CHECK(m->depth() == kMaxModuleDepth);
  std::string want_path;
  std::string want_fqn;
  for (std::size_t i = 0; i < kMaxModuleDepth; ++i) {
    want_path += (i ? "." : "") + std::string("modules[0]");
    want_fqn += (i ? "." : "") + std::string("m");
  }
  CHECK(m->json_path() == want_path);
  CHECK(m->param(0).fqn() == want_fqn + ".w");
  auto again = parse_graph_json(graph_to_json(*deep));
  CHECK(again->modules_preorder().size() == kMaxModuleDepth + 1);

  // One level more is refused, naming (the ends of) the path of the offending "modules".
  std::string msg = json_error(nested_modules(kMaxModuleDepth + 1));
  INFO(msg);
  CHECK(contains(msg, "]: graph.json: modules[0].modules[0].modules[0].modules[0]"));
  CHECK(contains(msg, ".modules[0].(496 more levels).modules[0]"));
  CHECK(contains(msg,
                 "modules[0].modules[0].modules: modules nest more than 256 levels below the "
                 "root (the limit)"));
  // 12,000 levels used to overflow the stack (SIGSEGV): the same error, at the same place.
  CHECK(json_error(nested_modules(12000)) == msg);

  // The C++ API has the same limit.
  Module& leaf = *m;
  msg = error_of<InvalidArgument>([&] { leaf.add_module("x"); });
  CHECK(contains(msg,
                 "cannot add child module \"x\": modules nest at most 256 levels below the "
                 "root"));
  CHECK(leaf.num_children() == 0);
}

TEST_CASE("nesting: deep JSON values are refused before they are built") {
  // 50,000 nested objects inside fully_shard used to crash the conversion to nlohmann::json.
  std::string deep_object = R"({"name": "m", "fully_shard": )";
  for (int i = 0; i < 50000; ++i)
    deep_object += R"({"a": )";
  deep_object += "1";
  for (int i = 0; i < 50000; ++i)
    deep_object += "}";
  deep_object += "}";
  std::string msg = json_error(deep_object);
  INFO(msg);
  CHECK(contains(msg, "]: graph.json: fully_shard.a.a.a.a.a.a.a.(1008 more levels).a.a"));
  CHECK(contains(msg, ": objects and arrays nest more than 1024 levels deep (the limit)"));

  const std::string deep_array = std::string(100000, '[') + std::string(100000, ']');
  msg = json_error(deep_array);
  CHECK(contains(msg, "]: graph.json: [0][0][0]"));
  CHECK(contains(msg, "nest more than 1024 levels deep"));

  msg = error_of<ConfigError>([&] {
    schedule::CostModel::parse_json(
        deep_array, schedule::CostModel::defaults(schedule::MeshShape::fsdp(2)), "cost.json");
  });
  CHECK(contains(msg, "]: cost.json: [0][0]"));
  CHECK(contains(msg, "nest more than 64 levels deep"));
}

TEST_CASE("names: a documented character set, in JSON and in C++") {
  // A NUL used to truncate the printed plan silently.
  std::string msg = json_error(R"({"modules": [{"name": "m\u00001"}]})");
  INFO(msg);
  CHECK(contains(msg, R"(]: graph.json: modules[0].name: invalid module name "m\u00001": control )"
                      "character U+0000 at byte 1"));
  msg = json_error(R"({"params": {"w\u0007": {"shape": [1]}}})");
  CHECK(contains(msg, R"(graph.json: params: invalid parameter name "w\u0007": control character )"
                      "U+0007 at byte 1"));
  msg = json_error(R"({"modules": [{"name": "a b"}]})");
  CHECK(contains(msg, "modules[0].name: invalid module name 'a b': a space at byte 1"));
  msg = json_error(R"({"modules": [{"name": "x\u0085"}]})");  // C1 control (NEL)
  CHECK(contains(msg, "modules[0].name: invalid module name "));
  CHECK(contains(msg, "C1 control character at byte 1"));
  msg = json_error(R"({"name": "r\u001b[31m"})");
  CHECK(contains(msg, R"(graph.json: name: invalid root module name "r\u001b[31m")"));
  // An unknown key is printed escaped too (an escape sequence cannot reach the terminal).
  msg = json_error(R"({"modules": [{"name": "a", "x\u001b": 1}]})");
  CHECK(contains(msg, R"(modules[0]: unknown key "x\u001b")"));

  // Printable UTF-8 is fine, and a name of kMaxFqnBytes bytes; one byte more is not.
  auto ok =
      parse_graph_json(R"({"modules": [{"name": "größe", "params": {"Ω": {"shape": [1]}}}]})");
  CHECK(ok->find_param("größe.Ω").shape() == Shape{1});
  const std::string longest(kMaxFqnBytes, 'n');
  CHECK(parse_graph_json(R"({"modules": [{"name": ")" + longest + R"("}]})")->child(0).name() ==
        longest);
  msg = json_error(R"({"modules": [{"name": ")" + longest + R"(n"}]})");
  CHECK(contains(msg, "modules[0].name: invalid module name \"nnnn"));
  CHECK(contains(msg, "the name has 1025 bytes, more than 1024"));
  msg = json_error(R"({"modules": [{"name": "a", "modules": [{"name": ")" + longest + R"("}]}]})");
  CHECK(contains(msg, "modules[0].modules[0].name: the module"));
  CHECK(contains(msg, "would have a fully qualified name of 1026 bytes, more than 1024"));

  // The C++ API applies the same rule.
  auto root = Module::make_root("model");
  msg = error_of<InvalidArgument>([&] {
    root->add_module(
        std::string("m\0"
                    "1",
                    3));
  });
  CHECK(contains(msg, R"(root module 'model': invalid child module name "m\u00001": control )"
                      "character U+0000 at byte 1"));
  msg = error_of<InvalidArgument>([&] { root->add_param("\xff", {1}); });
  CHECK(contains(msg, R"(invalid parameter name "\xff": malformed UTF-8)"));
  msg = error_of<InvalidArgument>([&] { root->add_param("\xc0\xae", {1}); });  // overlong '.'
  CHECK(contains(msg, "malformed UTF-8"));
  msg = error_of<InvalidArgument>([&] { root->add_param("tab\t", {1}); });
  CHECK(contains(msg, R"("tab\u0009": control character U+0009 at byte 3)"));
  CHECK_THROWS_AS(Module::make_root(std::string("a\nb")), InvalidArgument);
  CHECK(root->num_params() == 0);
  CHECK(root->num_children() == 0);
  CHECK(name_problem("layers") == "");
  CHECK(name_problem("0") == "");
  CHECK(name_problem("µ") == "");
  CHECK(quoted_name(std::string("a\0\"\\\xe2\x82\xac\xff", 8)) == R"("a\u0000\"\\€\xff")");
}

TEST_CASE("many siblings and parameters load in order, duplicates found anywhere") {
  constexpr int kN = 5000;
  std::string text = R"({"params": {)";
  for (int i = 0; i < kN; ++i)
    text += (i ? ", " : "") + std::string("\"p") + std::to_string(i) + R"(": {"shape": [2]})";
  text += R"(}, "modules": [)";
  for (int i = 0; i < kN; ++i)
    text += (i ? ", " : "") + std::string(R"({"name": "m)") + std::to_string(i) + R"("})";
  text += "]}";
  auto g = parse_graph_json(text);
  REQUIRE(g->num_params() == static_cast<std::size_t>(kN));
  REQUIRE(g->num_children() == static_cast<std::size_t>(kN));
  CHECK(g->param(kN - 1).name() == "p" + std::to_string(kN - 1));
  CHECK(g->child(kN - 1).json_path() == "modules[" + std::to_string(kN - 1) + "]");
  // graph_to_json keeps the parameter order.
  const auto back = graph_document(*g);
  CHECK(std::next(back.at("params").begin(), kN - 1).key() == "p" + std::to_string(kN - 1));
  CHECK(parse_graph_json(back.dump())->num_params() == static_cast<std::size_t>(kN));

  // A duplicate key past the first few keys of an object (where the reader switches to a hash
  // set), and a duplicate module name far from the first.
  std::string dup = R"({"params": {)";
  for (int i = 0; i < 40; ++i)
    dup += "\"p" + std::to_string(i) + R"(": {"shape": [1]}, )";
  dup += R"("p3": {"shape": [1]}}})";
  CHECK(contains(json_error(dup), "graph.json: params: duplicate parameter name 'p3'"));
  std::string dupm = R"({"modules": [)";
  for (int i = 0; i < 40; ++i)
    dupm += std::string(R"({"name": "m)") + std::to_string(i) + R"("}, )";
  dupm += R"({"name": "m7"}]})";
  CHECK(contains(json_error(dupm),
                 "graph.json: modules[40]: duplicate module name 'm7' (also at modules[7])"));
}

TEST_CASE("number overflow names the file and the JSON path") {
  std::string msg = json_error(R"({"modules": [{"name": "a", "cost": {"forward_ms": 1e999}}]})");
  INFO(msg);
  CHECK(contains(msg, "]: graph.json: modules[0].cost.forward_ms: number out of range"));
  CHECK(contains(msg, "1e999"));
  msg = json_error(R"({"params": {"w": {"shape": [1, -1e400]}}})");
  CHECK(contains(msg, "graph.json: params.w.shape[1]: number out of range"));

  const auto base = schedule::CostModel::defaults(schedule::MeshShape::fsdp(2));
  msg = error_of<ConfigError>([&] {
    schedule::CostModel::parse_json(R"({"all_gather": {"shard": {"alpha_ms": 1e999}}})", base,
                                    "cost.json");
  });
  CHECK(contains(msg, "]: cost.json: all_gather.shard.alpha_ms: number out of range"));
}

TEST_CASE("cost model JSON refuses duplicate keys like the graph loader") {
  const auto base = schedule::CostModel::defaults(schedule::MeshShape::fsdp(2));
  const auto err = [&](const std::string& text) {
    return error_of<ConfigError>([&] { schedule::CostModel::parse_json(text, base, "cost.json"); });
  };
  CHECK(contains(err(R"({"copy_gb_per_s": 5, "copy_gb_per_s": 7})"),
                 "]: cost.json: duplicate key 'copy_gb_per_s'"));
  CHECK(contains(err(R"({"all_gather": {"shard": {"alpha_ms": 1, "alpha_ms": 2}}})"),
                 "]: cost.json: all_gather.shard: duplicate key 'alpha_ms'"));
  CHECK(contains(err(R"({"all_gather": {"shard": {}, "shard": {}}})"),
                 "]: cost.json: all_gather: duplicate key 'shard'"));
  CHECK(contains(err(R"({"all_gather": )"), "]: cost.json: invalid JSON at byte"));
  // Without duplicates the values are read.
  const auto c = schedule::CostModel::parse_json(R"({"copy_gb_per_s": 7})", base, "cost.json");
  CHECK(c.copy_gb_per_s() == 7.0);
}
