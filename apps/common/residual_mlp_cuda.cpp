#include "residual_mlp_cuda.hpp"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstring>

#include "fullshard/base/error.hpp"
#include "fullshard/comm/stream.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/mesh/compute_space.hpp"

namespace fullshard::apps {

int cuda_device_count(std::string& why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e);
    return 0;
  }
  if (n == 0) why = "cudaGetDeviceCount: 0 devices";
  return n;
}

// The kernels: functors (nvcc compiles them for the device; no extended lambdas needed).
namespace detail {

using Exec = Kokkos::Cuda;
using Policy = Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>;
using DView = Kokkos::View<float*, Kokkos::CudaSpace>;

/// out[r, j] = b[j] (rows x n): the bias before a product accumulates onto it.
struct BiasRows {
  float* out;
  const float* b;
  std::int64_t n;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e) const { out[e] = b[e % n]; }
};

/// r = relu(a); next = h + b[j] (the block's residual path and second bias, before the
/// second product accumulates onto next).
struct BlockMid {
  float* r;
  const float* a;
  float* next;
  const float* h;
  const float* b;
  std::int64_t n;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e) const {
    r[e] = a[e] > 0.f ? a[e] : 0.f;
    next[e] = h[e] + b[e % n];
  }
};

struct Relu {
  float* r;
  const float* a;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e) const { r[e] = a[e] > 0.f ? a[e] : 0.f; }
};

/// d = d * (a > 0).
struct ReluMask {
  float* d;
  const float* a;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e) const {
    if (!(a[e] > 0.f)) d[e] = 0.f;
  }
};

/// dy = scale * (y - t); sum += (y - t)^2 in f64 (the host's formula).
struct Loss {
  const float* y;
  const float* t;
  float* dy;
  double scale;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e, double& sum) const {
    const double diff = static_cast<double>(y[e]) - static_cast<double>(t[e]);
    sum += diff * diff;
    dy[e] = static_cast<float>(scale * diff);
  }
};

struct Fill {
  float* p;
  float v;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e) const { p[e] = v; }
};

}  // namespace detail

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(std::string("fullshard-train (CUDA MLP): ") + what +
                " failed: " + cudaGetErrorString(e));
}

const char* cublas_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "a cuBLAS error";
  }
}

void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw Error(std::string("fullshard-train (CUDA MLP): ") + what + " failed: " + cublas_name(s));
}

}  // namespace

struct CudaResidualMlp::Impl {
  MlpShape s;
  DeviceMesh mesh;
  detail::Exec exec;           // Kokkos instance of the compute stream (created once)
  kernels::ExecStream copies;  // the same stream for fullshard's cast kernels (mixed precision)
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  int slots = 1;

  // Uploaded batches, activations (as the host MLP: h[i] input of block i, a[i] its
  // pre-activation, d_h the running gradient), a vector of ones (bias gradients as a gemv).
  detail::DView x, target;
  int rows = 0, batches = 0, batch_capacity = 0;
  std::vector<detail::DView> h, a;
  detail::DView y, dy, d_h, d_a, ones;
  // Mixed precision: f32 copies of 16-bit parameters and f32 gradient products.
  detail::DView w_scratch, w2_scratch, b_scratch, b2_scratch, gw_scratch, gb_scratch, gw2_scratch,
      gb2_scratch;
  Kokkos::View<double*, Kokkos::CudaSpace> sse;
  std::vector<cudaEvent_t> starts, ends;

  // The running step.
  const float* xb = nullptr;
  const float* tb = nullptr;
  std::int64_t global_rows = 0;
  int slot = 0;

