// fullshard-bench-schedule: what planning and the FSDP hooks cost, and whether prefetching
// overlaps a layer's all-gather with another layer's computation here.
//
//   plan/modules/<N>         Scheduler::plan of a graph root -> "layers" -> N leaf modules
//                            (2 small parameters, declared cost, every leaf and the root
//                            fully_shard'ed), MeshShape::fsdp(4); the graph is built once, the
//                            plan is destroyed outside the timed region. Counter
//                            us_per_1000_modules = med_us * 1000 / N.
//   plan/replan/<N>          the same, each iteration re-planning into one Plan
//                            (Scheduler::replan, as auto_plan does: the plan's memory is reused).
//   hooks/overhead/<N>       fsdp::forward + fsdp::backward of root -> N modules, each one
//                            fully_shard'ed group of one (W*4,) f32 parameter (so every group
//                            communicates on W > 1 ranks), empty callbacks. Counters
//                            baseline_us (the plain callback loop below, measured in the same
//                            run) and us_per_module_step = (med_us - baseline_us) / N.
//   hooks/baseline/<N>       the same 2N empty callbacks called in a plain loop (no FSDP).
//   overlap16/<mode>         16 layers, one fully_shard'ed (rows, 256) f32 parameter each
//                            (1 MiB shard per rank), a busy loop over a private 1 MiB buffer in
//                            every forward and backward callback calibrated to one layer's
//                            all-gather (unshard + reshard, measured on rank 0, broadcast).
//                            Modes: no_prefetch (FSDP2 default: implicit forward prefetch),
//                            prefetch2 (set_modules_to_forward_prefetch of the next 2 layers),
//                            compute_only (callbacks, no fully_shard), comm_only (fully_shard,
//                            empty callbacks).
//
// Launch: scripts/mpirun-local -n 2 build/bench/fullshard-bench-schedule [--benchmark_* flags]
#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/fullshard.hpp"
#include "fullshard/schedule/plan.hpp"
#include "mpi_bench.hpp"

namespace {

namespace fs = fullshard;
using fs::bench::die;
using fs::bench::median;
using fs::bench::timed_loop;
using fs::graph::Module;

volatile double g_sink = 0;

// ---- plan ---------------------------------------------------------------------------------

std::unique_ptr<Module> make_plan_graph(int n) {
  auto root = Module::make_root("bench");
  auto& layers = root->add_module("layers");
  for (int i = 0; i < n; ++i) {
    auto& m = layers.add_module(std::to_string(i));
    m.add_param("weight", {16, 16});
    m.add_param("bias", {16});
    m.cost() = fs::graph::Cost{0.1, 0.2, true};
    m.set_fully_shard_request(true);
  }
  root->add_param("head", {16});
  root->set_fully_shard_request(true);
  return root;
}

// replan: each iteration re-plans into the same Plan (Scheduler::replan, as auto_plan does).
void bench_plan(benchmark::State& state, int n, bool replan) {
  try {
    const auto root = make_plan_graph(n);
    const auto mesh = fs::schedule::MeshShape::fsdp(4);
    std::optional<fs::schedule::Plan> plan = fs::schedule::Scheduler::plan(*root, mesh);
    const std::size_t ops = plan->ops.size();
    if (!replan) plan.reset();
    // timed_loop's protocol (barrier, max over ranks), but the plan is destroyed untimed.
    std::vector<double> times;
    for (auto _ : state) {
      MPI_Barrier(fs::bench::control_comm());
      const double t0 = MPI_Wtime();
      if (replan)
        fs::schedule::Scheduler::replan(*plan, *root, mesh);
      else
        plan = fs::schedule::Scheduler::plan(*root, mesh);
      const double local = MPI_Wtime() - t0;
      double slowest = 0.0;
      MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, fs::bench::control_comm());
      state.SetIterationTime(slowest);
      times.push_back(slowest);
      if (plan->ops.size() != ops) state.SkipWithError("plan changed between iterations");
      if (!replan) plan.reset();
    }
    if (times.empty()) return;
    const double med_us = median(times) * 1e6;
    state.counters["med_us"] = med_us;
    state.counters["min_us"] = *std::min_element(times.begin(), times.end()) * 1e6;
    state.counters["us_per_1000_modules"] = med_us * 1000.0 / n;
    state.counters["ops"] = static_cast<double>(ops);
  } catch (const std::exception& e) {
    die("plan/modules", e);
  }
}

