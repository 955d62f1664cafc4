// Initial values that do not depend on the rank count: each element of a parameter drawn from a
// counter-based generator keyed by (seed, the parameter's FQN, the element's flat index in the
// full tensor), so a rank fills only its rows (ShardedModel::initialize after a deferred
// construction, deferred_init.hpp) and the model is the same, value for value, on any number of
// ranks and any mesh. The distributions are LibTorch's own defaults (reset_parameters); the
// draws are not LibTorch's generator's.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "fullshard/torch/deferred_init.hpp"

namespace fullshard::torch {

/// How one parameter or buffer starts.
struct InitRule {
  enum class Kind { uniform, normal, constant };
  Kind kind = Kind::constant;
  double a = 0.0;  ///< uniform: low; normal: mean; constant: the value
  double b = 0.0;  ///< uniform: high; normal: standard deviation
  static InitRule uniform(double lo, double hi) { return {Kind::uniform, lo, hi}; }
  static InitRule normal(double mean, double std) { return {Kind::normal, mean, std}; }
  static InitRule constant(double v) { return {Kind::constant, v, 0.0}; }
};

/// Fills `s.tensor` (this rank's rows, or the whole tensor) by `rule` from `seed`: element e of
/// the full tensor gets the same value whichever rank holds it. Any dtype and device.
void fill(const LocalShard& s, const InitRule& rule, std::uint64_t seed);

/// The rules of LibTorch's standard layers in `model` (shapes are enough: a model on the meta
/// device works), by FQN: Linear, Conv1d/2d/3d and ConvTranspose1d/2d/3d weight and bias
/// U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (fan_in: the weight's size(1) times its kernel);
/// Embedding N(0, 1); LayerNorm and GroupNorm weight 1, bias 0; BatchNorm weight 1, bias 0,
/// running mean 0, running var 1. `extra` adds or replaces rules (a custom module's
/// parameters).
std::map<std::string, InitRule> default_init_rules(
    const ::torch::nn::Module& model, const std::map<std::string, InitRule>& extra = {});

/// ShardedModel::initialize's function for `rules` and `seed`; a tensor without a rule is an
/// InvalidArgument naming it (give it a rule in `extra`).
std::function<void(const LocalShard&)> rule_initializer(std::map<std::string, InitRule> rules,
                                                        std::uint64_t seed);

}  // namespace fullshard::torch