  Impl(const MlpShape& shape, const DeviceMesh& m, int n_slots)
      : s(shape),
        mesh(m),
        exec(compute_space<Kokkos::Cuda>(m)),
        copies(kernels::ExecStream::device(m.compute_stream().native_handle())),
        stream(compute_cuda_stream(m)),
        slots(n_slots) {
    check_cublas(cublasCreate(&blas), "cublasCreate");
    try {
      check_cublas(cublasSetStream(blas, stream), "cublasSetStream (the compute stream)");
      // f32 products in f32 (no TF32 tensor-op math), as OpenBLAS on the host.
      check_cublas(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
      sse = Kokkos::View<double*, Kokkos::CudaSpace>(
          Kokkos::view_alloc(exec, std::string("fullshard-train::sse")), slots);
      starts.resize(static_cast<std::size_t>(slots), nullptr);
      ends.resize(static_cast<std::size_t>(slots), nullptr);
      for (int i = 0; i < slots; ++i) {
        check_cuda(cudaEventCreate(&starts[static_cast<std::size_t>(i)]), "cudaEventCreate");
        check_cuda(cudaEventCreate(&ends[static_cast<std::size_t>(i)]), "cudaEventCreate");
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~Impl() { release(); }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  void release() noexcept {
    if (stream) (void)cudaStreamSynchronize(stream);  // nothing may use the buffers after
    for (cudaEvent_t e : starts)
      if (e) (void)cudaEventDestroy(e);
    for (cudaEvent_t e : ends)
      if (e) (void)cudaEventDestroy(e);
    starts.clear();
    ends.clear();
    if (blas) (void)cublasDestroy(blas);
    blas = nullptr;
  }

  detail::DView alloc(const char* label, std::int64_t n) const {
    return detail::DView(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing,
                                            std::string("fullshard-train::") + label),
                         static_cast<std::size_t>(n));
  }

  void fill(float* p, std::int64_t n, float v) const {
    if (n > 0)
      Kokkos::parallel_for("fullshard-train::fill", detail::Policy(exec, 0, n), detail::Fill{p, v});
  }

  void resize(int r) {
    if (r == rows && !h.empty()) return;
    const std::int64_t H = static_cast<std::int64_t>(s.hidden) * r;
    h.clear();
    a.clear();
    for (int i = 0; i <= s.blocks; ++i)
      h.push_back(alloc("h", H));
    for (int i = 0; i < s.blocks; ++i)
      a.push_back(alloc("a", H));
    y = alloc("y", static_cast<std::int64_t>(s.outputs) * r);
    dy = alloc("dy", static_cast<std::int64_t>(s.outputs) * r);
    d_h = alloc("d_h", H);
    d_a = alloc("d_a", H);
    ones = alloc("ones", std::max(r, 1));
    fill(ones.data(), std::max(r, 1), 1.f);
    rows = r;
  }

  // ---- parameters -------------------------------------------------------------------------

  static void check_device(const Tensor& t, const graph::Parameter& p, const char* what) {
    if (t.space() != MemorySpace::device)
      throw InvalidArgument("CudaResidualMlp: the " + std::string(what) + " of parameter '" +
                            p.fqn() + "' is in " + memory_space_name(t.space()) +
                            " memory, expected device memory (is the model sharded on a "
                            "CUDA mesh?)");
  }

  std::int64_t largest_param() const {
    const std::int64_t I = s.inputs, H = s.hidden, O = s.outputs;
    return std::max({H * I, H * H, O * H, H});
  }

  /// f32 device pointer to a parameter's data: the tensor itself, or a converted copy.
  const float* data_f32(const graph::Parameter& p, detail::DView& scratch) {
    const Tensor& t = p.data();
    check_device(t, p, "data");
    if (t.dtype() == DType::f32) return t.data_as<const float>();
    if (scratch.size() == 0) scratch = alloc("param_f32", largest_param());
    kernels::cast_copy(copies, t.data(), t.dtype(), scratch.data(), DType::f32, t.numel());
    return scratch.data();
  }

  /// Where a gradient product goes: the f32 gradient itself (products accumulate, beta 1), or
  /// zeroed f32 scratch that flush_grad adds into a 16-bit gradient.
  float* grad_f32(const graph::Parameter& p, detail::DView& scratch) {
    const Tensor& g = p.grad();
    check_device(g, p, "gradient");
    if (g.dtype() == DType::f32) return g.data_as<float>();
    if (scratch.size() == 0) scratch = alloc("grad_f32", largest_param());
    fill(scratch.data(), g.numel(), 0.f);
    return scratch.data();
  }

  void flush_grad(const graph::Parameter& p, detail::DView& scratch) {
    const Tensor& g = p.grad();
    if (g.dtype() == DType::f32) return;
    kernels::reduce_copy_out(copies, scratch.data(), DType::f32, g.data(), g.dtype(), g.numel(),
                             1.0, /*accumulate=*/true);
  }

  // ---- products (row-major, as the host's cblas calls; cuBLAS is column-major, so each
  // row-major product C = A B is computed as C^T = B^T A^T) --------------------------------

  /// out (rows x n) = in (rows x k) W^T + b.
  void linear_forward(const float* in, int k, const float* w, const float* b, int n, float* out,
                      const char* what) {
    const std::int64_t e = static_cast<std::int64_t>(rows) * n;
    if (e == 0) return;
    Kokkos::parallel_for("fullshard-train::bias", detail::Policy(exec, 0, e),
                         detail::BiasRows{out, b, n});
    const float one = 1.f;
    check_cublas(
        cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &one, w, k, in, k, &one, out, n),
        what);
  }

  /// dW += dout^T in; db += column sums of dout; din = dout W (+= when accumulate_din).
  void linear_backward(const float* in, int k, const float* w, int n, const float* dout, float* dw,
                       float* db, float* din, bool accumulate_din, const char* what) {
    if (rows == 0) return;
    const float one = 1.f, zero = 0.f;
    check_cublas(
        cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_T, k, n, rows, &one, in, k, dout, n, &one, dw, k),
        what);
    check_cublas(
        cublasSgemv(blas, CUBLAS_OP_N, n, rows, &one, dout, n, ones.data(), 1, &one, db, 1), what);
    if (din)
      check_cublas(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, k, rows, n, &one, w, k, dout, n,
                               accumulate_din ? &one : &zero, din, k),
                   what);
  }

