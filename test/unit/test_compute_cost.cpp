// Compute costs from work counts (schedule::ComputeRates): the rate lookup, the cost of a
// module's work against hand-computed values, the JSON form and its errors, and the serial
// step time of a plan against the sum of its ops computed by hand.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "error_check.hpp"

#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "fullshard/schedule/compute_cost.hpp"
#include "fullshard/schedule/plan.hpp"

using namespace fullshard;
using namespace fullshard::schedule;
using fullshard::test::contains;
using fullshard::test::error_of;

namespace {

ComputeRates sample_rates() {
  ComputeRates r;
  r.gemm = {{{256, 512, 512, false, true}, 80.0},
            {{256, 512, 512, false, false}, 70.0},
            {{512, 512, 256, true, false}, 60.0},
            {{64, 1024, 1024, false, true}, 50.0}};
  r.default_gemm_gflop_per_s = 10.0;
  r.elementwise_gb_per_s = 8.0;
  r.adamw_ns_per_element = 4.0;
  r.sgd_ns_per_element = 2.5;
  r.ranks = 2;
  return r;
}

}  // namespace

TEST_CASE("compute_cost: GEMM shapes parse and print") {
  const Gemm g = Gemm::parse("256x512x64:TN");
  CHECK(g.m == 256);
  CHECK(g.n == 512);
  CHECK(g.k == 64);
  CHECK(g.trans_a);
  CHECK_FALSE(g.trans_b);
  CHECK(g.flops() == doctest::Approx(2.0 * 256 * 512 * 64));
  CHECK(g.to_string() == "256x512x64:TN");
  CHECK(Gemm::parse("3x4x5") == Gemm{3, 4, 5, false, false});
  CHECK(contains(error_of<InvalidArgument>([] { Gemm::parse("3x4", "--gemm"); }),
                 "--gemm: '3x4' is not a GEMM shape"));
  CHECK(contains(error_of<InvalidArgument>([] { Gemm::parse("3x4x5:NX", "--gemm"); }),
                 "two letters N or T"));
  CHECK(contains(error_of<InvalidArgument>([] { Gemm::parse("0x4x5", "--gemm"); }),
                 "size 0 is not in 1.."));
}

TEST_CASE("compute_cost: rate lookup (exact, nearest with the same transposes, default)") {
  const ComputeRates r = sample_rates();
  CHECK(r.gemm_gflop_per_s({256, 512, 512, false, true}) == 80.0);
  CHECK(r.gemm_gflop_per_s({256, 512, 512, false, false}) == 70.0);
  // Nearest NT shape to 128x1024x1024: 64x1024x1024 (log distance log 2) beats 256x512x512
  // (log 2 + 2 log 2).
  CHECK(r.gemm_gflop_per_s({128, 1024, 1024, false, true}) == 50.0);
  // No TT shape measured: the nearest of any transposes (256x512x512:NT is at distance 0).
  CHECK(r.gemm_gflop_per_s({256, 512, 512, true, true}) == 80.0);
  ComputeRates none;
  none.default_gemm_gflop_per_s = 12.5;
  CHECK(none.gemm_gflop_per_s({8, 8, 8, false, false}) == 12.5);
}

TEST_CASE("compute_cost: a module's cost is its GEMMs' FLOPs and its bytes at the rates") {
  const ComputeRates r = sample_rates();
  // A block of the residual MLP at 256 rows, hidden 512: forward 2 NT GEMMs and 7 passes of
  // 256 x 512 floats; backward 2 TN + 2 NN GEMMs and 6 passes.
  ModuleWork fwd, bwd;
  fwd.gemms = {{256, 512, 512, false, true}, {256, 512, 512, false, true}};
  fwd.elementwise_bytes = 7.0 * 4 * 256 * 512;
  bwd.gemms = {{512, 512, 256, true, false},
               {256, 512, 512, false, false},
               {512, 512, 256, true, false},
               {256, 512, 512, false, false}};
  bwd.elementwise_bytes = 6.0 * 4 * 256 * 512;
  const double gemm_flop = 2.0 * 256 * 512 * 512;  // 134,217,728 per GEMM
  // Hand-computed: ms = flop / (GFLOP/s * 1e6) + bytes / (GB/s * 1e6).
  const double fwd_ms = 2 * gemm_flop / 80e6 + 7.0 * 4 * 256 * 512 / 8e6;  // 3.355 + 0.459
  const double bwd_ms = 2 * gemm_flop / 60e6 + 2 * gemm_flop / 70e6 +      // 4.474 + 3.835
                        6.0 * 4 * 256 * 512 / 8e6;                         // + 0.393
  CHECK(fwd_ms == doctest::Approx(3.81420).epsilon(1e-5));
  CHECK(bwd_ms == doctest::Approx(8.70193).epsilon(1e-5));
  const graph::Cost c = cost_from_work(r, fwd, bwd);
  CHECK(c.declared);
  CHECK(c.forward_ms == doctest::Approx(fwd_ms).epsilon(1e-12));
  CHECK(c.backward_ms == doctest::Approx(bwd_ms).epsilon(1e-12));
  CHECK(r.optimizer_ms("adamw", 1e6) == doctest::Approx(4.0));
  CHECK(r.optimizer_ms("sgd", 2e6) == doctest::Approx(5.0));
  CHECK(contains(error_of<InvalidArgument>([&] { r.optimizer_ms("lion", 1); }),
                 "unknown optimizer 'lion'"));
}

