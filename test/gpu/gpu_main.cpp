// main() of the GPU test programs: skips with exit code 77 and a message when no CUDA device
// is visible (asked before anything starts: a CUDA-enabled Kokkos cannot even initialise
// without one), else starts the Runtime (MPI, Kokkos, device binding) and runs doctest.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdio>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>

#include "fullshard/runtime/runtime.hpp"
#include "gpu_support.hpp"

namespace fullshard::gpu_test {
namespace {
bool skipped = false;  // set by skip() in this process's tests
}

void skip(const std::string& why) {
  skipped = true;
  std::printf("SKIPPED: %s\n", why.c_str());
}

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(e));
}

}  // namespace fullshard::gpu_test

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf(
        "SKIPPED: no CUDA device (cudaGetDeviceCount: %s, %d devices); the GPU tests "
        "run on a machine with a GPU through scripts/gpu-check\n",
        e == cudaSuccess ? "ok" : cudaGetErrorString(e), devices);
    return 77;
  }
  int rc = 0;
  {
    std::optional<fullshard::Runtime> started;
    try {
      started.emplace(argc, argv);
    } catch (const std::exception& ex) {
      std::fprintf(stderr, "%s: the fullshard Runtime did not start: %s\n", argv[0], ex.what());
      return 1;
    }
    fullshard::Runtime& runtime = *started;
    std::printf("%s\n", runtime.describe().c_str());
    doctest::Context ctx(argc, argv);
    rc = ctx.run();
    if (rc == 0 && fullshard::gpu_test::skipped) rc = 77;
  }
  return rc;
}
