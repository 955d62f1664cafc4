// Overflow-checked integer arithmetic for sizes read from a checkpoint index (private to
// lib/checkpoint; a shared fullshard/base/checked.hpp may replace it). Each returns false
// instead of wrapping, leaving `out` unspecified.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fullshard::checkpoint::detail {

template <class T>
inline bool add_ok(T a, T b, T& out) noexcept {
  return !__builtin_add_overflow(a, b, &out);
}

template <class T>
inline bool mul_ok(T a, T b, T& out) noexcept {
  return !__builtin_mul_overflow(a, b, &out);
}

/// The product of non-negative extents, or false when it exceeds INT64_MAX.
inline bool numel_ok(const std::vector<std::int64_t>& shape, std::int64_t& out) noexcept {
  std::int64_t n = 1;
  for (std::int64_t e : shape)
    if (e < 0 || !mul_ok(n, e, n)) return false;
  out = n;
  return true;
}

/// numel(shape) * elem_bytes as a byte count, or false when it exceeds INT64_MAX (so that
/// every byte offset inside it is also a valid off_t and ptrdiff_t).
inline bool nbytes_ok(const std::vector<std::int64_t>& shape, std::size_t elem_bytes,
                      std::uint64_t& out) noexcept {
  std::int64_t n = 0;
  std::int64_t b = 0;
  if (!numel_ok(shape, n) || !mul_ok(n, static_cast<std::int64_t>(elem_bytes), b)) return false;
  out = static_cast<std::uint64_t>(b);
  return true;
}

}  // namespace fullshard::checkpoint::detail
