// fullshard-bench-capi: what a training step through the C API costs beside the same step
// through the C++ training session it adapts, and what the ranks' agreement on the batch
// costs inside a step.
//
//   capi/step/<hidden>  a residual MLP (64 inputs, `hidden` wide, 4 blocks, 16 outputs;
//                       fully_shard on every block and the root, AdamW) trained on a
//                       contiguous float32 batch of 128 rows per rank. Each iteration runs
//                       one C API step (fullshard_train_step on the caller's arrays) and one
//                       step of a fullshard::session::Session of the same configuration,
//                       alternated; the manual time is the C API step's (max over ranks).
//                       Counters: c_us and cpp_us (medians), ratio (the median of the
//                       per-pair ratios c / cpp: 1 is no overhead); agree_us (the median of
//                       the batch agreement alone, as every step runs it: describe the batch,
//                       one 24-byte all-reduce) and agree_share (agree_us / cpp_us);
//                       finite_us (the median of the non-finite checks alone, as every step
//                       runs them: the scan of the input and target arrays, one over the
//                       exponents of the rank's gradient shards, one 8-byte all-reduce) and
//                       finite_share (finite_us / cpp_us).
//
// Launch: mpiexec -n 2 build/bench/fullshard-bench-capi [--benchmark_* flags]
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "fullshard/base/bounded_comm.hpp"
#include "fullshard/fullshard.h"
#include "fullshard/fullshard.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "fullshard/session/session.hpp"
#include "fullshard/torch/sharded_model.hpp"
#include "lib/session/batch_agreement.hpp"
#include "mpi_bench.hpp"

namespace {

namespace fs = fullshard;
using fs::bench::die;
using fs::bench::median;

constexpr int kRows = 128, kIn = 64, kOut = 16;

void check(fullshard_status s) {
  if (s != FULLSHARD_OK) throw fs::Error(fullshard_last_error());
}

void bench_step(benchmark::State& state, const fs::DeviceMesh* mesh, int hidden) {
  try {
    const std::string config =
        R"({"model": {"type": "residual_mlp", "inputs": 64, "hidden": )" + std::to_string(hidden) +
        R"(, "outputs": 16, "blocks": 4}, "optimizer": {"type": "adamw", "lr": 0.001}})";
    fullshard_mesh cmesh{0};
    const int shape[1] = {mesh->size()};
    check(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", &cmesh));
    fullshard_model cmodel{0};
    check(fullshard_model_create_from_json(cmesh, config.c_str(), "bench", &cmodel));

    fs::session::Session session(*mesh, fs::session::parse_config(config, "bench"));
    const torch::Tensor x = torch::randn({kRows, kIn}), y = torch::randn({kRows, kOut});
    const int64_t xs[2] = {kRows, kIn}, ys[2] = {kRows, kOut};
    const fullshard_array in = fullshard_array_contiguous(x.data_ptr(), FULLSHARD_FLOAT32, 2, xs);
    const fullshard_array tg = fullshard_array_contiguous(y.data_ptr(), FULLSHARD_FLOAT32, 2, ys);
    double sink = 0;
    auto c_step = [&] {
      double loss = 0;
      check(fullshard_train_step(cmodel, 1, &in, 1, &tg, &loss));
      sink += loss;
    };
    auto cpp_step = [&] { sink += session.train_step({x}, {y}); };
    auto slowest = [&](double t) {
      double m = 0;
      MPI_Allreduce(&t, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      return m;
    };
    for (int i = 0; i < 3; ++i) {  // warm-up: lazy buffers, optimizer state
      c_step();
      cpp_step();
    }
    std::vector<double> c_t, cpp_t, ratios;
    for (auto _ : state) {
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = MPI_Wtime();
      c_step();
      const double c = slowest(MPI_Wtime() - t0);
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = MPI_Wtime();
      cpp_step();
      const double cpp = slowest(MPI_Wtime() - t0);
      state.SetIterationTime(c);
      c_t.push_back(c);
      cpp_t.push_back(cpp);
      ratios.push_back(c / cpp);
    }
    // The batch agreement alone, as train_step runs it.
    fs::BoundedComm comm(mesh->control_world(), "bench.agreement", 60.0);
    std::vector<double> agree_t;
    for (int i = 0; i < 200; ++i) {
      const double t0 = MPI_Wtime();
      fs::session::detail::agree_on_batch(comm, fs::session::detail::describe_batch({x}, {y}),
                                          "bench");
      agree_t.push_back(slowest(MPI_Wtime() - t0));
    }
    // The non-finite checks alone, as train_step runs them (the gradients of the last step).
    const std::vector<fs::graph::Parameter*> params = session.sharded().graph().parameters();
    std::vector<double> finite_t;
    for (int i = 0; i < 200; ++i) {
      const double t0 = MPI_Wtime();
      std::string bad = fs::session::detail::non_finite_in({x}, "input");
      bad += fs::session::detail::non_finite_in({y}, "target");
      const bool grads = fs::optim::local_all_finite(params, *mesh);
      int worst = bad.empty() && grads ? 1 : 0;
      comm.allreduce(&worst, 1, MPI_INT, MPI_MIN, "bench non-finite check");
      finite_t.push_back(slowest(MPI_Wtime() - t0));
    }
    benchmark::DoNotOptimize(sink);
    state.counters["finite_us"] = median(finite_t) * 1e6;
    state.counters["finite_share"] = median(finite_t) / median(cpp_t);
    state.counters["agree_us"] = median(agree_t) * 1e6;
    state.counters["agree_share"] = median(agree_t) / median(cpp_t);
    state.counters["c_us"] = median(c_t) * 1e6;
    state.counters["cpp_us"] = median(cpp_t) * 1e6;
    state.counters["ratio"] = median(ratios);
    state.counters["pairs"] = double(ratios.size());
    check(fullshard_model_free(&cmodel));
    check(fullshard_mesh_free(&cmesh));
  } catch (const std::exception& e) {
    die("capi/step", e);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (!fs::bench::early_flags(argc, argv, "fullshard-bench-capi")) return 1;
  fs::Runtime rt(argc, argv);
  int result = 0;
  {
    if (fullshard_init(MPI_COMM_WORLD) != FULLSHARD_OK) {
      std::fprintf(stderr, "%s\n", fullshard_last_error());
      return 1;
    }
    torch::set_num_threads(1);  // after fullshard_init (which sets the launcher's cores)
    fs::DeviceMesh mesh(rt, {rt.world_size()}, {"dp"});
    for (int hidden : {64, 256, 1024})
      benchmark::RegisterBenchmark(("capi/step/" + std::to_string(hidden)).c_str(), bench_step,
                                   &mesh, hidden)
          ->UseManualTime();
    result = fs::bench::run_benchmarks(argc, argv);
    fullshard_finalize();
  }
  return result;
}
