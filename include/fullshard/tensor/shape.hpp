// Tensor shapes.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fullshard/base/checked.hpp"
#include "fullshard/base/dtype.hpp"

namespace fullshard {

using Shape = std::vector<std::int64_t>;

/// "(8, 8)".
inline std::string shape_string(const Shape& s) {
  std::string out = "(";
  for (std::size_t i = 0; i < s.size(); ++i)
    out += (i ? ", " : "") + std::to_string(s[i]);
  if (s.size() == 1) out += ",";
  return out + ")";
}

/// Product of the extents (1 for a 0-d shape). Unchecked: for shapes that passed checked_numel
/// or checked_nbytes where they entered (Module::add_param, the graph loader, Tensor::empty,
/// shard_layout, the checkpoint index), so that the product is known to fit.
inline std::int64_t numel(const Shape& s) noexcept {
  std::int64_t n = 1;
  for (auto e : s)
    n *= e;
  return n;
}

/// Product of the extents of a shape from user input: throws E "<context>: shape (...) has a
/// negative extent ..." or "<context>: shape (...) has more than 2^63-1 elements".
template <class E = InvalidArgument, class Context>
std::int64_t checked_numel(const Shape& s, Context&& context) {
  std::int64_t n = 1;
  bool zero = false;
  for (std::size_t d = 0; d < s.size(); ++d) {
    if (s[d] < 0)
      throw E(context_text(std::forward<Context>(context)) + ": shape " + shape_string(s) +
              " has negative extent " + std::to_string(s[d]) + " in dim " + std::to_string(d));
    zero = zero || s[d] == 0;
  }
  if (zero) return 0;  // (0, 2^62, 2^62) has no elements; the other extents must still be >= 0
  for (auto e : s)
    if (__builtin_mul_overflow(n, e, &n))
      throw E(context_text(std::forward<Context>(context)) + ": shape " + shape_string(s) +
              " has more than 2^63-1 elements");
  return n;
}

/// checked_numel(s) * dtype_size(dtype) as a byte count that fits in a signed 64-bit integer
/// (so that every byte offset into the tensor does too); throws E naming `context` otherwise.
template <class E = InvalidArgument, class Context>
std::int64_t checked_nbytes(const Shape& s, DType dtype, Context&& context) {
  const std::int64_t n = checked_numel<E>(s, context);
  std::int64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<std::int64_t>(dtype_size(dtype)), &bytes))
    throw E(context_text(std::forward<Context>(context)) + ": shape " + shape_string(s) + " of " +
            dtype_name(dtype) + " has " + std::to_string(n) + " elements, more than 2^63-1 bytes");
  return bytes;
}

}  // namespace fullshard
