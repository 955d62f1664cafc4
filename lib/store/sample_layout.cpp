#include "lib/store/sample_layout.hpp"

namespace fullshard::store {

SampleLayout layout_of(const std::vector<Field>& fields) {
  SampleLayout layout;
  for (const Field& field : fields) {
    FieldLayout l;
    l.offset = align8(layout.sample_bytes);
    for (std::int64_t n : field.shape)
      l.elements *= n;
    l.stored = field.store_as_f32 ? DType::f32 : field.dtype;
    l.bytes = static_cast<std::size_t>(l.elements) * dtype_size(l.stored);
    layout.sample_bytes = l.offset + l.bytes;
    layout.fields.push_back(l);
  }
  layout.sample_bytes = align8(layout.sample_bytes);
  return layout;
}

}  // namespace fullshard::store
