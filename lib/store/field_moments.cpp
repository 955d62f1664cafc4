#include "lib/store/field_moments.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace fullshard::store {

void RunningMoments::merge(const RunningMoments& o) {
  if (o.count == 0) return;
  if (count == 0) {
    *this = o;
    return;
  }
  const double n = count + o.count;
  const double d = o.mean - mean;
  mean += d * o.count / n;
  m2 += o.m2 + d * d * count * o.count / n;
  count = n;
}

FieldMoments RunningMoments::result() const {
  return {static_cast<std::int64_t>(count), mean, count > 0 ? std::sqrt(m2 / count) : 0.0};
}

namespace {

struct AsF32 {
  using Word = std::uint32_t;
  static double value(Word w) { return bits_float(w); }
};
struct AsF64 {
  using Word = std::uint64_t;
  static double value(Word w) {
    double d;
    std::memcpy(&d, &w, sizeof d);
    return d;
  }
};
struct AsF16 {
  using Word = std::uint16_t;
  static double value(Word w) { return f16_to_float(w); }
};
struct AsBF16 {
  using Word = std::uint16_t;
  static double value(Word w) { return bf16_to_float(w); }
};

/// One field: copies it (Copy) and returns its moments. Four independent partial sums, so
/// that the additions do not wait on one another; their order is fixed, so a sample gives the
/// same moments in every run.
template <class As, bool Copy>
RunningMoments copy_and_measure_field(const std::byte* src, std::byte* dst, std::int64_t n) {
  using Word = typename As::Word;
  auto word = [&](std::int64_t i) {
    Word w;
    std::memcpy(&w, src + static_cast<std::size_t>(i) * sizeof(Word), sizeof w);
    if constexpr (Copy) std::memcpy(dst + static_cast<std::size_t>(i) * sizeof(Word), &w, sizeof w);
    return w;
  };
  const double shift = As::value(word(0));
  constexpr int kLanes = 8;
  double s1[kLanes] = {}, s2[kLanes] = {};
  std::int64_t i = 1;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) {
      const double d = As::value(word(i + k)) - shift;
      s1[k] += d;
      s2[k] += d * d;
    }
  for (; i < n; ++i) {
    const double d = As::value(word(i)) - shift;
    s1[0] += d;
    s2[0] += d * d;
  }
  double sum = 0, squares = 0;
  for (int k = 0; k < kLanes; ++k) {
    sum += s1[k];
    squares += s2[k];
  }
  const auto count = static_cast<double>(n);
  return {count, shift + sum / count, std::max(0.0, squares - sum * sum / count)};
}

template <class As>
RunningMoments measure_as(const std::byte* src, std::byte* dst, std::int64_t n) {
  return dst ? copy_and_measure_field<As, true>(src, dst, n)
             : copy_and_measure_field<As, false>(src, dst, n);
}

}  // namespace

void copy_and_measure(const std::vector<Field>& fields, const SampleLayout& layout,
                      const std::byte* sample, std::byte* slot,
                      std::vector<RunningMoments>& moments) {
  for (std::size_t f = 0; f < fields.size(); ++f) {
    const FieldLayout& l = layout.fields[f];
    const std::byte* src = sample + l.offset;
    std::byte* dst = slot ? slot + l.offset : nullptr;
    if (fields[f].mask) {  // no moments: "excluded from normalisation"
      if (dst) std::memcpy(dst, src, l.bytes);
      continue;
    }
    RunningMoments m;
    switch (l.stored) {
      case DType::f32:
        m = measure_as<AsF32>(src, dst, l.elements);
        break;
      case DType::f64:
        m = measure_as<AsF64>(src, dst, l.elements);
        break;
      case DType::f16:
        m = measure_as<AsF16>(src, dst, l.elements);
        break;
      case DType::bf16:
        m = measure_as<AsBF16>(src, dst, l.elements);
        break;
    }
    moments[f].merge(m);
  }
}

}  // namespace fullshard::store
