// The residual MLP's compute costs (apps/common/mlp_cost.hpp): the work counted from its code
// against hand-computed FLOPs and bytes, the declared costs of every module for given rates,
// the choice between measured module times and the FLOP model, the timing of the modules
// themselves, and a short calibration on every rank at once and one rank at a time (finite
// positive rates, the same on every rank, a JSON round trip). No timing is asserted.
#include <doctest/doctest.h>

#include <mpi.h>
#include <sched.h>

#include <cmath>
#include <string>

#include "error_check.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/comm/mpi_communicator.hpp"
#include "fullshard/schedule/compute_cost.hpp"
#include "fullshard/schedule/plan.hpp"
#include "mlp_cost.hpp"
#include "residual_mlp.hpp"

using namespace fullshard;
using fullshard::schedule::ComputeRates;
using fullshard::schedule::Gemm;

namespace {

double total_flops(const schedule::ModuleWork& w) {
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
  const std::string text = r.to_json();
  const std::uint64_t h = schedule::fnv1a64(text);
  std::uint64_t lo = h, hi = h;
  MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  CHECK(lo == hi);
  CHECK(ComputeRates::parse_json(text, ComputeRates{}) == r);
}

namespace {

/// The same text on every rank of MPI_COMM_WORLD.
bool same_everywhere(const std::string& text) {
  const std::uint64_t h = schedule::fnv1a64(text);
  std::uint64_t lo = h, hi = h;
  MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return lo == hi;
}

}  // namespace

TEST_CASE("mlp_cost: declare_costs takes the measured module times of the exact shape") {
  const apps::MlpShape s{16, 64, 4, 3};
  ComputeRates rates;
  rates.gemm = {{{10, 64, 64, false, true}, 20.0},
                {{10, 64, 64, false, false}, 16.0},
                {{64, 64, 10, true, false}, 8.0}};
  rates.elementwise_gb_per_s = 2.0;
  schedule::MeasuredModules m;
  m.model = apps::kResidualMlpModel;
  m.shape = apps::residual_mlp_key(s, 10);
  m.modules = {{"input", {0.5, 0.25}}, {"block", {3.0, 7.0}}, {"output", {0.75, 1.5}}};
  CHECK(m.shape == std::map<std::string, std::int64_t>{
                       {"rows", 10}, {"hidden", 64}, {"inputs", 16}, {"outputs", 4}});
  rates.module_times = {m};
  {
    apps::ResidualMlp model(s, 1);
    CHECK(apps::declare_costs(model, rates, 10) == apps::CostSource::measured_modules);
    for (int i = 0; i < 3; ++i) {
      const graph::Cost& c = model.root().module("blocks." + std::to_string(i)).cost();
      CHECK(c.declared);
      CHECK(c.forward_ms == 3.0);
      CHECK(c.backward_ms == 7.0);
    }
    CHECK(model.root().module("input").cost().forward_ms == 0.5);
    CHECK(model.root().module("input").cost().backward_ms == 0.25);
    CHECK(model.root().module("output").cost().forward_ms == 0.75);
    CHECK(model.root().module("output").cost().backward_ms == 1.5);
    CHECK_FALSE(model.root().cost().declared);
  }
  {
    // Other rows per rank (or another hidden size): the FLOP model, as without module times.
    apps::ResidualMlp model(s, 1), reference(s, 1);
    CHECK(apps::declare_costs(model, rates, 20) == apps::CostSource::flop_model);
    ComputeRates flop_only = rates;
    flop_only.module_times.clear();
    CHECK(apps::declare_costs(reference, flop_only, 20) == apps::CostSource::flop_model);
    const graph::Cost& c = model.root().module("blocks.1").cost();
    const graph::Cost& want = reference.root().module("blocks.1").cost();
    CHECK(c.forward_ms == want.forward_ms);
    CHECK(c.backward_ms == want.backward_ms);
    CHECK(c.forward_ms != 3.0);
    apps::ResidualMlp wider({16, 128, 4, 3}, 1);
    CHECK(apps::declare_costs(wider, rates, 10) == apps::CostSource::flop_model);
  }
  {
    // An entry of the shape without a module the model has: an error naming it.
    ComputeRates partial = rates;
    partial.module_times[0].modules.erase("block");
    apps::ResidualMlp model(s, 1);
    CHECK(fullshard::test::contains(
        fullshard::test::error_of<ConfigError>([&] { apps::declare_costs(model, partial, 10); }),
        "have no module 'block'"));
  }
}

TEST_CASE("mlp_cost: the modules' own code, timed on their own parameters") {
  const apps::MlpShape s{16, 64, 4, 3};
  const schedule::MeasuredModules m = apps::time_residual_mlp_modules(s, 12, 3, 1);
  CHECK(m.model == "residual_mlp");
  CHECK(m.shape == apps::residual_mlp_key(s, 12));
  CHECK(m.reps == 3);
  REQUIRE(m.modules.size() == 3);
  for (const char* name : {"input", "block", "output"}) {
    const schedule::ModuleTime& t = m.modules.at(name);
    CHECK(std::isfinite(t.forward_ms));
    CHECK(t.forward_ms > 0);
    CHECK(std::isfinite(t.backward_ms));
    CHECK(t.backward_ms > 0);
  }
  CHECK(fullshard::test::contains(
      fullshard::test::error_of<InvalidArgument>([&] { apps::time_residual_mlp_modules(s, 0, 3); }),
      "rows (0) must be in 1.."));
}

TEST_CASE("mlp_cost: the job's ranks per core") {
  const double rpc = apps::job_ranks_per_core(60.0);
  CHECK(rpc > 0);
  CHECK(same_everywhere(std::to_string(rpc)));
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size == 1) {  // one rank: 1 / the CPUs it may run on
    cpu_set_t set;
    CPU_ZERO(&set);
    REQUIRE(sched_getaffinity(0, sizeof(set), &set) == 0);
    CHECK(rpc == doctest::Approx(1.0 / CPU_COUNT(&set)));
  }
}

