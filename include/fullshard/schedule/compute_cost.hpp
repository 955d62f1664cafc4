// Compute costs from work counts: a module's forward or backward is described by the SGEMMs it
// runs and the bytes its elementwise passes move, and a calibration of this machine
// (ComputeRates: SGEMM GFLOP/s at measured shapes, elementwise and optimizer throughput,
// measured by `fullshard-calibrate --compute-out` at a whole core per rank) turns that into
// the milliseconds a module declares as its `cost` for the planner. The calibration can also
// hold measured module times (MeasuredModules), which a program prefers for its own shape;
// core_wait_ms models ranks that share cores.
// JSON schema: docs/plan-format.md, "Compute calibration JSON".
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "fullshard/graph/module.hpp"

namespace fullshard::schedule {

class Plan;

/// One SGEMM C (m x n) += op(A) (m x k) op(B) (k x n) (CBLAS row-major; trans_a / trans_b:
/// op is the transpose). 2 m n k floating-point operations.
struct Gemm {
  std::int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  double flops() const noexcept { return 2.0 * double(m) * double(n) * double(k); }
  /// "256x512x512:NT" (m x n x k, then A's and B's op: N or T).
  std::string to_string() const;
  /// Parses to_string()'s form (the ":NT" suffix is optional, default NN). InvalidArgument
  /// naming `what` and the text when it is not of that form or a size is not in 1..2^24.
  static Gemm parse(const std::string& text, const std::string& what = "gemm");
  bool operator==(const Gemm& o) const noexcept {
    return m == o.m && n == o.n && k == o.k && trans_a == o.trans_a && trans_b == o.trans_b;
  }
};

/// The work of one forward or backward of one module (its own work, without its children).
struct ModuleWork {
  std::vector<Gemm> gemms;
  /// Bytes read plus bytes written by the elementwise passes (bias broadcasts, activations,
  /// residual adds, column sums, copies).
  double elementwise_bytes = 0.0;
};

/// A measured SGEMM throughput at one shape.
struct GemmRate {
  Gemm shape;
  double gflop_per_s = 0.0;
};

/// One module's measured forward and backward (ms, the median of the repetitions).
struct ModuleTime {
  double forward_ms = 0.0, backward_ms = 0.0;
  bool operator==(const ModuleTime& o) const noexcept {
    return forward_ms == o.forward_ms && backward_ms == o.backward_ms;
  }
};

/// The measured times of the modules of one model at one shape: the modules' own forward and
/// backward code run on their own parameters and activations, unsharded, as a step runs it
/// (fullshard-calibrate --mlp: model "residual_mlp", shape {rows, hidden, inputs, outputs},
/// modules "input", "block", "output").
struct MeasuredModules {
  std::string model;
  /// The sizes the times are for (positive integers), e.g. {"hidden": 512, "rows": 256, ...}.
  std::map<std::string, std::int64_t> shape;
  std::map<std::string, ModuleTime> modules;
  /// Repetitions the medians are over (informational).
  int reps = 1;
  bool operator==(const MeasuredModules& o) const noexcept {
    return model == o.model && shape == o.shape && modules == o.modules && reps == o.reps;
  }
};

/// Compute throughputs of one rank while `ranks` ranks of the machine run at once.
struct ComputeRates {
  /// Measured SGEMM rates; gemm_gflop_per_s(g) looks them up.
  std::vector<GemmRate> gemm;
  /// The rate of a GEMM when no shape was measured.
  double default_gemm_gflop_per_s = 10.0;
  /// Elementwise passes: (bytes read + written) per second, 1 GB = 1e9 B.
  double elementwise_gb_per_s = 5.0;
  /// Optimizer step per element of this rank's shards (Optimizer::step), and zero_grad.
  double adamw_ns_per_element = 5.0;
  double sgd_ns_per_element = 3.0;
  /// Ranks of the calibrating job (informational).
  int ranks = 1;
  /// The calibrating job's ranks per core on its node (ranks on the node / the CPUs they may
  /// run on). Above 1, the calibration measured one rank at a time (the others waiting in a
  /// barrier); at most 1, every rank at once, each on its own core. Either way every rate and
  /// module time is a whole core's (whole_core()). 0: not recorded (files written before this
  /// key, whose ranks measured at once however many shared a core: 4 ranks on 2 cores wrote
  /// half a core's rates).
  double ranks_per_core = 0.0;
  /// Measured module times (JSON "module_times"); measured_modules() looks them up.
  std::vector<MeasuredModules> module_times;

