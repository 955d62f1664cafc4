// The executor: runs a plan's iteration over a fully_shard'ed graph (the user's callbacks on
// the calling thread, collectives on the mesh's channel streams), applies the plan's
// policies, and records the measured timeline in the plan's trace format.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/schedule/plan.hpp"

namespace fullshard::schedule {

/// One measured interval.
struct MeasuredOp {
  std::string label;
  StreamKind stream = StreamKind::compute;
  double start_us = 0.0;  // since the timeline's origin
  double end_us = 0.0;
};

/// Measured intervals of one or more iterations; thread-safe.
class Timeline {
 public:
  Timeline();
  void record(const std::string& label, StreamKind stream,
              std::chrono::steady_clock::time_point start,
              std::chrono::steady_clock::time_point end);
  std::vector<MeasuredOp> ops() const;
  /// Number of intervals recorded.
  std::size_t size() const;
  /// Summed duration (us) of the intervals from index `first` on, of the communication
  /// streams (communication = true) or of the compute stream; no copy of the timeline.
  double busy_us(std::size_t first, bool communication) const;
  void clear();
  /// The same trace-event format as Plan::to_chrome_trace (one thread per stream), as process
  /// `pid` so that a plan (pid 0) and a measurement can be merged into one file; the JSON
  /// text, on one line.
  std::string to_chrome_trace(int pid = 1, const std::string& name = "fullshard measured") const;

 private:
  mutable std::mutex m_;
  std::chrono::steady_clock::time_point origin_;
  std::vector<MeasuredOp> ops_;
};

/// Applies the plan's policies to the FSDP modules of `root` (fully_shard'ed as the plan
/// describes: InvalidArgument naming the first group that is not): forward and backward
/// prefetch, unshard in backward, and on the roots the reduce-scatter buffer cap, HSDP
/// all-reduce, reshard after backward, gradient sync and last backward. Returns the FSDP
/// module of each plan group, in the plan's order. The Executor and front ends that run a
/// plan (fullshard::torch::ShardedModel::apply_plan) call it.
std::vector<fsdp::FSDPModule*> apply_plan_policies(graph::Module& root, const Plan& plan);

class Executor {
 public:
  /// `root` must be fully_shard'ed over `mesh` as the plan describes (e.g. with
  /// fsdp::apply_fully_shard_requests and the plan's options.defaults); the executor applies
  /// the plan's policies to the FSDP modules (forward and backward prefetch, reduce-scatter
  /// buffer cap, HSDP all-reduce, reshard after backward, gradient sync, last backward,
  /// unshard in backward) and records every channel stream of `mesh`.
  Executor(graph::Module& root, const DeviceMesh& mesh, const Plan& plan);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  /// Forward then backward over the graph (fsdp::forward / fsdp::backward semantics).
  void step();
  void forward();
  void backward();

  const Timeline& timeline() const noexcept { return timeline_; }
  Timeline& timeline() noexcept { return timeline_; }
  /// Largest pool bytes in use of the roots' buffer pools since construction (or the last
  /// reset_measurement), summed over the roots: the quantity Plan::peak_bytes predicts.
  std::size_t measured_peak_bytes() const;
  void reset_measurement();

 private:
  fsdp::ComputeRecorder compute_recorder();

  graph::Module* root_;
  DeviceMesh mesh_;
  Timeline timeline_;
};

}  // namespace fullshard::schedule
