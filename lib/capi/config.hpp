// The model configuration of the C API (README: "the configuration file"): the JSON file read
// once, at model creation, into typed structs. Every key is checked (name, type, range);
// an unknown key or a bad value is a ConfigError naming the source, the key and what was
// expected. Private to lib/capi.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fullshard/base/dtype.hpp"

namespace fullshard::capi {

/// "model": which network. Only the keys of the chosen type are accepted.
struct ModelSpec {
  /// mlp | residual_mlp | gpt | conv_autoencoder | torchscript
  std::string type;
  // mlp: inputs -> hidden[0] -> ... -> outputs, one block per hidden layer;
  // residual_mlp: inputs -> hidden (blocks residual blocks) -> outputs.
  std::int64_t inputs = 0, outputs = 0;
  std::vector<std::int64_t> hidden;
  std::int64_t blocks = 0;
  std::string activation = "relu";  // mlp, conv_autoencoder: relu | gelu | tanh | silu
  // gpt
  std::int64_t vocab = 256, context = 128, d_model = 128, heads = 4, layers = 2, mlp_ratio = 4;
  bool checkpoint_blocks = false;
  // Built-in families: each piece released to the meta device as it is built and each rank
  // initialises its own rows (counter-based, the same model at any rank count); false: built
  // whole with LibTorch's generator, then sharded.
  bool deferred_init = true;
  // conv_autoencoder: (N, channels, H, W) -> (N, out_channels, H, W); H and W divisible by
  // 2^levels.
  std::int64_t channels = 1, out_channels = 1, width = 16, levels = 2;
  // torchscript
  std::string file;
};

struct OptimizerSpec {
  std::string type = "adamw";  // adamw | sgd
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;  // sgd
};

struct ScheduleSpec {
  std::string type = "constant";  // constant | warmup_cosine
  int warmup_steps = 0, total_steps = 0;
  double min_lr = 0.0;
};

struct ShardingSpec {
  std::string policy = "blocks";  // blocks | root | auto
  bool reshard_after_forward = true;
  double memory_budget_mb = 0.0;  // auto
  int forward_prefetch = 0;
};

/// "memory": the rank's planned process peak (docs/memory.md) against what it can have, checked
/// on every rank before the model's shards are allocated.
struct MemorySpec {
  double budget_mb = 0.0;        // 0: the cgroup limit or MemAvailable, shared by the node's ranks
  std::string check = "refuse";  // refuse | warn | off
};

struct Config {
  std::string source;  // the file name (or "<string>") errors name
  ModelSpec model;
  std::string loss = "mse";  // mse | l1 | smooth_l1 | cross_entropy | next_token (gpt)
  OptimizerSpec optimizer;
  ScheduleSpec lr_schedule;
  double grad_clip = 0.0;                          // max global gradient norm; 0: off
  DType dtype = DType::f32;                        // the parameters' (f32 | f64)
  std::optional<DType> param_dtype, reduce_dtype;  // mixed precision (FSDP2's policy)
  ShardingSpec sharding;
  MemorySpec memory;
  std::uint64_t seed = 0;
  int threads = 0;  // LibTorch intra-op threads; 0: the launcher's cores
  /// Every value read, as "key = value" in a fixed order (defaults included): what the ranks
  /// compare before they build the model.
  std::vector<std::string> canonical;
};

/// Parses `text` (JSON) from `source`. ConfigError "<source>: <key>: <problem>".
Config parse_config(const std::string& text, const std::string& source);

}  // namespace fullshard::capi
