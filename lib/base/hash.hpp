// 64-bit FNV-1a: the one hash fullshard compares across ranks (plan fingerprints, the FSDP
// configuration fingerprint, the apps' option agreement).
#pragma once

#include <cstdint>
#include <string_view>

namespace fullshard {

inline std::uint64_t fnv1a64(std::string_view s) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace fullshard
