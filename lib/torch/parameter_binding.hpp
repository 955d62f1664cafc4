// A LibTorch parameter that follows what the fsdp layer shows on its graph::Parameter,
// without copying: the shard (a torch view of fullshard's sharded storage), the unsharded
// parameter (a persistent storage object pointed at fullshard's buffer while unsharded and
// emptied at reshard: FSDP's resize-to-zero, so autograd's saved views see the next
// all-gather's values), and the gradients (a view of the sharded gradient; autograd's own
// unsharded gradient handed to the reduce-scatter). Private to lib/torch.
#pragma once

#include <torch/types.h>

#include "fullshard/graph/module.hpp"

namespace fullshard::torch::detail {

/// The torch dtype of a fullshard dtype and back (InvalidArgument for other torch dtypes,
/// naming `what`).
c10::ScalarType scalar_type(DType t);
DType dtype_of(c10::ScalarType t, const std::string& what);

class ParameterBinding final : public graph::ParameterBinding {
 public:
  /// `param` is the model's parameter (the TensorImpl its module and parameters() hold);
  /// `device` the mesh's (a meta parameter, deferred initialisation, becomes a tensor there).
  ParameterBinding(at::Tensor param, c10::Device device);
  ParameterBinding(const ParameterBinding&) = delete;
  ParameterBinding& operator=(const ParameterBinding&) = delete;

  void data_shown(const graph::Parameter& p, bool sharded) override;
  void grad_shown(const graph::Parameter& p, bool sharded) override;

  /// Post-backward: registers autograd's unsharded gradient (if any) on `p` for the
  /// reduce-scatter (no copy; the engine holds it until the copy-in ran).
  void register_gradient(graph::Parameter& p);
  /// Pre-backward: true when fullshard shows a sharded gradient that the torch parameter no
  /// longer has (the user set it to none: torch's zero_grad(set_to_none)).
  bool gradient_dropped(const graph::Parameter& p) const;

  const at::Tensor& param() const noexcept { return param_; }

 private:
  at::Tensor view(const Tensor& t) const;
  void show(const at::Tensor& t);  // param_ shows t (its storage, shape and device)
  at::Tensor param_;
  c10::Device device_;
  c10::Storage unsharded_;     // the unsharded parameter's storage object, kept for autograd
  at::Tensor unsharded_view_;  // the full shape over unsharded_ (made at the first unshard)
  at::Tensor shard_view_;      // cached views, by the fullshard data they show
  const void* shard_of_ = nullptr;
  at::Tensor grad_view_;
  const void* grad_of_ = nullptr;
  at::Tensor external_grad_;  // autograd's unsharded gradient, registered on the Parameter
};

}  // namespace fullshard::torch::detail
