// fullshard-bench-comm: what fullshard's MPI communicator costs on top of the raw MPI call.
//
// For all-gather (in place) and reduce-scatter (sum, out of place) over all ranks, f32, 4 KiB to
// 64 MiB per rank, it times
//   raw/<MPI call>/<bytes>                    the MPI collective on its own MPI_Comm_dup of world,
//   fullshard/<op>/caller/<bytes>             Communicator::<op> on a caller stream, then wait(),
//   fullshard/<op>/worker/<bytes>             the same on a worker stream (thread hand-off),
// plus raw/MPI_Iallgather/<bytes> (MPI_Iallgather + MPI_Wait) for the non-blocking variant.
// <bytes> is the per-rank payload: the all-gather's send count, the reduce-scatter's recv count.
//
// Timing, per iteration, on every rank: MPI_Barrier, MPI_Wtime around the operation, MAX over
// ranks (MPI_Allreduce), state.SetIterationTime(max). Every rank reports the same time, so
// Google Benchmark makes the same iteration-count decisions everywhere and no rank leaves a
// benchmark while the others still call collectives. Only rank 0 reports (console and
// --benchmark_out); the other ranks run with a reporter that prints nothing.
//
// Counters (nccl-tests factors, W ranks, B bytes per rank):
//   bytes  B;   algbw = W*B / time (GB/s);   busbw = algbw * (W-1)/W (GB/s).
//
// Allocator: Open MPI allocates temporary buffers inside collectives (reduce-scatter: the
// whole send size). With glibc's defaults, on the main thread those come from the main arena,
// which is trimmed back to the kernel after every free, so the next call page-faults them in
// again; a worker thread's arena is not trimmed the same way (but serves requests above its
// 64 MiB heap size with a fresh mmap every time). That alone made a 1 MiB
// MPI_Reduce_scatter_block 2x faster on a worker thread than on the main thread (2 ranks); with
// only the main arena kept warm, a 64 MiB one was 1.5-2x slower on the worker. To compare fullshard
// with raw MPI, not glibc's main arena with a thread arena, the benchmark starts with a warm
// allocator (mallopt: one arena, no mmap'd chunks, no trimming): every configuration then reuses
// the same pages.
// --fullshard_malloc=default keeps glibc's defaults.
//
// Launch: scripts/mpirun-local -n 4 build/bench/fullshard-bench-comm [--benchmark_* flags]
//         [--fullshard_malloc=warm|default]
#include <benchmark/benchmark.h>
#include <mpi.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "fullshard/fullshard.hpp"
#include "mpi_bench.hpp"

namespace {

using fullshard::DType;
using fullshard::bench::all_ranks;
using fullshard::bench::die;
using fullshard::bench::timed_loop;
using fullshard::comm::Communicator;
using fullshard::comm::ReduceOp;
using fullshard::comm::Stream;

// Communicators shared by all benchmarks (set in main, valid while benchmarks run).
MPI_Comm g_raw = MPI_COMM_NULL;   // the raw MPI benchmarks' own dup of world
Communicator* g_fs = nullptr;  // mesh.comm("dp")
int g_rank = 0;
int g_size = 1;

// Grow-only host buffers reused by every benchmark: allocated and touched (value-initialised)
// at the first run that needs the size, never inside the timed region.
std::vector<float> g_buf_a;
std::vector<float> g_buf_b;

float* grow(std::vector<float>& v, std::size_t n) {
  if (v.size() < n) {
    std::vector<float>().swap(v);  // free first: no old + new peak
    v.resize(n);
  }
  return v.data();
}

// Element i of rank q's contribution: small integers, so f32 sums over ranks are exact.
inline float pattern(int q, std::size_t i) {
  return static_cast<float>((q * 7 + i) % 251);
}

// Samples ~1024 elements of each block (and the ends) when checking results.
inline std::size_t stride_for(std::size_t count) {
  return count > 1024 ? count / 1024 : 1;
}

void set_counters(benchmark::State& state, std::size_t bytes_per_rank) {
  using benchmark::Counter;
  const double total = static_cast<double>(bytes_per_rank) * g_size;
  const double bus = g_size > 1 ? total * (g_size - 1) / g_size : 0.0;
  state.counters["bytes"] =
      Counter(static_cast<double>(bytes_per_rank), Counter::kDefaults, Counter::kIs1024);
  state.counters["algbw"] = Counter(total / 1e9, Counter::kIsIterationInvariantRate);
  state.counters["busbw"] = Counter(bus / 1e9, Counter::kIsIterationInvariantRate);
}

// ---- all-gather (in place) -----------------------------------------------------------------

// Fills this rank's slot, poisons the others.
float* prepare_all_gather(std::size_t count) {
  float* buf = grow(g_buf_a, count * g_size);
  for (int q = 0; q < g_size; ++q)
    for (std::size_t i = 0; i < count; ++i)
      buf[q * count + i] = q == g_rank ? pattern(q, i) : -1.0f;
  return buf;
}

bool all_gather_ok(const float* buf, std::size_t count) {
  bool ok = true;
  for (int q = 0; q < g_size; ++q) {
    for (std::size_t i = 0; i < count; i += stride_for(count))
      ok &= buf[q * count + i] == pattern(q, i);
    ok &= buf[q * count + count - 1] == pattern(q, count - 1);
  }
  return ok;
}

enum class Impl { raw, raw_nonblocking, fs };

void bench_all_gather(benchmark::State& state, Impl impl, Stream* stream, std::size_t count) {
  try {
    float* buf = prepare_all_gather(count);
    const int n = static_cast<int>(count);
    auto op = [&] {
      switch (impl) {
        case Impl::raw:
          MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, n, MPI_FLOAT, g_raw);
          break;
        case Impl::raw_nonblocking: {
          MPI_Request req = MPI_REQUEST_NULL;
          MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, n, MPI_FLOAT, g_raw, &req);
          MPI_Wait(&req, MPI_STATUS_IGNORE);
          break;
        }
        case Impl::fs:
          g_fs->all_gather(buf + g_rank * count, buf, count, DType::f32, *stream).wait();
          break;
      }
    };
    op();  // warm-up (connections, algorithm selection) and correctness check, untimed
    if (!all_ranks(all_gather_ok(buf, count))) {
      state.SkipWithError("all_gather produced wrong data on some rank");
      return;
    }
    timed_loop(state, op);
    set_counters(state, count * sizeof(float));
  } catch (const std::exception& e) {
    die("all_gather", e);
  }
}

