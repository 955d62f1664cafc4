#include "blas_kernel.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fullshard/runtime/blas.hpp"

namespace fullshard::apps {
namespace {

// Set in the environment of the program run again: its value is the setting chosen (and it
// stops a second exec whatever happens).
constexpr const char* kChosen = "FULLSHARD_BLAS_KERNEL_CHOSEN";

}  // namespace

void run_on_best_blas_kernel(char** argv) {
  if (std::getenv(kChosen)) return;
  const char* mode = std::getenv("FULLSHARD_BLAS_KERNEL");
  const std::string m = mode && *mode ? mode : "auto";
  if (m != "auto" && m != "best" && m != "keep") {
    std::fprintf(stderr, "%s: FULLSHARD_BLAS_KERNEL='%s' is invalid: expected auto, best or keep\n",
                 argv && argv[0] ? argv[0] : "fullshard", m.c_str());
    std::exit(2);
  }
  if (m == "keep") return;
  if (const char* v = std::getenv("OPENBLAS_CORETYPE"); v && *v && m == "auto") return;
  const BlasInfo blas = loaded_blas();
  if (blas.library != "OpenBLAS" || blas.better_kernel.empty()) return;
  const std::string& setting = blas.better_kernel;  // "OPENBLAS_CORETYPE=SkylakeX"
  const auto eq = setting.find('=');
  setenv(setting.substr(0, eq).c_str(), setting.substr(eq + 1).c_str(), 1);
  setenv(kChosen, setting.c_str(), 1);
  execv("/proc/self/exe", argv);
  // Still here: exec failed. Go on with the kernel that was chosen, and say so.
  std::fprintf(stderr,
               "%s: could not run again with %s (%s): the generic BLAS kernel stays; set it "
               "before starting the program\n",
               argv && argv[0] ? argv[0] : "fullshard", setting.c_str(), std::strerror(errno));
  unsetenv(setting.substr(0, eq).c_str());
}

std::string blas_kernel_choice() {
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  if (!core || !*core) return {};
  const char* chosen = std::getenv(kChosen);
  return std::string("OPENBLAS_CORETYPE=") + core + (chosen ? " (set by the program)" : " (yours)");
}

}  // namespace fullshard::apps
