// Compute costs of the residual MLP (residual_mlp.hpp): measured module times (its modules'
// own code, timed as a step runs it) or, without them, its work counts at calibrated rates;
// and the calibration of both (schedule::ComputeRates) on this machine: CBLAS SGEMM at given
// shapes, the elementwise passes, the optimizers and the modules, at a whole core per rank
// (every rank at once, or one rank at a time when ranks share cores).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "fullshard/comm/communicator.hpp"
#include "fullshard/schedule/compute_cost.hpp"
#include "residual_mlp.hpp"

namespace fullshard::apps {

/// The work of one forward and one backward of each kind of module of the residual MLP for
/// `rows` samples (ResidualMlp::Impl, counted from its code): GEMMs as CBLAS runs them and
/// the bytes read + written by the elementwise passes over rows x width arrays (bias
/// broadcasts, ReLU, residual copy and add, column sums, masks, the loss; f32).
struct MlpWork {
  schedule::ModuleWork input_forward, input_backward;
  schedule::ModuleWork block_forward, block_backward;
  schedule::ModuleWork output_forward, output_backward;
};
MlpWork residual_mlp_work(const MlpShape& shape, std::int64_t rows);

/// The distinct GEMM shapes of a block's forward and backward for `rows` samples (the
/// input and output layers' small GEMMs take the nearest of these): (rows, H, H) NT and NN,
/// (H, H, rows) TN.
std::vector<schedule::Gemm> residual_mlp_block_gemms(std::int64_t hidden, std::int64_t rows);

/// The key of the residual MLP's measured module times (schedule::MeasuredModules): model
/// "residual_mlp", shape {rows, hidden, inputs, outputs} (rows per rank).
constexpr const char* kResidualMlpModel = "residual_mlp";
std::map<std::string, std::int64_t> residual_mlp_key(const MlpShape& shape, std::int64_t rows);

/// Times the residual MLP's modules on this rank alone: a model of `shape` (its blocks, with
/// their own parameters, and its activations), unsharded, with zeroed f32 gradients, runs
/// the modules' own forward callbacks (input, every block, output) and then their backward
/// callbacks (output, blocks in reverse, input) as a step does, `warmup` times and then
/// `reps` times; each module's time is the median over the reps (a block's: of the mean over
/// the blocks). Modules "input", "block", "output"; key residual_mlp_key(shape, rows).
schedule::MeasuredModules time_residual_mlp_modules(const MlpShape& shape, std::int64_t rows,
                                                    int reps, int warmup = 2);

/// How the module costs were declared.
enum class CostSource { flop_model, measured_modules };

/// Declares every module's cost (input, blocks.<i>, output) for `rows` samples per rank:
/// the measured module times of `rates` for the model's shape at `rows` when it has them
/// (rates.measured_modules(kResidualMlpModel, residual_mlp_key(...))), else the FLOP model
/// (residual_mlp_work at the rates). Call before ResidualMlp::shard (the plan reads the
/// costs). Returns which it used.
CostSource declare_costs(ResidualMlp& model, const schedule::ComputeRates& rates,
                         std::int64_t rows);

/// The ranks per core of this job: over the nodes (MPI_COMM_TYPE_SHARED), the most ranks on a
/// node divided by the CPUs they may run on (the union of their affinity masks). Collective
/// over MPI_COMM_WORLD, every call bounded by `timeout_s` (FULLSHARD_TIMEOUT; 0: unbounded);
/// the same value on every rank.
double job_ranks_per_core(double timeout_s);

/// The time slice the kernel's scheduler gives a task before a core-mate runs (ms; for
/// schedule::core_wait_ms): FULLSHARD_SCHED_SLICE_MS when set (a number > 0; else
/// InvalidArgument naming it), else /sys/kernel/debug/sched/base_slice_ns when readable, else
/// Linux's default base slice (EEVDF, Linux >= 6.6): 0.75 ms x (1 + log2(min(online CPUs,
/// 8))), 1.5 ms on 2 CPUs.
double scheduler_slice_ms();

struct ComputeCalibration {
  std::vector<schedule::Gemm> gemms;
  /// Residual MLPs whose modules to time (time_residual_mlp_modules): shape and rows per
  /// rank, `module_reps` repetitions after 2 warm-ups.
  std::vector<std::pair<MlpShape, std::int64_t>> mlps;
  int module_reps = 9;
  /// The job's ranks per core (0: job_ranks_per_core(), collective over MPI_COMM_WORLD, so
  /// that `comm` must then span it). Above 1 every measurement runs on one rank at a time,
  /// the others waiting in a barrier, so that each measures a whole core.
  double ranks_per_core = 0.0;
  /// Floats per array of the elementwise passes (rows x hidden of the largest model; rows
  /// of 512 floats).
  std::int64_t elementwise_floats = 256 * 512;
  /// Elements of the parameter the optimizers update (a rank's shard).
  std::int64_t optimizer_elements = 1 << 22;
  /// Wall time each of the three rounds of a rate's measurement runs on a rank.
  double min_ms = 100.0;
};

/// Measures the rates and module times on every rank of `comm` (collective: same arguments on
/// every rank), at once or, with more ranks than cores, one rank at a time: three rounds over
/// the rates, each from a barrier for min_ms, the best round kept; the slowest rank's rate and
/// module time count (every rank gets the same result). ranks = comm.size(), ranks_per_core
/// as measured (or given).
schedule::ComputeRates calibrate_compute(const comm::Communicator& comm,
                                         const ComputeCalibration& what);

}  // namespace fullshard::apps
