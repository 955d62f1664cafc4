// Tensor shapes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fullshard {

using Shape = std::vector<std::int64_t>;

/// Product of the extents (1 for a 0-d shape).
inline std::int64_t numel(const Shape& s) noexcept {
  std::int64_t n = 1;
  for (auto e : s)
    n *= e;
  return n;
}

/// "(8, 8)".
inline std::string shape_string(const Shape& s) {
  std::string out = "(";
  for (std::size_t i = 0; i < s.size(); ++i)
    out += (i ? ", " : "") + std::to_string(s[i]);
  if (s.size() == 1) out += ",";
  return out + ")";
}

}  // namespace fullshard
