// The session's optimizer, behind one interface: fullshard's own SGD and AdamW on the model's
// graph parameters (a native model's, or the shards a LibTorch model's parameters view) where
// every parameter is f32, and LibTorch's torch::optim otherwise (lib/session/optimizer.hpp).
// Each steps every tensor once (a tied weight too) and writes the same checkpoint format.
// Private to lib/session.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "fullshard/checkpoint/async_save.hpp"
#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/session/config.hpp"

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
  /// Allocates and faults in the staging memory of asynchronous saves; returns its bytes.
  virtual std::uint64_t reserve_async_staging() = 0;
};

/// Optimizer state arrays per parameter element (SGD 0 or 1, AdamW 2).
int state_arrays(const OptimizerSpec& o);

/// The fully qualified names of `root`'s parameters that cfg.optimizer.no_weight_decay names
/// (a pattern matching none is a ConfigError naming it).
std::set<std::string> no_decay_names(const Config& cfg, graph::Module& root);

/// fullshard's SGD or AdamW of `cfg` over the parameters of `root` (sharded: fully_shard applied
/// to it); with cfg.optimizer.in_backward it runs inside backward. f32 parameters.
std::unique_ptr<SessionOptimizer> make_graph_optimizer(const Config& cfg, graph::Module& root);

}  // namespace fullshard::session
