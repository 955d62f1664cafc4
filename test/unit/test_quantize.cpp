// Block-scaled 8-bit codes (fullshard/kernels/quantize.hpp): every fp8 e4m3 code against the
// format's definition, the error bound of each code (half a step of the block's scale) on data
// spanning many magnitudes, zero and non-finite blocks, accumulation, 16-bit buffers, both
// execution targets. References are computed here from the definitions, not from the kernels.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "error_check.hpp"
#include "fullshard/base/dtype.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/kernels/quantize.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/tensor/sharding.hpp"

using namespace fullshard;
using namespace fullshard::kernels;
using fullshard::test::contains;
using fullshard::test::error_of;

namespace {

// The e4m3fn value of a code by its definition (NaN for 0x7f and 0xff).
double e4m3_value(unsigned c) {
  const unsigned e = (c >> 3) & 15u, q = c & 7u;
  if ((c & 0x7fu) == 0x7fu) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(double(q), -9) : std::ldexp(1.0 + q / 8.0, int(e) - 7);
  return (c & 0x80u) ? -mag : mag;
}

// Half the e4m3 step at magnitude y (the scaled value): subnormal steps 2^-9, else 2^(E-3).
double e4m3_half_step(double y) {
  if (y < std::ldexp(1.0, -6)) return std::ldexp(1.0, -10);
  return std::ldexp(1.0, int(std::floor(std::log2(y))) - 4);
}

// Values over many magnitudes, a different one per block: a deterministic sequence.
std::vector<float> spread(std::int64_t n, std::int64_t block) {
  std::vector<float> v(static_cast<std::size_t>(n));
  std::uint32_t s = 12345u;
  for (std::int64_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    const double u = (s >> 8) / double(1u << 24) * 2.0 - 1.0;  // [-1, 1)
    const int mag = int((i / block) % 9) - 4;                  // 1e-4 .. 1e4 by block
    v[static_cast<std::size_t>(i)] = static_cast<float>(u * std::pow(10.0, mag));
  }
  return v;
}

constexpr ExecTarget kTargets[] = {ExecTarget::host, ExecTarget::device};

ExecStream stream_of(ExecTarget t) {
  return t == ExecTarget::host ? ExecStream::host() : ExecStream::device();
}

}  // namespace

TEST_CASE("fp8 e4m3: every finite code decodes to its value and encodes back") {
  // One block: 448 first, so the scale is exactly 1 and each value is its own code.
  std::vector<float> src = {448.0f};
  std::vector<unsigned> expect = {0x7eu};
  for (unsigned c = 0; c < 256; ++c) {
    if ((c & 0x7fu) == 0x7fu) continue;
    src.push_back(static_cast<float>(e4m3_value(c)));
    expect.push_back(c);  // -0 (0x80) keeps its sign
  }
  const auto n = static_cast<std::int64_t>(src.size());
  for (ExecTarget t : kTargets) {
    const ExecStream on = stream_of(t);
    std::vector<std::uint8_t> codes(src.size());
    float scale = -1;
    quantize(on, src.data(), DType::f32, n, n, QuantCode::fp8_e4m3, codes.data(), &scale);
    std::vector<float> back(src.size(), -7.0f);
    dequantize(on, codes.data(), &scale, QuantCode::fp8_e4m3, n, n, back.data(), DType::f32, false);
    on.fence();
    CHECK(scale == 1.0f);
    int bad_codes = 0, bad_values = 0;
    for (std::size_t i = 0; i < src.size(); ++i) {
      if (codes[i] != expect[i]) ++bad_codes;
      if (back[i] != src[i]) ++bad_values;
    }
    CHECK(bad_codes == 0);
    CHECK(bad_values == 0);
  }
  // Rounding: halfway between 1 and 1.125 goes to even (1), above it up; past 448 saturates;
  // 2^-10, half the least subnormal, ties to 0. Each case beside 448 (or scaled to it).
  const float cases[] = {448.0f, 1.0625f, 1.0625001f, 1.1875f, 500.0f, -1e9f, 0.0009765625f};
  const double want[] = {448.0, 1.0, 1.125, 1.25, 448.0, -448.0, 0.0};
  float one[7];
  const float unit_scale = 1.0f;
  for (int i = 0; i < 7; ++i) {
    std::uint8_t c = 0;
    float s = 0;
    const float pair[2] = {448.0f, cases[i]};
    std::uint8_t pc[2];
    quantize(ExecStream::host(), pair, DType::f32, 2, 2, QuantCode::fp8_e4m3, pc, &s);
    c = pc[1];
    dequantize(ExecStream::host(), &c, &unit_scale, QuantCode::fp8_e4m3, 1, 1, &one[i], DType::f32,
               false);
    CAPTURE(i);
    CHECK(double(one[i]) == want[i]);
  }
}