TEST_CASE("compute_cost: JSON round trip, partial files, errors naming the key") {
  const ComputeRates r = sample_rates();
  const ComputeRates back = ComputeRates::parse_json(r.to_json(), ComputeRates{});
  CHECK(back == r);
  // Keys present replace the base's, others stay.
  const ComputeRates partial =
      ComputeRates::parse_json(R"({"elementwise_gb_per_s": 3.5})", r, "compute.json");
  CHECK(partial.elementwise_gb_per_s == 3.5);
  CHECK(partial.gemm.size() == r.gemm.size());
  CHECK(partial.adamw_ns_per_element == r.adamw_ns_per_element);

  auto err = [&](const std::string& text) {
    return error_of<ConfigError>([&] { ComputeRates::parse_json(text, r, "compute.json"); });
  };
  CHECK(contains(err(R"({"elementwise_gbps": 1})"),
                 "compute.json: elementwise_gbps: unknown key 'elementwise_gbps'"));
  CHECK(contains(err(R"({"elementwise_gb_per_s": 0})"),
                 "compute.json: elementwise_gb_per_s: expected a finite number > 0, got 0"));
  CHECK(contains(err(R"({"adamw_ns_per_element": -1})"),
                 "compute.json: adamw_ns_per_element: expected a finite number >= 0, got -1"));
  CHECK(contains(err(R"({"ranks": 0})"), "compute.json: ranks: expected an integer >= 1"));
  CHECK(contains(err(R"({"gemm": {}})"), "compute.json: gemm: expected an array"));
  CHECK(contains(err(R"({"gemm": [{"shape": "1x2x3", "gflop_per_s": 5}, {"shape": "1x2"}]})"),
                 "compute.json: gemm[1].shape: '1x2' is not a GEMM shape"));
  CHECK(contains(err(R"({"gemm": [{"shape": "1x2x3"}]})"),
                 "compute.json: gemm[0]: missing key 'gflop_per_s'"));
  CHECK(contains(err(R"({"gemm": [{"shape": "1x2x3", "gflops": 1}]})"),
                 "compute.json: gemm[0].gflops: unknown key 'gflops'"));
  CHECK(contains(err(R"({"gemm": [{"shape": "1x2x3", "gflop_per_s": "fast"}]})"),
                 "compute.json: gemm[0].gflop_per_s: expected a number"));
  CHECK(contains(err("[1]"), "compute.json: (top level): expected an object"));
  CHECK(contains(err("{"), "compute.json"));
  CHECK(contains(error_of<ConfigError>(
                     [] { ComputeRates::load_json("/nonexistent/compute.json", ComputeRates{}); }),
                 "/nonexistent/compute.json: cannot read the compute calibration file"));
}

TEST_CASE("compute_cost: serial_step_ms is the sum of the plan's op times") {
  // Two modules with declared costs in one group each plus the root, on 2 ranks: the sum
  // of every op's duration, computed here from the ops, and at least the declared compute
  // and at least the overlapped step.
  auto g = graph::parse_graph_json(R"({"name": "model", "fully_shard": true, "modules": [
      {"name": "a", "fully_shard": true, "cost": {"forward_ms": 1.5, "backward_ms": 3},
       "params": {"w": {"shape": [1024, 256]}}},
      {"name": "b", "fully_shard": true, "cost": {"forward_ms": 0.5, "backward_ms": 1},
       "params": {"w": {"shape": [256, 256]}}}]})",
                                   "graph.json");
  const Plan p = Scheduler::plan(*g, MeshShape::fsdp(2));
  double sum = 0.0, compute = 0.0;
  for (const Op& op : p.ops) {
    sum += op.end_ms - op.start_ms;
    if (op.kind == OpKind::forward || op.kind == OpKind::backward)
      compute += op.end_ms - op.start_ms;
  }
  CHECK(compute == doctest::Approx(6.0));
  CHECK(serial_step_ms(p) == doctest::Approx(sum).epsilon(1e-12));
  CHECK(serial_step_ms(p) > compute);
  CHECK(serial_step_ms(p) >= p.step_ms - 1e-9);
}

