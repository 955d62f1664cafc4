// The residual MLP's compute costs (apps/common/mlp_cost.hpp): the work counted from its code
// against hand-computed FLOPs and bytes, the declared costs of every module for given rates,
// and a short calibration on every rank at once (finite positive rates, the same on every
// rank, a JSON round trip).
#include <doctest/doctest.h>

#include <mpi.h>

#include <cmath>
#include <string>

#include "fullshard/comm/mpi_communicator.hpp"
#include "fullshard/schedule/compute_cost.hpp"
#include "fullshard/schedule/plan.hpp"
#include "mlp_cost.hpp"
#include "residual_mlp.hpp"

using namespace fullshard;
using fullshard::schedule::ComputeRates;
using fullshard::schedule::Gemm;

namespace {

double total_flops(const schedule::Work& w) {
  double f = 0;
  for (const Gemm& g : w.gemms)
    f += g.flops();
  return f;
}

}  // namespace

TEST_CASE("mlp_cost: the work of each module, counted by hand") {
  const apps::MlpShape s{16, 64, 4, 3};  // inputs, hidden, outputs, blocks
  const std::int64_t r = 10;
  const apps::MlpWork w = apps::residual_mlp_work(s, r);
  // A block: forward h W1^T and relu(a) W2^T (2 x 2 r H H), backward dW2, d_a, dW1, d_h.
  CHECK(total_flops(w.block_forward) == 2 * 2.0 * 10 * 64 * 64);   // 163,840
  CHECK(total_flops(w.block_backward) == 4 * 2.0 * 10 * 64 * 64);  // 327,680
  CHECK(w.block_forward.gemms[0] == Gemm{10, 64, 64, false, true});
  CHECK(w.block_backward.gemms[0] == Gemm{64, 64, 10, true, false});
  CHECK(w.block_backward.gemms[1] == Gemm{10, 64, 64, false, false});
  CHECK(w.block_forward.elementwise_bytes == 7.0 * 4 * 10 * 64);   // 17,920
  CHECK(w.block_backward.elementwise_bytes == 6.0 * 4 * 10 * 64);  // 15,360
  CHECK(total_flops(w.input_forward) == 2.0 * 10 * 64 * 16);
  CHECK(total_flops(w.input_backward) == 2.0 * 64 * 16 * 10);  // no input gradient
  CHECK(total_flops(w.output_forward) == 2.0 * 10 * 4 * 64);
  CHECK(total_flops(w.output_backward) == 2.0 * (4 * 64 * 10 + 10 * 64 * 4));
  CHECK(w.output_forward.elementwise_bytes == 4.0 * 4 * 10 * 4);
  // No rows: no GEMM, no bytes.
  const apps::MlpWork none = apps::residual_mlp_work(s, 0);
  CHECK(none.block_forward.gemms.empty());
  CHECK(none.block_forward.elementwise_bytes == 0.0);
  CHECK(apps::residual_mlp_block_gemms(64, 10) == std::vector<Gemm>{{10, 64, 64, false, true},
                                                                    {10, 64, 64, false, false},
                                                                    {64, 64, 10, true, false}});
}

TEST_CASE("mlp_cost: declare_costs gives every module the FLOP formula's milliseconds") {
  const apps::MlpShape s{16, 64, 4, 3};
  apps::ResidualMlp model(s, 1);
  ComputeRates rates;
  rates.gemm = {{{10, 64, 64, false, true}, 20.0},  // 20 GFLOP/s
                {{10, 64, 64, false, false}, 16.0},
                {{64, 64, 10, true, false}, 8.0}};
  rates.elementwise_gb_per_s = 2.0;
  apps::declare_costs(model, rates, 10);
  const graph::Cost& c = model.root().module("blocks.2").cost();
  // Hand-computed: forward 2 x 81,920 flop at 20 GFLOP/s + 17,920 B at 2 GB/s;
  // backward 2 x 81,920 at 8 + 2 x 81,920 at 16 + 15,360 B at 2 GB/s.
  CHECK(c.declared);
  CHECK(c.forward_ms == doctest::Approx(0.008192 + 0.00896).epsilon(1e-12));
  CHECK(c.backward_ms == doctest::Approx(0.02048 + 0.01024 + 0.00768).epsilon(1e-12));
  const graph::Cost& in = model.root().module("input").cost();
  CHECK(in.declared);
  CHECK(in.forward_ms > 0);
  CHECK(model.root().module("output").cost().backward_ms > 0);
  CHECK_FALSE(model.root().cost().declared);  // the root itself runs nothing
}

TEST_CASE("mlp_cost: a short calibration on every rank at once") {
  auto world = comm::MpiCommunicator::duplicate(MPI_COMM_WORLD, "world", 60.0);
  apps::ComputeCalibration what;
  what.gemms = apps::residual_mlp_block_gemms(32, 8);
  what.elementwise_floats = 8 * 512;
  what.optimizer_elements = 4096;
  what.min_ms = 2.0;
  const ComputeRates r = apps::calibrate_compute(*world, what);
  CHECK(r.ranks == world->size());
  REQUIRE(r.gemm.size() == 3);
  for (const auto& g : r.gemm) {
    CHECK(std::isfinite(g.gflop_per_s));
    CHECK(g.gflop_per_s > 0);
  }
  CHECK(r.gemm[2].shape == Gemm{32, 32, 8, true, false});
  CHECK(r.elementwise_gb_per_s > 0);
  CHECK(r.adamw_ns_per_element > 0);
  CHECK(r.sgd_ns_per_element > 0);
  // Every rank got the slowest rank's numbers: the same JSON everywhere.
  const std::string text = r.to_json().dump();
  const std::uint64_t h = schedule::fnv1a64(text);
  std::uint64_t lo = h, hi = h;
  MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  CHECK(lo == hi);
  CHECK(ComputeRates::parse_json(text, ComputeRates{}) == r);
}
