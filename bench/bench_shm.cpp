// fullshard-bench-shm: one communication group's all-gather and reduce-scatter on node-local
// shared memory against the same group on MPI, the raw MPI collectives of the same bytes and
// memcpy of the bytes the collective writes (all-gather) or reads (reduce-scatter), side by
// side in one run (issue 15).
//
//   shm/all_gather/<MiB>        FSDPModule::unshard() + reshard() on a mesh whose dim uses
//                               shared memory: every peer's shard straight into the
//                               unsharded parameters (collective and copy-out in one pass)
//   mpi/all_gather/<MiB>        the same group on FULLSHARD_HOST_COLLECTIVES=mpi: all-gather
//                               into a pooled buffer, then the copy-out
//   raw/MPI_Allgather/<MiB>     MPI_Allgather(MPI_IN_PLACE) of the same f32 bytes, no copy-out
//   shm/reduce_scatter/<MiB>    the group's post-backward: copy-in (chunk-cat into the
//                               window), then each rank sums its chunk of every peer's
//                               input with the divide and the accumulation fused, waited for
//   mpi/reduce_scatter/<MiB>    the same on MPI: copy-in, reduce-scatter, copy-out
//   raw/MPI_Reduce_scatter_block/<MiB>
//   memcpy/<MiB>                every rank copies W x <MiB> at once (what an all-gather
//                               writes, a reduce-scatter reads, per rank)
// <MiB> is the group shard per rank. Launch:
//   scripts/mpirun-local -n 2 build-rel/bench/fullshard-bench-shm --benchmark_min_time=0.3
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/fullshard.hpp"
#include "mpi_bench.hpp"

namespace {

namespace fs = fullshard;
using fs::bench::die;
using fs::bench::timed_loop;

constexpr int kParams = 64;
constexpr std::int64_t kCols = 256;

struct Model {
  std::unique_ptr<fs::graph::Module> root;
  fs::fsdp::FSDPModule* state = nullptr;
  std::int64_t shard_bytes = 0;
};

Model make_model(const fs::DeviceMesh& mesh, double mib) {
  const int W = mesh.size();
  const std::int64_t per_rank = static_cast<std::int64_t>(mib * (1 << 20)) / 4;
  const std::int64_t rows = std::max<std::int64_t>(1, per_rank * W / (kParams * kCols));
  Model m;
  m.root = fs::graph::Module::make_root("bench");
  for (int i = 0; i < kParams; ++i)
    m.root->add_param("p" + std::to_string(i), {rows, kCols}).init([i](std::int64_t e) {
      return static_cast<double>((e + i) % 97);
    });
  m.state = &fs::fsdp::fully_shard(*m.root, mesh);
  m.shard_bytes = m.state->group_layout().shard_numel * 4;
  return m;
}

void counters(benchmark::State& state, std::int64_t bytes_per_rank, int W) {
  using benchmark::Counter;
  const double total = static_cast<double>(bytes_per_rank) * W;
  state.counters["bytes"] =
      Counter(static_cast<double>(bytes_per_rank), Counter::kDefaults, Counter::kIs1024);
  state.counters["busbw"] =
      Counter(W > 1 ? total * (W - 1) / W / 1e9 : 0.0, Counter::kIsIterationInvariantRate);
}

void bench_all_gather(benchmark::State& state, const fs::DeviceMesh* mesh, double mib) {
  try {
    Model m = make_model(*mesh, mib);
    auto op = [&] {
      m.state->unshard();
      m.state->reshard();
    };
    op();
    op();
    timed_loop(state, op);
    counters(state, m.shard_bytes, mesh->size());
  } catch (const std::exception& e) {
    die("all_gather", e);
  }
}

void bench_reduce_scatter(benchmark::State& state, const fs::DeviceMesh* mesh, double mib) {
  try {
    Model m = make_model(*mesh, mib);
    m.state->set_reshard_after_backward(false);
    m.state->unshard();
    auto& root = *m.root;
    auto run = [&](bool timed) {
      fs::fsdp::pre_backward(root);  // gradients zeroed: not part of the reduce path
      MPI_Barrier(fs::bench::control_comm());
      const double t0 = MPI_Wtime();
      fs::fsdp::post_backward(root);  // copy-in, reduce-scatter, copy-out, waited for
      return timed ? MPI_Wtime() - t0 : 0.0;
    };
    run(false);
    run(false);
    std::vector<double> times;
    for (auto _ : state) {
      const double local = run(true);
      double slowest = 0;
      MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, fs::bench::control_comm());
      state.SetIterationTime(slowest);
      times.push_back(slowest);
    }
    std::sort(times.begin(), times.end());
    if (!times.empty()) {
      const std::size_t n = times.size();
      state.counters["med_us"] =
          (n % 2 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2])) * 1e6;
      state.counters["min_us"] = times.front() * 1e6;
    }
    counters(state, m.shard_bytes, mesh->size());
  } catch (const std::exception& e) {
    die("reduce_scatter", e);
  }
}

