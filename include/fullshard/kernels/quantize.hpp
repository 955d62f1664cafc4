// Block-scaled 8-bit codes: the wire format of compressed collectives (an all-gather of
// parameters sent as int8 or fp8 e4m3, a reduce-scatter of gradients sent as int8 and
// accumulated in f32; what DeepSpeed ZeRO++ calls qwZ and qgZ). A buffer of n elements is cut
// into blocks of `block` elements (the last one may be shorter); each block has one f32 scale
// (its largest magnitude / the code's largest value) and one byte per element. One source for
// every Kokkos execution space: a kernel per block, enqueued on an ExecStream without a fence.
#pragma once

#include <cstdint>
#include <string>

#include "fullshard/base/dtype.hpp"
#include "fullshard/kernels/shard_copy.hpp"

namespace fullshard::kernels {

/// The code of one element.
enum class QuantCode : std::uint8_t {
  int8,     ///< signed integer -127..127 (two's complement byte), rounded to nearest even
  fp8_e4m3  ///< float8 e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no
            ///< infinities, 0x7f/0xff NaN; largest 448), rounded to nearest even
};
/// "int8", "fp8_e4m3".
const char* quant_code_name(QuantCode c) noexcept;
/// "int8", "fp8_e4m3" (also "fp8", "e4m3"); ConfigError naming `what` (the option or JSON
/// path the name came from) for anything else.
QuantCode parse_quant_code(const std::string& name, const std::string& what);
/// The code's largest finite magnitude: 127 (int8), 448 (fp8_e4m3).
float quant_code_max(QuantCode c) noexcept;

/// Blocks of n elements: ceil(n / block). InvalidArgument unless n >= 0 and block >= 1.
std::int64_t quant_blocks(std::int64_t n, std::int64_t block);

/// Encodes src[0..n) (dtype src_t) block by block: scales[b] = max |x| over block b divided by
/// quant_code_max(code) (0 for a block of zeros, whose codes are 0), codes[i] = the code
/// nearest to x / scales[b]. The error of an element after dequantize is at most half the
/// code's step at its magnitude times the block's scale (int8: scales[b] / 2; fp8_e4m3: a
/// relative 2^-4 for normal codes), plus the f32 rounding of the scale. A non-finite element
/// makes its block's scale non-finite (the caller's check for bad gradients sees it).
/// `codes` holds n bytes, `scales` quant_blocks(n, block) floats, both in memory the stream's
/// space can access.
void quantize(const ExecStream& on, const void* src, DType src_t, std::int64_t n,
              std::int64_t block, QuantCode code, std::uint8_t* codes, float* scales);

/// Decodes what quantize wrote: dst[i] = code value * scales[b], as dst_t; with `accumulate`
/// dst[i] += that value (added in f32, f64 for an f64 dst, and rounded once to dst_t: the
/// reduce-scatter's sum of received blocks).
void dequantize(const ExecStream& on, const std::uint8_t* codes, const float* scales,
                QuantCode code, std::int64_t n, std::int64_t block, void* dst, DType dst_t,
                bool accumulate);

/// Bytes of one packed slot of n elements: the n codes, padded to a multiple of 4 bytes, then
/// quant_blocks(n, block) f32 scales. A compressed all-gather moves W such slots, rank-major.
std::int64_t quant_packed_bytes(std::int64_t n, std::int64_t block);

/// quantize() into one packed slot at `packed` (4-byte aligned; quant_packed_bytes long; the
/// padding bytes are written as zeros).
void quantize_packed(const ExecStream& on, const void* src, DType src_t, std::int64_t n,
                     std::int64_t block, QuantCode code, void* packed);

/// The all-gather copy-out with the dequantize fused (one pass): run_copies whose source is W
/// packed slots of `slot_numel` elements back to back, a run's source offsets counted in
/// elements of that W * slot_numel space. Each element is decoded and scaled as dequantize
/// does and written as dst_t; padding is written as zeros. The plan's target must be the
/// stream's.
void run_dequantize_copies(const CopyPlan& plan, const void* packed, std::int64_t slot_numel,
                           std::int64_t block, QuantCode code, void* dst, DType dst_t,
                           const ExecStream& on);

/// The receive side of a compressed reduce-scatter: `nslots` packed slots of n elements back
/// to back (quantize_packed's layout; the chunks every rank sent this one, rank-major), each
/// element decoded and scaled, summed in f32 in slot order, divided by `divisor` (1: none)
/// in f32, and written as dst_t: dst[i] = accumulate ? dst[i] + t : t, that sum in f32 (f64
/// for an f64 dst) rounded once to dst_t. One pass over the slots.
void reduce_dequantize(const ExecStream& on, const void* packed, int nslots, std::int64_t n,
                       std::int64_t block, QuantCode code, double divisor, void* dst, DType dst_t,
                       bool accumulate);

}  // namespace fullshard::kernels
