// 16-bit float conversions against references computed by exhaustive search.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "fullshard/base/dtype.hpp"
#include "fullshard/base/error.hpp"

using namespace fullshard;

namespace {

bool is_nan_bits_f16(std::uint16_t h) {
  return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu);
}
bool is_nan_bits_bf16(std::uint16_t h) {
  return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu);
}

// Reference: the representable value nearest to x (ties to the even encoding), found by
// binary search over the positive encodings [0, inf_bits], whose values increase with the bits.
template <class Decode>
std::uint16_t nearest(float x, std::uint16_t inf_bits, std::uint16_t sign_bit, Decode decode) {
  const double a = std::fabs(static_cast<double>(x));
  std::uint32_t lo = 0;
  std::uint32_t hi = inf_bits;  // decode(hi) = +inf
  while (hi - lo > 1) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (static_cast<double>(decode(static_cast<std::uint16_t>(mid))) <= a)
      lo = mid;
    else
      hi = mid;
  }
  // a lies in [decode(lo), decode(hi)); hi may be inf: the overflow threshold is the midpoint
  // between the largest finite value and the next power of two (IEEE rounding).
  const double vlo = decode(static_cast<std::uint16_t>(lo));
  double vhi = decode(static_cast<std::uint16_t>(hi));
  if (std::isinf(vhi))
    vhi = 2.0 * vlo - static_cast<double>(decode(static_cast<std::uint16_t>(lo - 1)));
  std::uint32_t pick;
  if (a - vlo < vhi - a)
    pick = lo;
  else if (a - vlo > vhi - a)
    pick = hi;
  else
    pick = (lo % 2 == 0) ? lo : hi;
  const bool neg = std::signbit(x);
  return static_cast<std::uint16_t>(pick | (neg ? sign_bit : 0u));
}

}  // namespace

TEST_CASE("bf16 and f16 round-trip every 16-bit pattern") {
  for (std::uint32_t h = 0; h <= 0xffffu; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    if (is_nan_bits_bf16(b)) {
      CHECK(std::isnan(bf16_to_float(b)));
      CHECK(is_nan_bits_bf16(float_to_bf16(bf16_to_float(b))));
    } else {
      REQUIRE(float_to_bf16(bf16_to_float(b)) == b);
    }
    if (is_nan_bits_f16(b)) {
      CHECK(std::isnan(f16_to_float(b)));
      CHECK(is_nan_bits_f16(float_to_f16(f16_to_float(b))));
    } else {
      REQUIRE(float_to_f16(f16_to_float(b)) == b);
    }
  }
}

TEST_CASE("float to bf16 and f16 rounds to nearest even") {
  std::mt19937 gen(1234);
  std::uniform_int_distribution<std::uint32_t> bits;
  int checked = 0;
  for (int i = 0; i < 200000; ++i) {
    // Random bit patterns cover every exponent; force half of them into f16's range.
    std::uint32_t u = bits(gen);
    if (i % 2) u = (u & 0x807fffffu) | ((100u + u % 45u) << 23);
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f)) continue;
    ++checked;
    const auto ref_bf = nearest(f, 0x7f80u, 0x8000u, bf16_to_float);
    REQUIRE_MESSAGE(float_to_bf16(f) == ref_bf, "f=" << f);
    const auto ref_h = nearest(f, 0x7c00u, 0x8000u, f16_to_float);
    REQUIRE_MESSAGE(float_to_f16(f) == ref_h, "f=" << f);
  }
  CHECK(checked > 150000);
  // Exact ties.
  CHECK(float_to_bf16(1.0f + 1.0f / 256) == float_to_bf16(1.0f));  // tie -> even
  CHECK(float_to_bf16(1.0f + 3.0f / 256) == float_to_bf16(1.0f + 4.0f / 256));
  CHECK(float_to_f16(2049.0f) == float_to_f16(2048.0f));
  CHECK(float_to_f16(2051.0f) == float_to_f16(2052.0f));
  CHECK(f16_to_float(float_to_f16(65519.0f)) == 65504.0f);
  CHECK(std::isinf(f16_to_float(float_to_f16(65520.0f))));
  CHECK(f16_to_float(float_to_f16(5.9604645e-08f)) == 5.9604645e-08f);  // smallest subnormal
}

TEST_CASE("Inf and NaN survive the 16-bit conversions") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(bf16_to_float(float_to_bf16(inf)) == inf);
  CHECK(bf16_to_float(float_to_bf16(-inf)) == -inf);
  CHECK(f16_to_float(float_to_f16(inf)) == inf);
  CHECK(f16_to_float(float_to_f16(-inf)) == -inf);
  CHECK(std::isnan(bf16_to_float(float_to_bf16(nan))));
  CHECK(std::isnan(f16_to_float(float_to_f16(nan))));
  // A signalling NaN whose payload sits only in the low bits must not become Inf.
  std::uint32_t snan_bits = 0x7f800001u;
  float snan;
  std::memcpy(&snan, &snan_bits, 4);
  CHECK(std::isnan(bf16_to_float(float_to_bf16(snan))));
  CHECK(std::isnan(f16_to_float(float_to_f16(snan))));
}

TEST_CASE("dtype names parse and bad names are reported") {
  CHECK(parse_dtype("bf16") == DType::bf16);
  CHECK(parse_dtype("float32") == DType::f32);
  CHECK(parse_dtype("F16") == DType::f16);
  CHECK(dtype_size(DType::f64) == 8);
  CHECK(std::string(dtype_name(DType::bf16)) == "bf16");
  try {
    parse_dtype("int8", "modules[0].params.w.dtype");
    FAIL("no error");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()).find("modules[0].params.w.dtype") != std::string::npos);
    CHECK(std::string(e.what()).find("int8") != std::string::npos);
  }
}
