// Block-scaled 8-bit codes (fullshard/kernels/quantize.hpp): one kernel per call, a
// RangePolicy over blocks, each block's elements in one loop (its largest magnitude, then its
// codes), so one source serves the host spaces and CUDA alike. The element encoders are exact
// round-to-nearest-even on the f32 bits, no library rounding call (none is common to Kokkos 3.4
// and 4.x on the device).
#include "fullshard/kernels/quantize.hpp"

#include <Kokkos_Core.hpp>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "fullshard/base/error.hpp"
#include "lib/kernels/exec_stream_impl.hpp"
#include "lib/kernels/shard_copy_impl.hpp"

namespace fullshard::kernels {

const char* quant_code_name(QuantCode c) noexcept {
  return c == QuantCode::int8 ? "int8" : "fp8_e4m3";
}

QuantCode parse_quant_code(const std::string& name, const std::string& what) {
  if (name == "int8") return QuantCode::int8;
  if (name == "fp8_e4m3" || name == "fp8" || name == "e4m3") return QuantCode::fp8_e4m3;
  throw ConfigError(what + ": unknown code '" + name + "' (allowed: int8, fp8_e4m3)");
}

float quant_code_max(QuantCode c) noexcept {
  return c == QuantCode::int8 ? 127.0f : 448.0f;
}

std::int64_t quant_blocks(std::int64_t n, std::int64_t block) {
  if (n < 0 || block < 1)
    throw InvalidArgument("fullshard::kernels::quant_blocks: need n >= 0 and block >= 1, got n " +
                          std::to_string(n) + ", block " + std::to_string(block));
  return (n + block - 1) / block;
}

// Named (not anonymous) namespace: CUDA's extended lambdas may not sit in functions of
// internal linkage.
namespace detail {

using ::fullshard::bits_float;
using ::fullshard::float_bits;

// f32 product and sum, each rounded once: CUDA's compiler would otherwise contract a * b + c
// into one fused multiply-add, and the device's codes would differ from the host's.
KOKKOS_INLINE_FUNCTION float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KOKKOS_INLINE_FUNCTION float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

/// y rounded to the nearest integer, ties to even, for |y| < 2^22: y + 1.5 * 2^23 lies where
/// the f32 step is 1, so the addition rounds (no branch: the loops vectorise).
KOKKOS_INLINE_FUNCTION float round_even(float y) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return add_rn(y, magic) - magic;
}

KOKKOS_INLINE_FUNCTION float quiet_nan() {
  return bits_float(0x7fc00000u);
}

KOKKOS_INLINE_FUNCTION std::uint8_t encode_int8(float y) {
  // Rounded, then clamped (|y| <= 127 up to the scale's rounding): never past 127. Integer
  // selects: the host loop vectorises.
  const int q = static_cast<int>(round_even(y));
  const int c = q > 127 ? 127 : (q < -127 ? -127 : q);
  return static_cast<std::uint8_t>(c);  // the two's complement byte
}

KOKKOS_INLINE_FUNCTION float decode_int8(std::uint8_t c) {
  return static_cast<float>(static_cast<std::int8_t>(c));
}

// float8 e4m3fn: exponent bias 7, subnormals q * 2^-9, largest 448 (0x7e); saturating. y is
// finite (a non-finite block codes zeros). Selects, no branches: the host loops vectorise.
KOKKOS_INLINE_FUNCTION std::uint8_t encode_e4m3(float y) {
  const std::uint32_t u = float_bits(y);
  const std::uint32_t sign = (u >> 24) & 0x80u;  // -0 too
  const std::uint32_t ua = u & 0x7fffffffu;
  // Below 2^-6: subnormal steps of 2^-9 (8 rounds up to the least normal, code 8).
  const std::uint32_t small = ua < 0x3c800000u ? ua : 0u;  // (kept in round_even's range)
  const auto sub = static_cast<std::uint32_t>(  // via int: x86 converts packed floats to int
      static_cast<int>(round_even(mul_rn(bits_float(small), 512.0f))));
  // Normal: the exponent (biased by 7) and 3 mantissa bits, rounded to nearest even on the
  // 20 dropped bits; a carry out of the mantissa moves into the exponent by the addition.
  const std::uint32_t q = (ua >> 20) & 7u, rest = ua & 0xfffffu;
  const std::uint32_t up = (rest > 0x80000u) | ((rest == 0x80000u) & q);
  const std::uint32_t e = ua >> 23;  // f32-biased exponent; >= 121 for a normal e4m3
  const std::uint32_t normal = e >= 121u ? ((e - 120u) << 3) + q + up : 0u;
  const std::uint32_t code = ua < 0x3c800000u ? sub : (normal > 0x7eu ? 0x7eu : normal);
  return static_cast<std::uint8_t>(sign | code);
}

KOKKOS_INLINE_FUNCTION float decode_e4m3(std::uint8_t c) {
  const std::uint32_t biased = (c >> 3) & 0xfu;
  const std::uint32_t q = c & 7u;
  const float sub = static_cast<float>(static_cast<int>(q)) * 0.001953125f;  // 2^-9 (via int:
                                                                             // packed cvt)
  const float normal = bits_float(((biased + 120u) << 23) | (q << 20));
  const float v = (c & 0x7fu) == 0x7fu ? quiet_nan() : (biased == 0 ? sub : normal);
  return bits_float(float_bits(v) | (static_cast<std::uint32_t>(c & 0x80u) << 24));
}

// An element's code, and a code's value times its block's scale, for code C.
template <QuantCode C>
KOKKOS_INLINE_FUNCTION std::uint8_t encode(float y) {
  if constexpr (C == QuantCode::int8)
    return encode_int8(y);
  else
    return encode_e4m3(y);
}
template <QuantCode C>
KOKKOS_INLINE_FUNCTION float decode(std::uint8_t c, float scale) {
  if constexpr (C == QuantCode::int8)
    return mul_rn(decode_int8(c), scale);
  else
    return mul_rn(decode_e4m3(c), scale);
}

// old + v as D, the sum in f32 (f64 for an f64 D) rounded once: dequantize's and the
// reduce's accumulation (v already rounded: nothing to contract).
template <class D>
KOKKOS_INLINE_FUNCTION typename D::storage add_into(typename D::storage old, float v) {
  using A = std::conditional_t<std::is_same<D, F64>::value, double, float>;
  return store<D, A>(load<D, A>(old) + static_cast<A>(v));
}

// Bytes of a packed slot's codes (n, padded to 4): where its scales begin.
constexpr std::int64_t scales_offset(std::int64_t n) {
  return (n + 3) / 4 * 4;
}

// f(b, begin, end) for every block b of n elements, one iteration each, on `exec`.
template <class Exec, class F>
void for_each_block(const Exec& exec, const char* name, std::int64_t n, std::int64_t block,
                    const F& f) {
  Kokkos::parallel_for(
      name,
      Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(exec, 0, (n + block - 1) / block),
      KOKKOS_LAMBDA(std::int64_t b) {
        const std::int64_t begin = b * block;
        f(b, begin, begin + block < n ? begin + block : n);
      });
}

template <class Exec, class S, QuantCode C>
void quantize_on(const Exec& exec, const typename S::storage* src, std::int64_t n,
                 std::int64_t block, std::uint8_t* codes, float* scales) {
  const float cmax = C == QuantCode::int8 ? 127.0f : 448.0f;
  for_each_block(
      exec, "fullshard::kernels::quantize", n, block,
      KOKKOS_LAMBDA(std::int64_t b, std::int64_t begin, std::int64_t end) {
        // The largest |x| as an integer maximum of the magnitudes' bits (their order is the
        // floats' order, a NaN's above infinity's): a reduction that vectorises.
        std::uint32_t top = 0;
        for (std::int64_t i = begin; i < end; ++i) {
          const std::uint32_t a = float_bits(S::to_float(src[i])) & 0x7fffffffu;
          top = a > top ? a : top;
        }
        const float amax = top > 0x7f800000u ? quiet_nan() : bits_float(top);
        scales[b] = amax / cmax;
        if (top >= 0x7f800000u) {  // a non-finite block: its scale says so, its codes are 0
          for (std::int64_t i = begin; i < end; ++i)
            codes[i] = 0;
          return;
        }
        const float inv = top > 0 ? cmax / amax : 0.0f;
        for (std::int64_t i = begin; i < end; ++i)
          codes[i] = encode<C>(mul_rn(S::to_float(src[i]), inv));
      });
}

template <class Exec, class D, QuantCode C, bool Accumulate>
void dequantize_on(const Exec& exec, const std::uint8_t* codes, const float* scales, std::int64_t n,
                   std::int64_t block, typename D::storage* dst) {
  for_each_block(
      exec, "fullshard::kernels::dequantize", n, block,
      KOKKOS_LAMBDA(std::int64_t b, std::int64_t begin, std::int64_t end) {
        // Captured outside the constexpr-if (nvcc refuses a device lambda's first capture in one).
        typename D::storage* const out = dst;
        const float scale = scales[b];
        for (std::int64_t i = begin; i < end; ++i) {
          const float v = decode<C>(codes[i], scale);
          if constexpr (Accumulate)
            out[i] = add_into<D>(out[i], v);
          else
            out[i] = D::from_float(v);
        }
      });
}

// One piece of a plan per index: its elements from W packed slots (slot_bytes each: codes,
// then the scales at scales_at), a block of a slot at a time.
template <class Exec, class D, QuantCode C>
void dequantize_runs_on(const Exec& exec,
                        const Kokkos::View<CopyRun*, typename Exec::memory_space>& runs,
                        const std::uint8_t* packed, std::int64_t slot_numel,
                        std::int64_t slot_bytes, std::int64_t scales_at, std::int64_t block,
                        typename D::storage* dst) {
  using DS = typename D::storage;
  Kokkos::parallel_for(
      "fullshard::kernels::run_dequantize_copies",
      Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(
          exec, 0, static_cast<std::int64_t>(runs.extent(0))),
      KOKKOS_LAMBDA(std::int64_t r) {
        const CopyRun run = runs(r);
        DS* d = dst + run.dst_offset;
        // Segments of one block of one slot: a fixed scale, a branch-free inner loop.
        for (std::int64_t i = 0; i < run.len;) {
          const std::int64_t s = run.src_offset + i;
          const std::int64_t q = s / slot_numel, k = s - q * slot_numel, b = k / block;
          const std::uint8_t* slot = packed + q * slot_bytes;
          const float scale = reinterpret_cast<const float*>(slot + scales_at)[b];
          std::int64_t len = (b + 1) * block - k;  // to the block's end, the slot's, the run's
          if (len > slot_numel - k) len = slot_numel - k;
          if (len > run.len - i) len = run.len - i;
          const std::uint8_t* c = slot + k;
          DS* out = d + i;
          for (std::int64_t j = 0; j < len; ++j)
            out[j] = D::from_float(decode<C>(c[j], scale));
          i += len;
        }
        for (std::int64_t i = 0; i < run.pad; ++i)
          d[run.len + i] = DS(0);
      });
}

// Per element: the sum over the slots of its decoded value, in slot order (a block per
// iteration).
template <class Exec, class D, QuantCode C, bool Accumulate>
void reduce_dequantize_on(const Exec& exec, const std::uint8_t* packed, int nslots, std::int64_t n,
                          std::int64_t block, std::int64_t slot_bytes, std::int64_t scales_at,
                          float divisor, bool divide, typename D::storage* dst) {
  for_each_block(
      exec, "fullshard::kernels::reduce_dequantize", n, block,
      KOKKOS_LAMBDA(std::int64_t b, std::int64_t begin, std::int64_t end) {
        typename D::storage* const out = dst;  // captured outside the constexpr-if (nvcc)
        // A chunk of the block at a time, slot after slot: contiguous inner loops.
        constexpr std::int64_t kChunk = 64;
        float sum[kChunk];
        for (std::int64_t at = begin; at < end; at += kChunk) {
          const std::int64_t len = end - at < kChunk ? end - at : kChunk;
          for (int q = 0; q < nslots; ++q) {
            const std::uint8_t* slot = packed + q * slot_bytes;
            const float scale = reinterpret_cast<const float*>(slot + scales_at)[b];
            const std::uint8_t* c = slot + at;
            if (q == 0)
              for (std::int64_t j = 0; j < len; ++j)
                sum[j] = decode<C>(c[j], scale);
            else
              for (std::int64_t j = 0; j < len; ++j)
                sum[j] = add_rn(sum[j], decode<C>(c[j], scale));
          }
          const float by = divide ? divisor : 1.0f;  // x / 1 is x: one loop for both
          for (std::int64_t j = 0; j < len; ++j) {
            const float t = sum[j] / by;
            if constexpr (Accumulate)
              out[at + j] = add_into<D>(out[at + j], t);
            else
              out[at + j] = D::from_float(t);
          }
        }
      });
}

template <class Exec>
void zero_bytes_on(const Exec& exec, std::uint8_t* p, std::int64_t n) {
  Kokkos::parallel_for(
      "fullshard::kernels::quantize_packed(padding)",
      Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(exec, 0, n),
      KOKKOS_LAMBDA(std::int64_t i) { p[i] = 0; });
}

// The element type tag of `t` as the argument of f (shard_copy_impl.hpp's dispatch), and the
// code as a template argument.
template <class F>
void dispatch_type(DType t, F&& f) {
  dispatch_dst<F32>(t, [&](auto, auto tag) { f(tag); });
}

template <class F>
void dispatch_code(QuantCode c, F&& f) {
  if (c == QuantCode::int8)
    f(std::integral_constant<QuantCode, QuantCode::int8>{});
  else
    f(std::integral_constant<QuantCode, QuantCode::fp8_e4m3>{});
}

// f(exec, tag, code, accumulate): the stream's execution space instance, t's element tag, and
// the code and `accumulate` as std::integral_constants (template arguments).
template <class F>
void dispatch_kernel(const ExecStream& on, DType t, QuantCode code, bool accumulate, F&& f) {
  const ExecStreamImpl& s = ExecStreamImpl::of(on);
  auto with_acc = [&](const auto& exec, auto tag, auto c) {
    if (accumulate)
      f(exec, tag, c, std::true_type{});
    else
      f(exec, tag, c, std::false_type{});
  };
  dispatch_type(t, [&](auto tag) {
    dispatch_code(code, [&](auto c) {
      if (s.target == ExecTarget::host)
        with_acc(s.host, tag, c);
      else
        with_acc(s.device, tag, c);
    });
  });
}

inline void check_quantized(std::int64_t n, std::int64_t block, const void* data, const void* codes,
                            const void* scales, const char* op) {
  quant_blocks(n, block);
  if (n > 0 && (!data || !codes || !scales))
    throw InvalidArgument(std::string("fullshard::kernels::") + op +
                          ": a null buffer with elements to code");
}

}  // namespace detail

