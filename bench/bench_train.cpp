// fullshard-bench-train: one training step of fullshard-train's model (residual MLP, AdamW)
// with a fixed global batch, so runs on 1, 2 and 4 ranks compare like for like (strong
// scaling), plus the bytes communicated per step against FSDP's reference.
//
//   train/<mode>/h<hidden>   forward + backward (the executor: all-gathers, reduce-scatters)
//                            + AdamW step; 8 blocks, global batch 256
// mode: fsdp (reshard_after_forward automatic), noreshard (reshard_after_forward false),
// bf16 (param_dtype bf16, reduce_dtype f32).
// Counters: med_us (median step, max over ranks), comm_x (bytes issued per step by rank 0,
// as a multiple of the f32 parameter bytes: FSDP's reference is 3, 2 without resharding
// after forward), ag_x / rs_x (the all-gather and reduce-scatter parts).
//
// Launch: for n in 1 2 4; do scripts/mpirun-local -n $n build/bench/fullshard-bench-train; done
#include <memory>
#include <string>
#include <vector>

#include "fullshard/fullshard.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "blas_kernel.hpp"
#include "mpi_bench.hpp"
#include "residual_mlp.hpp"

namespace {

namespace fs = fullshard;
using fs::bench::die;
using fs::bench::timed_loop;

constexpr int kBlocks = 8;
constexpr std::int64_t kGlobalBatch = 256;

enum class Mode { fsdp, noreshard, bf16 };

void bench_train(benchmark::State& state, const fs::DeviceMesh* mesh, int hidden, Mode mode) {
  try {
    const fs::apps::MlpShape shape{64, hidden, 16, kBlocks};
    fs::apps::ResidualMlp model(shape, 1);
    fs::schedule::PlanOptions po;
    po.forward_prefetch_depth = 1;
    if (mode == Mode::noreshard) po.defaults.reshard_after_forward = false;
    if (mode == Mode::bf16) {
      po.defaults.mp_policy.param_dtype = fs::DType::bf16;
      po.defaults.mp_policy.reduce_dtype = fs::DType::f32;
    }
    model.shard(*mesh, po);
    fs::optim::AdamW opt(model.root().parameters(), 1e-4);

    const int W = mesh->size(), r = mesh->rank();
    const std::int64_t rows = kGlobalBatch / W + (r < kGlobalBatch % W ? 1 : 0);
    std::vector<float> x(static_cast<std::size_t>(rows * shape.inputs)),
        t(static_cast<std::size_t>(rows * shape.outputs));
    for (std::size_t i = 0; i < x.size(); ++i)
      x[i] = static_cast<float>(fs::apps::normal01(2, 0, i + r * x.size()));
    for (std::size_t i = 0; i < t.size(); ++i)
      t[i] = static_cast<float>(fs::apps::normal01(2, 1, i + r * t.size()));
    auto step = [&] {
      opt.zero_grad();
      model.forward_backward(x.data(), t.data(), static_cast<int>(rows), kGlobalBatch);
      opt.step();
      model.executor().timeline().clear();
    };
    step();  // first step: lazy initialisation, pool warm-up
    const fs::comm::Traffic before = mesh->traffic();
    timed_loop(state, step);
    const fs::comm::Traffic after = mesh->traffic();
    const double n = static_cast<double>(state.iterations()), p = model.num_params() * 4.0;
    state.counters["comm_x"] = (after.total() - before.total()) / n / p;
    state.counters["ag_x"] = (after.all_gather - before.all_gather) / n / p;
    state.counters["rs_x"] = (after.reduce_scatter - before.reduce_scatter) / n / p;
    state.counters["ranks"] = W;
    state.counters["params_M"] = model.num_params() / 1e6;
  } catch (const std::exception& e) {
    die("train", e);
  }
}

}  // namespace

int main(int argc, char** argv) {
  fs::apps::run_on_best_blas_kernel(argv);  // as fullshard-train: the kernel the CPU is made for
  if (!fs::bench::early_flags(argc, argv, "fullshard-bench-train")) return 1;
  fs::Runtime rt(argc, argv);
  int result = 0;
  {
    fs::DeviceMesh mesh(rt, {rt.world_size()}, {"dp"});
    const std::pair<const char*, Mode> modes[] = {
        {"fsdp", Mode::fsdp}, {"noreshard", Mode::noreshard}, {"bf16", Mode::bf16}};
    for (int hidden : {256, 1024})
      for (const auto& [name, mode] : modes)
        benchmark::RegisterBenchmark(
            ("train/" + std::string(name) + "/h" + std::to_string(hidden)).c_str(), bench_train,
            &mesh, hidden, mode)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
    result = fs::bench::run_benchmarks(argc, argv);
  }
  return result;
}