// ---- hooks --------------------------------------------------------------------------------

struct HookGraph {
  std::unique_ptr<Module> root;
  std::vector<Module*> mods;
};

// root -> n modules "m<i>" with one (W*4,) parameter and empty callbacks; fully_shard'ed
// bottom-up (each module, then the root, which keeps no parameter of its own) when `mesh`.
HookGraph make_hook_graph(int n, int W, const fs::DeviceMesh* mesh) {
  HookGraph g;
  g.root = Module::make_root("bench");
  for (int i = 0; i < n; ++i) {
    auto& m = g.root->add_module("m" + std::to_string(i));
    m.add_param("w", {static_cast<std::int64_t>(W) * 4});
    m.on_forward([](Module&) {});
    m.on_backward([](Module&) {});
    g.mods.push_back(&m);
  }
  if (mesh) {
    for (auto* m : g.mods)
      fs::fsdp::fully_shard(*m, *mesh);
    fs::fsdp::fully_shard(*g.root, *mesh);
  }
  return g;
}

// The callbacks fsdp::forward / fsdp::backward call, in their order, without FSDP.
void run_callbacks(const HookGraph& g) {
  for (auto* m : g.mods)
    m->forward_callback()(*m);
  for (auto it = g.mods.rbegin(); it != g.mods.rend(); ++it)
    (*it)->backward_callback()(**it);
}

void bench_hooks(benchmark::State& state, const fs::DeviceMesh* mesh, int n) {
  try {
    HookGraph g = make_hook_graph(n, mesh->size(), mesh);
    auto op = [&] {
      fs::fsdp::forward(*g.root);
      fs::fsdp::backward(*g.root);
    };
    op();  // warm-up: lazy initialisation, pool buffers
    timed_loop(state, op);
    // The baseline, on the same graph in the same process state: median of 101 loops, the
    // slowest rank's.
    const double base = fs::bench::slowest_median_s([&] { run_callbacks(g); }, 101);
    if (state.counters.count("med_us")) {
      const double med_us = state.counters["med_us"];
      state.counters["baseline_us"] = base * 1e6;
      state.counters["us_per_module_step"] = (med_us - base * 1e6) / n;
    }
  } catch (const std::exception& e) {
    die("hooks/overhead", e);
  }
}

void bench_hooks_baseline(benchmark::State& state, int W, int n) {
  try {
    HookGraph g = make_hook_graph(n, W, nullptr);
    auto op = [&] { run_callbacks(g); };
    op();
    timed_loop(state, op);
  } catch (const std::exception& e) {
    die("hooks/baseline", e);
  }
}

// ---- overlap16 ----------------------------------------------------------------------------

constexpr int kLayers = 16;
constexpr std::int64_t kCols = 256;
constexpr double kLayerMiB = 1.0;  // shard per rank per layer

std::int64_t layer_rows(int W) {
  const auto per_rank = static_cast<std::int64_t>(kLayerMiB * (1 << 20)) / 4;
  return std::max<std::int64_t>(1, per_rank * W / kCols);
}

// bench_fsdp.cpp's memory- and FMA-bound pass over a 1 MiB buffer, for `updates` element
// updates in all (whole passes, then a prefix): finer than whole passes (~0.2 ms each here).
double compute(std::vector<float>& x, std::int64_t updates) {
  float acc = 0;
  const auto n = static_cast<std::int64_t>(x.size());
  for (std::int64_t done = 0; done < updates; done += n) {
    const std::int64_t len = std::min(n, updates - done);
    for (std::int64_t i = 0; i < len; ++i) {
      float& v = x[static_cast<std::size_t>(i)];
      v = v * 0.999f + 0.001f;
      acc += v;
    }
  }
  return acc;
}

