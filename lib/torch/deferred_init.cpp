#include "fullshard/torch/deferred_init.hpp"

namespace fullshard::torch {

namespace {
// The tensor object stays (modules hold it by member and in their dicts); its metadata and
// storage become a meta tensor's, as set_data would do if it allowed a change of device.
void release(at::Tensor& t) {
  if (!t.defined() || t.is_meta()) return;
  const at::Tensor meta = at::empty(t.sizes(), t.options().device(c10::kMeta));
  t.unsafeGetTensorImpl()->shallow_copy_from(meta.getIntrusivePtr());
}
}  // namespace

void to_meta(::torch::nn::Module& module) {
  for (at::Tensor& t : module.parameters(/*recurse=*/true))
    release(t);
  for (at::Tensor& t : module.buffers(/*recurse=*/true))
    release(t);
}

}  // namespace fullshard::torch