  // ---- the modules' callbacks (the host MLP's, on the device) ------------------------------

  void input_forward(graph::Module& m) {
    const float* w = data_f32(m.param("weight"), w_scratch);
    const float* b = data_f32(m.param("bias"), b_scratch);
    linear_forward(xb, s.inputs, w, b, s.hidden, h[0].data(), "cublasSgemm (input forward)");
  }

  void block_forward(graph::Module& m, std::size_t i) {
    const int H = s.hidden;
    const float* w1 = data_f32(m.param("w1"), w_scratch);
    const float* b1 = data_f32(m.param("b1"), b_scratch);
    const float* w2 = data_f32(m.param("w2"), w2_scratch);
    const float* b2 = data_f32(m.param("b2"), b2_scratch);
    float* ai = a[i].data();
    linear_forward(h[i].data(), H, w1, b1, H, ai, "cublasSgemm (block forward, w1)");
    const std::int64_t e = static_cast<std::int64_t>(rows) * H;
    if (e == 0) return;
    // relu(a) into d_a (scratch; backward recomputes it), next = h + b2, next += relu(a) W2^T.
    float* next = h[i + 1].data();
    Kokkos::parallel_for("fullshard-train::block_mid", detail::Policy(exec, 0, e),
                         detail::BlockMid{d_a.data(), ai, next, h[i].data(), b2, H});
    const float one = 1.f;
    check_cublas(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, H, rows, H, &one, w2, H, d_a.data(), H,
                             &one, next, H),
                 "cublasSgemm (block forward, w2)");
  }

  void output_forward(graph::Module& m) {
    const float* w = data_f32(m.param("weight"), w_scratch);
    const float* b = data_f32(m.param("bias"), b_scratch);
    linear_forward(h[static_cast<std::size_t>(s.blocks)].data(), s.hidden, w, b, s.outputs,
                   y.data(), "cublasSgemm (output forward)");
    // Loss and its gradient: d/dy of sum (y - t)^2 / (global_rows * outputs); this rank's
    // sum of squares into its slot, on the device.
    const double scale = 2.0 / (static_cast<double>(global_rows) * s.outputs);
    const std::int64_t e = static_cast<std::int64_t>(rows) * s.outputs;
    auto out = Kokkos::subview(sse, slot);
    if (e == 0) {
      Kokkos::deep_copy(exec, out, 0.0);
      return;
    }
    Kokkos::parallel_reduce("fullshard-train::loss", detail::Policy(exec, 0, e),
                            detail::Loss{y.data(), tb, dy.data(), scale}, out);
  }

  void output_backward(graph::Module& m) {
    auto& pw = m.param("weight");
    auto& pb = m.param("bias");
    const float* w = data_f32(pw, w_scratch);
    float* gw = grad_f32(pw, gw_scratch);
    float* gb = grad_f32(pb, gb_scratch);
    linear_backward(h[static_cast<std::size_t>(s.blocks)].data(), s.hidden, w, s.outputs, dy.data(),
                    gw, gb, d_h.data(), false, "cuBLAS (output backward)");
    flush_grad(pw, gw_scratch);
    flush_grad(pb, gb_scratch);
  }

  void block_backward(graph::Module& m, std::size_t i) {
    const int H = s.hidden;
    auto &p1 = m.param("w1"), &q1 = m.param("b1"), &p2 = m.param("w2"), &q2 = m.param("b2");
    const float* w1 = data_f32(p1, w_scratch);
    const float* w2 = data_f32(p2, w2_scratch);
    const std::int64_t e = static_cast<std::int64_t>(rows) * H;
    const float* ai = a[i].data();
    if (e > 0)
      Kokkos::parallel_for("fullshard-train::relu", detail::Policy(exec, 0, e),
                           detail::Relu{d_a.data(), ai});
    {
      float* g2 = grad_f32(p2, gw2_scratch);
      float* gb2 = grad_f32(q2, gb2_scratch);
      // dW2 += d_h^T relu(a); db2 += colsum d_h.
      linear_backward(d_a.data(), H, w2, H, d_h.data(), g2, gb2, nullptr, false,
                      "cuBLAS (block backward, w2)");
      flush_grad(p2, gw2_scratch);
      flush_grad(q2, gb2_scratch);
    }
    if (e > 0) {
      // d_a = (d_h W2) * (a > 0).
      const float one = 1.f, zero = 0.f;
      check_cublas(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, H, rows, H, &one, w2, H, d_h.data(),
                               H, &zero, d_a.data(), H),
                   "cublasSgemm (block backward, d_h W2)");
      Kokkos::parallel_for("fullshard-train::relu_mask", detail::Policy(exec, 0, e),
                           detail::ReluMask{d_a.data(), ai});
    }
    // dW1 += d_a^T h_i; db1 += colsum d_a; d_h += d_a W1 (the residual path keeps d_h).
    float* g1 = grad_f32(p1, gw_scratch);
    float* gb1 = grad_f32(q1, gb_scratch);
    linear_backward(h[i].data(), H, w1, H, d_a.data(), g1, gb1, d_h.data(), true,
                    "cuBLAS (block backward, w1)");
    flush_grad(p1, gw_scratch);
    flush_grad(q1, gb_scratch);
  }

  void input_backward(graph::Module& m) {
    auto& pw = m.param("weight");
    auto& pb = m.param("bias");
    float* gw = grad_f32(pw, gw_scratch);
    float* gb = grad_f32(pb, gb_scratch);
    linear_backward(xb, s.inputs, nullptr, s.hidden, d_h.data(), gw, gb, nullptr, false,
                    "cuBLAS (input backward)");
    flush_grad(pw, gw_scratch);
    flush_grad(pb, gb_scratch);
  }

  void check_slot(int k, const char* what) const {
    if (k < 0 || k >= slots)
      throw InvalidArgument(std::string("CudaResidualMlp::") + what + ": slot " +
                            std::to_string(k) + " is outside [0, " + std::to_string(slots) + ")");
  }
};

