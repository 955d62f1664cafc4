#include "fullshard/torch/init.hpp"

#include <ATen/ATen.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>
#include <utility>
#include <vector>

#include "fullshard/base/error.hpp"
#include "lib/base/hash.hpp"

namespace fullshard::torch {
namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;

std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1) for (key, index): 53 random bits, never 0.
double uniform01(std::uint64_t key, std::uint64_t index) noexcept {
  const std::uint64_t r = splitmix64(key ^ splitmix64(index));
  return (static_cast<double>(r >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for a layer whose weight has `shape` (PyTorch's
// _calculate_fan_in_and_fan_out: size(1) times the kernel's elements).
InitRule fan_in_uniform(const at::Tensor& weight) {
  std::int64_t fan_in = weight.dim() >= 2 ? weight.size(1) : weight.numel();
  for (std::int64_t d = 2; d < weight.dim(); ++d)
    fan_in *= weight.size(d);
  const double b = fan_in > 0 ? 1.0 / std::sqrt(double(fan_in)) : 0.0;
  return InitRule::uniform(-b, b);
}

template <class Impl>
const Impl* as(const ::torch::nn::Module& m) {
  return dynamic_cast<const Impl*>(&m);
}

}  // namespace

void fill(const LocalShard& s, const InitRule& rule, std::uint64_t seed) {
  ::torch::NoGradGuard no_grad;
  if (!s.tensor.defined() || s.tensor.numel() == 0) return;
  if (rule.kind == InitRule::Kind::constant) {
    s.tensor.fill_(rule.a);
    return;
  }
  // The first element's flat index in the full tensor.
  std::int64_t row = 1;
  for (std::size_t d = 1; d < s.full_shape.size(); ++d)
    row *= s.full_shape[d];
  const auto first = static_cast<std::uint64_t>(s.sharded ? s.row_offset * row : 0);
  const std::uint64_t key = splitmix64(seed) ^ fnv1a64(s.fqn);
  auto value = [&](std::uint64_t e) {
    if (rule.kind == InitRule::Kind::uniform) return rule.a + (rule.b - rule.a) * uniform01(key, e);
    // Box-Muller over two draws of the element's own.
    const double u1 = uniform01(key, 2 * e), u2 = uniform01(key ^ 0x5bd1e995ull, 2 * e + 1);
    return rule.a + rule.b * std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
  };
  const std::int64_t n = s.tensor.numel();
  const at::Tensor& t = s.tensor;
  // Host f32 / f64 storage is written in place; anything else through a bounded scratch.
  if (t.device().is_cpu() && t.is_contiguous() &&
      (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble)) {
    if (t.scalar_type() == at::kFloat) {
      float* v = t.data_ptr<float>();
      for (std::int64_t i = 0; i < n; ++i)
        v[i] = static_cast<float>(value(first + static_cast<std::uint64_t>(i)));
    } else {
      double* v = t.data_ptr<double>();
      for (std::int64_t i = 0; i < n; ++i)
        v[i] = value(first + static_cast<std::uint64_t>(i));
    }
    return;
  }
  constexpr std::int64_t kChunk = std::int64_t{1} << 16;
  const at::Tensor flat = t.is_contiguous() ? t.view({n}) : at::Tensor();
  const at::Tensor whole = flat.defined() ? at::Tensor() : at::empty({n}, t.options());
  at::Tensor host = at::empty({std::min(n, kChunk)}, at::TensorOptions().dtype(at::kDouble));
  double* v = host.data_ptr<double>();
  for (std::int64_t at0 = 0; at0 < n; at0 += kChunk) {
    const std::int64_t len = std::min(kChunk, n - at0);
    for (std::int64_t i = 0; i < len; ++i)
      v[i] = value(first + static_cast<std::uint64_t>(at0 + i));
    (flat.defined() ? flat : whole).narrow(0, at0, len).copy_(host.narrow(0, 0, len));
  }
  if (!flat.defined()) t.copy_(whole.view(t.sizes()));
}

std::map<std::string, InitRule> default_init_rules(const ::torch::nn::Module& model,
                                                   const std::map<std::string, InitRule>& extra) {
  namespace nn = ::torch::nn;
  std::map<std::string, InitRule> rules;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const nn::Module& m = *item.value();
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    auto set = [&](const char* name, InitRule r) {
      for (const auto& p : m.named_parameters(/*recurse=*/false))
        if (p.key() == name) rules[prefix + name] = r;
      for (const auto& p : m.named_buffers(/*recurse=*/false))
        if (p.key() == name) rules[prefix + name] = r;
    };
    at::Tensor weight;  // a handle: named_parameters() returns a temporary dictionary
    for (const auto& p : m.named_parameters(/*recurse=*/false))
      if (p.key() == "weight") weight = p.value();
    const bool fan_in_layer = as<nn::LinearImpl>(m) || as<nn::Conv1dImpl>(m) ||
                              as<nn::Conv2dImpl>(m) || as<nn::Conv3dImpl>(m) ||
                              as<nn::ConvTranspose1dImpl>(m) || as<nn::ConvTranspose2dImpl>(m) ||
                              as<nn::ConvTranspose3dImpl>(m);
    if (fan_in_layer && weight.defined()) {
      set("weight", fan_in_uniform(weight));
      set("bias", fan_in_uniform(weight));
    } else if (as<nn::EmbeddingImpl>(m)) {
      set("weight", InitRule::normal(0.0, 1.0));
    } else if (as<nn::LayerNormImpl>(m) || as<nn::GroupNormImpl>(m) || as<nn::BatchNorm1dImpl>(m) ||
               as<nn::BatchNorm2dImpl>(m) || as<nn::BatchNorm3dImpl>(m)) {
      set("weight", InitRule::constant(1.0));
      set("bias", InitRule::constant(0.0));
      set("running_mean", InitRule::constant(0.0));
      set("running_var", InitRule::constant(1.0));
      set("num_batches_tracked", InitRule::constant(0.0));
    }
  }
  for (const auto& [fqn, r] : extra)
    rules[fqn] = r;
  return rules;
}

std::function<void(const LocalShard&)> rule_initializer(std::map<std::string, InitRule> rules,
                                                        std::uint64_t seed) {
  return [rules = std::move(rules), seed](const LocalShard& s) {
    const auto it = rules.find(s.fqn);
    if (it == rules.end())
      throw InvalidArgument("fullshard::torch: no initial values for '" + s.fqn +
                            "' (not a parameter of a standard layer): give it an InitRule");
    fill(s, it->second, seed);
  };
}

}  // namespace fullshard::torch