// Element updates that take about as long as one layer's all-gather (unshard + reshard
// of a fully_shard'ed (rows, 256) f32 parameter): both measured on rank 0, broadcast.
std::int64_t calibrate(const fs::DeviceMesh& mesh, std::vector<float>& work, double* comm_us) {
  auto root = Module::make_root("calibrate");
  root->add_param("w", {layer_rows(mesh.size()), kCols});
  auto& st = fs::fsdp::fully_shard(*root, mesh);
  st.unshard();
  st.reshard();
  std::vector<double> t;
  for (int i = 0; i < 9; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    st.unshard();
    st.reshard();
    t.push_back(MPI_Wtime() - t0);
  }
  const double ag = median(t);
  const auto n = static_cast<std::int64_t>(work.size());
  g_sink = compute(work, 2 * n);
  const double t1 = MPI_Wtime();
  g_sink = compute(work, 20 * n);
  const double per_update = (MPI_Wtime() - t1) / static_cast<double>(20 * n);
  long long updates = std::max<long long>(1, std::llround(ag / per_update));
  MPI_Bcast(&updates, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  double us = ag * 1e6;
  MPI_Bcast(&us, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  *comm_us = us;
  return updates;
}

enum class Mode { no_prefetch, prefetch2, compute_only, comm_only };

void bench_overlap16(benchmark::State& state, const fs::DeviceMesh* mesh, Mode mode,
                     std::int64_t updates, std::vector<float>* work) {
  try {
    auto root = Module::make_root("bench");
    std::vector<Module*> layers;
    for (int i = 0; i < kLayers; ++i) {
      auto& m = root->add_module(std::to_string(i));
      m.add_param("w", {layer_rows(mesh->size()), kCols});
      if (mode != Mode::comm_only) {
        m.on_forward([work, updates](Module&) { g_sink = compute(*work, updates); });
        m.on_backward([work, updates](Module&) { g_sink = compute(*work, updates); });
      }
      layers.push_back(&m);
    }
    if (mode != Mode::compute_only) {
      for (auto* m : layers)
        fs::fsdp::fully_shard(*m, *mesh);
      fs::fsdp::fully_shard(*root, *mesh);
    }
    if (mode == Mode::prefetch2)
      for (int i = 0; i < kLayers; ++i) {
        std::vector<Module*> next;
        for (int j = i + 1; j < std::min(kLayers, i + 3); ++j)
          next.push_back(layers[static_cast<std::size_t>(j)]);
        fs::fsdp::fsdp_state(*layers[static_cast<std::size_t>(i)])
            ->set_modules_to_forward_prefetch(next);
      }
    auto op = [&] {
      fs::fsdp::forward(*root);
      fs::fsdp::backward(*root);
    };
    op();
    timed_loop(state, op);
    state.counters["passes"] = static_cast<double>(updates) / static_cast<double>(work->size());
  } catch (const std::exception& e) {
    die("overlap16", e);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (!fs::bench::early_flags(argc, argv, "fullshard-bench-schedule")) return 1;
  fs::Runtime rt(argc, argv);
  int result = 0;
  {
    fs::DeviceMesh mesh(rt, {rt.world_size()}, {"dp"});
    for (const bool replan : {false, true})
      for (int n : {10, 1000, 10000, 100000}) {
        auto* b = benchmark::RegisterBenchmark(
            ((replan ? "plan/replan/" : "plan/modules/") + std::to_string(n)).c_str(), bench_plan,
            n, replan);
        b->UseManualTime();
        if (n >= 100000) b->Iterations(9);  // a median of 9, not a single run
      }
    for (int n : {100, 1000}) {
      benchmark::RegisterBenchmark(("hooks/overhead/" + std::to_string(n)).c_str(), bench_hooks,
                                   &mesh, n)
          ->UseManualTime();
      benchmark::RegisterBenchmark(("hooks/baseline/" + std::to_string(n)).c_str(),
                                   bench_hooks_baseline, mesh.size(), n)
          ->UseManualTime();
    }
    std::vector<float> work((1 << 20) / 4, 1.0f);
    double comm_us = 0.0;
    const std::int64_t updates = calibrate(mesh, work, &comm_us);
    benchmark::AddCustomContext("overlap16_layer_all_gather_us", std::to_string(comm_us));
    benchmark::AddCustomContext("overlap16_compute_passes",
                                std::to_string(static_cast<double>(updates) / work.size()));
    const std::pair<const char*, Mode> modes[] = {{"no_prefetch", Mode::no_prefetch},
                                                  {"prefetch2", Mode::prefetch2},
                                                  {"compute_only", Mode::compute_only},
                                                  {"comm_only", Mode::comm_only}};
    for (const auto& [name, mode] : modes)
      benchmark::RegisterBenchmark(("overlap16/" + std::string(name)).c_str(), bench_overlap16,
                                   &mesh, mode, updates, &work)
          ->UseManualTime();
    result = fs::bench::run_benchmarks(argc, argv);
  }
  return result;
}