void bench_raw(benchmark::State& state, MPI_Comm comm, double mib, bool all_gather) {
  int W = 1;
  MPI_Comm_size(comm, &W);
  const std::int64_t per_rank = static_cast<std::int64_t>(mib * (1 << 20)) / 4;
  std::vector<float> a(static_cast<std::size_t>(per_rank * W), 1.0f);
  std::vector<float> b(static_cast<std::size_t>(per_rank), 0.0f);
  const int n = static_cast<int>(per_rank);
  auto op = [&] {
    if (all_gather)
      MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, a.data(), n, MPI_FLOAT, comm);
    else
      MPI_Reduce_scatter_block(a.data(), b.data(), n, MPI_FLOAT, MPI_SUM, comm);
  };
  op();
  timed_loop(state, op);
  counters(state, per_rank * 4, W);
}

void bench_memcpy(benchmark::State& state, int W, double mib) {
  const auto bytes = static_cast<std::size_t>(mib * (1 << 20)) * static_cast<std::size_t>(W);
  std::vector<char> a(bytes, 1), b(bytes, 0);
  auto op = [&] { std::memcpy(b.data(), a.data(), bytes); };
  op();
  timed_loop(state, op);
  benchmark::DoNotOptimize(b.data());
  counters(state, static_cast<std::int64_t>(bytes) / W, W);
}

}  // namespace

int main(int argc, char** argv) {
  if (!fs::bench::early_flags(argc, argv, "fullshard-bench-shm")) return 1;
  fs::Runtime rt(argc, argv);
  int result = 0;
  {
    const int W = rt.world_size();
    fs::DeviceMesh shm(MPI_COMM_WORLD, {W}, {"dp"}, rt.settings().timeout_s,
                       fs::HostProgress::inline_, fs::HostCollectives::auto_);
    fs::DeviceMesh mpi(MPI_COMM_WORLD, {W}, {"dp"}, rt.settings().timeout_s,
                       fs::HostProgress::inline_, fs::HostCollectives::mpi);
    if (rt.rank() == 0 && W > 1 && !shm.shm("dp"))
      std::printf("note: the ranks do not share a node: shm/ runs on MPI\n");
    MPI_Comm raw = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);
    for (double mib : {0.25, 1.0, 4.0, 16.0}) {
      const std::string s = mib < 1 ? "0.25" : std::to_string(static_cast<int>(mib));
      auto reg = [](const std::string& name, auto&&... args) {
        benchmark::RegisterBenchmark(name.c_str(), args...)->UseManualTime();
      };
      reg("memcpy/" + s, bench_memcpy, W, mib);
      reg("shm/all_gather/" + s, bench_all_gather, &shm, mib);
      reg("mpi/all_gather/" + s, bench_all_gather, &mpi, mib);
      reg("raw/MPI_Allgather/" + s, bench_raw, raw, mib, true);
      reg("shm/reduce_scatter/" + s, bench_reduce_scatter, &shm, mib);
      reg("mpi/reduce_scatter/" + s, bench_reduce_scatter, &mpi, mib);
      reg("raw/MPI_Reduce_scatter_block/" + s, bench_raw, raw, mib, false);
    }
    result = fs::bench::run_benchmarks(argc, argv);
    MPI_Comm_free(&raw);
  }
  return result;
}
