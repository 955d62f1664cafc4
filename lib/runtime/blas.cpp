#include "fullshard/runtime/blas.hpp"

#include <dlfcn.h>

#include <cstdint>
#include <string>

namespace fullshard {
namespace {

// A function of the process's global scope (the executable and the libraries it loaded), or
// null: how a BLAS is recognised without linking one.
template <typename Fn>
Fn* symbol(const char* name) {
  return reinterpret_cast<Fn*>(dlsym(RTLD_DEFAULT, name));
}

// The word after `key` in OpenBLAS's configuration string ("OpenBLAS 0.3.21 DYNAMIC_ARCH ...").
std::string word_after(const std::string& s, const std::string& key) {
  const auto at = s.find(key);
  if (at == std::string::npos) return {};
  const auto from = at + key.size();
  return s.substr(from, s.find(' ', from) - from);
}

// How far a kernel goes: 2 for AVX-512 kernels, 1 for AVX2, 0 for older ones.
int openblas_core_level(const std::string& core) {
  for (const char* c : {"SkylakeX", "Cooperlake", "SapphireRapids"})
    if (core == c) return 2;
  for (const char* c : {"Haswell", "Zen", "Excavator"})
    if (core == c) return 1;
  return 0;
}

void openblas(BlasInfo& b) {
  b.library = "OpenBLAS";
  if (auto* config = symbol<char*()>("openblas_get_config")) {
    const std::string s = config();
    b.version = word_after(s, "OpenBLAS ");
    b.dynamic_arch = s.find("DYNAMIC_ARCH") != std::string::npos;
  }
  if (auto* core = symbol<char*()>("openblas_get_corename")) b.kernel = core();
  if (auto* parallel = symbol<int()>("openblas_get_parallel")) {
    const int p = parallel();
    b.threading = p == 0 ? "sequential" : p == 2 ? "OpenMP" : "pthreads";
  }
  if (auto* n = symbol<int()>("openblas_get_num_threads")) b.threads = n();
  if (b.dynamic_arch) {
    const std::string better = better_openblas_core(b.kernel, cpu_features());
    if (!better.empty()) b.better_kernel = "OPENBLAS_CORETYPE=" + better;
  }
}

void blis(BlasInfo& b) {
  b.library = "BLIS";
  if (auto* v = symbol<const char*()>("bli_info_get_version_str")) b.version = v();
  auto* id = symbol<int()>("bli_arch_query_id");
  auto* name = symbol<const char*(int)>("bli_arch_string");
  if (id && name) b.kernel = name(id());
  if (auto* n = symbol<std::int64_t()>("bli_thread_get_num_threads")) {
    const std::int64_t t = n();
    b.threads = t > 0 ? static_cast<int>(t) : 1;  // -1: not set, one thread
  }
}

void mkl(BlasInfo& b) {
  b.library = "Intel MKL";
  if (auto* v = symbol<void(char*, int)>("MKL_Get_Version_String")) {
    char buf[256] = {0};
    v(buf, sizeof buf - 1);
    b.version = buf;
    if (const auto end = b.version.find_last_not_of(' '); end != std::string::npos)
      b.version.resize(end + 1);
  }
  if (auto* n = symbol<int()>("MKL_Get_Max_Threads")) b.threads = n();
}

void flexiblas(BlasInfo& b) {
  b.library = "FlexiBLAS";
  if (auto* v = symbol<int(int*, int*, int*)>("flexiblas_get_version")) {
    int major = 0, minor = 0, patch = 0;
    v(&major, &minor, &patch);
    b.version = std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
  }
  if (auto* backend = symbol<int(char*, std::size_t)>("flexiblas_current_backend")) {
    char buf[128] = {0};
    backend(buf, sizeof buf - 1);
    b.kernel = buf;
  }
  if (auto* n = symbol<int()>("flexiblas_get_num_threads")) b.threads = n();
}

}  // namespace

std::string better_openblas_core(const std::string& core, const CpuFeatures& cpu) {
  const int have = openblas_core_level(core);
  if (cpu.avx512 && have < 2) return "SkylakeX";
  if (cpu.avx2 && cpu.fma && have < 1) return "Haswell";
  return {};
}

BlasInfo loaded_blas() {
  BlasInfo b;
  // FlexiBLAS first: the backend it loads may show its own symbols too.
  if (symbol<void>("flexiblas_get_version"))
    flexiblas(b);
  else if (symbol<void>("MKL_Get_Version_String"))
    mkl(b);
  else if (symbol<void>("openblas_get_config"))
    openblas(b);
  else if (symbol<void>("bli_info_get_version_str"))
    blis(b);
  return b;
}

bool set_blas_threads(int threads) {
  if (threads < 1) return false;
  if (auto* f = symbol<void(int)>("flexiblas_set_num_threads")) {
    f(threads);
    return true;
  }
  if (auto* m = symbol<void(int)>("MKL_Set_Num_Threads")) {
    m(threads);
    return true;
  }
  if (auto* o = symbol<void(int)>("openblas_set_num_threads")) {
    o(threads);
    return true;
  }
  if (auto* b = symbol<void(std::int64_t)>("bli_thread_set_num_threads")) {
    b(threads);
    return true;
  }
  return false;
}

const char* const* blas_thread_variables(const std::string& library) {
  static const char* const openblas_vars[] = {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                                              "OMP_NUM_THREADS", nullptr};
  static const char* const blis_vars[] = {"BLIS_NUM_THREADS", "OMP_NUM_THREADS", nullptr};
  static const char* const mkl_vars[] = {"MKL_NUM_THREADS", "OMP_NUM_THREADS", nullptr};
  static const char* const flexiblas_vars[] = {"FLEXIBLAS_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                               "BLIS_NUM_THREADS",      "MKL_NUM_THREADS",
                                               "OMP_NUM_THREADS",       nullptr};
  static const char* const none[] = {nullptr};
  if (library == "OpenBLAS") return openblas_vars;
  if (library == "BLIS") return blis_vars;
  if (library == "Intel MKL") return mkl_vars;
  if (library == "FlexiBLAS") return flexiblas_vars;
  return none;
}

std::string BlasInfo::describe() const {
  if (library.empty()) return "none loaded";
  std::string s = library;
  if (!version.empty()) s += " " + version;
  std::string detail;
  auto add = [&detail](const std::string& part) {
    if (part.empty()) return;
    detail += detail.empty() ? "" : ", ";
    detail += part;
  };
  if (!kernel.empty()) add((library == "FlexiBLAS" ? "backend " : "kernel ") + kernel);
  add(threading);
  if (threads > 0) add(std::to_string(threads) + (threads == 1 ? " thread" : " threads"));
  if (!detail.empty()) s += " (" + detail + ")";
  return s;
}

}  // namespace fullshard
