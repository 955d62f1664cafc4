#include "fullshard/checkpoint/checksum.hpp"
#include "lib/checkpoint/crc32c_variants.hpp"

#include <algorithm>
#include <cstring>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define FULLSHARD_CRC32C_SSE42 1
#include <emmintrin.h>
#include <nmmintrin.h>
#else
#define FULLSHARD_CRC32C_SSE42 0
#endif

namespace fullshard::checkpoint {
namespace {

// Everything below works on the raw CRC register (no pre/post inversion); the public functions
// invert. Bit-reflected representation: bit 31 is the coefficient of x^0.
constexpr std::uint32_t kPoly = 0x82f63b78u;

struct Tables {
  std::uint32_t t[8][256];
};

constexpr Tables make_tables() {
  Tables tb{};
  for (std::uint32_t n = 0; n < 256; ++n) {
    std::uint32_t c = n;
    for (int k = 0; k < 8; ++k)
      c = (c & 1u) ? (c >> 1) ^ kPoly : c >> 1;
    tb.t[0][n] = c;
  }
  for (std::uint32_t n = 0; n < 256; ++n)
    for (int k = 1; k < 8; ++k)
      tb.t[k][n] = (tb.t[k - 1][n] >> 8) ^ tb.t[0][tb.t[k - 1][n] & 0xffu];
  return tb;
}

constexpr Tables kTables = make_tables();

// a * b mod P (zlib's multmodp, for this polynomial).
constexpr std::uint32_t multmodp(std::uint32_t a, std::uint32_t b) {
  std::uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1u) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

struct PowerTable {
  std::uint32_t x2n[32];  // x^(2^k) mod P
};

constexpr PowerTable make_powers() {
  PowerTable t{};
  std::uint32_t p = 1u << 30;  // x^1
  for (int k = 0; k < 32; ++k) {
    t.x2n[k] = p;
    p = multmodp(p, p);
  }
  return t;
}

constexpr PowerTable kPowers = make_powers();

// x^(8 * n) mod P: multiplying the register by it appends n zero bytes.
constexpr std::uint32_t x8nmodp(std::uint64_t n) {
  std::uint32_t p = 1u << 31;  // x^0
  int k = 3;
  while (n) {
    if (n & 1u) p = multmodp(kPowers.x2n[k & 31], p);
    n >>= 1;
    ++k;
  }
  return p;
}

std::uint32_t crc_table(std::uint32_t crc, const unsigned char* p, std::size_t n) noexcept {
  const auto& t = kTables.t;
  while (n >= 8) {
    // Built from bytes: the same on little- and big-endian machines.
    const std::uint32_t lo =
        crc ^ (static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
               static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24);
    crc = t[7][lo & 0xffu] ^ t[6][(lo >> 8) & 0xffu] ^ t[5][(lo >> 16) & 0xffu] ^ t[4][lo >> 24] ^
          t[3][p[4]] ^ t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
    p += 8;
    n -= 8;
  }
  while (n--)
    crc = t[0][(crc ^ *p++) & 0xffu] ^ (crc >> 8);
  return crc;
}

#if FULLSHARD_CRC32C_SSE42
// Three independent streams of kStride bytes hide the crc32 instruction's 3-cycle latency;
// their registers are merged with a multiplication by x^(8 * kStride).
constexpr std::size_t kStride = 8192;
constexpr std::uint32_t kShiftStride = x8nmodp(kStride);

__attribute__((target("sse4.2"))) std::uint32_t crc_sse42(std::uint32_t crc, const unsigned char* p,
                                                          std::size_t n) noexcept {
  while (n && (reinterpret_cast<std::uintptr_t>(p) & 7u)) {
    crc = _mm_crc32_u8(crc, *p++);
    --n;
  }
  while (n >= 3 * kStride) {
    std::uint64_t c0 = crc, c1 = 0, c2 = 0;
    for (std::size_t i = 0; i < kStride; i += 8) {
      std::uint64_t a, b, c;
      std::memcpy(&a, p + i, 8);
      std::memcpy(&b, p + kStride + i, 8);
      std::memcpy(&c, p + 2 * kStride + i, 8);
      c0 = _mm_crc32_u64(c0, a);
      c1 = _mm_crc32_u64(c1, b);
      c2 = _mm_crc32_u64(c2, c);
    }
    crc = multmodp(kShiftStride, static_cast<std::uint32_t>(c0)) ^ static_cast<std::uint32_t>(c1);
    crc = multmodp(kShiftStride, crc) ^ static_cast<std::uint32_t>(c2);
    p += 3 * kStride;
    n -= 3 * kStride;
  }
  std::uint64_t c = crc;
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  crc = static_cast<std::uint32_t>(c);
  while (n--)
    crc = _mm_crc32_u8(crc, *p++);
  return crc;
}

// Copies n bytes to d with non-temporal stores where d is 16-byte aligned (the destination, a
// staging buffer read next by I/O, bypasses the cache and is not read for ownership).
void stream_copy(unsigned char* d, const unsigned char* p, std::size_t n) noexcept {
  const std::size_t head = std::min(n, (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16);
  std::memcpy(d, p, head);
  std::size_t i = head;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, p + i, n - i);
}

// The copy and the checksum in one pass over memory: the checksum of a slice pulls it into the
// cache, the copy reads it from there (measured on 96 MiB: about memcpy's time alone, where
// memcpy then crc32c took 1.7x it). Ends with a store fence: the copy is visible to other
// threads once this returns.
std::uint32_t copy_crc_sse42(std::uint32_t crc, unsigned char* d, const unsigned char* p,
                             std::size_t n) noexcept {
  constexpr std::size_t kSlice = 6 * kStride;  // 48 KiB: two rounds of the three streams
  for (std::size_t at = 0; at < n; at += kSlice) {
    const std::size_t len = std::min(kSlice, n - at);
    crc = crc_sse42(crc, p + at, len);
    stream_copy(d + at, p + at, len);
  }
  _mm_sfence();
  return crc;
}

bool have_sse42() noexcept {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
#if FULLSHARD_CRC32C_SSE42
  if (have_sse42()) return ~crc_sse42(~crc, p, n);
#endif
  return ~crc_table(~crc, p, n);
}

std::uint32_t detail::copy_crc32c(void* dst, const void* src, std::size_t n,
                                  std::uint32_t crc) noexcept {
  const auto* p = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
#if FULLSHARD_CRC32C_SSE42
  if (have_sse42()) return ~copy_crc_sse42(~crc, d, p, n);
#endif
  // Without the instruction the checksum is the slow part: it reads what memcpy just wrote
  // while still in cache, in slices of L1 size.
  constexpr std::size_t kSlice = 16384;
  for (std::size_t at = 0; at < n; at += kSlice) {
    const std::size_t len = n - at < kSlice ? n - at : kSlice;
    std::memcpy(d + at, p + at, len);
    crc = ~crc_table(~crc, d + at, len);
  }
  return crc;
}

std::uint32_t detail::crc32c_table(const void* data, std::size_t n, std::uint32_t crc) noexcept {
  return ~crc_table(~crc, static_cast<const unsigned char*>(data), n);
}

std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b,
                             std::uint64_t len_b) noexcept {
  return multmodp(x8nmodp(len_b), crc_a) ^ crc_b;
}

const char* crc32c_implementation() noexcept {
#if FULLSHARD_CRC32C_SSE42
  if (have_sse42()) return "sse4.2";
#endif
  return "table";
}

}  // namespace fullshard::checkpoint