namespace {

MeasuredModules sample_modules(std::int64_t rows) {
  MeasuredModules m;
  m.model = "residual_mlp";
  m.shape = {{"rows", rows}, {"hidden", 512}, {"inputs", 32}, {"outputs", 8}};
  m.modules = {{"input", {0.125, 0.0625}}, {"block", {2.5, 5.25}}, {"output", {0.25, 0.375}}};
  m.reps = 9;
  return m;
}

}  // namespace

TEST_CASE("compute_cost: measured module times round trip and are looked up by exact shape") {
  ComputeRates r = sample_rates();
  r.ranks_per_core = 2.0;
  r.module_times = {sample_modules(256), sample_modules(64)};
  const nlohmann::json j = nlohmann::json::parse(r.to_json());
  // The documented form (docs/plan-format.md).
  CHECK(j.at("ranks_per_core") == 2.0);
  CHECK(j.at("module_times")[1].at("shape").at("rows") == 64);
  CHECK(j.at("module_times")[0].at("modules").at("block").at("backward_ms") == 5.25);
  CHECK(j.at("module_times")[0].at("reps") == 9);
  const ComputeRates back = ComputeRates::parse_json(j.dump(), ComputeRates{});
  CHECK(back == r);
  CHECK(back.whole_core());
  // Lookup: exact model and shape only.
  const MeasuredModules* m = back.measured_modules("residual_mlp", sample_modules(64).shape);
  REQUIRE(m != nullptr);
  CHECK(m->modules.at("block").forward_ms == 2.5);
  CHECK(m->shape.at("rows") == 64);
  auto other = sample_modules(64).shape;
  other["hidden"] = 1024;
  CHECK(back.measured_modules("residual_mlp", other) == nullptr);
  other = sample_modules(64).shape;
  other.erase("outputs");
  CHECK(back.measured_modules("residual_mlp", other) == nullptr);
  CHECK(back.measured_modules("transformer", sample_modules(64).shape) == nullptr);
  // A file without the new keys (written before them) still loads: no module times, the
  // ranks per core not recorded, so its rates are not taken for a whole core's.
  const ComputeRates old = ComputeRates::parse_json(
      R"({"gemm": [], "default_gemm_gflop_per_s": 50, "elementwise_gb_per_s": 20,
          "adamw_ns_per_element": 6, "sgd_ns_per_element": 2, "ranks": 4})",
      ComputeRates{}, "old.json");
  CHECK(old.module_times.empty());
  CHECK(old.ranks_per_core == 0.0);
  CHECK_FALSE(old.whole_core());
  CHECK(old.measured_modules("residual_mlp", sample_modules(64).shape) == nullptr);
  CHECK(old.default_gemm_gflop_per_s == 50.0);
}

