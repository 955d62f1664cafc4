#include "lib/torch/parameter_binding.hpp"

#include <memory>
#include <string>

#include "fullshard/base/error.hpp"

namespace fullshard::torch::detail {

c10::ScalarType scalar_type(DType t) {
  switch (t) {
    case DType::f32:
      return c10::ScalarType::Float;
    case DType::f64:
      return c10::ScalarType::Double;
    case DType::f16:
      return c10::ScalarType::Half;
    case DType::bf16:
      return c10::ScalarType::BFloat16;
  }
  throw InvalidArgument("fullshard::torch: no torch dtype for " + std::string(dtype_name(t)));
}

DType dtype_of(c10::ScalarType t, const std::string& what) {
  switch (t) {
    case c10::ScalarType::Float:
      return DType::f32;
    case c10::ScalarType::Double:
      return DType::f64;
    case c10::ScalarType::Half:
      return DType::f16;
    case c10::ScalarType::BFloat16:
      return DType::bf16;
    default:
      throw InvalidArgument(what + " is a " + std::string(c10::toString(t)) +
                            " tensor; fullshard shards float32, float64, float16 and bfloat16");
  }
}

namespace {

void drop_tensor(void* ctx) {
  delete static_cast<Tensor*>(ctx);
}

std::vector<int64_t> sizes_of(const Shape& s) {
  return {s.begin(), s.end()};
}

}  // namespace

ParameterBinding::ParameterBinding(at::Tensor param, c10::Device device)
    : param_(std::move(param)),
      device_(device),
      unsharded_(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, device), nullptr,
                 false) {}

// A torch tensor over t's bytes that keeps t (and so fullshard's buffer) alive.
at::Tensor ParameterBinding::view(const Tensor& t) const {
  auto* keep = new Tensor(t);
  return ::torch::from_blob(
      t.data(), sizes_of(t.shape()), [keep](void*) { delete keep; },
      at::TensorOptions().dtype(scalar_type(t.dtype())).device(device_));
}

void ParameterBinding::show(const at::Tensor& t) {
  // Deferred initialisation: set_data refuses a meta tensor a device tensor's data; what it
  // does after that check is this metadata copy (the TensorImpl and its autograd state stay).
  if (param_.is_meta())
    param_.unsafeGetTensorImpl()->shallow_copy_from(t.getIntrusivePtr());
  else
    param_.set_data(t);
}

void ParameterBinding::data_shown(const graph::Parameter& p, bool sharded) {
  const Tensor& t = p.data();
  c10::StorageImpl* storage = unsharded_.unsafeGetStorageImpl();
  const c10::Device device = device_;
  if (sharded) {
    if (!shard_view_.defined() || shard_of_ != t.data() ||
        shard_view_.sizes() != c10::IntArrayRef(sizes_of(t.shape()))) {
      shard_view_ = view(t);
      shard_of_ = t.data();
    }
    show(shard_view_);
    storage->set_data_ptr_noswap(c10::DataPtr(nullptr, device));  // resize to zero
    storage->set_nbytes(0);
    return;
  }
  // Unsharded: the storage object autograd's saved views share points at the new buffer.
  storage->set_data_ptr_noswap(c10::DataPtr(t.data(), new Tensor(t), &drop_tensor, device));
  storage->set_nbytes(t.nbytes());
  if (!unsharded_view_.defined())
    unsharded_view_ =
        at::empty({0}, at::TensorOptions().dtype(scalar_type(t.dtype())).device(device))
            .set_(unsharded_, 0, sizes_of(t.shape()));
  show(unsharded_view_);
}

void ParameterBinding::grad_shown(const graph::Parameter& p, bool sharded) {
  const Tensor& t = p.grad();
  if (!sharded) {
    // Pre-backward: the gradient a no_sync backward left (autograd accumulates into it in
    // place), or none (autograd allocates one).
    if (!t.defined())
      external_grad_ = at::Tensor();
    else if (!external_grad_.defined() || t.data() != external_grad_.data_ptr())
      external_grad_ = view(t);
    param_.mutable_grad() = external_grad_;
    return;
  }
  external_grad_ = at::Tensor();  // the engine holds what it still needs
  if (!t.defined()) {
    // Dropped (zero_grad): the cached view goes too, so that the group can reuse the storage
    // for the next gradients instead of allocating another beside it.
    grad_view_ = at::Tensor();
    grad_of_ = nullptr;
    param_.mutable_grad() = at::Tensor();
    return;
  }
  if (!grad_view_.defined() || grad_of_ != t.data() ||
      grad_view_.sizes() != c10::IntArrayRef(sizes_of(t.shape()))) {
    grad_view_ = view(t);
    grad_of_ = t.data();
  }
  param_.mutable_grad() = grad_view_;
}

void ParameterBinding::register_gradient(graph::Parameter& p) {
  at::Tensor g = param_.grad();
  if (!g.defined()) return;  // unused in this backward: p keeps what it shows
  if (p.grad().defined() && p.grad().data() == g.data_ptr()) return;  // registered already
  if (g.dim() != static_cast<int64_t>(p.shape().size()) || g.numel() != p.numel())
    throw InvalidArgument("fullshard::torch: the gradient of '" + p.fqn() + "' has shape " +
                          c10::str(g.sizes()) + ", expected the unsharded " +
                          shape_string(p.shape()));
  if (!g.is_contiguous()) g = g.contiguous();
  external_grad_ = g;
  param_.mutable_grad() = g;
  auto keep = std::make_shared<at::Tensor>(g);
  p.set_grad(Tensor::from_owner(keep, g.data_ptr(), p.shape(),
                                dtype_of(g.scalar_type(), "the gradient of '" + p.fqn() + "'"),
                                g.is_cuda() ? MemorySpace::device : MemorySpace::host));
}

bool ParameterBinding::gradient_dropped(const graph::Parameter& p) const {
  return p.grad().defined() && !param_.grad().defined();
}

}  // namespace fullshard::torch::detail
