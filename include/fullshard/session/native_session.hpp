// The training session of a native model: a model fullshard computes itself, without LibTorch
// (a hand-written forward and backward over its module graph, such as fullshard-train's and
// heat-surrogate's residual MLP). The same session as fullshard::session::Session — the typed
// configuration with "model": {"type": "native"}, plan-then-shard with sharded creation and the
// memory check, the step (clipping, the optimizer, inside backward too, the schedule, the
// non-finite check), inference, checkpoints (synchronous, asynchronous, retention, the
// directory's check and claim, resume on any rank count), safetensors export and import, and
// the ranks' agreement — over a model the program gives:
//
//   fullshard::apps::ResidualMlp net(shape, seed);           // a NativeModel
//   fullshard::session::Config cfg = fullshard::session::read_config(mesh, "train.json");
//   fullshard::session::NativeSession s(mesh, net, cfg, rows);
//   for (int i = 0; i < steps; ++i) double loss = s.train_step(x, t, rows, global_rows);
//
// Every collective call must be made by every rank of the mesh, in the same order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "fullshard/schedule/plan.hpp"
#include "fullshard/session/config.hpp"
#include "fullshard/session/metrics.hpp"
#include "fullshard/session/session_base.hpp"

namespace fullshard::session {

/// A model fullshard computes itself. Its loss is the mean squared error over the global
/// batch and the outputs (the configuration's "loss": "mse"); its parameters are f32.
class NativeModel {
 public:
  virtual ~NativeModel() = default;
  /// The module graph (its parameters are the shards once sharded).
  virtual graph::Module& root() = 0;
  /// Parameters (elements) of the whole model.
  virtual std::int64_t num_params() const = 0;
  /// Features per sample of the input, values per sample of the output.
  virtual std::int64_t inputs() const = 0;
  virtual std::int64_t outputs() const = 0;
  /// "model.<key> = <value>" lines that size the model: the ranks agree on them at creation
  /// and a checkpoint saved by another model is refused naming the first that differs.
  virtual std::vector<std::string> identity() const = 0;
  /// Plans the iteration with `options`, applies fully_shard and creates each rank's rows of
  /// the parameters (never the whole model); `before_creation` sees the plan before any
  /// parameter is created (and may throw to stop). Collective over `mesh`; called once.
  virtual void shard(const DeviceMesh& mesh, const schedule::PlanOptions& options,
                     const std::function<void(const schedule::Plan&)>& before_creation) = 0;
  /// Whether its backward honours graph::Parameter::grad_fresh (assigns a parameter's first
  /// gradient instead of adding into it): the session then plans no gradient zeroing on host
  /// meshes (schedule::PlanOptions::fresh_gradients).
  virtual bool assigns_fresh_gradients() const { return false; }
  /// Bytes of the activations and scratch a step over `rows` local samples holds (the memory
  /// account's activations).
  virtual std::size_t activation_bytes(std::int64_t rows, DType param_dtype) const = 0;
  /// One forward and backward over `rows` local samples (x: rows x inputs, target: rows x
  /// outputs, row-major) of a global batch of `global_rows`: afterwards every parameter's
  /// gradient is its shard of the gradient of the global mean loss. Returns this rank's sum of
  /// squared errors. Collective.
  virtual double forward_backward(const float* x, const float* target, std::int64_t rows,
                                  std::int64_t global_rows) = 0;
  /// Forward only: rows x outputs predictions into `out`. Collective (rows may be 0).
  virtual void predict(const float* x, std::int64_t rows, float* out) = 0;
};

class NativeSession final : public SessionBase {
 public:
  /// Agrees on `config` (model.type "native") and model.identity() across the mesh, checks and
  /// claims the checkpoint directory, shards `model` under the plan the configuration asks for
  /// (sharding.policy "blocks": the modules the model asks to shard, then the root; "root":
  /// the root only) after checking its planned process peak, with the activations of
  /// `max_rows` local samples, against the memory budget, makes the optimizer and schedule,
  /// and resumes when asked. `model` must outlive the session. Collective over the mesh.
  NativeSession(const DeviceMesh& mesh, NativeModel& model, Config config,
                std::int64_t max_rows = 0);
  ~NativeSession();
  NativeSession(const NativeSession&) = delete;
  NativeSession& operator=(const NativeSession&) = delete;

  /// One optimizer step over this rank's `rows` samples (x: rows x inputs, target: rows x
  /// outputs; rows may be 0) of a global batch of `global_rows` (the ranks' rows summed; a
  /// wrong sum is an InvalidArgument on every rank). Returns the global mean loss. A NaN or
  /// infinity in an input or target, the loss or the gradients skips the step on every rank
  /// (NaN returned; the step count stays) or stops the run, as config().non_finite says. One
  /// all-reduce besides the model's collectives (with the optimizer inside backward, one more
  /// before the forward: the inputs are checked before any update). Collective.
  double train_step(const float* x, const float* target, std::int64_t rows,
                    std::int64_t global_rows);
  /// For a program's own loop whose losses stay where they were computed (a GPU loop reading
  /// them back every few steps): begin_external_step sets the step's learning rate and clears
  /// the gradients (returns the rate); after the program's forward and backward,
  /// finish_external_step clips to grad_clip, runs the optimizer and counts the step. No
  /// non-finite check: the program checks what it reads back. Collective.
  double begin_external_step();
  void finish_external_step();
  /// The model's outputs for `rows` samples into `out` (rows x outputs). Collective.
  void predict(const float* x, std::int64_t rows, float* out);
  /// The global mean loss over every rank's samples, without gradients or updates. Collective.
  double evaluate(const float* x, const float* target, std::int64_t rows);

  // Checkpoints, safetensors, progress, config(), step(), lr(), plan(): SessionBase.

  NativeModel& model() const noexcept;
  /// The auto policy's choice (its plan, its calls, its prediction against the baseline of
  /// every block and the root); nullptr under the other policies.
  const schedule::AutoPlan* auto_plan() const noexcept;
  std::int64_t num_params() const noexcept;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fullshard::session
