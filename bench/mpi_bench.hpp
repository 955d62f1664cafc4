// Plumbing shared by the MPI benchmarks: Google Benchmark under MPI done right.
//
// Every iteration is timed on every rank (MPI_Barrier, MPI_Wtime around the operation) and
// the MAX over ranks is what Google Benchmark sees (manual time), so all ranks make the same
// iteration-count decisions and none leaves a benchmark while others still call collectives.
// Only rank 0 reports; the others run with a reporter that prints nothing.
#pragma once

#include <benchmark/benchmark.h>
#include <mpi.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "fullshard/runtime/blas.hpp"
#include "fullshard/runtime/cpu_features.hpp"

namespace fullshard::bench {

/// Communicator for barriers and max-time agreement (never timed); set by run_benchmarks.
/// The median of `v` (the mean of the middle two for an even count).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline MPI_Comm& control_comm() {
  static MPI_Comm c = MPI_COMM_NULL;
  return c;
}

/// Prints nothing; ReportContext returns true, else the runs would be skipped on that rank
/// and rank 0 would wait forever in the first collective.
class NullReporter final : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

/// True on every rank iff `ok` on every rank.
inline bool all_ranks(bool ok) {
  int v = ok ? 1 : 0;
  int all = 0;
  MPI_Allreduce(&v, &all, 1, MPI_INT, MPI_MIN, control_comm());
  return all == 1;
}

/// Errors must not leave the other ranks waiting in a collective: report and abort the job.
[[noreturn]] inline void die(const char* bench, const std::exception& e) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "fullshard bench[rank %d] %s: %s\n", rank, bench, e.what());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 2);
  std::abort();
}

/// Times every iteration (max over ranks) and adds the counters med_us and min_us (median and
/// minimum iteration time in microseconds; Google Benchmark's Time column is the mean, which
/// one descheduled iteration on an oversubscribed node can dominate).
template <class Op>
void timed_loop(benchmark::State& state, Op&& op) {
  std::vector<double> times;
  times.reserve(static_cast<std::size_t>(state.max_iterations));
  for (auto _ : state) {
    MPI_Barrier(control_comm());
    const double t0 = MPI_Wtime();
    op();
    const double local = MPI_Wtime() - t0;
    double slowest = 0.0;
    MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, control_comm());
    state.SetIterationTime(slowest);
    times.push_back(slowest);
  }
  if (times.empty()) return;
  std::sort(times.begin(), times.end());
  const std::size_t n = times.size();
  state.counters["med_us"] = (n % 2 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2])) * 1e6;
  state.counters["min_us"] = times.front() * 1e6;
}

/// A baseline beside a timed_loop: the median of `runs` timed calls of `op` on each rank, the
/// slowest rank's, in seconds (a plain loop, no barrier per call).
template <class Op>
double slowest_median_s(Op&& op, int runs) {
  std::vector<double> t;
  t.reserve(static_cast<std::size_t>(runs));
  for (int k = 0; k < runs; ++k) {
    const double t0 = MPI_Wtime();
    op();
    t.push_back(MPI_Wtime() - t0);
  }
  std::sort(t.begin(), t.end());
  const std::size_t n = t.size();
  const double local = n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
  double slowest = 0.0;
  MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, control_comm());
  return slowest;
}

/// Removes --benchmark_out=... and --benchmark_out_format=... (ranks != 0: only rank 0 writes
/// the file; another rank opening it would truncate what rank 0 wrote).
inline void drop_output_flags(int& argc, char** argv) {
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--benchmark_out=", 0) != 0 && a.rfind("--benchmark_out_format=", 0) != 0)
      argv[kept++] = argv[i];
  }
  argc = kept;
  argv[argc] = nullptr;
}

// Parses and removes --fullshard_malloc=warm|default (before MPI and Google Benchmark see
// argv); returns false on a bad value.
inline bool take_malloc_flag(int& argc, char** argv, bool& warm) {
  const char* const key = "--fullshard_malloc=";
  const std::size_t len = std::strlen(key);
  bool good = true;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], key, len) != 0) {
      argv[kept++] = argv[i];
      continue;
    }
    const std::string v = argv[i] + len;
    if (v == "warm" || v == "default")
      warm = v == "warm";
    else
      good = false;
  }
  argc = kept;
  argv[argc] = nullptr;
  return good;
}

// Warm allocator (see the top of this file): every malloc from the heap, freed memory kept.
inline const char* warm_up_allocator(bool warm) {
  if (!warm) return "glibc defaults";
#if defined(__GLIBC__)
  mallopt(M_ARENA_MAX, 1);        // worker threads allocate like the main thread
  mallopt(M_MMAP_MAX, 0);         // no mmap'd chunks (each would be page-faulted in per call)
  mallopt(M_TRIM_THRESHOLD, -1);  // never give the top of the heap back
  mallopt(M_TOP_PAD, 64 << 20);   // grow the heap in big steps
  return "warm (glibc mallopt: M_ARENA_MAX=1, M_MMAP_MAX=0, M_TRIM_THRESHOLD=-1, "
         "M_TOP_PAD=64 MiB)";
#else
  return "not glibc: allocator defaults";
#endif
}

// --benchmark_enable_random_interleaving shuffles the run order with std::random_device: a
// different order on every rank, so ranks would call different collectives. Refused.
inline bool random_interleaving_requested(int argc, char** argv) {
  const char* const key = "--benchmark_enable_random_interleaving";
  const std::size_t len = std::strlen(key);
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], key, len) != 0) continue;
    const std::string v = argv[i][len] == '=' ? argv[i] + len + 1 : "true";
    if (v != "false" && v != "0" && v != "no" && v != "f" && v != "n" && v != "FALSE" &&
        v != "False")
      return true;
  }
  return false;
}

inline std::string mpi_library() {
  char v[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
  int len = 0;
  MPI_Get_library_version(v, &len);
  std::string s(v, static_cast<std::size_t>(len));
  if (const auto cut = s.find_first_of("\n,"); cut != std::string::npos) s.resize(cut);
  return s;
}

/// Before the Runtime starts: takes --fullshard_malloc=warm|default (and applies it, recording
/// it in the benchmark context) and refuses random interleaving. False (after printing why)
/// on a bad flag.
inline bool early_flags(int& argc, char** argv, const char* program) {
  bool warm = true;
  if (!take_malloc_flag(argc, argv, warm) || random_interleaving_requested(argc, argv)) {
    std::fprintf(stderr,
                 "%s: --fullshard_malloc takes warm or default; "
                 "--benchmark_enable_random_interleaving is not supported under MPI\n",
                 program);
    return false;
  }
  benchmark::AddCustomContext("malloc", warm_up_allocator(warm));
  return true;
}

/// Runs the registered benchmarks with rank 0 reporting; call after the Runtime is up.
inline int run_benchmarks(int argc, char** argv) {
  // What products ran on (for the programs with a model): the BLAS, its kernel and threads.
  benchmark::AddCustomContext("blas", fullshard::loaded_blas().describe());
  benchmark::AddCustomContext("cpu", fullshard::cpu_features().names());
  MPI_Comm_dup(MPI_COMM_WORLD, &control_comm());
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) drop_output_flags(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;  // same on every rank
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    NullReporter quiet;  // no --benchmark_out here, so no file reporter either
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  MPI_Comm_free(&control_comm());
  return 0;
}

}  // namespace fullshard::bench
