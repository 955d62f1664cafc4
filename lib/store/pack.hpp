// A put's one pass over the caller's arrays: the strided gather, the conversion to the stored
// dtype, and the checks of every value (non-finite, mask), straight into the send slot the
// sample will leave from. The checks look at each value as it is written, so a sample costs
// one read of the caller's arrays and one write of the slot, whatever its strides and dtypes.
// No MPI here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fullshard/store/sample_store.hpp"
#include "lib/store/sample_layout.hpp"

namespace fullshard::store {

/// The element of a sample a check stopped at.
struct ElementAt {
  std::size_t field = 0;
  std::int64_t element = 0;  ///< its row-major index in the field
  double value = 0;          ///< as stored (after an f64 -> f32 rounding)
};

struct PackOutcome {
  /// The first NaN or infinity, in field order then row-major. Packing stops there: the
  /// sample is refused or dropped, and the rest of the slot is left as it was.
  std::optional<ElementAt> non_finite;
  /// The first element of a mask field other than 0 or 1 (packing goes on, so that a later
  /// non-finite value still takes precedence, as NonFinite::drop says).
  std::optional<ElementAt> not_mask;
};

/// InvalidArgument naming the store (`label`), the field, what it expects and what was given,
/// when a view's count, dtype, shape or strides do not fit the fields, or its data is null.
void check_views(const std::string& label, const std::vector<Field>& fields,
                 const std::vector<ArrayView>& views);

/// Packs `views` (check_views passed) into `sample` (layout.sample_bytes): each field in its
/// stored dtype, row-major, at its offset. Bytes between fields are never written.
PackOutcome pack_sample(const std::vector<Field>& fields, const SampleLayout& layout,
                        const std::vector<ArrayView>& views, std::byte* sample);

/// "<label>: field 'x' element 1 (index [1]) is nan at step 5 on rank 0".
std::string non_finite_text(const std::string& label, const std::vector<Field>& fields,
                            const ElementAt& at, std::int64_t step, int rank);
/// "<label>: mask field 'm' element 1 (index [1]) is 0.5 at step 1 on rank 0: a mask holds 0
/// or 1".
std::string not_mask_text(const std::string& label, const std::vector<Field>& fields,
                          const ElementAt& at, std::int64_t step, int rank);

}  // namespace fullshard::store
