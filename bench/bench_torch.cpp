// fullshard-bench-torch: the cost of the LibTorch front end's hooks.
//
//   torch/hooks/<N>   a LibTorch model: root -> N blocks of one Linear(4W, 4W) (a (4W, 4W)
//                     weight and a 4W bias: a few elements per rank, so communication and
//                     compute are small and the per-module overhead shows), every block
//                     called through fullshard::torch::call, fully_shard'ed on each block and
//                     the root; one iteration is forward (fst::call of the root on a (2, 4W)
//                     input) and backward of the output's sum. Counters baseline_us (the same
//                     model unsharded, the same calls, measured in the same run: median of 51
//                     iterations, the slowest rank's) and us_per_module_step =
//                     (med_us - baseline_us) / N: what fullshard adds per module and step
//                     (the all-gathers and reduce-scatters of the tiny groups included), to set
//                     beside fullshard-bench-schedule's hooks/overhead (the native engine's).
//
// Launch: mpiexec -n 2 build/bench/fullshard-bench-torch [--benchmark_* flags]
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/fullshard.hpp"
#include "fullshard/torch.hpp"
#include "mpi_bench.hpp"

namespace {

namespace fs = fullshard;
namespace fst = fullshard::torch;
using fs::bench::die;
using fs::bench::timed_loop;

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d) : fc(register_module("fc", torch::nn::Linear(d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc(x); }
  torch::nn::Linear fc;
};

struct ChainImpl : torch::nn::Module {
  ChainImpl(int n, int64_t d) {
    for (int i = 0; i < n; ++i)
      blocks.push_back(register_module("b" + std::to_string(i), std::make_shared<BlockImpl>(d)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks)
      x = fst::call(b, x);
    return x;
  }
  std::vector<std::shared_ptr<BlockImpl>> blocks;
};

void bench_hooks(benchmark::State& state, const fs::DeviceMesh* mesh, int n) {
  try {
    const int64_t d = 4 * mesh->size();
    torch::manual_seed(0);
    auto plain = std::make_shared<ChainImpl>(n, d);
    auto net = std::make_shared<ChainImpl>(n, d);
    fst::ShardedModel sharded(net);
    for (auto& b : net->blocks)
      sharded.fully_shard(*b, *mesh);
    sharded.fully_shard(*net, *mesh);
    const torch::Tensor x = torch::randn({2, d});
    auto step = [&](const std::shared_ptr<ChainImpl>& m) {
      fst::call(m, x).sum().backward();
      for (auto& p : m->parameters())
        p.mutable_grad() = torch::Tensor();
    };
    step(net);  // warm-up: lazy initialisation, pool buffers
    timed_loop(state, [&] { step(net); });
    const double base = fs::bench::slowest_median_s([&] { step(plain); }, 51);
    if (state.counters.count("med_us")) {
      const double med_us = state.counters["med_us"];
      state.counters["baseline_us"] = base * 1e6;
      state.counters["us_per_module_step"] = (med_us - base * 1e6) / n;
    }
  } catch (const std::exception& e) {
    die("torch/hooks", e);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (!fs::bench::early_flags(argc, argv, "fullshard-bench-torch")) return 1;
  fs::Runtime rt(argc, argv);
  torch::set_num_threads(1);
  int result = 0;
  {
    fs::DeviceMesh mesh(rt, {rt.world_size()}, {"dp"});
    for (int n : {10, 100})
      benchmark::RegisterBenchmark(("torch/hooks/" + std::to_string(n)).c_str(), bench_hooks, &mesh,
                                   n)
          ->UseManualTime();
    result = fs::bench::run_benchmarks(argc, argv);
  }
  return result;
}