CudaResidualMlp::CudaResidualMlp(ResidualMlp& model, const DeviceMesh& mesh, int slots) {
  if (mesh.device_type() != DeviceType::cuda)
    throw InvalidArgument("CudaResidualMlp: mesh " + mesh.describe() +
                          " is not a CUDA mesh (init_device_mesh(\"cuda\", ...))");
  if (slots < 1)
    throw InvalidArgument("CudaResidualMlp: slots must be >= 1, got " + std::to_string(slots));
  model.executor();  // InvalidArgument unless sharded
  impl_ = std::make_unique<Impl>(model.shape(), mesh, slots);
  Impl* im = impl_.get();
  graph::Module& root = model.root();
  root.on_forward("input", [im](graph::Module& m) { im->input_forward(m); });
  root.on_backward("input", [im](graph::Module& m) { im->input_backward(m); });
  for (int i = 0; i < model.shape().blocks; ++i) {
    const auto idx = static_cast<std::size_t>(i);
    const std::string fqn = "blocks." + std::to_string(i);
    root.on_forward(fqn, [im, idx](graph::Module& m) { im->block_forward(m, idx); });
    root.on_backward(fqn, [im, idx](graph::Module& m) { im->block_backward(m, idx); });
  }
  root.on_forward("output", [im](graph::Module& m) { im->output_forward(m); });
  root.on_backward("output", [im](graph::Module& m) { im->output_backward(m); });
  model_ = &model;
}

