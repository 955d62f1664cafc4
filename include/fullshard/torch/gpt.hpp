// A GPT-style decoder written with torch::nn (token and position embeddings, pre-LayerNorm
// blocks of causal multi-head self-attention and a GELU MLP, a final LayerNorm and an output
// head tied to the token embedding), ready for fully_shard: each block is called through
// fullshard::torch::call (or checkpoint), so sharding every block and then the root is all a
// training program does. Byte-level by default (vocabulary 256).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "fullshard/torch/deferred_init.hpp"

namespace fullshard::torch {

struct GptConfig {
  std::int64_t vocab = 256;    // tokens (bytes)
  std::int64_t context = 128;  // the longest sequence (position embeddings)
  std::int64_t d_model = 256;
  std::int64_t heads = 4;  // must divide d_model
  std::int64_t layers = 4;
  std::int64_t mlp_ratio = 4;      // MLP hidden = mlp_ratio * d_model
  double dropout = 0.0;            // after attention and MLP (training mode only)
  bool checkpoint_blocks = false;  // activation checkpointing of every block
  /// Deferred initialisation: every piece (embeddings, each block, the final LayerNorm) is
  /// released to the meta device as soon as it is built, so the full model never exists;
  /// after fully_shard, ShardedModel::initialize with init_weights fills the shards.
  bool deferred = false;
  /// The initial values' seed: drawn counter-based (init.hpp), element by element, so the
  /// model is the same at any rank count, deferred or not.
  std::uint64_t seed = 0;
};

/// One decoder block: x + attn(ln1(x)), then + mlp(ln2(x)).
class GptBlockImpl : public ::torch::nn::Module {
 public:
  explicit GptBlockImpl(const GptConfig& c);
  /// x: (batch, time, d_model) -> the same shape.
  at::Tensor forward(const at::Tensor& x);

  ::torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  ::torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};

 private:
  std::int64_t heads_;
  double dropout_;
};
// The holders (TORCH_MODULE's, written out: inside fullshard::torch the macro's unqualified
// torch::nn would name fullshard::torch::nn).
class GptBlock : public ::torch::nn::ModuleHolder<GptBlockImpl> {
 public:
  using ::torch::nn::ModuleHolder<GptBlockImpl>::ModuleHolder;
  using Impl = GptBlockImpl;
};

class GptImpl : public ::torch::nn::Module {
 public:
  /// InvalidArgument for sizes that are not positive or heads that do not divide d_model.
  explicit GptImpl(const GptConfig& c);
  /// ids: (batch, time) int64 tokens, time <= context -> logits (batch, time, vocab).
  at::Tensor forward(const at::Tensor& ids);
  /// Mean cross-entropy of predicting ids[:, 1:] from ids[:, :-1] (nats per token); runs the
  /// forward through fullshard::torch::call (the root's hooks when it is sharded).
  at::Tensor loss(const at::Tensor& ids);

  /// GPT-2's initialisation of one parameter (the whole tensor, or a rank's shard: the
  /// function ShardedModel::initialize takes after a deferred construction), from
  /// config().seed: the same values whichever rank holds the rows.
  void init_weights(const LocalShard& s) const;

  const GptConfig& config() const noexcept { return config_; }
  ::torch::nn::Embedding tok{nullptr}, pos{nullptr};
  ::torch::nn::ModuleList blocks{nullptr};
  ::torch::nn::LayerNorm ln_f{nullptr};
  std::vector<GptBlock> block_list;  // the blocks, typed (blocks holds the same modules)

 private:
  GptConfig config_;
};
class Gpt : public ::torch::nn::ModuleHolder<GptImpl> {
 public:
  using ::torch::nn::ModuleHolder<GptImpl>::ModuleHolder;
  using Impl = GptImpl;
};

}  // namespace fullshard::torch
