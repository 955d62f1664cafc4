#include "fullshard/torch/residual_mlp.hpp"

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/options/linear.h>

#include <cmath>
#include <map>
#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/torch/deferred_init.hpp"
#include "fullshard/torch/init.hpp"
#include "fullshard/torch/sharded_model.hpp"

namespace fullshard::torch {

ResidualBlockImpl::ResidualBlockImpl(std::int64_t hidden) {
  const double b = 1.0 / std::sqrt(double(hidden));
  w1 = register_parameter("w1", ::torch::empty({hidden, hidden}).uniform_(-b, b));
  b1 = register_parameter("b1", ::torch::empty({hidden}).uniform_(-b, b));
  w2 = register_parameter("w2", ::torch::empty({hidden, hidden}).uniform_(-b, b));
  b2 = register_parameter("b2", ::torch::empty({hidden}).uniform_(-b, b));
}

at::Tensor ResidualBlockImpl::forward(const at::Tensor& h) {
  return h + at::linear(at::relu(at::linear(h, w1, b1)), w2, b2);
}

ResidualMlpImpl::ResidualMlpImpl(const ResidualMlpConfig& c) {
  for (const auto& [v, what] : {std::pair{c.inputs, "inputs"}, std::pair{c.hidden, "hidden"},
                                std::pair{c.outputs, "outputs"}, std::pair{c.blocks, "blocks"}})
    if (v <= 0)
      throw InvalidArgument("ResidualMlpConfig: " + std::string(what) + " must be positive, not " +
                            std::to_string(v));
  // Deferred: each piece released as soon as it is made (at most one block exists).
  auto made = [&](auto holder) {
    if (c.deferred) to_meta(*holder);
    return holder;
  };
  input = register_module("input", made(::torch::nn::Linear(c.inputs, c.hidden)));
  auto blocks = register_module("blocks", std::make_shared<::torch::nn::Module>("blocks"));
  for (std::int64_t i = 0; i < c.blocks; ++i)
    block_list.push_back(blocks->register_module(
        std::to_string(i), made(std::make_shared<ResidualBlockImpl>(c.hidden))));
  output = register_module("output", made(::torch::nn::Linear(c.hidden, c.outputs)));
}

std::function<void(const LocalShard&)> ResidualMlpImpl::initializer(std::uint64_t seed) const {
  std::map<std::string, InitRule> blocks;
  for (std::size_t i = 0; i < block_list.size(); ++i) {
    const double b = 1.0 / std::sqrt(double(block_list[i]->w1.size(1)));
    for (const char* name : {"w1", "b1", "w2", "b2"})
      blocks["blocks." + std::to_string(i) + "." + name] = InitRule::uniform(-b, b);
  }
  return rule_initializer(default_init_rules(*this, blocks), seed);
}

at::Tensor ResidualMlpImpl::forward(const at::Tensor& x) {
  at::Tensor h = input(x);
  for (auto& b : block_list)
    h = call(b, h);
  return output(h);
}

}  // namespace fullshard::torch
