#include "lib/store/pack.hpp"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "fullshard/base/error.hpp"
#include "lib/store/describe.hpp"

namespace fullshard::store {

void check_views(const std::string& label, const std::vector<Field>& fields,
                 const std::vector<ArrayView>& views) {
  if (views.size() != fields.size())
    throw InvalidArgument(label + ": put got " + std::to_string(views.size()) + " arrays for the " +
                          std::to_string(fields.size()) + " fields");
  for (std::size_t f = 0; f < views.size(); ++f) {
    const Field& field = fields[f];
    const ArrayView& v = views[f];
    // Built only for an error: this runs on every put.
    auto name = [&] { return label + ": put: field '" + field.name + "'"; };
    const bool dtype_ok = v.dtype == field.dtype ||
                          (field.store_as_f32 && (v.dtype == DType::f64 || v.dtype == DType::f32));
    if (!dtype_ok)
      throw InvalidArgument(name() + " expects dtype " + dtype_name(field.dtype) +
                            (field.store_as_f32 ? " (or f32; kept as f32)" : "") + ", given " +
                            dtype_name(v.dtype));
    if (v.shape != field.shape)
      throw InvalidArgument(name() + " expects shape " + shape_text(field.shape) + ", given " +
                            shape_text(v.shape));
    if (!v.strides.empty() && v.strides.size() != v.shape.size())
      throw InvalidArgument(name() + " has " + std::to_string(v.strides.size()) +
                            " strides for a shape of " + std::to_string(v.shape.size()) + " dims");
    if (v.data == nullptr) throw InvalidArgument(name() + ": no data (a null pointer)");
  }
}

namespace {

// The checks work on the stored bits, so that they cost no conversion and the copy loop stays
// branch-free: a value is non-finite when its exponent bits are all ones; a mask value is 0
// (every bit but the sign clear) or exactly 1.
struct F32Bits {
  using Word = std::uint32_t;
  static constexpr Word exponent = 0x7f800000u, sign = 0x80000000u, one = 0x3f800000u;
};
struct F64Bits {
  using Word = std::uint64_t;
  static constexpr Word exponent = 0x7ff0000000000000ull, sign = 0x8000000000000000ull,
                        one = 0x3ff0000000000000ull;
};
struct F16Bits {
  using Word = std::uint16_t;
  static constexpr Word exponent = 0x7c00u, sign = 0x8000u, one = 0x3c00u;
};
struct BF16Bits {
  using Word = std::uint16_t;
  static constexpr Word exponent = 0x7f80u, sign = 0x8000u, one = 0x3f80u;
};

template <class Bits>
bool is_non_finite(typename Bits::Word w) {
  return (w & Bits::exponent) == Bits::exponent;
}

template <class Bits>
bool is_not_mask(typename Bits::Word w) {
  using Word = typename Bits::Word;
  return static_cast<Word>(w & static_cast<Word>(~Bits::sign)) != 0 && w != Bits::one;
}

struct RowFlags {
  bool non_finite = false;
  bool not_mask = false;
};

/// One row of a field: `n` elements of the caller's array from `src`, `stride` elements apart
/// (Unit: 1, a constant the compiler can use), written contiguous to `dst` in the stored dtype
/// (Narrow: f64 given, f32 stored) and checked as they are written. The flags are or-reduced
/// rather than branched on, so that the loop has no exit and vectorises (GCC: with
/// -fvect-cost-model=dynamic, as lib/CMakeLists.txt builds the kernels; its -O2 default leaves
/// a loop of unknown count scalar).
template <class Bits, bool Narrow, bool Mask, bool Unit>
RowFlags pack_row(const std::byte* src, std::ptrdiff_t stride, std::byte* dst, std::int64_t n) {
  using Word = typename Bits::Word;
  using In = std::conditional_t<Narrow, double, Word>;
  static_assert(!Narrow || sizeof(Word) == sizeof(float), "f64 is narrowed to f32 only");
  constexpr auto in_size = static_cast<std::ptrdiff_t>(sizeof(In));
  const std::ptrdiff_t step = (Unit ? 1 : stride) * in_size;
  unsigned non_finite = 0, not_mask = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    In in;
    std::memcpy(&in, src + i * step, sizeof in);
    Word w;
    if constexpr (Narrow) {
      const auto x = static_cast<float>(in);
      std::memcpy(&w, &x, sizeof w);
    } else {
      w = in;
    }
    std::memcpy(dst + static_cast<std::size_t>(i) * sizeof(Word), &w, sizeof w);
    non_finite |= is_non_finite<Bits>(w) ? 1u : 0u;
    if constexpr (Mask) not_mask |= is_not_mask<Bits>(w) ? 1u : 0u;
  }
  return {non_finite != 0, not_mask != 0};
}

/// A dim of the caller's array: extent and stride (elements).
struct Run {
  std::int64_t extent;
  std::ptrdiff_t stride;
};

/// Dims, at most kInline of them without a heap allocation (a put allocates nothing for any
/// array of up to 8 dims).
class Runs {
 public:
  static constexpr std::size_t kInline = 8;
  explicit Runs(std::size_t capacity) {
    if (capacity > kInline) heap_.resize(capacity);
  }
  Run* data() { return heap_.empty() ? inline_ : heap_.data(); }
  std::size_t size() const { return size_; }
  Run& operator[](std::size_t i) { return data()[i]; }
  Run& back() { return data()[size_ - 1]; }
  void push_back(Run r) { data()[size_++] = r; }
  void pop_back() { --size_; }

