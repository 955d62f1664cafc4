// What a training session (Session, NativeSession) reports: the plan's prediction for a step,
// and the progress callback's view of each step and each committed checkpoint.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace fullshard::session {

/// The planner's prediction for one step (one forward and backward; a step of `accumulation`
/// micro-batches runs that many). Made at creation with the modules' declared costs (none by
/// default), then, for LibTorch models, again with the modules' measured compute times after
/// the calibration steps (sharding.calibrate_steps).
struct PlanPrediction {
  /// The plan's operations one after the other (a host mesh runs its collectives on the
  /// calling thread; on a GPU mesh the streams overlapped), plus optimizer_ms. Uncalibrated, the
  /// modules cost what they declare (nothing by default): a lower bound.
  double step_ms = 0;
  std::int64_t peak_bytes = 0, sharded_bytes = 0, groups = 0;
  /// The memory account's planned process peak (0 on a CUDA mesh); a LibTorch model's
  /// activations are in it from the first train_step on (measured there).
  std::int64_t process_peak_bytes = 0;
  /// 0: the modules' costs are the declared ones; n: measured over n training forwards and
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
  double loss = 0;        // the step's loss (Session: this rank's; NativeSession: the global mean)
  double lr = 0;          // the learning rate the step used
  double seconds = 0;     // the step's wall time on this rank
  /// Of `seconds`, the forward and backward (the rest: the checks, clipping, the optimizer).
  double forward_backward_seconds = 0;
};

/// What the progress callback sees when a checkpoint is committed.
struct SaveMetrics {
  std::int64_t step = 0;
  std::string step_dir;
  bool asynchronous = false;
  /// Asynchronous saves: this rank's background write (seconds) and its staging memory.
  double write_seconds = 0;
  std::uint64_t staging_bytes = 0;
};

/// Called on every rank, from the calling thread, inside the session's calls.
struct Progress {
  std::function<void(const StepMetrics&)> on_step;
  std::function<void(const SaveMetrics&)> on_save;
};

}  // namespace fullshard::session
