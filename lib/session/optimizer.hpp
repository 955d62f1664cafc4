// The session's optimizer, behind one interface: fullshard's own SGD and AdamW on the model's
// graph parameters (the shards the LibTorch parameters view) where every parameter is f32 —
// what makes the optimizer inside backward available to LibTorch models — and LibTorch's
// torch::optim otherwise (f64 models, a TorchScript file with other dtypes: fullshard's
// optimizers and checkpointed optimizer state are f32). Both step each
// tensor once (a tied weight too) and write the same checkpoint format. Private to
// lib/session.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "fullshard/checkpoint/async_save.hpp"
#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/session/config.hpp"
#include "fullshard/torch/sharded_model.hpp"

namespace fullshard::session {

class SessionOptimizer {
 public:
  virtual ~SessionOptimizer() = default;
  /// Before a step's backward: the learning rate the step uses (an update inside backward reads
  /// it when its group's reduction is issued), and no gradient left from the step before.
  virtual void begin_step(double lr) = 0;
  /// After the step's backward: updates every parameter that still has a gradient (inside
  /// backward: none; the step is counted).
  virtual void step() = 0;
  /// Parameter tensors the optimizer steps (each once).
  virtual std::size_t tensors() const = 0;
  /// The checkpoint calls of fullshard/checkpoint (and fullshard/torch/checkpoint.hpp) with
  /// this optimizer's state.
  virtual std::string save(const std::string& dir, std::int64_t step,
                           const checkpoint::SaveOptions& options,
                           const nlohmann::json& metadata) = 0;
  virtual checkpoint::AsyncSave save_async(const std::string& dir, std::int64_t step,
                                           const checkpoint::SaveOptions& options,
                                           const nlohmann::json& metadata) = 0;
  virtual checkpoint::Loaded load(const std::string& dir) = 0;
};

/// The optimizer of `cfg` over `model` (sharded: fully_shard applied to its root). With
/// cfg.optimizer.in_backward, fullshard's optimizer runs inside backward (parse_config refuses
/// it with f64 parameters and with clipping).
std::unique_ptr<SessionOptimizer> make_optimizer(const Config& cfg,
                                                 fullshard::torch::ShardedModel& model);

}  // namespace fullshard::session
