// The CRC32C functions besides crc32c() (fullshard/checkpoint/checksum.hpp) that only the
// library and its tests use: the portable table implementation, and a copy that checksums.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fullshard::checkpoint {

namespace detail {
/// crc32c() by the portable table implementation, whatever the machine (tests compare the
/// SSE4.2 path against it).
std::uint32_t crc32c_table(const void* data, std::size_t n, std::uint32_t crc = 0) noexcept;

/// Copies `n` bytes from `src` to `dst` (not overlapping) and returns crc32c() of them from
/// `crc`, in one pass where memcpy and crc32c() take two (the asynchronous save's snapshot into
/// staging). With SSE4.2 the stores bypass the cache: for destinations not read again soon.
std::uint32_t copy_crc32c(void* dst, const void* src, std::size_t n,
                          std::uint32_t crc = 0) noexcept;
}  // namespace detail

}  // namespace fullshard::checkpoint