TEST_CASE("compute_cost: module_times errors name the JSON path") {
  const ComputeRates r = sample_rates();
  auto err = [&](const std::string& text) {
    return error_of<ConfigError>([&] { ComputeRates::parse_json(text, r, "compute.json"); });
  };
  const std::string ok_entry =
      R"({"model": "residual_mlp", "shape": {"rows": 64}, "modules": {"block": )"
      R"({"forward_ms": 1, "backward_ms": 2}}})";
  CHECK(
      ComputeRates::parse_json(R"({"module_times": [)" + ok_entry + "]}", r).module_times.size() ==
      1);
  CHECK(contains(err(R"({"module_times": {}})"), "compute.json: module_times: expected an array"));
  CHECK(contains(err(R"({"module_times": [3]})"),
                 "compute.json: module_times[0]: expected an object, got 3"));
  CHECK(contains(err(R"({"module_times": [{"shape": {}, "modules": {}}]})"),
                 "compute.json: module_times[0].modules: expected at least one module"));
  CHECK(contains(err(R"({"module_times": [{"shape": {"rows": 1}, "modules": )"
                     R"({"b": {"forward_ms": 1, "backward_ms": 1}}}]})"),
                 "compute.json: module_times[0]: missing key 'model'"));
  CHECK(contains(err(R"({"module_times": [{"model": "m", "modules": )"
                     R"({"b": {"forward_ms": 1, "backward_ms": 1}}}]})"),
                 "compute.json: module_times[0]: missing key 'shape'"));
  CHECK(contains(err(R"({"module_times": [{"model": "", "shape": {}}]})"),
                 "compute.json: module_times[0].model: expected a non-empty string"));
  CHECK(contains(err(R"({"module_times": [{"model": "m", "shape": {"rows": 0}}]})"),
                 "compute.json: module_times[0].shape.rows: expected an integer >= 1, got 0"));
  CHECK(contains(err(R"({"module_times": [{"model": "m", "shape": {"rows": 2.5}}]})"),
                 "compute.json: module_times[0].shape.rows: expected an integer >= 1, got 2.5"));
  CHECK(contains(err(R"({"module_times": [{"model": "m", "shape": [64]}]})"),
                 "compute.json: module_times[0].shape: expected an object"));
  CHECK(contains(err(R"({"module_times": [{"model": "m", "shape": {}, "modules": )"
                     R"({"block": {"forward_ms": -1, "backward_ms": 2}}}]})"),
                 "compute.json: module_times[0].modules.block.forward_ms: expected a finite "
                 "number >= 0, got -1"));
  CHECK(contains(err(R"({"module_times": [{"model": "m", "shape": {}, "modules": )"
                     R"({"block": {"forward_ms": 1}}}]})"),
                 "compute.json: module_times[0].modules.block: missing key 'backward_ms'"));
  CHECK(contains(err(R"({"module_times": [{"model": "m", "shape": {}, "modules": )"
                     R"({"block": {"forward_ms": 1, "backward_ms": 1, "fwd": 1}}}]})"),
                 "compute.json: module_times[0].modules.block.fwd: unknown key 'fwd'"));
  CHECK(contains(err(R"({"module_times": [{"model": "m", "shape": {}, "modules": )"
                     R"({"block": 7}}]})"),
                 "compute.json: module_times[0].modules.block: expected an object, got 7"));
  CHECK(contains(err(R"({"module_times": [{"model": "m", "shape": {}, "mods": {}}]})"),
                 "compute.json: module_times[0].mods: unknown key 'mods'"));
  CHECK(contains(err(R"({"module_times": [)" + ok_entry + ", {\"model\": \"m\", \"shape\": {}, " +
                     R"("modules": {"b": {"forward_ms": 1, "backward_ms": 1}}, "reps": 0}]})"),
                 "compute.json: module_times[1].reps: expected an integer >= 1, got 0"));
  CHECK(contains(err(R"({"module_times": [)" + ok_entry + ", " + ok_entry + "]}"),
                 "compute.json: module_times[1]: a second entry for model 'residual_mlp' at the "
                 "same shape"));
  CHECK(contains(err(R"({"ranks_per_core": -1})"),
                 "compute.json: ranks_per_core: expected a finite number >= 0, got -1"));
  CHECK(contains(err(R"({"ranks_per_core": "2"})"),
                 "compute.json: ranks_per_core: expected a number"));
}

TEST_CASE(
    "compute_cost: core_wait_ms: core-mates' optimizer, modules beyond a slice or collectives") {
  // 4 ranks on 2 cores, slice 1.5 ms: modules of 1, 1 and 4 ms. Beyond the slice: 2.5 ms;
  // within: 1 + 1 + 1.5 = 3.5 ms, which fits into 50 ms of collectives; the optimizer adds.
  const std::vector<double> mods = {1.0, 1.0, 4.0};
  CHECK(core_wait_ms(2.0, mods, 50.0, 8.0, 1.5) == doctest::Approx(8.0 + 2.5));
  // Only 1 ms of collectives: 2.5 ms of the within-slice part does not fit.
  CHECK(core_wait_ms(2.0, mods, 1.0, 8.0, 1.5) == doctest::Approx(8.0 + 2.5 + 2.5));
  // 3 ranks on 2 cores: half a core-mate per rank.
  CHECK(core_wait_ms(1.5, mods, 0.0, 8.0, 1.5) == doctest::Approx(0.5 * (8.0 + 2.5) + 1.75));
  // A slice of 0: every module shares the core (the whole module time adds).
  CHECK(core_wait_ms(2.0, mods, 50.0, 8.0, 0.0) == doctest::Approx(8.0 + 6.0));
  CHECK(core_wait_ms(1.0, mods, 0.0, 8.0, 1.5) == 0.0);  // a core per rank
  CHECK(core_wait_ms(0.5, mods, 0.0, 8.0, 1.5) == 0.0);  // fewer ranks than cores
  CHECK(core_wait_ms(0.0, mods, 0.0, 8.0, 1.5) == 0.0);  // not recorded
}