TEST_CASE("quantize: each element within half a step of its block, both codes and targets") {
  const std::int64_t block = 64, n = 64 * 37 + 11;  // a short last block
  const std::vector<float> src = spread(n, block);
  const std::int64_t blocks = quant_blocks(n, block);
  CHECK(blocks == 38);
  for (QuantCode code : {QuantCode::int8, QuantCode::fp8_e4m3}) {
    for (ExecTarget t : kTargets) {
      CAPTURE(std::string(quant_code_name(code)));
      const ExecStream on = stream_of(t);
      std::vector<std::uint8_t> codes(static_cast<std::size_t>(n));
      std::vector<float> scales(static_cast<std::size_t>(blocks));
      std::vector<float> back(static_cast<std::size_t>(n));
      quantize(on, src.data(), DType::f32, n, block, code, codes.data(), scales.data());
      dequantize(on, codes.data(), scales.data(), code, n, block, back.data(), DType::f32, false);
      on.fence();
      int bad_scale = 0, bad = 0;
      double worst = 0;  // the largest error in half steps
      for (std::int64_t b = 0; b < blocks; ++b) {
        double amax = 0;
        for (std::int64_t i = b * block; i < std::min(n, (b + 1) * block); ++i)
          amax = std::max(amax, std::fabs(double(src[std::size_t(i)])));
        const double scale = amax / quant_code_max(code);
        if (std::fabs(scales[std::size_t(b)] - scale) > 1e-6 * scale) ++bad_scale;
        for (std::int64_t i = b * block; i < std::min(n, (b + 1) * block); ++i) {
          const double x = src[std::size_t(i)];
          const double half =
              code == QuantCode::int8 ? 0.5 * scale : e4m3_half_step(std::fabs(x) / scale) * scale;
          const double err = std::fabs(double(back[std::size_t(i)]) - x);
          worst = std::max(worst, err / half);
          // Half a step, plus the f32 roundings of the scale and of x / scale.
          if (err > half * (1 + 1e-5) + 1e-6 * scale) ++bad;
        }
      }
      CHECK(bad_scale == 0);
      CHECK(bad == 0);
      CHECK(worst > 0.3);  // the bound is reached, not trivially loose
    }
  }
}

TEST_CASE("quantize: zero and non-finite blocks, accumulation, 16-bit buffers, errors") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  // Blocks of 4: zeros, a NaN, an infinity, plain values.
  const float src[16] = {0, 0, 0, 0, 1, nan, 2, 3, -inf, 1, 2, 3, 0.5f, -1, 0.25f, 2};
  for (QuantCode code : {QuantCode::int8, QuantCode::fp8_e4m3}) {
    CAPTURE(std::string(quant_code_name(code)));
    std::uint8_t codes[16];
    float scales[4];
    quantize(ExecStream::host(), src, DType::f32, 16, 4, code, codes, scales);
    CHECK(scales[0] == 0.0f);
    for (int i = 0; i < 4; ++i)
      CHECK(codes[i] == 0);
    CHECK(std::isnan(scales[1]));  // the bad gradient shows in its block's scale
    CHECK(std::isinf(scales[2]));
    CHECK(scales[3] == 2.0f / quant_code_max(code));
    float out[16];
    dequantize(ExecStream::host(), codes, scales, code, 16, 4, out, DType::f32, false);
    for (int i = 0; i < 4; ++i)
      CHECK(out[i] == 0.0f);
    CHECK(std::isnan(out[4]));  // 0 * NaN
    CHECK(std::isnan(out[8]));  // 0 * inf
    // Accumulation adds the decoded values in f32.
    float acc[16];
    for (int i = 0; i < 16; ++i)
      acc[i] = 10.0f + float(i);
    dequantize(ExecStream::host(), codes, scales, code, 16, 4, acc, DType::f32, true);
    for (int i = 12; i < 16; ++i)
      CHECK(acc[i] == 10.0f + float(i) + out[i]);
  }
  // bf16 in and out: the block's codes from the bf16 values; the output rounded to bf16.
  std::vector<std::uint16_t> h(100), back(100);
  for (int i = 0; i < 100; ++i)
    h[std::size_t(i)] = float_to_bf16(0.01f * float(i - 50));
  std::vector<std::uint8_t> codes(100);
  float scales[2];
  quantize(ExecStream::host(), h.data(), DType::bf16, 100, 50, QuantCode::int8, codes.data(),
           scales);
  dequantize(ExecStream::host(), codes.data(), scales, QuantCode::int8, 100, 50, back.data(),
             DType::bf16, false);
  CHECK(scales[0] == doctest::Approx(bf16_to_float(h[0]) * -1 / 127.0));
  int bad = 0;
  for (int i = 0; i < 100; ++i) {
    const double x = bf16_to_float(h[std::size_t(i)]);
    const double s = scales[i / 50];
    // Half a step, then the bf16 rounding of the output (2^-9 relative).
    if (std::fabs(bf16_to_float(back[std::size_t(i)]) - x) > 0.5 * s + std::fabs(x) / 256 + 1e-7)
      ++bad;
  }
  CHECK(bad == 0);

  float x = 1.0f;
  std::uint8_t c = 0;
  CHECK(contains(error_of<InvalidArgument>([&] {
                   quantize(ExecStream::host(), &x, DType::f32, 1, 0, QuantCode::int8, &c, &x);
                 }),
                 "need n >= 0 and block >= 1, got n 1, block 0"));
  CHECK(contains(error_of<InvalidArgument>([&] {
                   quantize(ExecStream::host(), nullptr, DType::f32, 1, 1, QuantCode::int8, &c, &x);
                 }),
                 "fullshard::kernels::quantize: a null buffer"));
  quantize(ExecStream::host(), nullptr, DType::f32, 0, 1, QuantCode::int8, nullptr, nullptr);
  CHECK(quant_blocks(0, 8) == 0);
  CHECK(std::string(quant_code_name(QuantCode::fp8_e4m3)) == "fp8_e4m3");
}

