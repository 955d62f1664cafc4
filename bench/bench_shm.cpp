// fullshard-bench-shm: one communication group's all-gather and reduce-scatter on node-local
// shared memory against the same group on MPI, the raw MPI collectives of the same bytes and
// memcpy of the bytes the collective writes (all-gather) or reads (reduce-scatter), side by
// side in one run (issue 15).
//
//   shm/all_gather/<MiB>        FSDPModule::unshard() + reshard() on a mesh whose dim uses
//                               shared memory: every peer's shard straight into the
//                               unsharded parameters (collective and copy-out in one pass)
//                               (ranks spanning nodes, or FULLSHARD_RANKS_PER_NODE: the
//                               two-level transport, MPI across nodes into the windows)
//   mpi/all_gather/<MiB>        the same group on FULLSHARD_HOST_COLLECTIVES=mpi: all-gather
//                               into a pooled buffer, then the copy-out
//   raw/MPI_Allgather/<MiB>     MPI_Allgather(MPI_IN_PLACE) of the same f32 bytes, no copy-out
//   shm/reduce_scatter/<MiB>    the group's post-backward: copy-in (chunk-cat into the
//                               window), then each rank sums its chunk of every peer's
//                               input with the divide and the accumulation fused, waited for
//   mpi/reduce_scatter/<MiB>    the same on MPI: copy-in, reduce-scatter, copy-out
//   raw/MPI_Reduce_scatter_block/<MiB>
//   int8/all_gather/<MiB>       the group compressed (CompressionPolicy, docs/compression.md):
//   fp8/all_gather/<MiB>        int8 or fp8 e4m3 codes with a scale per 256 elements, on MPI
//   int8/reduce_scatter/<MiB>   (a compressed group leaves shared memory): encode, all-to-all
//                               of packed slots, decode fused into the copy-out or the sum
//   memcpy/<MiB>                every rank copies W x <MiB> at once (what an all-gather
//                               writes, a reduce-scatter reads, per rank)
//   memcpy_peers/<MiB>          every rank copies (W-1) x <MiB> at once (what an in-place
//                               MPI_Allgather writes per rank: the peers' slots only)
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
#include "group_bench.hpp"
#include "mpi_bench.hpp"

namespace {

namespace fs = fullshard;
using fs::bench::die;
using fs::bench::timed_loop;

using fs::bench::bus_counters;

void bench_all_gather(benchmark::State& state, const fs::DeviceMesh* mesh, double mib,
                      fs::fsdp::CompressionPolicy z) {
  fs::bench::bench_group_all_gather(state, mesh, mib, std::nullopt, "all_gather", z);
}
void bench_reduce_scatter(benchmark::State& state, const fs::DeviceMesh* mesh, double mib,
                          fs::fsdp::CompressionPolicy z) {
  fs::bench::bench_group_reduce_scatter(state, mesh, mib, "reduce_scatter", z);
}
using fs::bench::bench_raw_collective;

void bench_memcpy(benchmark::State& state, int W, double mib, int slots) {
  const auto bytes = static_cast<std::size_t>(mib * (1 << 20)) * static_cast<std::size_t>(slots);
  std::vector<char> a(bytes, 1), b(bytes, 0);
  auto op = [&] { std::memcpy(b.data(), a.data(), bytes); };
  op();
  timed_loop(state, op);
  benchmark::DoNotOptimize(b.data());
  bus_counters(state, static_cast<std::int64_t>(mib * (1 << 20)), W);
}

}  // namespace

int main(int argc, char** argv) {
  if (!fs::bench::early_flags(argc, argv, "fullshard-bench-shm")) return 1;
  fs::Runtime rt(argc, argv);
  int result = 0;
  {
    const int W = rt.world_size();
    // FULLSHARD_RANKS_PER_NODE pretends nodes, as the runtime's meshes do.
    const int per_node = rt.settings().ranks_per_node;
    fs::DeviceMesh shm(MPI_COMM_WORLD, {W}, {"dp"}, rt.settings().timeout_s,
                       fs::HostProgress::inline_, fs::HostCollectives::auto_, per_node);
    fs::DeviceMesh mpi(MPI_COMM_WORLD, {W}, {"dp"}, rt.settings().timeout_s,
                       fs::HostProgress::inline_, fs::HostCollectives::mpi, per_node);
    if (rt.rank() == 0 && W > 1 && shm.node_split("dp"))
      std::printf(
          "note: the ranks span %d nodes: shm/ runs on two levels (shared memory "
          "inside each node, MPI across)\n",
          shm.node_split("dp")->nodes());
    else if (rt.rank() == 0 && W > 1 && !shm.shm("dp"))
      std::printf("note: the ranks do not share a node: shm/ runs on MPI\n");
    MPI_Comm raw = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);
    for (double mib : {0.25, 1.0, 4.0, 16.0}) {
      const std::string s = mib < 1 ? "0.25" : std::to_string(static_cast<int>(mib));
      auto reg = [](const std::string& name, auto&&... args) {
        benchmark::RegisterBenchmark(name.c_str(), args...)->UseManualTime();
      };
      reg("memcpy/" + s, bench_memcpy, W, mib, W);
      if (W > 1) reg("memcpy_peers/" + s, bench_memcpy, W, mib, W - 1);
      const fs::fsdp::CompressionPolicy none;
      fs::fsdp::CompressionPolicy int8, fp8;
      int8.all_gather = int8.reduce_scatter = fs::kernels::QuantCode::int8;
      fp8.all_gather = fs::kernels::QuantCode::fp8_e4m3;
      reg("shm/all_gather/" + s, bench_all_gather, &shm, mib, none);
      reg("mpi/all_gather/" + s, bench_all_gather, &mpi, mib, none);
      reg("int8/all_gather/" + s, bench_all_gather, &mpi, mib, int8);
      reg("fp8/all_gather/" + s, bench_all_gather, &mpi, mib, fp8);
      reg("raw/MPI_Allgather/" + s, bench_raw_collective, raw, mib, true);
      reg("shm/reduce_scatter/" + s, bench_reduce_scatter, &shm, mib, none);
      reg("mpi/reduce_scatter/" + s, bench_reduce_scatter, &mpi, mib, none);
      reg("int8/reduce_scatter/" + s, bench_reduce_scatter, &mpi, mib, int8);
      reg("raw/MPI_Reduce_scatter_block/" + s, bench_raw_collective, raw, mib, false);
    }
    result = fs::bench::run_benchmarks(argc, argv);
    MPI_Comm_free(&raw);
  }
  return result;
}
