// fullshard-bench-predict: the training session's predicted step (Session::plan()) against
// the measured one, for LibTorch models: with the default module costs (what the plan knows
// at creation: communication and copies) and after the calibration steps (the modules'
// measured compute and the optimizer's step, sharding.calibrate_steps).
//
//   predict/mlp   the residual MLP of fullshard-bench-capi (64 inputs, 512 wide, 4 blocks,
//                 16 outputs; AdamW), 128 rows per rank
//   predict/gpt   the session's GPT (vocab 256, context 128, d_model 128, 4 heads, 2 layers;
//                 AdamW), 8 sequences of 129 tokens per rank
//   predict/heat  heat-fortran's surrogate (mlp 10 -> 64 -> 64 -> 1, tanh; AdamW), 1024 rows
//                 per rank (its 64 x 64 grid over 4 ranks)
// Each runs one step, the calibration steps (sharding.calibrate_steps, 10), then the timed steps
// (manual time: the slowest rank's step). Counters: measured_ms (median), default_ms and
// predicted_ms (the plan's step before and after the calibration), error_pct ((predicted -
// measured) / measured) and default_error_pct (the same for default_ms), optimizer_ms (the measured
// optimizer step inside predicted_ms), comm_scale (the measured collectives over the cost model's:
// the plan's communication is scaled by it).
//
// Launch: mpiexec -n 2 build/bench/fullshard-bench-predict [--benchmark_* flags]
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "fullshard/fullshard.hpp"
#include "fullshard/session/session.hpp"
#include "mpi_bench.hpp"

namespace {

namespace fs = fullshard;
using fs::bench::median;
namespace ss = fullshard::session;
using fs::bench::die;

struct Case {
  std::string config;
  std::vector<torch::Tensor> inputs, targets;
};

Case mlp() {
  return {R"({"model": {"type": "residual_mlp", "inputs": 64, "hidden": 512, "outputs": 16,
              "blocks": 4}, "optimizer": {"type": "adamw", "lr": 0.001}})",
          {torch::randn({128, 64})},
          {torch::randn({128, 16})}};
}

Case heat() {
  return {R"({"model": {"type": "mlp", "inputs": 10, "hidden": [64, 64], "outputs": 1,
              "activation": "tanh"}, "optimizer": {"type": "adamw", "lr": 0.003}})",
          {torch::randn({1024, 10})},
          {torch::randn({1024, 1})}};
}

Case gpt() {
  return {R"({"model": {"type": "gpt"}, "optimizer": {"type": "adamw", "lr": 0.001}})",
          {torch::randint(0, 256, {8, 129}, torch::kLong)},
          {}};
}

void bench_predict(benchmark::State& state, const fs::DeviceMesh* mesh, Case (*make)()) {
  try {
    const Case c = make();
    ss::Session s(*mesh, ss::parse_config(c.config, "bench"));
    const ss::PlanPrediction before = s.plan();
    double sink = 0;
    for (int i = 0; i <= s.config().sharding.calibrate_steps; ++i)
      sink += s.train_step(c.inputs, c.targets);
    const ss::PlanPrediction after = s.plan();
    std::vector<double> t;
    for (auto _ : state) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      sink += s.train_step(c.inputs, c.targets);
      double dt = MPI_Wtime() - t0, slowest = 0;
      MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      state.SetIterationTime(slowest);
      t.push_back(slowest * 1e3);
    }
    benchmark::DoNotOptimize(sink);
    const double measured = median(t);
    state.counters["measured_ms"] = measured;
    state.counters["default_ms"] = before.step_ms;
    state.counters["predicted_ms"] = after.step_ms;
    state.counters["optimizer_ms"] = after.optimizer_ms;
    state.counters["error_pct"] = 100.0 * (after.step_ms - measured) / measured;
    state.counters["default_error_pct"] = 100.0 * (before.step_ms - measured) / measured;
    state.counters["calibrated"] = double(after.calibrated_iterations);
    state.counters["comm_scale"] = after.communication_scale;
  } catch (const std::exception& e) {
    die("predict", e);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (!fs::bench::early_flags(argc, argv, "fullshard-bench-predict")) return 1;
  fs::Runtime rt(argc, argv);
  int result = 0;
  {
    torch::manual_seed(1);
    fs::DeviceMesh mesh(rt, {rt.world_size()}, {"dp"});
    benchmark::RegisterBenchmark("predict/mlp", bench_predict, &mesh, &mlp)->UseManualTime();
    benchmark::RegisterBenchmark("predict/gpt", bench_predict, &mesh, &gpt)->UseManualTime();
    benchmark::RegisterBenchmark("predict/heat", bench_predict, &mesh, &heat)->UseManualTime();
    result = fs::bench::run_benchmarks(argc, argv);
  }
  return result;
}
