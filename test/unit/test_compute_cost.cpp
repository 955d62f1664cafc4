// Compute costs from work counts (schedule::ComputeRates): the rate lookup, the cost of a
// module's work against hand-computed values, the JSON form and its errors, and the serial
// step time of a plan against the sum of its ops computed by hand.
#include <doctest/doctest.h>

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
  Work fwd, bwd;
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
  const ComputeRates back = ComputeRates::parse_json(r.to_json().dump(), ComputeRates{});
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
  const Plan p = Scheduler::plan(*g, MeshShape{2, 1});
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
