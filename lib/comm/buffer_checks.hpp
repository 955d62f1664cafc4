// Argument checks shared by the communicator backends (private to lib/comm).
#pragma once

#include <cstddef>
#include <cstdint>

namespace fullshard::comm {

/// Byte ranges [a, a+na) and [b, b+nb) overlap.
inline bool overlaps(const void* a, std::size_t na, const void* b, std::size_t nb) noexcept {
  const auto pa = reinterpret_cast<std::uintptr_t>(a);
  const auto pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + nb && pb < pa + na;
}

}  // namespace fullshard::comm
