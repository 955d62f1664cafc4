#include "fullshard/runtime/cpu_features.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace fullshard {
namespace {

#if defined(__x86_64__) || defined(__i386__)
bool bit(unsigned reg, int b) {
  return (reg >> b) & 1u;
}

// The XCR0 register: which register states the operating system saves (XGETBV, ecx 0).
unsigned long long xcr0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}
#endif

}  // namespace

CpuFeatures cpu_features() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = bit(c, 27), avx = bit(c, 28), fma = bit(c, 12);
  if (!osxsave || !avx) return f;
  const unsigned long long xcr = xcr0();
  const bool ymm = (xcr & 0x6) == 0x6;            // SSE and AVX state
  const bool zmm = (xcr & 0xe6) == 0xe6;          // and opmask, ZMM_Hi256, Hi16_ZMM
  const bool tiles = (xcr & 0x60000) == 0x60000;  // XTILECFG, XTILEDATA
  unsigned a7 = 0, b7 = 0, c7 = 0, d7 = 0;
  if (!__get_cpuid_count(7, 0, &a7, &b7, &c7, &d7)) return f;
  f.fma = ymm && fma;
  f.avx2 = ymm && bit(b7, 5);
  // F (16), DQ (17), BW (30), VL (31)
  f.avx512 = zmm && bit(b7, 16) && bit(b7, 17) && bit(b7, 30) && bit(b7, 31);
  f.amx = tiles && bit(d7, 24);
  unsigned a71 = 0, b71 = 0, c71 = 0, d71 = 0;
  if (a7 >= 1 && __get_cpuid_count(7, 1, &a71, &b71, &c71, &d71))
    f.avx512_bf16 = f.avx512 && bit(a71, 5);
#endif
  return f;
}

std::string CpuFeatures::names() const {
  std::string s;
  auto add = [&s](bool has, const char* name) {
    if (!has) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(avx2, "AVX2");
  add(fma, "FMA");
  add(avx512, "AVX-512");
  add(avx512_bf16, "AVX512-BF16");
  add(amx, "AMX");
  return s.empty() ? "no AVX2" : s;
}

}  // namespace fullshard