void quantize(const ExecStream& on, const void* src, DType src_t, std::int64_t n,
              std::int64_t block, QuantCode code, std::uint8_t* codes, float* scales) {
  detail::check_quantized(n, block, src, codes, scales, "quantize");
  if (n == 0) return;
  detail::dispatch_kernel(on, src_t, code, false, [&](const auto& exec, auto tag, auto c, auto) {
    using S = decltype(tag);
    detail::quantize_on<std::decay_t<decltype(exec)>, S, decltype(c)::value>(
        exec, static_cast<const typename S::storage*>(src), n, block, codes, scales);
  });
}

std::int64_t quant_packed_bytes(std::int64_t n, std::int64_t block) {
  return detail::scales_offset(n) +
         quant_blocks(n, block) * static_cast<std::int64_t>(sizeof(float));
}

void quantize_packed(const ExecStream& on, const void* src, DType src_t, std::int64_t n,
                     std::int64_t block, QuantCode code, void* packed) {
  quant_blocks(n, block);  // checks n and block
  if (n == 0) return;
  if (!packed)
    throw InvalidArgument(
        "fullshard::kernels::quantize_packed: a null buffer with elements to code");
  if (reinterpret_cast<std::uintptr_t>(packed) % alignof(float) != 0)
    throw InvalidArgument(
        "fullshard::kernels::quantize_packed: the packed slot must be 4-byte aligned");
  auto* codes = static_cast<std::uint8_t*>(packed);
  const std::int64_t scales_at = detail::scales_offset(n);
  if (scales_at > n) {  // the padding: zeros, so every byte the all-gather sends is defined
    const ExecStreamImpl& s = ExecStreamImpl::of(on);
    if (s.target == ExecTarget::host)
      detail::zero_bytes_on<HostExec>(s.host, codes + n, scales_at - n);
    else
      detail::zero_bytes_on<DeviceExec>(s.device, codes + n, scales_at - n);
  }
  quantize(on, src, src_t, n, block, code, codes, reinterpret_cast<float*>(codes + scales_at));
}

