// What a C API model handle holds: the configuration, the LibTorch model sharded with the
// LibTorch front end over a mesh, its optimizer, schedule and loss, and the training step.
// Private to lib/capi.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "fullshard/schedule/plan.hpp"
#include "fullshard/torch/sharded_model.hpp"
#include "lib/capi/config.hpp"
#include "lib/capi/models.hpp"

namespace fullshard::capi {

/// The planner's prediction for one step (fullshard_plan_info).
struct PlanPrediction {
  double step_ms = 0;
  std::int64_t peak_bytes = 0, sharded_bytes = 0, groups = 0;
  std::int64_t process_peak_bytes = 0;  // the memory account's (0 on a CUDA mesh)
};

class Trainer {
 public:
  /// Reads nothing: `config` was parsed and agreed on. Builds the model (seeded), shards it
  /// by the configuration's policy through the planner, and makes the optimizer. Collective.
  Trainer(const DeviceMesh& mesh, Config config);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// One optimizer step on this rank's batch; returns this rank's loss. Collective.
  double train_step(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets);
  /// The outputs of the model without gradients. Collective.
  std::vector<at::Tensor> predict(const std::vector<at::Tensor>& inputs);

  void save_checkpoint(const std::string& dir);
  void load_checkpoint(const std::string& dir);
  void export_safetensors(const std::string& path);

  /// The dtype inputs are converted to (a contiguous input of it is used in place).
  at::ScalarType input_dtype() const noexcept { return model_.input_dtype; }
  /// Where the model computes: the CPU, or the rank's GPU on a CUDA mesh (host arrays are
  /// copied there once).
  const c10::Device& device() const noexcept { return device_; }
  std::int64_t step() const noexcept { return step_; }
  double lr() const;
  std::int64_t num_params() const noexcept { return num_params_; }
  const PlanPrediction& plan() const noexcept { return plan_; }
  const DeviceMesh& mesh() const noexcept { return mesh_; }
  /// The data pointer of the first input of the last forward (tests: zero copy).
  const void* last_input_data() const noexcept { return last_input_; }

 private:
  void shard();
  /// Plans the process peak (plan_.process_peak_bytes) and checks it against the
  /// configuration's "memory" budget, on every rank before the shards are allocated
  /// (MemoryBudgetExceeded on every rank).
  void check_memory(const schedule::Plan& plan);
  at::Tensor loss_of(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets);

  Config cfg_;
  DeviceMesh mesh_;
  BuiltModel model_;
  std::unique_ptr<fullshard::torch::ShardedModel> sharded_;
  std::unique_ptr<::torch::optim::Optimizer> opt_;
  std::optional<optim::WarmupCosine> schedule_;
  std::vector<graph::Parameter*> graph_params_;
  std::int64_t step_ = 0;
  std::int64_t num_params_ = 0;
  PlanPrediction plan_;
  const void* last_input_ = nullptr;
  c10::Device device_ = c10::Device(c10::kCPU);
};

}  // namespace fullshard::capi
