// doctest main for fullshard's test programs, run as `mpiexec -n N prog` (N >= 1).
// Every rank runs every test case in the same order. Rank 0 reports on stdout as usual;
// the other ranks collect their output and print it, prefixed with their rank, only when
// they saw a failure. All ranks exit with the worst result of any rank.
//
// Compiled once per test device (test_devices.hpp): a program whose device cannot run here
// (the CUDA instantiation on a machine without a GPU) exits 77 with "SKIPPED: <why>" before
// anything starts; a Runtime that cannot start (a CUDA-Kokkos build without a device) ends
// the program with exit code 1 and the Runtime's message, not an uncaught exception.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <exception>
#include <optional>
#include <sstream>
#include <string>

#include "fullshard/runtime/runtime.hpp"
#include "test_devices.hpp"
#include "test_support.hpp"

namespace fullshard::test {
namespace {
Runtime* g_runtime = nullptr;  // set for the lifetime of main() only
}
const Runtime& runtime() {
  return *g_runtime;
}
}  // namespace fullshard::test

int main(int argc, char** argv) {
  using Device = fullshard::test::ProgramDevice;
  if (const std::string why = Device::unavailable(); !why.empty()) {
    std::printf("SKIPPED: the %s instantiation of these tests: %s\n", Device::name, why.c_str());
    return 77;
  }
  std::optional<fullshard::Runtime> runtime;
  try {
    runtime.emplace(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: the fullshard Runtime did not start: %s\n", argv[0], e.what());
    return 1;
  }
  fullshard::Runtime& rt = *runtime;
  fullshard::test::g_runtime = &rt;

  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  std::ostringstream captured;
  if (rt.rank() != 0) ctx.setCout(&captured);
  int result = ctx.run();
  if (rt.rank() != 0 && result != 0) {
    std::istringstream lines(captured.str());
    std::string line;
    while (std::getline(lines, line))
      std::fprintf(stderr, "[rank %d] %s\n", rt.rank(), line.c_str());
  }
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, rt.world());
  if (rt.rank() == 0 && worst != 0 && result == 0)
    std::printf("some test failed on another rank (see its [rank N] lines above)\n");
  fullshard::test::g_runtime = nullptr;
  return worst;
}
