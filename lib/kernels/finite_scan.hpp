// Finiteness of host arrays at memory speed: one pass over the exponent bits (an element is a
// NaN or an infinity exactly when its exponent field is all ones; that field plus one carries
// into the sign bit), OR-ed over eight lanes without a branch, which the compiler vectorizes.
// Used by the optimizer's non-finite check of gradient shards (optim::local_all_finite) and by
// the session's scan of a step's inputs and targets; host memory only.
#pragma once

#include <cmath>
#include <cstdint>

namespace fullshard::kernels {

namespace detail {
template <typename Bits>
inline bool exponent_all_finite(const void* data, std::int64_t n, Bits exponent, Bits one) {
  constexpr Bits sign = Bits(1) << (8 * sizeof(Bits) - 1);
  // The floats read as their bits (may_alias: a read through another type, on purpose).
  using Aliased [[gnu::may_alias]] = Bits;
  const auto* bits = static_cast<const Aliased*>(data);
  Bits lanes[8] = {};
  std::int64_t e = 0;
  for (; e + 8 <= n; e += 8)
    for (int k = 0; k < 8; ++k)
      lanes[k] |= (bits[e + k] & exponent) + one;
  Bits seen = 0;
  for (; e < n; ++e)
    seen |= (bits[e] & exponent) + one;
  for (Bits l : lanes)
    seen |= l;
  return (seen & sign) == 0;
}
}  // namespace detail

/// Whether every one of the `n` floats at `x` is finite.
inline bool all_finite(const float* x, std::int64_t n) {
  return detail::exponent_all_finite<std::uint32_t>(x, n, 0x7f800000u, 0x00800000u);
}
inline bool all_finite(const double* x, std::int64_t n) {
  return detail::exponent_all_finite<std::uint64_t>(x, n, 0x7ff0000000000000ull,
                                                    0x0010000000000000ull);
}

/// The index of the first element that is not finite, or -1 (the element is looked for only
/// when the fast pass found one).
template <typename T>
std::int64_t first_non_finite(const T* x, std::int64_t n) {
  if (all_finite(x, n)) return -1;
  for (std::int64_t e = 0; e < n; ++e)
    if (!std::isfinite(x[e])) return e;
  return -1;
}

}  // namespace fullshard::kernels
