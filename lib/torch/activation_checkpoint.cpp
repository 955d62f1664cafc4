// Activation checkpointing (the reentrant form: LibTorch's C++ API has no saved-tensor hooks
// common to 1.13 and 2.x). The forward runs without grad, keeping only the inputs and the CPU
// RNG state; backward restores that state, runs the forward again with grad (through call(),
// so a sharded module's hooks see a forward inside backward: its group is all-gathered once,
// by the recomputation, and pre-backward finds it unsharded) and back-propagates through it.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>

#include "fullshard/base/error.hpp"
#include "fullshard/torch/sharded_model.hpp"

namespace fullshard::torch {
namespace {

using ::torch::autograd::AutogradContext;
using ::torch::autograd::variable_list;

// The recompute function, owned by a 0-element tensor saved in the autograd context: it lives
// exactly as long as the node (a custom Function's context holds only IValues).
at::Tensor hold(Recompute fn) {
  // (A 0-element tensor's data_ptr() is null: the function is found through its storage.)
  auto* f = new Recompute(std::move(fn));
  return ::torch::from_blob(
      f, {0}, [f](void*) { delete f; }, at::TensorOptions().dtype(at::kByte));
}

Recompute& recompute(const at::Tensor& held) {
  return *static_cast<Recompute*>(held.storage().data_ptr().get());
}

struct Checkpoint : ::torch::autograd::Function<Checkpoint> {
  static variable_list forward(AutogradContext* ctx, at::Tensor fn, at::TensorList xs) {
    ctx->saved_data["fn"] = fn;
    ctx->saved_data["rng"] = at::detail::getDefaultCPUGenerator().get_state();
    c10::List<bool> grads;
    for (const at::Tensor& x : xs)
      grads.push_back(x.requires_grad());
    ctx->saved_data["requires_grad"] = grads;
    ctx->save_for_backward(xs.vec());
    ::torch::NoGradGuard no_grad;
    return {recompute(fn)(xs.vec())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const c10::List<bool> wanted = ctx->saved_data["requires_grad"].toBoolList();
    std::vector<at::Tensor> inputs;
    for (std::size_t i = 0; i < saved.size(); ++i)
      inputs.push_back(saved[i].detach().requires_grad_(wanted.get(i)));
    at::Tensor out;
    {
      // The forward's RNG state for the recomputation, then the current one again.
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      const at::Tensor now = gen.get_state();
      gen.set_state(ctx->saved_data["rng"].toTensor());
      try {
        ::torch::AutoGradMode grad(true);
        at::Tensor fn = ctx->saved_data["fn"].toTensor();
        out = recompute(fn)(inputs);
      } catch (...) {
        gen.set_state(now);
        throw;
      }
      gen.set_state(now);
    }
    if (out.requires_grad() && grads.at(0).defined())
      ::torch::autograd::backward({out}, {grads[0]});
    variable_list result;
    result.emplace_back();  // fn
    for (const at::Tensor& x : inputs)
      result.push_back(x.requires_grad() ? x.grad() : at::Tensor());
    return result;
  }
};

}  // namespace

at::Tensor checkpointed(Recompute fn, std::vector<at::Tensor> inputs) {
  if (!fn) throw InvalidArgument("fullshard::torch::checkpoint: no forward to run");
  return Checkpoint::apply(hold(std::move(fn)), at::TensorList(inputs))[0];
}

}  // namespace fullshard::torch
