// The runtime gives each rank its share of the node's cores (its affinity mask's CPUs over
// the ranks of the node bound to the same mask), and hands that count to the BLAS it finds
// loaded and to Kokkos's host threads, unless the user chose theirs.
#include <doctest/doctest.h>
#include <sched.h>
#include <Kokkos_Core.hpp>
#include "cblas_api.hpp"

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "fullshard/runtime/blas.hpp"
#include "fullshard/runtime/core_share.hpp"
#include "test_support.hpp"

TEST_CASE("each rank's thread count is its mask's CPUs over the ranks bound to that mask") {
  const fullshard::Runtime& rt = fullshard::test::runtime();
  cpu_set_t mask;
  CPU_ZERO(&mask);
  REQUIRE(sched_getaffinity(0, sizeof mask, &mask) == 0);
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(rt.world(), MPI_COMM_TYPE_SHARED, rt.rank(), MPI_INFO_NULL, &node);
  int n = 0;
  MPI_Comm_size(node, &n);
  std::vector<cpu_set_t> all(static_cast<std::size_t>(n));
  MPI_Allgather(&mask, sizeof mask, MPI_BYTE, all.data(), sizeof mask, MPI_BYTE, node);
  MPI_Comm_free(&node);
  int same = 0;
  for (const cpu_set_t& m : all)
    same += CPU_EQUAL(&m, &mask) ? 1 : 0;
  int expected = std::max(1, CPU_COUNT(&mask) / same);
  if (const char* c = std::getenv("SLURM_CPUS_PER_TASK"); c && std::atoi(c) > 0)
    expected = std::min(expected, std::atoi(c));
  INFO("mask CPUs " << CPU_COUNT(&mask) << ", ranks sharing it " << same << ": " << rt.cores().why);
  CHECK(rt.cores().threads == expected);
}

TEST_CASE("the loaded BLAS runs the rank's threads unless its variables chose") {
  const fullshard::Runtime& rt = fullshard::test::runtime();
  const float x[4] = {1, 2, 3, 4};
  CHECK(cblas_sdot(4, x, 1, x, 1) == 30.0f);  // and this program loads the BLAS
  const fullshard::BlasInfo blas = fullshard::loaded_blas();
  REQUIRE(!blas.library.empty());
  const std::string user =
      fullshard::user_thread_setting(fullshard::blas_thread_variables(blas.library));
  if (user.empty()) {
    CHECK(blas.threads == rt.cores().threads);
  } else {
    MESSAGE("the BLAS's threads were chosen by " << user << ": not changed, not checked");
  }
}

TEST_CASE("Kokkos's host threads are the rank's unless the user chose") {
#if defined(KOKKOS_ENABLE_OPENMP) || defined(KOKKOS_ENABLE_THREADS)
  const fullshard::Runtime& rt = fullshard::test::runtime();
  if (std::getenv("OMP_NUM_THREADS") || std::getenv("KOKKOS_NUM_THREADS")) {
    MESSAGE("OMP_NUM_THREADS or KOKKOS_NUM_THREADS is set: Kokkos keeps the user's threads");
    return;
  }
  CHECK(Kokkos::DefaultHostExecutionSpace().concurrency() == rt.cores().threads);
#else
  MESSAGE("Kokkos runs no host threads here (" << Kokkos::DefaultHostExecutionSpace::name()
                                               << "): nothing to give it");
#endif
}