  /// The entry of `model` with exactly `shape`, or nullptr.
  const MeasuredModules* measured_modules(
      const std::string& model, const std::map<std::string, std::int64_t>& shape) const noexcept;
  /// True when the rates and module times are a whole core's (ranks_per_core recorded), so
  /// that a job with more ranks than cores adds the time its core-mates compute
  /// (core_wait_ms).
  bool whole_core() const noexcept { return ranks_per_core > 0.0; }

  /// The rate for `g`: the measured shape equal to it; else, among the measured shapes with
  /// the same transposes (or any when none has them), the nearest in log space (sum of
  /// |log(m/m')| + |log(n/n')| + |log(k/k')|, the first of equals); else
  /// default_gemm_gflop_per_s.
  double gemm_gflop_per_s(const Gemm& g) const noexcept;
  /// flops / rate, in ms.
  double time_ms(const Gemm& g) const noexcept;
  /// Sum of the GEMMs' times plus elementwise_bytes / elementwise rate, in ms.
  double time_ms(const ModuleWork& w) const noexcept;
  /// One optimizer step over `elements` (this rank's shard elements): "adamw" or "sgd";
  /// InvalidArgument for another name.
  double optimizer_ms(const std::string& optimizer, double elements) const;

  /// The JSON form (every key written), as text (`indent` < 0: on one line).
  std::string to_json(int indent = -1) const;
  /// Reads the JSON `text` over `base` (keys present replace base's; "gemm" replaces the whole
  /// list). ConfigError "<source>: invalid JSON ..." when it does not parse, "<source>: <JSON
  /// path>: <problem>" on unknown keys, wrong types, numbers that are negative, zero where a
  /// rate is meant, or not finite, bad shapes.
  static ComputeRates parse_json(const std::string& text, const ComputeRates& base,
                                 const std::string& source = "<compute>");
  /// parse_json on a file; ConfigError naming the path when it cannot be read.
  static ComputeRates load_json(const std::string& path, const ComputeRates& base);

  bool operator==(const ComputeRates& o) const noexcept;
};

/// The time a rank waits, per step, for the other ranks on its core when `ranks_per_core`
/// (> 1) ranks share each core and the rates are a whole core's (ComputeRates::whole_core()).
/// Every core runs the CPU work of all its ranks. The kernel runs a task for a time slice
/// (`slice_ms`) before it lets a core-mate have the core, so the first slice of each module
/// runs at a whole core's speed and the core-mates compute that part while this rank waits in
/// a collective (the collectives' calibrated time, measured with every rank at once on the
/// shared cores, is mostly such waiting); what a module runs beyond one slice shares the core
/// with its core-mates, and the optimizer step, which every rank runs at the same time after
/// its last reduce-scatter, adds in full:
///   m = ranks_per_core - 1;
///   m x optimizer_ms + m x sum_i max(0, module_ms[i] - slice_ms)
///     + max(0, m x sum_i min(module_ms[i], slice_ms) - collective_ms);
/// 0 when ranks_per_core <= 1. `module_ms`: the rank's modules' forward and backward ops of a
/// step at a whole core; `collective_ms`: its communication-stream ops (the plan's).
double core_wait_ms(double ranks_per_core, const std::vector<double>& module_ms,
                    double collective_ms, double optimizer_ms, double slice_ms) noexcept;

/// The module's declared cost from its forward and backward work.
graph::Cost cost_from_work(const ComputeRates& rates, const ModuleWork& forward,
                           const ModuleWork& backward);

/// The time of the plan when every op runs on the calling thread, one after the other: the
/// sum of every op's (end - start). A host mesh with FULLSHARD_HOST_PROGRESS=inline (the
/// default) runs its collectives that way, so this, not Plan::step_ms (the streams
/// overlapped), is what a host step takes.
double serial_step_ms(const Plan& plan) noexcept;

}  // namespace fullshard::schedule
