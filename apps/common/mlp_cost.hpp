// Compute costs of the residual MLP (residual_mlp.hpp) from its work counts, and the
// calibration of the rates they need (schedule::ComputeRates) on this machine: CBLAS SGEMM at
// given shapes, the elementwise passes and the optimizers, with every rank of the job
// measuring at the same time (so that ranks sharing cores measure their share).
#pragma once

#include <cstdint>
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
  schedule::Work input_forward, input_backward;
  schedule::Work block_forward, block_backward;
  schedule::Work output_forward, output_backward;
};
MlpWork residual_mlp_work(const MlpShape& shape, std::int64_t rows);

/// The distinct GEMM shapes of a block's forward and backward for `rows` samples (the
/// input and output layers' small GEMMs take the nearest of these): (rows, H, H) NT and NN,
/// (H, H, rows) TN.
std::vector<schedule::Gemm> residual_mlp_block_gemms(std::int64_t hidden, std::int64_t rows);

/// Declares every module's cost (input, blocks.<i>, output) from `rates` for `rows` samples
/// per rank. Call before ResidualMlp::shard (the plan reads the costs).
void declare_costs(ResidualMlp& model, const schedule::ComputeRates& rates, std::int64_t rows);

struct ComputeCalibration {
  std::vector<schedule::Gemm> gemms;
  /// Floats per array of the elementwise passes (rows x hidden of the largest model; rows
  /// of 512 floats).
  std::int64_t elementwise_floats = 256 * 512;
  /// Elements of the parameter the optimizers update (a rank's shard).
  std::int64_t optimizer_elements = 1 << 22;
  /// Wall time each of the three rounds of a measurement runs on every rank at once.
  double min_ms = 100.0;
};

/// Measures the rates on every rank of `comm` at once (collective: same arguments on every
/// rank): three rounds over all measurements, each from a barrier for min_ms; the slowest
/// rank's rate counts, the best round is kept (every rank gets the same result).
/// ranks = comm.size().
schedule::ComputeRates calibrate_compute(const comm::Communicator& comm,
                                         const ComputeCalibration& what);

}  // namespace fullshard::apps