TEST_CASE("run_dequantize_copies: the all-gather copy-out with the dequantize fused") {
  // A group of four parameters over W = 3 ranks (uneven rows: padding in the slots).
  const int W = 3;
  std::vector<ShardLayout> layouts;
  for (const Shape& sh : {Shape{13, 5}, Shape{7}, Shape{3, 4, 6}, Shape{100, 3}})
    layouts.push_back(shard_layout(sh, Placement::Shard(0), W, 0, "p"));
  const GroupLayout g = make_group_layout(layouts);
  const std::int64_t gsn = g.shard_numel, block = 16;
  const std::int64_t slot = quant_packed_bytes(gsn, block);
  CHECK(slot == (gsn + 3) / 4 * 4 + quant_blocks(gsn, block) * 4);
  const std::vector<float> shards = spread(W * gsn, 11);  // rank q's shard at q * gsn
  for (QuantCode code : {QuantCode::int8, QuantCode::fp8_e4m3})
    for (ExecTarget t : kTargets) {
      CAPTURE(std::string(quant_code_name(code)));
      const ExecStream on = stream_of(t);
      // What each rank sends (its packed slot), gathered rank-major.
      std::vector<float> words(static_cast<std::size_t>(W * slot / 4), -1.0f);  // 4-aligned
      auto* packed = reinterpret_cast<std::uint8_t*>(words.data());
      for (int q = 0; q < W; ++q)
        quantize_packed(on, shards.data() + q * gsn, DType::f32, gsn, block, code,
                        packed + q * slot);
      // Unfused reference: each slot dequantized into the all-gather buffer, then copied out.
      std::vector<float> gathered(static_cast<std::size_t>(W * gsn));
      for (int q = 0; q < W; ++q) {
        const std::uint8_t* s = packed + q * slot;
        dequantize(on, s, reinterpret_cast<const float*>(s + (gsn + 3) / 4 * 4), code, gsn, block,
                   gathered.data() + q * gsn, DType::f32, false);
      }
      const CopyPlan plan(t, all_gather_copy_out_runs(g));
      std::vector<float> want(static_cast<std::size_t>(g.arena_numel), -7.0f);
      run_copies(plan, gathered.data(), DType::f32, want.data(), DType::f32, on);
      std::vector<std::uint16_t> got16(static_cast<std::size_t>(g.arena_numel), 0xffffu);
      std::vector<float> got(static_cast<std::size_t>(g.arena_numel), -7.0f);
      run_dequantize_copies(plan, packed, gsn, block, code, got.data(), DType::f32, on);
      run_dequantize_copies(plan, packed, gsn, block, code, got16.data(), DType::bf16, on);
      on.fence();
      int bad = 0, bad16 = 0, padding = 0;
      for (std::size_t i = 0; i < want.size(); ++i) {
        if (got[i] != want[i]) ++bad;
        if (got16[i] != float_to_bf16(want[i])) ++bad16;
      }
      for (int q = 0; q < W; ++q)  // the bytes between the codes and the scales
        for (std::int64_t b = gsn; b < (gsn + 3) / 4 * 4; ++b)
          if (packed[q * slot + b] != 0) ++padding;
      CHECK(bad == 0);
      CHECK(bad16 == 0);
      CHECK(padding == 0);
    }
  CHECK(contains(error_of<InvalidArgument>([&] {
                   const CopyPlan plan(ExecTarget::host, all_gather_copy_out_runs(g));
                   float d = 0;
                   run_dequantize_copies(plan, &d, 0, 16, QuantCode::int8, &d, DType::f32,
                                         ExecStream::host());
                 }),
                 "need slot_numel >= 1 and block >= 1, got 0 and 16"));
}