 private:
  Run inline_[kInline];
  std::vector<Run> heap_;
  std::size_t size_ = 0;
};

/// The view's dims as few runs as possible: extent-1 dims dropped, a dim merged into the
/// next when both are one stretch of memory (a contiguous array is one run, packed as one
/// row). The row-major order of the elements is unchanged. Never empty.
Runs collapse(const ArrayView& v) {
  Runs runs(std::max<std::size_t>(v.shape.size(), 1));
  if (v.strides.empty()) {  // contiguous row-major
    std::int64_t n = 1;
    for (std::int64_t e : v.shape)
      n *= e;
    runs.push_back({n, 1});
    return runs;
  }
  for (std::size_t d = 0; d < v.shape.size(); ++d) {
    if (v.shape[d] == 1) continue;
    const Run inner{v.shape[d], static_cast<std::ptrdiff_t>(v.strides[d])};
    if (runs.size() > 0 && runs.back().stride == inner.stride * inner.extent)
      runs.back() = Run{runs.back().extent * inner.extent, inner.stride};
    else
      runs.push_back(inner);
  }
  if (runs.size() == 0) runs.push_back({1, 1});  // a scalar, or every extent 1
  return runs;
}

/// The first element of a packed row that fails `bad`, as an ElementAt.
template <class Bits, class Bad>
ElementAt locate(const std::byte* row, std::int64_t n, std::int64_t first, std::size_t field,
                 DType stored, Bad bad) {
  using Word = typename Bits::Word;
  for (std::int64_t i = 0; i < n; ++i) {
    Word w;
    std::memcpy(&w, row + static_cast<std::size_t>(i) * sizeof(Word), sizeof w);
    if (bad(w)) return {field, first + i, load_as_double(row, stored, static_cast<std::size_t>(i))};
  }
  return {field, first, 0.0};  // unreachable: the row's flag said one fails
}

/// Packs field `f` row by row. Returns false when it met a non-finite value (recorded in
/// `outcome`; the rest of the field is not packed).
template <class Bits, bool Narrow, bool Mask>
bool pack_field(const ArrayView& v, const FieldLayout& l, std::size_t f, std::byte* dst,
                PackOutcome& outcome) {
  using Word = typename Bits::Word;
  Runs runs = collapse(v);
  const Run inner = runs.back();
  runs.pop_back();
  std::int64_t idx_inline[Runs::kInline] = {};
  std::vector<std::int64_t> idx_heap(runs.size() > Runs::kInline ? runs.size() : 0, 0);
  std::int64_t* idx = idx_heap.empty() ? idx_inline : idx_heap.data();

  const auto* base = static_cast<const std::byte*>(v.data);
  const auto in_size = static_cast<std::ptrdiff_t>(dtype_size(v.dtype));
  std::ptrdiff_t at = 0;  // elements from base to the row's first
  const std::int64_t rows = l.elements / inner.extent;
  for (std::int64_t row = 0; row < rows; ++row) {
    const std::int64_t first = row * inner.extent;
    std::byte* out = dst + static_cast<std::size_t>(first) * sizeof(Word);
    const std::byte* src = base + at * in_size;
    const RowFlags flags =
        inner.stride == 1
            ? pack_row<Bits, Narrow, Mask, true>(src, 1, out, inner.extent)
            : pack_row<Bits, Narrow, Mask, false>(src, inner.stride, out, inner.extent);
    if (flags.non_finite) {  // the error path: find which element
      outcome.non_finite = locate<Bits>(out, inner.extent, first, f, l.stored,
                                        [](Word w) { return is_non_finite<Bits>(w); });
      return false;
    }
    if (flags.not_mask && !outcome.not_mask)
      outcome.not_mask = locate<Bits>(out, inner.extent, first, f, l.stored,
                                      [](Word w) { return is_not_mask<Bits>(w); });
    for (std::size_t d = runs.size(); d-- > 0;) {  // the next row's first element
      at += runs[d].stride;
      if (++idx[d] < runs[d].extent) break;
      at -= runs[d].stride * runs[d].extent;
      idx[d] = 0;
    }
  }
  return true;
}

template <class Bits, bool Narrow>
bool pack_field_as(bool mask, const ArrayView& v, const FieldLayout& l, std::size_t f,
                   std::byte* dst, PackOutcome& outcome) {
  return mask ? pack_field<Bits, Narrow, true>(v, l, f, dst, outcome)
              : pack_field<Bits, Narrow, false>(v, l, f, dst, outcome);
}

std::string element_text(const std::vector<Field>& fields, const ElementAt& at) {
  const Field& field = fields[at.field];
  return "field '" + field.name + "' element " + std::to_string(at.element) + " (index " +
         index_text(field.shape, at.element) + ") is " + value_text(at.value);
}

}  // namespace

