// The vector extensions of the CPU that decide which BLAS kernel is the right one.
#pragma once

#include <string>

namespace fullshard {

/// What this x86-64 CPU (and its operating system) can run; all false elsewhere.
struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  /// AVX-512 F, BW, DQ and VL together: what OpenBLAS's SkylakeX kernels use.
  bool avx512 = false;
  bool avx512_bf16 = false;
  /// Intel AMX tiles (AMX-TILE).
  bool amx = false;

  /// "AVX2 FMA AVX-512 AVX512-BF16 AMX", the extensions present, or "no AVX2".
  std::string names() const;
};

/// This CPU's features (CPUID, with the operating system's XSAVE state checked).
CpuFeatures cpu_features();

}  // namespace fullshard
