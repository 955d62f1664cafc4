// The packed sample: the one byte layout every buffer of the store holds (a producer's ring
// slot after its header, a consumer's staging slot after its header, a buffer slot), so that a
// sample moves between them without being re-laid out. Each field in its stored dtype,
// row-major, at an 8-byte aligned offset (an f64 field is aligned wherever the sample is); the
// whole rounded up to 8 bytes, so consecutive slots keep that alignment.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "fullshard/store/sample_store.hpp"

namespace fullshard::store {

inline std::size_t align8(std::size_t n) {
  return (n + 7) & ~std::size_t(7);
}

/// Where one field lives in a packed sample.
struct FieldLayout {
  std::size_t offset = 0;
  std::int64_t elements = 1;
  DType stored = DType::f32;  ///< f32 for a store_as_f32 field, else the field's dtype
  std::size_t bytes = 0;      ///< elements x the stored dtype's size
};

struct SampleLayout {
  std::vector<FieldLayout> fields;  ///< in the order of StoreOptions::fields
  std::size_t sample_bytes = 0;
};

/// The layout of `fields` (already validated: every extent >= 1, known dtypes).
SampleLayout layout_of(const std::vector<Field>& fields);

}  // namespace fullshard::store