CudaResidualMlp::~CudaResidualMlp() = default;

void CudaResidualMlp::upload(const float* x, const float* target, int rows, int steps) {
  Impl& im = *impl_;
  if (rows < 0 || steps < 1)
    throw InvalidArgument("CudaResidualMlp::upload: rows " + std::to_string(rows) + " and steps " +
                          std::to_string(steps) + " must be >= 0 and >= 1");
  if (rows != im.rows || steps > im.batch_capacity) {
    im.x = im.alloc("x", std::max<std::int64_t>(1, std::int64_t{steps} * rows * im.s.inputs));
    im.target =
        im.alloc("target", std::max<std::int64_t>(1, std::int64_t{steps} * rows * im.s.outputs));
    im.batch_capacity = steps;
  }
  im.resize(rows);
  const std::size_t nx = static_cast<std::size_t>(steps) * rows * im.s.inputs;
  const std::size_t nt = static_cast<std::size_t>(steps) * rows * im.s.outputs;
  // From pageable memory: the call returns once the host buffer has been staged.
  if (nx)
    check_cuda(
        cudaMemcpyAsync(im.x.data(), x, nx * sizeof(float), cudaMemcpyHostToDevice, im.stream),
        "cudaMemcpyAsync (inputs to the device)");
  if (nt)
    check_cuda(cudaMemcpyAsync(im.target.data(), target, nt * sizeof(float), cudaMemcpyHostToDevice,
                               im.stream),
               "cudaMemcpyAsync (targets to the device)");
  im.batches = steps;
}

void CudaResidualMlp::forward_backward(int batch, std::int64_t global_rows, int slot) {
  Impl& im = *impl_;
  if (batch < 0 || batch >= im.batches)
    throw InvalidArgument("CudaResidualMlp::forward_backward: batch " + std::to_string(batch) +
                          " was not uploaded (" + std::to_string(im.batches) + " batches)");
  im.check_slot(slot, "forward_backward");
  if (global_rows < im.rows || global_rows <= 0)
    throw InvalidArgument("CudaResidualMlp::forward_backward: global rows " +
                          std::to_string(global_rows) + " must be > 0 and >= the " +
                          std::to_string(im.rows) + " local rows");
  im.xb = im.x.data() + static_cast<std::size_t>(batch) * im.rows * im.s.inputs;
  im.tb = im.target.data() + static_cast<std::size_t>(batch) * im.rows * im.s.outputs;
  im.global_rows = global_rows;
  im.slot = slot;
  model_->executor().step();
}

void CudaResidualMlp::mark_start(int slot) {
  impl_->check_slot(slot, "mark_start");
  check_cuda(cudaEventRecord(impl_->starts[static_cast<std::size_t>(slot)], impl_->stream),
             "cudaEventRecord (step start)");
}

void CudaResidualMlp::mark_end(int slot) {
  impl_->check_slot(slot, "mark_end");
  check_cuda(cudaEventRecord(impl_->ends[static_cast<std::size_t>(slot)], impl_->stream),
             "cudaEventRecord (step end)");
}

std::vector<double> CudaResidualMlp::sse(int first, int n) {
  Impl& im = *impl_;
  auto host = Kokkos::create_mirror_view(Kokkos::HostSpace(), im.sse);
  Kokkos::deep_copy(im.exec, host, im.sse);
  im.exec.fence("fullshard-train: the step losses");
  std::vector<double> out;
  for (int k = 0; k < n; ++k)
    out.push_back(host((first + k) % im.slots));
  return out;
}

std::vector<double> CudaResidualMlp::step_ms(int first, int n) {
  Impl& im = *impl_;
  std::vector<double> out;
  for (int k = 0; k < n; ++k) {
    const auto i = static_cast<std::size_t>((first + k) % im.slots);
    check_cuda(cudaEventSynchronize(im.ends[i]), "cudaEventSynchronize (step end)");
    float ms = 0.f;
    check_cuda(cudaEventElapsedTime(&ms, im.starts[i], im.ends[i]), "cudaEventElapsedTime");
    out.push_back(ms);
  }
  return out;
}

void CudaResidualMlp::fence() {
  impl_->exec.fence("CudaResidualMlp::fence");
}

}  // namespace fullshard::apps
