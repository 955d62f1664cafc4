// The residual MLP of fullshard-train (apps/common/residual_mlp.hpp, written there by hand
// over CBLAS) as a LibTorch model, with the same module tree and FQNs ("input", "blocks.<i>"
// with w1, b1, w2, b2, "output"), so that one safetensors file initialises both:
//   h0 = x W_in^T + b_in;  h_{i+1} = h_i + relu(h_i W1_i^T + b1_i) W2_i^T + b2_i;
//   y = h_L W_out^T + b_out.
// Each block is called through fullshard::torch::call: fully_shard every block and the root.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "fullshard/torch/deferred_init.hpp"

namespace fullshard::torch {

struct ResidualMlpConfig {
  std::int64_t inputs = 32, hidden = 256, outputs = 8, blocks = 4;
  /// Deferred initialisation (deferred_init.hpp): each piece released to the meta device as
  /// soon as it is built, so the full model never exists; fill the shards after fully_shard
  /// with ShardedModel::initialize(model->initializer(seed)).
  bool deferred = false;
};

/// One block: h + relu(h W1^T + b1) W2^T + b2 (parameters w1 (H, H), b1 (H), w2 (H, H), b2).
class ResidualBlockImpl : public ::torch::nn::Module {
 public:
  explicit ResidualBlockImpl(std::int64_t hidden);
  at::Tensor forward(const at::Tensor& h);
  at::Tensor w1, b1, w2, b2;
};

class ResidualMlpImpl : public ::torch::nn::Module {
 public:
  /// InvalidArgument for sizes that are not positive. The initial values are LibTorch's
  /// (load the hand-written model's with checkpoint::load_safetensors to compare the two);
  /// deferred: none (meta tensors until ShardedModel::initialize).
  explicit ResidualMlpImpl(const ResidualMlpConfig& c);
  /// x: (rows, inputs) -> (rows, outputs); the blocks through fullshard::torch::call.
  at::Tensor forward(const at::Tensor& x);
  /// The initial values of `seed`, the same at any rank count (init.hpp): the layers'
  /// U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the blocks' w1, b1, w2, b2 U(-1/sqrt(H), 1/sqrt(H)).
  /// ShardedModel::initialize's function after a deferred construction.
  std::function<void(const LocalShard&)> initializer(std::uint64_t seed) const;

  ::torch::nn::Linear input{nullptr}, output{nullptr};
  std::vector<std::shared_ptr<ResidualBlockImpl>> block_list;  // registered as blocks.<i>
};

// The holder (TORCH_MODULE's, written out: inside fullshard::torch the macro's unqualified
// torch::nn would name fullshard::torch::nn).
class ResidualMlp : public ::torch::nn::ModuleHolder<ResidualMlpImpl> {
 public:
  using ::torch::nn::ModuleHolder<ResidualMlpImpl>::ModuleHolder;
  using Impl = ResidualMlpImpl;
};

}  // namespace fullshard::torch