void run_dequantize_copies(const CopyPlan& plan, const void* packed, std::int64_t slot_numel,
                           std::int64_t block, QuantCode code, void* dst, DType dst_t,
                           const ExecStream& on) {
  const CopyPlanImpl* p = CopyPlanImpl::of(plan);
  if (!p || p->written == 0) return;
  if (p->target != on.target())
    throw InvalidArgument(
        "fullshard::kernels::run_dequantize_copies: the copy plan and the stream run on different "
        "targets (host and device)");
  if (slot_numel < 1 || block < 1)
    throw InvalidArgument(
        "fullshard::kernels::run_dequantize_copies: need slot_numel >= 1 and "
        "block >= 1, got " +
        std::to_string(slot_numel) + " and " + std::to_string(block));
  if (!dst || (p->read > 0 && !packed))
    throw InvalidArgument(
        "fullshard::kernels::run_dequantize_copies: a null buffer with elements to copy");
  const auto* in = static_cast<const std::uint8_t*>(packed);
  const std::int64_t slot_bytes = quant_packed_bytes(slot_numel, block);
  const std::int64_t scales_at = detail::scales_offset(slot_numel);
  const ExecStreamImpl& s = ExecStreamImpl::of(on);
  detail::dispatch_type(dst_t, [&](auto tag) {
    using D = decltype(tag);
    auto* out = static_cast<typename D::storage*>(dst);
    detail::dispatch_code(code, [&](auto c) {
      constexpr QuantCode C = decltype(c)::value;
      if (s.target == ExecTarget::host)
        detail::dequantize_runs_on<HostExec, D, C>(s.host, p->host_runs, in, slot_numel, slot_bytes,
                                                   scales_at, block, out);
      else
        detail::dequantize_runs_on<DeviceExec, D, C>(s.device, p->device_runs, in, slot_numel,
                                                     slot_bytes, scales_at, block, out);
    });
  });
}

