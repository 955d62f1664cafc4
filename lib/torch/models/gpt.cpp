#include "fullshard/torch/gpt.hpp"

#include "fullshard/torch/init.hpp"

#include <torch/nn/functional/loss.h>
#include <torch/nn/options/embedding.h>
#include <torch/nn/options/linear.h>
#include <torch/nn/options/normalization.h>

#include <cmath>
#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/torch/sharded_model.hpp"

namespace fullshard::torch {

namespace {
void check(const GptConfig& c) {
  auto positive = [](std::int64_t v, const char* what) {
    if (v <= 0)
      throw InvalidArgument("GptConfig: " + std::string(what) + " must be positive, not " +
                            std::to_string(v));
  };
  positive(c.vocab, "vocab");
  positive(c.context, "context");
  positive(c.d_model, "d_model");
  positive(c.heads, "heads");
  positive(c.layers, "layers");
  positive(c.mlp_ratio, "mlp_ratio");
  if (c.d_model % c.heads != 0)
    throw InvalidArgument("GptConfig: heads (" + std::to_string(c.heads) +
                          ") must divide d_model (" + std::to_string(c.d_model) + ")");
  if (c.dropout < 0 || c.dropout >= 1)
    throw InvalidArgument("GptConfig: dropout must be in [0, 1), not " + std::to_string(c.dropout));
}
}  // namespace

GptBlockImpl::GptBlockImpl(const GptConfig& c) : heads_(c.heads), dropout_(c.dropout) {
  namespace nn = ::torch::nn;
  const std::int64_t d = c.d_model;
  ln1 = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({d})));
  qkv = register_module("qkv", nn::Linear(d, 3 * d));
  proj = register_module("proj", nn::Linear(d, d));
  ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({d})));
  fc = register_module("fc", nn::Linear(d, c.mlp_ratio * d));
  out = register_module("out", nn::Linear(c.mlp_ratio * d, d));
}

at::Tensor GptBlockImpl::forward(const at::Tensor& x) {
  const std::int64_t b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads_;
  // Causal self-attention: (b, heads, t, hd) queries, keys and values.
  std::vector<at::Tensor> parts = qkv(ln1(x)).view({b, t, 3, heads_, hd}).unbind(2);
  const at::Tensor q = parts[0].transpose(1, 2), k = parts[1].transpose(1, 2),
                   v = parts[2].transpose(1, 2);
  at::Tensor att = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(hd)));
  const at::Tensor future =
      at::ones({t, t}, at::TensorOptions().dtype(at::kBool).device(x.device())).triu(1);
  att = at::softmax(att.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
  at::Tensor y = at::matmul(att, v).transpose(1, 2).reshape({b, t, d});
  y = proj(y);
  if (dropout_ > 0) y = at::dropout(y, dropout_, is_training());
  at::Tensor h = x + y;
  at::Tensor m = out(at::gelu(fc(ln2(h))));
  if (dropout_ > 0) m = at::dropout(m, dropout_, is_training());
  return h + m;
}

GptImpl::GptImpl(const GptConfig& c) : config_(c) {
  namespace nn = ::torch::nn;
  check(c);
  // Deferred: each piece released to the meta device as soon as it is built (the full model
  // never exists; initialize() fills the shards after fully_shard).
  auto made = [&](auto holder) {
    if (c.deferred) to_meta(*holder);
    return holder;
  };
  tok = register_module("tok", made(nn::Embedding(c.vocab, c.d_model)));
  pos = register_module("pos", made(nn::Embedding(c.context, c.d_model)));
  blocks = register_module("blocks", nn::ModuleList());
  for (std::int64_t i = 0; i < c.layers; ++i) {
    block_list.push_back(made(GptBlock(c)));
    blocks->push_back(block_list.back());
  }
  ln_f = register_module("ln_f", made(nn::LayerNorm(nn::LayerNormOptions({c.d_model}))));
  if (c.deferred) return;
  ::torch::NoGradGuard no_grad;
  for (auto& p : named_parameters())
    init_weights({p.key(), p.value(), p.value().sizes().vec(), 0, false});
}

void GptImpl::init_weights(const LocalShard& s) const {
  // GPT-2's initialisation: N(0, 0.02) for embeddings and weights, zero biases, unit LayerNorm
  // gains, the residual projections scaled by 1/sqrt(2 * layers). Element by element, so a
  // shard draws from the same distribution as the full tensor.
  const std::string& name = s.fqn;
  const bool bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
  if (bias) {
    fill(s, InitRule::constant(0.0), config_.seed);
  } else if (s.full_shape.size() >= 2) {
    const bool residual =
        name.find(".proj.") != std::string::npos || name.find(".out.") != std::string::npos;
    fill(s, InitRule::normal(0.0, residual ? 0.02 / std::sqrt(2.0 * double(config_.layers)) : 0.02),
         config_.seed);
  } else {
    fill(s, InitRule::constant(1.0), config_.seed);
  }
}

at::Tensor GptImpl::forward(const at::Tensor& ids) {
  const std::int64_t t = ids.size(1);
  if (t > config_.context)
    throw InvalidArgument("Gpt: a sequence of " + std::to_string(t) +
                          " tokens is longer than the context (" + std::to_string(config_.context) +
                          ")");
  at::Tensor x = tok(ids) + pos(at::arange(t, ids.options()));
  for (GptBlock& b : block_list)
    x = config_.checkpoint_blocks ? checkpoint(b, x) : call(b, x);
  // The output head is the token embedding (tied).
  return at::matmul(ln_f(x), tok->weight.t());
}

at::Tensor GptImpl::loss(const at::Tensor& ids) {
  const std::int64_t t = ids.size(1);
  const at::Tensor logits = call(*this, ids.narrow(1, 0, t - 1));  // the root's hooks
  return ::torch::nn::functional::cross_entropy(logits.reshape({-1, config_.vocab}),
                                                ids.narrow(1, 1, t - 1).reshape({-1}));
}

}  // namespace fullshard::torch
