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
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/session/config.hpp"

namespace fullshard::torch {
class ShardedModel;
}

namespace fullshard::session {

/// Reads the configuration file at `path` on every rank of `mesh` and agrees on it: a file one
/// rank cannot read, or reads differently, is a ConfigError (RankMismatch naming the rank and
/// the first differing key) on every rank instead of a hang. Collective.
Config read_config(const DeviceMesh& mesh, const std::string& path);
/// The same for configuration text (`source` names it in messages); `read_error`: this rank
/// could not read it (the rank still joins the agreement, so that every rank reports it).
Config parse_config(const DeviceMesh& mesh, const std::string& text, const std::string& source,
                    std::string read_error = {});

/// The planner's prediction for one step (one forward and backward; a step of `accumulation`
/// micro-batches runs that many). Made at creation with default module costs, then again with
/// the modules' measured compute times after the calibration steps (sharding.calibrate_steps).
struct PlanPrediction {
  /// The plan's operations one after the other (a host mesh runs its collectives on the
  /// calling thread; on a GPU mesh the streams overlapped), plus optimizer_ms. Uncalibrated, the
  /// modules cost nothing: communication and copies only, a lower bound.
  double step_ms = 0;
  std::int64_t peak_bytes = 0, sharded_bytes = 0, groups = 0;
  std::int64_t process_peak_bytes = 0;  // the memory account's (0 on a CUDA mesh)
  /// 0: the modules' costs are the defaults (none); n: measured over n training forwards and
  /// backwards (the ranks' mean of each module's time) and the plan made again with them.
  std::int64_t calibrated_iterations = 0;
  /// The optimizer's step (and clipping) per step, measured with the modules; 0 before.
  double optimizer_ms = 0;
  /// The calibration steps' FSDP work as it ran (the time in the modules' hooks: collectives,
  /// copies and the waits for them, the ranks' mean; where ranks share cores, also waits for
  /// peers off their core) over the cost model's times for the plan's operations of it: the
  /// plan's cost model is scaled by it. 1 before (and on a GPU mesh).
  double communication_scale = 1;
};

/// What the progress callback sees after each step.
struct StepMetrics {
  std::int64_t step = 0;  // steps taken, this one included
  double loss = 0;        // this rank's loss
  double lr = 0;          // the learning rate the step used
  double seconds = 0;     // the step's wall time on this rank
};

/// What the progress callback sees when a checkpoint is committed.
struct SaveMetrics {
  std::int64_t step = 0;
  std::string step_dir;
  bool asynchronous = false;
};

/// Called on every rank, from the calling thread, inside the session's calls.
struct Progress {
  std::function<void(const StepMetrics&)> on_step;
  std::function<void(const SaveMetrics&)> on_save;
};

class Session {
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

  /// Saves parameters, optimizer state, the step count and the configuration's identity as a
  /// new step directory under `dir` (empty: the configured checkpoint.dir), then applies
  /// checkpoint.keep_last. Waits for an asynchronous save in flight first. Returns the step
  /// directory. Collective.
  std::string save(const std::string& dir = {});
  /// The same in the background: returns once this rank's state is copied into host staging
  /// memory; poll_save() at step boundaries, or wait_save(), commits. A second save_async
  /// while one is in flight is InvalidArgument (wait for it first). Collective.
  void save_async(const std::string& dir = {});
  /// Whether an asynchronous save is in flight (started, not yet committed or failed); local.
  bool save_in_flight() const noexcept;
  /// Commits the asynchronous save when every rank's files are written: true when it is
  /// committed (or none is in flight), false while it is being written. A failed write is
  /// thrown on every rank. Collective.
  bool poll_save();
  /// Waits for the asynchronous save in flight and commits it; returns its step directory.
  /// InvalidArgument when none is in flight. Collective.
  std::string wait_save();

  /// Loads the latest checkpoint under `dir` (empty: checkpoint.dir), saved on any number of
  /// ranks, into the model and optimizer, and restores the step count. Refused on every rank,
  /// naming what differs, when it was saved by another model or optimizer. Collective.
  std::int64_t load(const std::string& dir = {});
  /// Writes the full parameters as one safetensors file (rank 0 writes). Collective.
  void export_safetensors(const std::string& path);
  /// Replaces the parameters with those of a safetensors file (fully qualified names, e.g.
  /// export_safetensors' or PyTorch's model.state_dict()); each rank reads its rows. The
  /// optimizer state and step count stay. Refused naming the tensor that is missing or has
  /// another shape. Collective.
  void import_safetensors(const std::string& path);

  void set_progress(Progress progress);

  /// The LibTorch model: its parameters() are this rank's shards (a tied weight listed once
  /// per module that registers it; the optimizer holds each once).
  ::torch::nn::Module& module() const noexcept;
  /// The model's FSDP side: its module graph, each group's controls (state(module())), the
  /// unique parameter list.
  fullshard::torch::ShardedModel& sharded() const noexcept;
  const Config& config() const noexcept;
  const DeviceMesh& mesh() const noexcept;
  /// The dtype inputs are converted to (a contiguous input of it is used in place).
  at::ScalarType input_dtype() const noexcept;
  /// Where the model computes: the CPU, or the rank's GPU on a CUDA mesh (host arrays are
  /// copied there once).
  c10::Device device() const noexcept;
  std::int64_t step() const noexcept;
  /// Steps skipped for a non-finite value (config().non_finite).
  std::int64_t skipped_steps() const noexcept;
  /// The learning rate of the next step.
  double lr() const;
  /// Parameters of the whole model, each tensor once (tied weights counted once).
  std::int64_t num_params() const noexcept;
  /// Parameter tensors the optimizer steps (each once, also when tied).
  std::size_t optimizer_tensors() const;
  const PlanPrediction& plan() const noexcept;
  /// The data pointer of the first input of the last forward (tests: zero copy).
  const void* last_input_data() const noexcept;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fullshard::session
