#include "fullshard/torch/threads.hpp"

#include <ATen/Parallel.h>

#include <cstdlib>
#include <string>

#include "fullshard/base/error.hpp"

namespace fullshard::torch {

int use_launcher_cores(const Runtime& runtime) {
  if (const char* v = std::getenv("FULLSHARD_TORCH_THREADS"); v && *v) {
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    if (*end != '\0' || x < 1 || x > 4096)
      throw SettingsError("FULLSHARD_TORCH_THREADS=" + std::string(v) +
                          ": expected a thread count from 1 to 4096");
    at::set_num_threads(static_cast<int>(x));
  } else if (const char* omp = std::getenv("OMP_NUM_THREADS"); omp && *omp) {
    // The user's choice, which LibTorch read itself.
  } else {
    at::set_num_threads(runtime.cores().threads);
  }
  return at::get_num_threads();
}

}  // namespace fullshard::torch