TEST_CASE("reduce_dequantize: the compressed reduce-scatter's sum of every rank's chunk") {
  // W = 4 ranks' chunks for this rank (n elements each, the last block short), packed as each
  // rank sends them; the reference decodes each with dequantize and sums in rank order in f32.
  const int W = 4;
  const std::int64_t n = 1000, block = 64;
  const std::int64_t slot = quant_packed_bytes(n, block);
  const std::vector<float> grads = spread(W * n, 37);
  for (QuantCode code : {QuantCode::int8, QuantCode::fp8_e4m3})
    for (ExecTarget t : kTargets) {
      CAPTURE(std::string(quant_code_name(code)));
      const ExecStream on = stream_of(t);
      std::vector<float> words(static_cast<std::size_t>(W * slot / 4));
      auto* packed = reinterpret_cast<std::uint8_t*>(words.data());
      for (int q = 0; q < W; ++q)
        quantize_packed(on, grads.data() + q * n, DType::f32, n, block, code, packed + q * slot);
      std::vector<float> decoded(static_cast<std::size_t>(W * n));
      for (int q = 0; q < W; ++q)
        dequantize(on, packed + q * slot,
                   reinterpret_cast<const float*>(packed + q * slot + (n + 3) / 4 * 4), code, n,
                   block, decoded.data() + q * n, DType::f32, false);
      std::vector<float> out(static_cast<std::size_t>(n), -1.0f), acc(out.size());
      std::vector<double> acc64(out.size());
      for (std::size_t i = 0; i < out.size(); ++i) {
        acc[i] = 0.25f * float(i % 7);
        acc64[i] = 1e-9 * double(i);
      }
      const std::vector<float> acc0 = acc;
      const std::vector<double> acc64_0 = acc64;
      reduce_dequantize(on, packed, W, n, block, code, W, out.data(), DType::f32, false);
      reduce_dequantize(on, packed, W, n, block, code, W, acc.data(), DType::f32, true);
      reduce_dequantize(on, packed, W, n, block, code, 1.0, acc64.data(), DType::f64, true);
      on.fence();
      int bad = 0, bad_acc = 0, bad64 = 0, far = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        float sum = decoded[std::size_t(i)];
        for (int q = 1; q < W; ++q)
          sum = sum + decoded[std::size_t(q * n + i)];
        const float mean = sum / float(W);
        if (out[std::size_t(i)] != mean) ++bad;
        if (acc[std::size_t(i)] != acc0[std::size_t(i)] + mean) ++bad_acc;
        if (acc64[std::size_t(i)] != acc64_0[std::size_t(i)] + double(sum)) ++bad64;
        // Against the uncompressed mean: at most the ranks' half steps (int8), summed.
        double exact = 0, bound = 0;
        for (int q = 0; q < W; ++q) {
          exact += grads[std::size_t(q * n + i)];
          const std::uint8_t* s = packed + q * slot;
          const double scale =
              reinterpret_cast<const float*>(s + (n + 3) / 4 * 4)[std::size_t(i / block)];
          bound += code == QuantCode::int8
                       ? 0.5 * scale
                       : e4m3_half_step(std::fabs(grads[std::size_t(q * n + i)]) / scale) * scale;
        }
        if (std::fabs(double(out[std::size_t(i)]) - exact / W) > bound / W * (1 + 1e-4) + 1e-6)
          ++far;
      }
      CHECK(bad == 0);
      CHECK(bad_acc == 0);
      CHECK(bad64 == 0);  // the f64 gradients keep their precision: the sum added in f64
      CHECK(far == 0);
    }
  float x = 0;
  CHECK(contains(error_of<InvalidArgument>([&] {
                   reduce_dequantize(ExecStream::host(), &x, 0, 1, 1, QuantCode::int8, 1.0, &x,
                                     DType::f32, false);
                 }),
                 "need at least one slot, got 0"));
  CHECK(contains(error_of<InvalidArgument>([&] {
                   reduce_dequantize(ExecStream::host(), &x, 1, 1, 1, QuantCode::int8, 0.0, &x,
                                     DType::f32, false);
                 }),
                 "the divisor must be finite and > 0"));
}
