// CRC32C (Castagnoli), the checksum of checkpoint data: SSE4.2 instructions on x86-64 (three
// interleaved streams, about 20 GB/s per core), slicing-by-8 tables elsewhere (about 2 GB/s).
// Both give the same values (the iSCSI / ext4 / RFC 3720 CRC: crc32c("123456789") is
// 0xe3069283).
#pragma once

#include <cstddef>
#include <cstdint>

namespace fullshard::checkpoint {

/// CRC32C of `n` bytes continuing from `crc` (the CRC of the bytes before them; 0 to start).
std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc = 0) noexcept;

/// CRC32C of A followed by B, from crc32c(A), crc32c(B) and the length of B.
std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b,
                             std::uint64_t len_b) noexcept;

/// "sse4.2" or "table": which implementation crc32c() uses on this machine.
const char* crc32c_implementation() noexcept;

}  // namespace fullshard::checkpoint
