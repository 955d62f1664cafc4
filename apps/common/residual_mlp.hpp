// A residual MLP trained with fully_shard, shared by the training apps (fullshard-train and
// heat-surrogate). The forward and backward passes are written by hand with BLAS (CBLAS
// sgemm) for the matrix products; each block is its own communication group and the root
// groups the input and output layers, as FSDP2 recommends for a transformer-like stack.
//
//   h0      = x W_in^T + b_in                         (input layer, inputs -> hidden)
//   h_{i+1} = h_i + relu(h_i W1_i^T + b1_i) W2_i^T + b2_i    (block i, hidden -> hidden)
//   y       = h_L W_out^T + b_out                     (output layer, hidden -> outputs)
//   loss    = mean over the global batch and the outputs of (y - target)^2
//
// Data parallel: each rank passes its slice of the global batch and the global row count;
// the gradients are summed over the data-parallel ranks (divide factor 1) of gradients
// scaled by 1 / (global rows * outputs), so the result is the full-batch gradient whatever
// the slicing. Parameters are f32; with a mixed-precision param_dtype (bf16, f16) the
// products run in f32 on converted copies and gradients are rounded to the param dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/schedule/executor.hpp"
#include "fullshard/schedule/plan.hpp"
#include "fullshard/session/native_session.hpp"

namespace fullshard::apps {

struct MlpShape {
  int inputs = 32;
  int hidden = 256;
  int outputs = 8;
  int blocks = 4;
};

/// A session::NativeModel: fullshard::session::NativeSession trains it.
class ResidualMlp final : public session::NativeModel {
 public:
  /// Builds the graph ("input", "blocks.<i>", "output") and declares the parameters' initial
  /// values from `seed` (Parameter::init_sharded: shard() fills each rank's rows only, the same
  /// values whatever the world size; nothing is allocated before). InvalidArgument for
  /// non-positive sizes.
  ResidualMlp(MlpShape shape, std::uint64_t seed);
  ~ResidualMlp() override;
  ResidualMlp(const ResidualMlp&) = delete;
  ResidualMlp& operator=(const ResidualMlp&) = delete;

  const MlpShape& shape() const noexcept { return shape_; }
  graph::Module& root() noexcept override { return *root_; }
  /// Number of parameters (elements) of the whole model.
  std::int64_t num_params() const noexcept override;
  std::int64_t inputs() const noexcept override { return shape_.inputs; }
  std::int64_t outputs() const noexcept override { return shape_.outputs; }
  /// "model.native = residual_mlp", then its inputs, hidden, outputs and blocks.
  std::vector<std::string> identity() const override;
  /// Its backward assigns a fresh gradient (Parameter::grad_fresh) instead of adding.
  bool assigns_fresh_gradients() const override { return true; }

  /// For a model used unsharded (no shard()): makes every parameter's full tensor from its
  /// initial values.
  void materialize();

  /// Plans the iteration (Scheduler) for `mesh` and `options`, applies fully_shard to every
  /// block and then the root (with options.defaults), and creates the executor. Collective
  /// over the mesh. Call once.
  /// `before_creation`, when given, sees the plan before any parameter is created (where a
  /// front end checks the memory account, and may throw to stop).
  void shard(const DeviceMesh& mesh, const schedule::PlanOptions& options,
             const std::function<void(const schedule::Plan&)>& before_creation = {}) override;
  const schedule::Plan& plan() const;

  /// Bytes of the activations and scratch a step over `rows` local samples holds (f32; with a
  /// 16-bit param_dtype also the f32 copies of one block's weights and gradients): the
  /// memory account's activations (docs/memory.md).
  std::size_t activation_bytes(std::int64_t rows,
                               DType param_dtype = DType::f32) const noexcept override;
  /// Bytes the activations and scratch hold now (the vectors' capacities).
  std::size_t activations_held() const noexcept;
  schedule::Executor& executor();

  /// One forward and backward over `rows` local samples (x: rows x inputs, target: rows x
  /// outputs, row-major; the pointers are read during the call only); `global_rows` is the
  /// global batch. Afterwards every parameter's grad() is its shard of the gradient of the
  /// global mean loss. Returns this rank's sum of squared errors (not averaged).
  double forward_backward(const float* x, const float* target, std::int64_t rows,
                          std::int64_t global_rows) override;

  /// Sets the batch the modules' callbacks read (x, target, rows, global rows; sizes the
  /// activations) as forward_backward does, without running a step: for running the
  /// callbacks on their own (fullshard-calibrate times them on an unsharded model whose
  /// gradients the caller allocated). Same arguments and errors as forward_backward.
  void set_batch(const float* x, const float* target, std::int64_t rows, std::int64_t global_rows);

  /// Forward only (evaluation): writes rows x outputs predictions to `out`, then reshards
  /// every group. Collective like a training step (every rank calls it; rows may be 0).
  void predict(const float* x, std::int64_t rows, float* out) override;

 private:
  struct Impl;
  MlpShape shape_;
  std::unique_ptr<graph::Module> root_;
  std::unique_ptr<Impl> impl_;
};

/// Sum of `value` over every rank of `mesh` (one f64 all-reduce on its main channel).
double sum_over_mesh(double value, const DeviceMesh& mesh);

/// Counter-based random numbers: the same value for the same (seed, stream, index) on every
/// rank, so data and initial values do not depend on the world size.
double uniform01(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) noexcept;
/// Standard normal (Box-Muller over two uniform01 draws).
double normal01(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) noexcept;

}  // namespace fullshard::apps