PackOutcome pack_sample(const std::vector<Field>& fields, const SampleLayout& layout,
                        const std::vector<ArrayView>& views, std::byte* sample) {
  PackOutcome outcome;
  for (std::size_t f = 0; f < views.size(); ++f) {
    const ArrayView& v = views[f];
    const FieldLayout& l = layout.fields[f];
    const bool mask = fields[f].mask;
    std::byte* dst = sample + l.offset;
    bool go_on = true;
    switch (l.stored) {
      case DType::f32:
        go_on = v.dtype == DType::f64 ? pack_field_as<F32Bits, true>(mask, v, l, f, dst, outcome)
                                      : pack_field_as<F32Bits, false>(mask, v, l, f, dst, outcome);
        break;
      case DType::f64:
        go_on = pack_field_as<F64Bits, false>(mask, v, l, f, dst, outcome);
        break;
      case DType::f16:
        go_on = pack_field_as<F16Bits, false>(mask, v, l, f, dst, outcome);
        break;
      case DType::bf16:
        go_on = pack_field_as<BF16Bits, false>(mask, v, l, f, dst, outcome);
        break;
    }
    if (!go_on) break;
  }
  return outcome;
}

std::string non_finite_text(const std::string& label, const std::vector<Field>& fields,
                            const ElementAt& at, std::int64_t step, int rank) {
  return label + ": " + element_text(fields, at) +
         (fields[at.field].store_as_f32 ? " (as f32)" : "") + " at step " + std::to_string(step) +
         " on rank " + std::to_string(rank);
}

std::string not_mask_text(const std::string& label, const std::vector<Field>& fields,
                          const ElementAt& at, std::int64_t step, int rank) {
  return label + ": mask " + element_text(fields, at) + " at step " + std::to_string(step) +
         " on rank " + std::to_string(rank) + ": a mask holds 0 or 1";
}

}  // namespace fullshard::store
