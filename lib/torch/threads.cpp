#include "fullshard/torch/threads.hpp"

#include <ATen/Parallel.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <thread>

#include "fullshard/base/error.hpp"

namespace fullshard::torch {

int use_launcher_cores(const Runtime& runtime) {
  int n = 0;
  if (const char* v = std::getenv("FULLSHARD_TORCH_THREADS"); v && *v) {
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    if (*end != '\0' || x < 1 || x > 4096)
      throw SettingsError("FULLSHARD_TORCH_THREADS=" + std::string(v) +
                          ": expected a thread count from 1 to 4096");
    n = static_cast<int>(x);
  } else {
    const int machine = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    cpu_set_t set;
    CPU_ZERO(&set);
    const int bound = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : machine;
    n = bound < machine ? bound : std::max(1, machine / std::max(1, runtime.local_size()));
  }
  at::set_num_threads(n);
  return n;
}

}  // namespace fullshard::torch
