// The in-situ surrogate: a fully_shard'ed ResidualMlp over the training ranks that learns to
// advance the heat equation by one window of K solver steps at a patch centre.
//
// Features of a record (patch p of (2R+1)^2 values with centre value c, source increment q,
// future centre value u): the patch differences (p_i - c) / s_in, except that the centre's
// slot holds (c - mean_c) / s_c, then q / s_out. Target: (u - c) / s_out, the change over the
// window. The scales come from the first round's records of all training ranks together.
// Errors are reported in field units: |c + s_out * prediction - u|.
#pragma once

#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "bounded_comm.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/session/native_session.hpp"
#include "options.hpp"
#include "residual_mlp.hpp"

namespace fullshard::apps::heat {

/// Held-out error over every training rank's records, in field units.
struct EvalResult {
  double rmse_model = 0;    // the surrogate
  double rmse_trivial = 0;  // "no change": u(t + K) = u(t)
  std::int64_t points = 0;
  /// Whether "no change" is a baseline a ratio can be measured against: points evaluated,
  /// both errors finite, and the field changed at them (rmse_trivial > 0).
  bool baseline_ok() const {
    return points > 0 && std::isfinite(rmse_model) && std::isfinite(rmse_trivial) &&
           rmse_trivial > 0;
  }
  /// rmse_model / rmse_trivial; NaN when !baseline_ok() (never a ratio that passes).
  double ratio() const {
    return baseline_ok() ? rmse_model / rmse_trivial : std::numeric_limits<double>::quiet_NaN();
  }
};

/// The run's verdict: PASS (code 0) only if the baseline is sound, the ratio is below
/// pass_ratio and the loss fell; FAIL (code 1) otherwise, `line` saying why ("verdict: ...").
struct Verdict {
  int code = 1;
  std::string line;
};
Verdict decide(const EvalResult& last, double first_loss, double last_loss, double pass_ratio);

/// Training since the previous take_progress(), over every training rank.
struct TrainProgress {
  double loss = 0;             // mean squared error of the normalised target per sample
  std::int64_t received = 0;   // records received so far (distinct samples)
  std::int64_t presented = 0;  // minibatch rows trained on so far (with repetition)
};

class Surrogate {
 public:
  /// Collective over `train_comm` (the training ranks): builds the 1-D mesh "shard" on it and
  /// the training session (session::NativeSession) of the model: every block, then the root,
  /// sharded; AdamW under a warm-up cosine schedule, clipping, the non-finite check.
  Surrogate(const Options& o, MPI_Comm train_comm, double timeout_s, HostProgress progress);
  ~Surrogate();
  Surrogate(const Surrogate&) = delete;
  Surrogate& operator=(const Surrogate&) = delete;

  std::int64_t num_params() const noexcept { return model_->num_params(); }
  const DeviceMesh& mesh() const noexcept { return mesh_; }
  const ResidualMlp& model() const noexcept { return *model_; }
  /// The session's configuration for these options (what --help's training flags set).
  static session::Config session_config(const Options& o);
  const session::NativeSession& session() const noexcept { return *session_; }

  /// Adds a round's training records (`stride` floats each) to the replay buffer, replacing
  /// the oldest beyond --buffer. The first call fixes the feature scales: collective.
  void add(const std::vector<float>& records);
  /// --train-steps optimizer steps, each on a global minibatch of --batch rows drawn from the
  /// ranks' buffers (rank t draws its share from its own buffer). Collective.
  void train();
  /// Collective.
  TrainProgress take_progress();
  /// Called after each optimizer step with this rank's minibatch (rows x inputs features,
  /// rows targets), the global rows and the step's global mean loss (NaN: skipped): what a
  /// test replays through the session's C++ API.
  using StepObserver = std::function<void(const std::vector<float>& x, const std::vector<float>& y,
                                          int rows, std::int64_t global_rows, double loss)>;
  void set_step_observer(StepObserver observer) { observer_ = std::move(observer); }
  /// The surrogate's and "no change"'s errors on held-out records (`stride` floats each, any
  /// count per rank). Collective.
  EvalResult evaluate(const std::vector<float>& records);

 private:
  void fix_scales(const std::vector<float>& records);
  // Sum over the training ranks (MPI_Iallreduce under FULLSHARD_TIMEOUT).
  void sum_in_place(double* v, int n, const char* what);
  void features(const float* record, float* x) const;

  Options o_;
  MPI_Comm comm_;           // the training ranks (not owned)
  apps::BoundedComm sums_;  // comm_ for the sums of the app (bounded waits)
  int rank_ = 0, size_ = 1;
  int patch_ = 0, stride_ = 0, inputs_ = 0;
  DeviceMesh mesh_;
  std::unique_ptr<ResidualMlp> model_;
  std::unique_ptr<session::NativeSession> session_;
  bool scaled_ = false;
  double s_in_ = 1, s_out_ = 1, mean_c_ = 0, s_c_ = 1;
  // Replay buffer (features and targets), a ring of at most --buffer rows.
  std::vector<float> x_, y_;
  std::int64_t size_rows_ = 0, next_row_ = 0;
  // Counters.
  std::int64_t step_ = 0, received_ = 0, presented_ = 0;
  double sse_since_ = 0;              // every rank's, normalised units
  std::int64_t rows_since_ = 0;       // global rows since the last take_progress
  std::vector<float> bx_, by_, out_;  // minibatch / evaluation scratch
  StepObserver observer_;
};

}  // namespace fullshard::apps::heat
