// The optimizer of a LibTorch model's session (lib/session/session_optimizer.hpp): fullshard's
// own SGD and AdamW on the model's graph parameters (the shards the LibTorch parameters view)
// where every parameter is f32 — what makes the optimizer inside backward available to LibTorch
// models — and LibTorch's torch::optim otherwise (f64 models, a TorchScript file with other
// dtypes: fullshard's optimizers and checkpointed optimizer state are f32). Private to
// lib/session.
#pragma once

#include <memory>

#include "fullshard/session/config.hpp"
#include "fullshard/torch/sharded_model.hpp"
#include "lib/session/session_optimizer.hpp"

namespace fullshard::session {

/// The optimizer of `cfg` over `model` (sharded: fully_shard applied to its root). With
/// cfg.optimizer.in_backward, fullshard's optimizer runs inside backward (parse_config refuses
/// it with f64 parameters and with clipping).
std::unique_ptr<SessionOptimizer> make_optimizer(const Config& cfg,
                                                 fullshard::torch::ShardedModel& model);

}  // namespace fullshard::session
