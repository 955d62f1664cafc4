// What every training session does whatever its model (a LibTorch module: Session; a native
// graph model: NativeSession), written once and free of LibTorch: the ranks' agreement on the
// configuration, the checkpoint directory's check and claim, the plan's options and the memory
// check, the learning-rate schedule, the step's non-finite check and clipping (one all-reduce),
// the optimizer step, checkpoints (synchronous, asynchronous, retention, resume, identity),
// safetensors export and import, and the refusal of non-finite parameters. A session's Impl
// derives from it and adds its model. Private to lib/session.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fullshard/base/bounded_comm.hpp"
#include "fullshard/checkpoint/async_save.hpp"
#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/checkpoint/directory_claim.hpp"
#include "fullshard/checkpoint/safetensors.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "fullshard/schedule/memory_account.hpp"
#include "fullshard/schedule/plan.hpp"
#include "fullshard/session/config.hpp"
#include "fullshard/session/metrics.hpp"
#include "lib/session/non_finite_policy.hpp"
#include "lib/session/session_optimizer.hpp"

namespace fullshard::session {

class SessionCore {
 public:
  /// Checks `config` as a file is checked and agrees on it across the mesh (with
  /// `model_identity`, "model.<key> = value" lines of a model the configuration does not
  /// describe), then checks and claims the checkpoint directory. Collective.
  /// `native`: the session of a NativeModel (model.type "native" and f32 required), else of a
  /// LibTorch model (native refused).
  SessionCore(const DeviceMesh& mesh, Config config, bool native,
              const std::vector<std::string>& model_identity = {});
  virtual ~SessionCore();
  SessionCore(const SessionCore&) = delete;
  SessionCore& operator=(const SessionCore&) = delete;

  /// The plan's options the configuration sets (precision, reshard_after_forward, prefetch,
  /// compression, the optimizer inside backward, the mesh's collective costs).
  /// Collective (the ranks agree on reading sharding.cost_file).
  schedule::PlanOptions plan_options_of_config();
  /// sharding.allow_compression's candidates for the auto-planner.
  void add_allowed_compressions(schedule::AutoPlanOptions& ao) const;
  /// The blocks and root policies' fully_shard requests on `g` (sharding.policy, list
  /// groups): `blocks` (fully qualified names) become groups under "blocks" unless listed; a
  /// listed module's own request is dropped; "root" keeps the root's only. ConfigError naming a
  /// listed module the model does not have.
  void request_groups(graph::Module& g, const std::vector<std::string>& blocks);
  /// What the memory account needs besides a plan (docs/memory.md): the optimizer's state,
  /// the transport, `activations` bytes and the baseline: `baseline_resident` where a session
  /// measured it before sharding, otherwise the process's resident bytes now.
  schedule::MemoryInputs memory_inputs(std::size_t activations) const;
  std::size_t baseline_resident = 0;
  /// The planned process peak of `p` with `activations` bytes (docs/memory.md) against the
  /// rank's budget (memory.*), agreed on every rank; `advice` ends the refusal. Sets
  /// plan.process_peak_bytes. Host meshes only. Collective.
  void check_memory(const schedule::Plan& p, std::size_t activations, const std::string& advice);
  /// plan's sizes and predicted step from `p` (`serial`: a host mesh's collectives inline).
  void record_plan(const schedule::Plan& p, bool serial);

  /// After the model is created and sharded: its parameters (refused when one is not
  /// finite), the optimizer, the schedule, and the resume when asked for. Collective.
  void start(graph::Module& root, std::unique_ptr<SessionOptimizer> optimizer);
  /// Before the model goes: a save in flight finishes, the optimizer lets the model go.
  void release() noexcept;

  double lr() const;