void reduce_dequantize(const ExecStream& on, const void* packed, int nslots, std::int64_t n,
                       std::int64_t block, QuantCode code, double divisor, void* dst, DType dst_t,
                       bool accumulate) {
  quant_blocks(n, block);  // checks n and block
  if (nslots < 1)
    throw InvalidArgument("fullshard::kernels::reduce_dequantize: need at least one slot, got " +
                          std::to_string(nslots));
  if (!(divisor > 0) || !std::isfinite(divisor))
    throw InvalidArgument(
        "fullshard::kernels::reduce_dequantize: the divisor must be finite and "
        "> 0, got " +
        std::to_string(divisor));
  if (n == 0) return;
  if (!packed || !dst)
    throw InvalidArgument(
        "fullshard::kernels::reduce_dequantize: a null buffer with elements to reduce");
  const auto* in = static_cast<const std::uint8_t*>(packed);
  const std::int64_t slot_bytes = quant_packed_bytes(n, block);
  const std::int64_t scales_at = detail::scales_offset(n);
  const auto div = static_cast<float>(divisor);
  const bool divide = divisor != 1.0;
  detail::dispatch_kernel(
      on, dst_t, code, accumulate, [&](const auto& exec, auto tag, auto c, auto a) {
        using D = decltype(tag);
        detail::reduce_dequantize_on<std::decay_t<decltype(exec)>, D, decltype(c)::value,
                                     decltype(a)::value>(exec, in, nslots, n, block, slot_bytes,
                                                         scales_at, div, divide,
                                                         static_cast<typename D::storage*>(dst));
      });
}

void dequantize(const ExecStream& on, const std::uint8_t* codes, const float* scales,
                QuantCode code, std::int64_t n, std::int64_t block, void* dst, DType dst_t,
                bool accumulate) {
  detail::check_quantized(n, block, dst, codes, scales, "dequantize");
  if (n == 0) return;
  detail::dispatch_kernel(
      on, dst_t, code, accumulate, [&](const auto& exec, auto tag, auto c, auto a) {
        using D = decltype(tag);
        detail::dequantize_on<std::decay_t<decltype(exec)>, D, decltype(c)::value,
                              decltype(a)::value>(exec, codes, scales, n, block,
                                                  static_cast<typename D::storage*>(dst));
      });
}

}  // namespace fullshard::kernels
