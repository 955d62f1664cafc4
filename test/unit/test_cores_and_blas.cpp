// The rank's share of cores (the function that decides), the user's thread settings, and the
// BLAS kernel advice against this CPU's features as /proc/cpuinfo lists them.
#include <doctest/doctest.h>
#include <stdlib.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "fullshard/runtime/blas.hpp"
#include "fullshard/runtime/core_share.hpp"
#include "fullshard/runtime/cpu_features.hpp"

using fullshard::better_openblas_core;
using fullshard::CpuFeatures;
using fullshard::LauncherCores;
using fullshard::share_cores;

namespace {
LauncherCores facts(int node, int mask, int sharing, int slurm = 0) {
  LauncherCores c;
  c.node_cpus = node;
  c.affinity_cpus = mask;
  c.ranks_sharing_mask = sharing;
  c.slurm_cpus_per_task = slurm;
  return c;
}

// The "flags" words of the first processor in /proc/cpuinfo (empty where there is none).
std::set<std::string> cpuinfo_flags() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> s;
    for (std::string w; words >> w;)
      s.insert(w);
    return s;
  }
  return {};
}
}  // namespace

TEST_CASE("share_cores: the mask's CPUs over the ranks that share it, at most srun -c") {
  // mpirun -n 4 --oversubscribe on 2 cores: nobody bound, 4 ranks share the node.
  auto s = share_cores(facts(2, 2, 4));
  CHECK(s.threads == 1);
  CHECK(s.why == "the node's 2 CPUs shared by 4 ranks");
  // One rank alone on the node takes every CPU.
  s = share_cores(facts(16, 16, 1));
  CHECK(s.threads == 16);
  CHECK(s.why == "the node's 16 CPUs for one rank");
  // Bound to 4 cores each (srun --cpu-bind=cores -c 4, mpirun --map-by slot:PE=4).
  s = share_cores(facts(16, 4, 1, 4));
  CHECK(s.threads == 4);
  CHECK(s.why == "its 4 bound CPUs");
  // Bound to a socket of 8 CPUs with another rank (mpirun's --bind-to socket).
  s = share_cores(facts(16, 8, 2));
  CHECK(s.threads == 4);
  CHECK(s.why == "its 8 bound CPUs shared by 2 ranks");
  // srun -c 2 without binding (task/none): at most 2.
  s = share_cores(facts(16, 16, 4, 2));
  CHECK(s.threads == 2);
  CHECK(s.why == "srun -c 2 (SLURM_CPUS_PER_TASK)");
  // srun -c larger than the share (--overcommit): the share.
  s = share_cores(facts(2, 2, 4, 8));
  CHECK(s.threads == 1);
  // Never below one thread, whatever the facts say.
  CHECK(share_cores(facts(1, 0, 0)).threads == 1);
}

TEST_CASE("user_thread_setting: the first variable set, as NAME=value") {
  static const char* const vars[] = {"FULLSHARD_TEST_A_THREADS", "FULLSHARD_TEST_B_THREADS",
                                     nullptr};
  unsetenv("FULLSHARD_TEST_A_THREADS");
  unsetenv("FULLSHARD_TEST_B_THREADS");
  CHECK(fullshard::user_thread_setting(vars).empty());
  setenv("FULLSHARD_TEST_B_THREADS", "3", 1);
  CHECK(fullshard::user_thread_setting(vars) == "FULLSHARD_TEST_B_THREADS=3");
  setenv("FULLSHARD_TEST_A_THREADS", "2", 1);
  CHECK(fullshard::user_thread_setting(vars) == "FULLSHARD_TEST_A_THREADS=2");
  setenv("FULLSHARD_TEST_A_THREADS", "", 1);  // empty: not a choice
  CHECK(fullshard::user_thread_setting(vars) == "FULLSHARD_TEST_B_THREADS=3");
  unsetenv("FULLSHARD_TEST_A_THREADS");
  unsetenv("FULLSHARD_TEST_B_THREADS");
  // OpenBLAS reads its own variable first, then GOTO's, then OpenMP's.
  const char* const* o = fullshard::blas_thread_variables("OpenBLAS");
  CHECK(std::string(o[0]) == "OPENBLAS_NUM_THREADS");
  CHECK(std::string(o[2]) == "OMP_NUM_THREADS");
  CHECK(fullshard::blas_thread_variables("none")[0] == nullptr);
}

TEST_CASE("better_openblas_core: the kernel the CPU is made for, only when it is better") {
  CpuFeatures sse;
  CpuFeatures avx2;
  avx2.avx2 = avx2.fma = true;
  CpuFeatures avx512 = avx2;
  avx512.avx512 = true;
  CHECK(better_openblas_core("Prescott", avx512) == "SkylakeX");
  CHECK(better_openblas_core("Haswell", avx512) == "SkylakeX");
  CHECK(better_openblas_core("SkylakeX", avx512).empty());
  CHECK(better_openblas_core("Cooperlake", avx512).empty());
  CHECK(better_openblas_core("Prescott", avx2) == "Haswell");
  CHECK(better_openblas_core("Zen", avx2).empty());
  CHECK(better_openblas_core("Prescott", sse).empty());
  CHECK(better_openblas_core("Sandybridge", sse).empty());
}

TEST_CASE("cpu_features agrees with /proc/cpuinfo") {
  const std::set<std::string> flags = cpuinfo_flags();
  if (flags.empty()) {
    MESSAGE("no flags line in /proc/cpuinfo: nothing to compare");
    return;
  }
  const CpuFeatures f = fullshard::cpu_features();
  auto has = [&flags](const char* name) { return flags.count(name) > 0; };
  CHECK(f.avx2 == has("avx2"));
  CHECK(f.fma == has("fma"));
  CHECK(f.avx512 == (has("avx512f") && has("avx512bw") && has("avx512dq") && has("avx512vl")));
  CHECK(f.avx512_bf16 == has("avx512_bf16"));
  CHECK(f.amx == has("amx_tile"));
  const std::string names = f.names();
  CHECK((names.find("AVX2") != std::string::npos) == f.avx2);
  CHECK((names.find("AVX-512") != std::string::npos) == f.avx512);
}

TEST_CASE("BlasInfo::describe") {
  fullshard::BlasInfo b;
  CHECK(b.describe() == "none loaded");
  b.library = "OpenBLAS";
  b.version = "0.3.21";
  b.kernel = "SkylakeX";
  b.threading = "pthreads";
  b.threads = 1;
  CHECK(b.describe() == "OpenBLAS 0.3.21 (kernel SkylakeX, pthreads, 1 thread)");
  b.threads = 4;
  CHECK(b.describe() == "OpenBLAS 0.3.21 (kernel SkylakeX, pthreads, 4 threads)");
  b.library = "FlexiBLAS";
  b.kernel = "OPENBLAS-OPENMP";
  b.threading.clear();
  CHECK(b.describe() == "FlexiBLAS 0.3.21 (backend OPENBLAS-OPENMP, 4 threads)");
}