  /// The step's totals over the ranks, from one all-reduce after the backward.
  struct StepTotals {
    double loss = 0;  // the ranks' losses summed
    double rows = 0;  // the ranks' rows summed
    double norm = 0;  // the global gradient norm (grad_clip only)
  };
  /// After the step's backward: this rank's loss, rows and (with grad_clip) gradients' sum of
  /// squares, and whether its loss, gradients (inside backward: parameters) or `input_problem`
  /// (what this rank's input holds, "" when nothing) are bad, in one all-reduce (a second
  /// only on a bad step, naming the lowest bad rank). Returns "" or what was bad (the same on
  /// every rank). Collective.
  /// `extra`: `n_extra` more values of this rank summed in the same all-reduce (in place).
  std::string check_step(double local_loss, double local_rows, const std::string& input_problem,
                         StepTotals& totals, double* extra = nullptr, int n_extra = 0);
  /// The step's update after check_step passed: clipping to grad_clip, the optimizer, the step
  /// count.
  void apply_step(const StepTotals& totals);
  /// A step found holding a non-finite value (`what`, agreed by every rank): counted, and
  /// skipped (returns NaN) or, by the policy, an InvalidArgument on every rank.
  double non_finite_step(const std::string& what, bool applied = false);
  /// Calls the progress callback of a finished step (started at `start`, its backward done at
  /// `backward_end`).
  void report_step(double loss, double lr, std::chrono::steady_clock::time_point start,
                   std::chrono::steady_clock::time_point backward_end) const;

  /// Refuses parameters holding a non-finite value (`when`: "initial", "imported", ...):
  /// InvalidArgument on every rank naming the lowest rank's first such parameter. Collective.
  void check_parameters_finite(const std::string& when);
  /// InvalidArgument naming `call` while the parameters hold refused values (refused_values):
  /// nothing trains, predicts or saves them until a load or an import succeeds.
  void check_usable(const char* call) const;

  // Checkpoints: the sessions' calls of the same names (fullshard/session/session.hpp).
  std::string save(const std::string& dir);
  void save_async(const std::string& dir);
  bool poll_save();
  std::string wait_save();
  std::int64_t load(const std::string& dir);
  checkpoint::Loaded load_parameters(const std::string& dir);
  std::uint64_t reserve_async_staging();
  void export_safetensors(const std::string& path);
  checkpoint::SafetensorsLoaded import_safetensors(const std::string& path, bool cast);

  Config cfg;
  DeviceMesh mesh;
  std::unique_ptr<BoundedComm> control;  // the session's agreements (batch, checkpoints)
  // This run's hold on cfg.checkpoint.dir; released last (after a save in flight).
  std::unique_ptr<checkpoint::DirectoryClaim> claim;
  graph::Module* root = nullptr;  // the model's graph (start)
  std::vector<graph::Parameter*> graph_params;
  std::unique_ptr<SessionOptimizer> opt;
  std::optional<optim::WarmupCosine> schedule;
  std::int64_t step = 0;
  PlanPrediction plan;
  schedule::MemoryAccount planned;  // check_memory's
  double last_load_seconds = 0;
  std::optional<NonFinitePolicy> non_finite;  // cfg.non_finite
  std::int64_t skipped_at_load = 0;           // non_finite->skipped() at the last load
  Progress progress;
  nlohmann::json identity;  // the lines a checkpoint must match, kept in its metadata
  checkpoint::AsyncSave pending;
  bool in_flight = false;
  std::string pending_dir;
  nlohmann::json metadata_extra;            // the program's keys in every checkpoint's metadata
  checkpoint::Loaded last_loaded;           // the last load's (step_dir empty before one)
  std::string resumed_step_dir;             // of checkpoint.dir, resumed from: never removed
  std::optional<std::uint64_t> free_bytes;  // checkpoint.dir's file system, at creation
  // Set when a load or import was refused after it had replaced the parameters (a non-finite
  // value found in them): what was refused; the same on every rank.
  std::string refused_values;

 private:
  std::string dir_or_configured(const std::string& dir, const char* call) const;
  checkpoint::SaveOptions save_options(const std::string& dir) const;
  nlohmann::json metadata() const;
  /// Whether `path` is checkpoint.dir or one of its step directories (rank 0 decides).
  /// Collective.
  bool in_checkpoint_dir(const std::string& path);
  void check_identity(const std::string& dir);
  void committed(const std::string& step_dir, std::int64_t step, bool async) const;
};

}  // namespace fullshard::session
