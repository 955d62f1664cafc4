// The training session: the one place that turns a configuration (fullshard/session/config.hpp)
// into a model sharded over a mesh, trained, checkpointed and exported. The C API and the
// Fortran module are adapters over it; C++ programs use it directly:
//
//   fullshard::Runtime rt(argc, argv);
//   fullshard::DeviceMesh mesh(MPI_COMM_WORLD, {rt.world_size()}, {"dp"});
//   fullshard::session::Session s(mesh, fullshard::session::read_config(mesh, "model.json"));
//   for (int i = 0; i < steps; ++i) {
//     double loss = s.train_step({x}, {y});     // this rank's batch
//     s.poll_save();                             // commits an asynchronous save when written
//   }
//   s.save_async();                              // into the configured checkpoint dir
//   s.wait_save();
//
// Creation (collective): the ranks agree on the configuration (a rank that differs is named
// with the first differing key), the model is built on the meta device and each rank fills
// only its rows (the same seed gives the same model at any rank count), the planner plans
// the sharding (blocks, root, list groups or the auto-planner under a memory budget), the
// planned process peak is checked against the memory budget before the shards are allocated,
// the checkpoint directory is checked, and the latest checkpoint is loaded when asked to.
//
// Every collective call must be made by every rank of the mesh, in the same order. Errors are
// fullshard::Error subclasses thrown on every rank with the same message where the ranks
// agreed on the failure (configuration, batch shapes, checkpoints).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/session/config.hpp"
#include "fullshard/session/metrics.hpp"
#include "fullshard/session/session_base.hpp"

namespace fullshard::torch {
class ShardedModel;
}

namespace fullshard::session {

class Session final : public SessionBase {
 public:
  /// Builds, plans, shards and initialises the model of `config` on `mesh` (see above).
  /// Collective over the mesh.
  Session(const DeviceMesh& mesh, Config config);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  /// One optimizer step on this rank's batch: checks that every rank's batch has the same
  /// shapes (but the first dim) and dtypes (one small all-reduce; a mismatch is refused on
  /// every rank naming the ranks and shapes), then config().accumulation micro-batches of
  /// forward, loss and backward, clipping, the optimizer and the schedule. Returns this
  /// rank's loss (the micro-batches' mean). A NaN or infinity in a float input or target, the
  /// loss or the gradients skips the step on every rank (returns NaN; the step count stays)
  /// or stops the run, as config().non_finite says. Collective.
  double train_step(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets);
  /// The model's outputs without gradients. Collective.
  std::vector<at::Tensor> predict(const std::vector<at::Tensor>& inputs);
  /// This rank's loss on a batch without gradients or updates (the model in eval mode:
  /// no dropout), checked as train_step checks it. Collective.
  double evaluate(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets);

  // Checkpoints, safetensors, progress, config(), step(), lr(), plan(): SessionBase.

  /// The LibTorch model: its parameters() are this rank's shards (a tied weight listed once
  /// per module that registers it; the optimizer holds each once).
  ::torch::nn::Module& module() const noexcept;
  /// The model's FSDP side: its module graph, each group's controls (state(module())), the
  /// unique parameter list.
  fullshard::torch::ShardedModel& sharded() const noexcept;
  /// The dtype inputs are converted to (a contiguous input of it is used in place).
  at::ScalarType input_dtype() const noexcept;
  /// Where the model computes: the CPU, or the rank's GPU on a CUDA mesh (host arrays are
  /// copied there once).
  c10::Device device() const noexcept;
  /// Parameters of the whole model, each tensor once (tied weights counted once).
  std::int64_t num_params() const noexcept;
  /// The data pointer of the first input of the last forward (tests: zero copy).
  const void* last_input_data() const noexcept;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fullshard::session