// ---- reduce-scatter (sum, out of place: send W*count, recv count) ----------------------------

void bench_reduce_scatter(benchmark::State& state, Impl impl, Stream* stream, std::size_t count) {
  try {
    float* send = grow(g_buf_a, count * g_size);
    float* recv = grow(g_buf_b, count);
    for (std::size_t j = 0; j < count * g_size; ++j)
      send[j] = pattern(g_rank, j);
    std::fill(recv, recv + count, -1.0f);
    const int n = static_cast<int>(count);
    auto op = [&] {
      if (impl == Impl::fs)
        g_fs->reduce_scatter(send, recv, count, DType::f32, ReduceOp::sum, *stream).wait();
      else
        MPI_Reduce_scatter_block(send, recv, n, MPI_FLOAT, MPI_SUM, g_raw);
    };
    op();
    bool ok = true;
    auto expect = [&](std::size_t i) {
      float s = 0.0f;
      for (int q = 0; q < g_size; ++q)
        s += pattern(q, g_rank * count + i);
      return s;
    };
    for (std::size_t i = 0; i < count; i += stride_for(count))
      ok &= recv[i] == expect(i);
    ok &= recv[count - 1] == expect(count - 1);
    if (!all_ranks(ok)) {
      state.SkipWithError("reduce_scatter produced wrong data on some rank");
      return;
    }
    timed_loop(state, op);
    set_counters(state, count * sizeof(float));
  } catch (const std::exception& e) {
    die("reduce_scatter", e);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool warm = true;
  if (!fullshard::bench::take_malloc_flag(argc, argv, warm)) {
    std::fprintf(stderr, "fullshard-bench-comm: --fullshard_malloc takes warm or default\n");
    return 1;
  }
  if (fullshard::bench::random_interleaving_requested(argc, argv)) {
    std::fprintf(stderr,
                 "fullshard-bench-comm: --benchmark_enable_random_interleaving would run "
                 "the benchmarks in a different order on every rank; not supported\n");
    return 1;
  }
  const char* const malloc_mode =
      fullshard::bench::warm_up_allocator(warm);  // before MPI allocates anything
  try {
    fullshard::Runtime rt(argc, argv);
    g_rank = rt.rank();
    g_size = rt.world_size();
    MPI_Comm_dup(rt.world(), &g_raw);
    fullshard::DeviceMesh mesh(rt, {g_size}, {"dp"});
    g_fs = &mesh.comm("dp");
    Stream caller = Stream::caller("bench");
    Stream ag_worker = Stream::worker("ag");
    Stream rs_worker = Stream::worker("rs");

    benchmark::AddCustomContext("fullshard_ranks", std::to_string(g_size));
    benchmark::AddCustomContext("fullshard_runtime", rt.describe());
    benchmark::AddCustomContext("mpi_library", fullshard::bench::mpi_library());
    benchmark::AddCustomContext("dtype", "f32");
    benchmark::AddCustomContext("malloc", malloc_mode);

    struct Family {
      const char* name;
      bool gather;
      Impl impl;
      Stream* stream;
    };
    const Family families[] = {
        {"raw/MPI_Allgather", true, Impl::raw, nullptr},
        {"fullshard/all_gather/caller", true, Impl::fs, &caller},
        {"fullshard/all_gather/worker", true, Impl::fs, &ag_worker},
        {"raw/MPI_Iallgather", true, Impl::raw_nonblocking, nullptr},
        {"raw/MPI_Reduce_scatter_block", false, Impl::raw, nullptr},
        {"fullshard/reduce_scatter/caller", false, Impl::fs, &caller},
        {"fullshard/reduce_scatter/worker", false, Impl::fs, &rs_worker},
    };
    // Sizes outer, implementations inner: raw and fullshard of one size run back to back, so
    // slow drifts of a noisy machine hit both alike.
    for (std::size_t bytes = 4096; bytes <= (std::size_t{64} << 20); bytes *= 4) {
      const std::size_t count = bytes / sizeof(float);
      for (const Family& f : families) {
        const std::string name = std::string(f.name) + "/" + std::to_string(bytes);
        auto* b = f.gather ? benchmark::RegisterBenchmark(name.c_str(), bench_all_gather, f.impl,
                                                          f.stream, count)
                           : benchmark::RegisterBenchmark(name.c_str(), bench_reduce_scatter,
                                                          f.impl, f.stream, count);
        b->UseManualTime()->Unit(benchmark::kMicrosecond);
      }
    }

    const int rc = fullshard::bench::run_benchmarks(argc, argv);
    MPI_Comm_free(&g_raw);
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fullshard-bench-comm: %s\n", e.what());
    return 2;
  }
}
