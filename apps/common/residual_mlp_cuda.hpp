// The residual MLP of residual_mlp.hpp computed on a CUDA mesh: the matrix products with
// cuBLAS, the element-wise parts (bias, ReLU, residual add, loss and its gradient) as Kokkos
// kernels, everything enqueued on the mesh's compute stream (fullshard/mesh/compute_space.hpp:
// FSDP orders its all-gather copy-outs before and its reduce-scatters after what the callbacks
// enqueue there). No call waits on the host except sse() and step_ms(), which read results
// back (fullshard-train calls them at its log points).
//
// Built only when Kokkos has CUDA and the CUDA toolkit has cuBLAS (FULLSHARD_APPS_HAVE_CUDA).
// The same model (graph, names, initial values) as the host ResidualMlp: CudaResidualMlp
// replaces its modules' forward and backward callbacks, so a model is either host or CUDA.
// The formulas are the host ones (residual_mlp.hpp); with a 16-bit param dtype the products
// run in f32 on converted copies and gradients are accumulated into the 16-bit gradients, as
// on the host. cuBLAS runs in its default math mode: no TF32 (f32 products in f32).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/mesh/device_mesh.hpp"
#include "residual_mlp.hpp"

namespace fullshard::apps {

/// The number of CUDA devices visible to this process, or 0 with the reason in `why`
/// (cudaGetDeviceCount's error). Safe before the Runtime (Kokkos) starts.
int cuda_device_count(std::string& why);

class CudaResidualMlp {
 public:
  /// Binds the CUDA forward and backward to `model`, which must be sharded on `mesh`, a CUDA
  /// mesh (InvalidArgument otherwise). `slots`: how many steps' losses and times are kept
  /// on the device between two reads (sse(), step_ms()), >= 1. Creates the cuBLAS handle on
  /// the compute stream.
  CudaResidualMlp(ResidualMlp& model, const DeviceMesh& mesh, int slots);
  ~CudaResidualMlp();
  CudaResidualMlp(const CudaResidualMlp&) = delete;
  CudaResidualMlp& operator=(const CudaResidualMlp&) = delete;

  /// Copies `steps` consecutive batches of `rows` rows (x: steps x rows x inputs, target:
  /// steps x rows x outputs, f32, row-major, host memory) to the device, ordered on the
  /// compute stream after every kernel enqueued before (the host buffers may be reused on
  /// return). Replaces the batches uploaded before.
  void upload(const float* x, const float* target, int rows, int steps);

  /// One forward and backward over uploaded batch `batch` (FSDP's step through the model's
  /// executor); afterwards every parameter's grad() is its shard of the gradient of the
  /// global mean loss (global_rows rows), on the device. This rank's sum of squared errors
  /// goes to device slot `slot` (< slots). Returns without waiting for the device.
  void forward_backward(int batch, std::int64_t global_rows, int slot);

  /// Records the start / the end of step `slot` on the compute stream (CUDA events).
  void mark_start(int slot);
  void mark_end(int slot);
  /// Slots [first, first + n): the sums of squared errors, and the milliseconds between
  /// each slot's marks, read back to the host (waits for the compute stream).
  std::vector<double> sse(int first, int n);
  std::vector<double> step_ms(int first, int n);

  /// Kokkos instance of the compute stream (for tests): blocks until it is idle.
  void fence();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  ResidualMlp* model_ = nullptr;
};

}  // namespace fullshard::apps
