// What every training session offers whatever its model (Session: a LibTorch module;
// NativeSession: a model fullshard computes itself): checkpoints, safetensors, progress, the
// configuration, the step count and schedule, the plan's prediction. Free of LibTorch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/checkpoint/safetensors.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/schedule/memory_account.hpp"
#include "fullshard/session/config.hpp"
#include "fullshard/session/metrics.hpp"

namespace fullshard::session {

class SessionCore;

class SessionBase {
 public:
  SessionBase(const SessionBase&) = delete;
  SessionBase& operator=(const SessionBase&) = delete;

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
  /// What the last load read (the step directory, its metadata, kind and bytes); the step
  /// directory is empty before one.
  const checkpoint::Loaded& last_loaded() const noexcept;
  /// The last load's time on this rank (the identity check, the reads, the checks), seconds.
  double last_load_seconds() const noexcept;
  /// The parameters of the checkpoint at `dir` (a root or a step directory, saved on any
  /// number of ranks), without optimizer state or step count (a fresh start from its
  /// weights). Refused naming a tensor that is missing or has another shape, or a non-finite
  /// value; the configuration's identity is not compared (weights of another run of the same
  /// model load), and last_loaded() stays. Collective.
  checkpoint::Loaded load_parameters(const std::string& dir);
  /// Keys (the text of a JSON object, any keys but "session") written into every
  /// checkpoint's metadata beside the session's identity, e.g. what a program needs to
  /// continue its data stream; read back through last_loaded().metadata (JSON text).
  /// InvalidArgument for text that is not such an object.
  void set_checkpoint_metadata(const std::string& extra);
  /// Allocates and faults in the host staging memory of asynchronous saves, so that the first
  /// save_async costs a step no more than later ones; returns its bytes on this rank.
  std::uint64_t reserve_async_staging();
  /// Writes the full parameters as one safetensors file (rank 0 writes). Collective.
  void export_safetensors(const std::string& path);
  /// Replaces the parameters with those of a safetensors file (fully qualified names, e.g.
  /// export_safetensors' or PyTorch's model.state_dict()); each rank reads its rows. The
  /// optimizer state and step count stay. Refused naming the tensor that is missing or has
  /// another shape, or another dtype unless `cast` (converted, as PyTorch's load_state_dict
  /// does). Collective.
  checkpoint::SafetensorsLoaded import_safetensors(const std::string& path, bool cast = false);

  void set_progress(Progress progress);

  const Config& config() const noexcept;
  const DeviceMesh& mesh() const noexcept;
  std::int64_t step() const noexcept;
  /// Steps skipped for a non-finite value (config().non_finite).
  std::int64_t skipped_steps() const noexcept;
  /// The learning rate of the next step.
  double lr() const;
  /// Parameter tensors the optimizer steps (each once, also when tied).
  std::size_t optimizer_tensors() const;
  const PlanPrediction& plan() const noexcept;
  /// The memory account of the plan (docs/memory.md): its parts for this rank, as the memory
  /// check saw them at creation. A LibTorch Session's activations are not declared: from its
  /// first train_step on they are the largest host bytes LibTorch allocated in a step (a
  /// measured warm-up), and plan().process_peak_bytes includes them.
  const schedule::MemoryAccount& planned_memory() const noexcept;

 protected:
  SessionBase() = default;
  ~SessionBase() = default;
  /// The session's core (set by the derived session once it is made).
  void attach(SessionCore& core) noexcept { core_ = &core; }

 private:
  SessionCore* core_ = nullptr;
};

}  // namespace fullshard::session
