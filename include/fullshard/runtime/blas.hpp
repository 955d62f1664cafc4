// The BLAS library this process runs its matrix products with: which one, which kernel, how
// many threads. fullshard itself needs no BLAS; the programs and the front ends' models do,
// and a generic kernel or a thread per core in every rank makes them several times slower.
#pragma once

#include <string>

#include "fullshard/runtime/cpu_features.hpp"

namespace fullshard {

struct BlasInfo {
  /// "OpenBLAS", "BLIS", "Intel MKL" or "FlexiBLAS"; empty when no BLAS is loaded.
  std::string library;
  /// Its version ("0.3.21"), when it says.
  std::string version;
  /// The kernel it chose: OpenBLAS's core ("Prescott", "Haswell", "SkylakeX"), BLIS's
  /// architecture ("skx", "zen3"), FlexiBLAS's backend.
  std::string kernel;
  /// "pthreads", "OpenMP" or "sequential", when it says.
  std::string threading;
  /// Its thread count now (0 when it does not say).
  int threads = 0;
  /// OpenBLAS only: built with DYNAMIC_ARCH, so OPENBLAS_CORETYPE chooses the kernel.
  bool dynamic_arch = false;
  /// When the kernel is below what this CPU runs: the setting that gives the right one
  /// ("OPENBLAS_CORETYPE=SkylakeX"); empty when the kernel fits the CPU or cannot be changed.
  std::string better_kernel;

  /// "OpenBLAS 0.3.21 (kernel SkylakeX, pthreads, 1 thread)", or "none loaded".
  std::string describe() const;
};

/// The BLAS loaded into this process, found by its own symbols (nothing is loaded or linked
/// for this): what the process's products run on, whoever linked it.
BlasInfo loaded_blas();

/// The OpenBLAS core to ask for (OPENBLAS_CORETYPE) when `core` runs below what `cpu`
/// supports: "SkylakeX" on AVX-512, "Haswell" on AVX2 with FMA; empty when `core` already
/// uses them. Exposed for tests.
std::string better_openblas_core(const std::string& core, const CpuFeatures& cpu);

/// Sets the loaded BLAS's thread count (OpenBLAS, BLIS, MKL, FlexiBLAS); false when no BLAS
/// is loaded or it has no such call.
bool set_blas_threads(int threads);

/// The environment variables with which a user chooses `library`'s thread count, in the
/// order that library reads them ("OPENBLAS_NUM_THREADS GOTO_NUM_THREADS OMP_NUM_THREADS").
const char* const* blas_thread_variables(const std::string& library);

}  // namespace fullshard
