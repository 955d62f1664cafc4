// What fullshard-bench-fsdp and fullshard-bench-shm both measure: one communication group of
// 64 (rows, 256) f32 parameters (its all-gather with copy-out, its post-backward reduction)
// and the raw MPI collectives of the same bytes. Header-only, for the benchmark programs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/fullshard.hpp"
#include "mpi_bench.hpp"

namespace fullshard::bench {

struct GroupModel {
  std::unique_ptr<graph::Module> root;
  fsdp::FSDPModule* state = nullptr;
  std::int64_t shard_bytes = 0;  // per rank
};

/// One group of 64 (rows, 256) f32 parameters whose shards total `mib` MiB per rank.
inline GroupModel make_group_model(const DeviceMesh& mesh, double mib,
                                   std::optional<DType> param_dtype = std::nullopt,
                                   const fsdp::CompressionPolicy& compression = {}) {
  constexpr int kParams = 64;
  constexpr std::int64_t kCols = 256;
  const int W = mesh.size();
  const std::int64_t per_rank = static_cast<std::int64_t>(mib * (1 << 20)) / 4;
  const std::int64_t rows = std::max<std::int64_t>(1, per_rank * W / (kParams * kCols));
  GroupModel m;
  m.root = graph::Module::make_root("bench");
  for (int i = 0; i < kParams; ++i)
    m.root->add_param("p" + std::to_string(i), {rows, kCols}).init([i](std::int64_t e) {
      return static_cast<double>((e + i) % 97);
    });
  fsdp::FullyShardOptions o;
  o.mp_policy.param_dtype = param_dtype;
  o.compression = compression;
  m.state = &fsdp::fully_shard(*m.root, mesh, o);
  m.shard_bytes = m.state->group_layout().shard_numel * 4;
  return m;
}

/// Counters bytes (per rank) and busbw (GB/s, (W-1)/W of the W ranks' bytes).
inline void bus_counters(benchmark::State& state, std::int64_t bytes_per_rank, int W) {
  using benchmark::Counter;
  const double total = static_cast<double>(bytes_per_rank) * W;
  state.counters["bytes"] =
      Counter(static_cast<double>(bytes_per_rank), Counter::kDefaults, Counter::kIs1024);
  state.counters["busbw"] =
      Counter(W > 1 ? total * (W - 1) / W / 1e9 : 0.0, Counter::kIsIterationInvariantRate);
}

/// FSDPModule::unshard() + reshard() of the group (collective + copy-out).
inline void bench_group_all_gather(benchmark::State& state, const DeviceMesh* mesh, double mib,
                                   std::optional<DType> param_dtype, const char* name,
                                   const fsdp::CompressionPolicy& compression = {}) {
  try {
    GroupModel m = make_group_model(*mesh, mib, param_dtype, compression);
    auto op = [&] {
      m.state->unshard();
      m.state->reshard();
    };
    op();  // warm-up: pool buffers (or windows) allocated and touched
    op();
    timed_loop(state, op);
    bus_counters(state, m.shard_bytes, mesh->size());
  } catch (const std::exception& e) {
    die(name, e);
  }
}

/// The group's post-backward (copy-in, reduce-scatter, copy-out), waited for; the gradient
/// zeroing of pre-backward is outside the timed region. Counters med_us, min_us.
inline void bench_group_reduce_scatter(benchmark::State& state, const DeviceMesh* mesh, double mib,
                                       const char* name,
                                       const fsdp::CompressionPolicy& compression = {}) {
  try {
    GroupModel m = make_group_model(*mesh, mib, std::nullopt, compression);
    m.state->set_reshard_after_backward(false);
    m.state->unshard();
    auto& root = *m.root;
    auto run = [&](bool timed) {
      fsdp::pre_backward(root);
      MPI_Barrier(control_comm());
      const double t0 = MPI_Wtime();
      fsdp::post_backward(root);
      return timed ? MPI_Wtime() - t0 : 0.0;
    };
    run(false);
    run(false);
    std::vector<double> times;
    for (auto _ : state) {
      const double local = run(true);
      double slowest = 0;
      MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, control_comm());
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
    bus_counters(state, m.shard_bytes, mesh->size());
  } catch (const std::exception& e) {
    die(name, e);
  }
}

/// MPI_Allgather in place, or MPI_Reduce_scatter_block, of `mib` MiB of f32 per rank.
inline void bench_raw_collective(benchmark::State& state, MPI_Comm comm, double mib,
                                 bool all_gather) {
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
  bus_counters(state, per_rank * 4, W);
}

}  // namespace fullshard::bench
