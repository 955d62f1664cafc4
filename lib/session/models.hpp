// The model families of the C API's configuration ("model": {"type": ...}) built as LibTorch
// modules whose blocks are called through fullshard::torch::call, so that fully_shard on each
// block and the root is FSDP2's usual wrapping. Private to lib/session.
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/session/config.hpp"
#include "fullshard/torch/deferred_init.hpp"

namespace fullshard::session {

struct BuiltModel {
  std::shared_ptr<::torch::nn::Module> root;
  /// The modules fully_shard may take besides the root (FSDP2's wrapping candidates), in
  /// forward order.
  std::vector<const ::torch::nn::Module*> blocks;
  /// The forward through fullshard::torch::call on the root: inputs -> outputs.
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> forward;
  /// The model's own loss (a GPT's next-token cross-entropy on its input), or empty.
  std::function<at::Tensor(const std::vector<at::Tensor>&)> own_loss;
  /// Checks the inputs of one call (count, shapes, dtypes) before any collective; throws
  /// InvalidArgument naming the input and what the model takes.
  std::function<void(const std::vector<at::Tensor>&)> check_inputs;
  /// Deferred initialisation (the model was built on the meta device): fills each rank's
  /// shards after fully_shard (ShardedModel::initialize's function), or empty.
  std::function<void(const fullshard::torch::LocalShard&)> initialize;
  /// The dtype the model wants its inputs in (a float dtype converts, kLong for tokens).
  at::ScalarType input_dtype = at::kFloat;
};

/// Builds the model of `spec` in `dtype` (kFloat or kDouble). spec.deferred_init: on the meta
/// device piece by piece, `initialize` filling each rank's rows from `seed` (counter-based:
/// the same values at any rank count); else whole, with LibTorch's default generator (seed it
/// first). TorchScript files are loaded whole from spec.file (IoError-like ConfigError naming
/// the file when it cannot be read or is not a scripted Sequential).
BuiltModel build_model(const ModelSpec& spec, at::ScalarType dtype, const std::string& source,
                       std::uint64_t seed);

/// The parameters `spec` builds, counted from its keys without building anything (each tied
/// tensor once); -1 for a TorchScript file. ConfigError naming the source when the count does
/// not fit in 64 bits.
std::int64_t parameter_count(const ModelSpec& spec, const std::string& source);

}  // namespace fullshard::session
