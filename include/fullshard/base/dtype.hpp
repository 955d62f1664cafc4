// Element types and the 16-bit float conversions used on every path (wire format, casts,
// reductions). f16 and bf16 are stored as raw 16-bit words: Kokkos' half types are 4-byte
// floats on host builds, so they are never used for storage or on the wire.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FULLSHARD_HOST_DEVICE __host__ __device__
#else
#define FULLSHARD_HOST_DEVICE
#endif

namespace fullshard {

enum class DType : std::uint8_t { f32, f64, f16, bf16 };

/// Bytes per element.
constexpr std::size_t dtype_size(DType t) noexcept {
  return t == DType::f64 ? 8 : (t == DType::f32 ? 4 : 2);
}
/// "f32", "f64", "f16", "bf16".
const char* dtype_name(DType t) noexcept;
/// Parses a dtype name ("f32", "float32", "bf16", "bfloat16", ...); throws ConfigError naming
/// `what` (the option or JSON path the value came from) on anything else.
DType parse_dtype(const std::string& name, const std::string& what = "dtype");

/// Unit roundoff of a dtype: the largest relative error of one rounding to nearest.
constexpr double dtype_unit_roundoff(DType t) noexcept {
  switch (t) {
    case DType::f64:
      return 1.1102230246251565e-16;  // 2^-53
    case DType::f32:
      return 5.960464477539063e-08;  // 2^-24
    case DType::f16:
      return 4.8828125e-04;  // 2^-11
    case DType::bf16:
      return 3.90625e-03;  // 2^-8
  }
  return 0.0;
}

/// The bits of a float (IEEE binary32), and the float of 32 bits: what the 16-bit conversions
/// below work on.
FULLSHARD_HOST_DEVICE inline std::uint32_t float_bits(float f) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
FULLSHARD_HOST_DEVICE inline float bits_float(std::uint32_t u) noexcept {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// float -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN, Inf stays Inf.
FULLSHARD_HOST_DEVICE inline std::uint16_t float_to_bf16(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

FULLSHARD_HOST_DEVICE inline float bf16_to_float(std::uint16_t h) noexcept {
  return bits_float(static_cast<std::uint32_t>(h) << 16);
}

/// float -> IEEE binary16 bits, round to nearest even, subnormals kept, overflow to Inf,
/// NaN stays a (quiet) NaN.
FULLSHARD_HOST_DEVICE inline std::uint16_t float_to_f16(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x1ffu));
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to >= 65520
  if (a < 0x38800000u) {                                                    // |f| < 2^-14
    if (a < 0x33000000u) return sign;  // below half the smallest subnormal: +-0
    // Subnormal: value = mantissa * 2^-24. Shift the full significand, round to nearest even.
    const std::uint32_t exp = a >> 23;
    const std::uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exp;  // 14..24
    std::uint32_t half = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t mid = 1u << (shift - 1u);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<std::uint16_t>(sign | half);
  }
  // Normal: rebias exponent (127 -> 15), round the 13 dropped bits to nearest even.
  std::uint32_t v = a - 0x38000000u;
  v += 0xfffu + ((v >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (v >> 13));
}

FULLSHARD_HOST_DEVICE inline float f16_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = (static_cast<std::uint32_t>(h) & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (mant << 13));  // Inf/NaN
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    // Subnormal: normalise.
    std::uint32_t e = 113;  // 127 - 15 + 1
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    return bits_float(sign | (e << 23) | ((mant & 0x3ffu) << 13));
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

/// Reads element i of a buffer of dtype t as double (host helper for tests and tools).
double load_as_double(const void* data, DType t, std::size_t i) noexcept;
/// Writes v (rounded to nearest even) as element i of a buffer of dtype t.
void store_from_double(void* data, DType t, std::size_t i, double v) noexcept;

}  // namespace fullshard