TEST_CASE("mlp_cost: a calibration with module times, one rank at a time") {
  auto world = comm::MpiCommunicator::duplicate(MPI_COMM_WORLD, "world", 60.0);
  apps::ComputeCalibration what;
  what.gemms = apps::residual_mlp_block_gemms(32, 8);
  what.elementwise_floats = 8 * 512;
  what.optimizer_elements = 4096;
  what.min_ms = 2.0;
  what.mlps = {{apps::MlpShape{16, 32, 4, 2}, 8}, {apps::MlpShape{16, 64, 4, 2}, 8}};
  what.module_reps = 3;
  what.ranks_per_core = 2.0;  // as with more ranks than cores: one rank after the other
  const ComputeRates r = apps::calibrate_compute(*world, what);
  CHECK(r.ranks_per_core == 2.0);
  CHECK(r.whole_core());
  REQUIRE(r.module_times.size() == 2);
  const schedule::MeasuredModules* m =
      r.measured_modules(apps::kResidualMlpModel, apps::residual_mlp_key({16, 64, 4, 2}, 8));
  REQUIRE(m != nullptr);
  CHECK(m->reps == 3);
  for (const auto& [name, t] : m->modules) {
    CHECK(t.forward_ms > 0);
    CHECK(t.backward_ms > 0);
  }
  CHECK(r.adamw_ns_per_element > 0);
  // The slowest rank's times on every rank: the same JSON everywhere, and it round-trips.
  const std::string text = r.to_json();
  CHECK(same_everywhere(text));
  CHECK(ComputeRates::parse_json(text, ComputeRates{}) == r);
}

TEST_CASE("mlp_cost: the scheduler slice") {
  const double slice = apps::scheduler_slice_ms();
  CHECK(std::isfinite(slice));
  CHECK(slice > 0);
  setenv("FULLSHARD_SCHED_SLICE_MS", "2.5", 1);
  CHECK(apps::scheduler_slice_ms() == 2.5);
  setenv("FULLSHARD_SCHED_SLICE_MS", "fast", 1);
  CHECK(fullshard::test::contains(
      fullshard::test::error_of<InvalidArgument>([] { apps::scheduler_slice_ms(); }),
      "FULLSHARD_SCHED_SLICE_MS: 'fast' is not a number of milliseconds > 0"));
  unsetenv("FULLSHARD_SCHED_SLICE_MS");
  CHECK(apps::scheduler_slice_ms() == slice);
}
