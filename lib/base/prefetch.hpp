// A hint to the cache: the lines a walk over data that is not in cache is about to read or
// write, asked for a few steps ahead (planning a 100,000-module graph walks ~165 MB).
#pragma once

#include <cstddef>

namespace fullshard {

/// Asks for every cache line of [p, p + Bytes), for writing when `Write`: one prefetch per 64
/// bytes from p and one for the last byte (an object need not start on a line). A hint only:
/// it touches nothing and faults nothing. The size is a constant so that the prefetches are
/// straight-line code (a loop of nothing but prefetches may be deleted as having no effect).
template <std::size_t Bytes, bool Write = false>
inline void prefetch_lines(const void* p) noexcept {
  static_assert(Bytes > 0, "prefetch_lines: nothing to ask for");
  const auto* b = static_cast<const char*>(p);
  for (std::size_t off = 0; off < Bytes; off += 64)
    __builtin_prefetch(b + off, Write ? 1 : 0);
  if constexpr (Bytes % 64 != 1)  // else the last byte is at the last offset asked for
    __builtin_prefetch(b + Bytes - 1, Write ? 1 : 0);
}

}  // namespace fullshard
