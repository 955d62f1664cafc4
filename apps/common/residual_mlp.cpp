#include "residual_mlp.hpp"

#include "cblas_api.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include "fullshard/base/error.hpp"
#include "fullshard/comm/stream.hpp"
#include "fullshard/kernels/shard_copy.hpp"

namespace fullshard::apps {

// ---- Random numbers ---------------------------------------------------------------------------

namespace {

std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

double uniform01(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) noexcept {
  const std::uint64_t h = splitmix64(splitmix64(splitmix64(seed) ^ stream) ^ index);
  return (static_cast<double>(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);  // (0, 1)
}

double normal01(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) noexcept {
  const double u1 = uniform01(seed, stream, 2 * index);
  const double u2 = uniform01(seed, stream, 2 * index + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

double sum_over_mesh(double value, const DeviceMesh& mesh) {
  double v = value;
  mesh.world_comm()
      .all_reduce(&v, &v, 1, DType::f64, comm::ReduceOp::sum,
                  mesh.stream(comm::StreamKind::compute))
      .wait();
  return v;
}

// ---- Model ------------------------------------------------------------------------------------

namespace {

/// f32 view of a parameter or gradient tensor: the tensor itself when it is f32, else a
/// converted copy in `scratch` (mixed precision).
const float* as_f32(const Tensor& t, std::vector<float>& scratch) {
  if (t.dtype() == DType::f32) return t.data_as<const float>();
  scratch.resize(static_cast<std::size_t>(t.numel()));
  kernels::cast_copy(kernels::ExecTarget::host, t.data(), t.dtype(), scratch.data(), DType::f32,
                     t.numel());
  return scratch.data();
}

/// Where a gradient product goes: straight into the f32 gradient (beta = 1 accumulates; a
/// fresh gradient, Parameter::grad_fresh, is assigned: beta = 0), or into f32 scratch that the
/// destructor adds into (or, fresh, writes as) a 16-bit gradient.
class GradTarget {
 public:
  GradTarget(const graph::Parameter& p, std::vector<float>& scratch)
      : grad_(p.grad()), scratch_(scratch), fresh_(p.grad_fresh()) {
    if (grad_.dtype() != DType::f32) scratch_.assign(static_cast<std::size_t>(grad_.numel()), 0.f);
  }
  float* data() const {
    return grad_.dtype() == DType::f32 ? grad_.data_as<float>() : scratch_.data();
  }
  /// The products overwrite data() instead of adding into it.
  bool assign() const { return fresh_ && grad_.dtype() == DType::f32; }
  ~GradTarget() {
    if (grad_.dtype() == DType::f32) return;
    kernels::reduce_copy_out(kernels::ExecTarget::host, scratch_.data(), DType::f32, grad_.data(),
                             grad_.dtype(), grad_.numel(), 1.0, /*accumulate=*/!fresh_);
  }
  GradTarget(const GradTarget&) = delete;
  GradTarget& operator=(const GradTarget&) = delete;

 private:
  Tensor grad_;
  std::vector<float>& scratch_;
  bool fresh_;
};

/// out (rows x n) = in (rows x k) W^T (W: n x k) + b, with b broadcast over the rows.
void linear_forward(const float* in, int rows, int k, const float* w, const float* b, int n,
                    float* out) {
  for (int r = 0; r < rows; ++r)
    std::memcpy(out + static_cast<std::size_t>(r) * n, b, sizeof(float) * n);
  if (rows == 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, n, k, 1.f, in, k, w, k, 1.f, out, n);
}

/// Given dout (rows x n) of out = in W^T + b: dW += dout^T in, db += column sums of dout (=
/// with `gw.assign()`, `gb.assign()`: a fresh gradient), and (when din is not null) din = dout W
/// (+= when accumulate_din).
void linear_backward(const float* in, int rows, int k, const float* w, int n, const float* dout,
                     const GradTarget& gw, const GradTarget& gb, float* din, bool accumulate_din) {
  float* dw = gw.data();
  float* db = gb.data();
  if (gb.assign()) std::fill(db, db + n, 0.f);
  if (rows == 0) {
    if (gw.assign()) std::fill(dw, dw + static_cast<std::size_t>(n) * k, 0.f);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, k, rows, 1.f, dout, n, in, k,
              gw.assign() ? 0.f : 1.f, dw, k);
  for (int r = 0; r < rows; ++r) {
    const float* d = dout + static_cast<std::size_t>(r) * n;
    for (int j = 0; j < n; ++j)
      db[j] += d[j];
  }
  if (din)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, k, n, 1.f, dout, n, w, k,
                accumulate_din ? 1.f : 0.f, din, k);
}

}  // namespace

struct ResidualMlp::Impl {
  MlpShape s;
  std::optional<DeviceMesh> mesh;
  std::optional<schedule::Plan> plan;
  std::unique_ptr<schedule::Executor> executor;

  // The batch of the running step (set by forward_backward / predict).
  const float* x = nullptr;
  const float* target = nullptr;
  float* predict_out = nullptr;
  int rows = 0;
  std::int64_t global_rows = 0;
  bool training = false;
  double sse = 0.0;

  // Activations: h[i] is the input of block i (h[L] the input of the output layer), a[i] the
  // pre-activation of block i. d_h is the running gradient w.r.t. the current h.
  std::vector<std::vector<float>> h, a;
  std::vector<float> y, dy, d_h, d_a;
  // Mixed precision scratch.
  std::vector<float> w_scratch, w2_scratch, b_scratch, b2_scratch, gw_scratch, gb_scratch,
      gw2_scratch, gb2_scratch;

  void resize(int r) {
    const auto H = static_cast<std::size_t>(s.hidden) * static_cast<std::size_t>(r);
    h.resize(static_cast<std::size_t>(s.blocks) + 1);
    a.resize(static_cast<std::size_t>(s.blocks));
    for (auto& v : h)
      v.resize(H);
    for (auto& v : a)
      v.resize(H);
    y.resize(static_cast<std::size_t>(s.outputs) * static_cast<std::size_t>(r));
    dy.resize(y.size());
    d_h.resize(H);
    d_a.resize(H);
  }

  void input_forward(graph::Module& m) {
    const float* w = as_f32(m.param("weight").data(), w_scratch);
    const float* b = as_f32(m.param("bias").data(), b_scratch);
    linear_forward(x, rows, s.inputs, w, b, s.hidden, h[0].data());
  }

  void block_forward(graph::Module& m, std::size_t i) {
    const int H = s.hidden;
    const float* w1 = as_f32(m.param("w1").data(), w_scratch);
    const float* b1 = as_f32(m.param("b1").data(), b_scratch);
    const float* w2 = as_f32(m.param("w2").data(), w2_scratch);
    const float* b2 = as_f32(m.param("b2").data(), b2_scratch);
    float* ai = a[i].data();
    linear_forward(h[i].data(), rows, H, w1, b1, H, ai);
    // h[i+1] = h[i] + b2 + relu(a) W2^T: relu in place into d_a as scratch (backward
    // recomputes it from a).
    std::vector<float>& r = d_a;
    for (std::size_t e = 0; e < static_cast<std::size_t>(rows) * H; ++e)
      r[e] = ai[e] > 0.f ? ai[e] : 0.f;
    float* next = h[i + 1].data();
    std::memcpy(next, h[i].data(), sizeof(float) * static_cast<std::size_t>(rows) * H);
    for (int row = 0; row < rows; ++row)
      for (int j = 0; j < H; ++j)
        next[static_cast<std::size_t>(row) * H + j] += b2[j];
    if (rows > 0)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, H, H, 1.f, r.data(), H, w2, H, 1.f,
                  next, H);
  }

  void output_forward(graph::Module& m) {
    const float* w = as_f32(m.param("weight").data(), w_scratch);
    const float* b = as_f32(m.param("bias").data(), b_scratch);
    float* out = predict_out ? predict_out : y.data();
    linear_forward(h[static_cast<std::size_t>(s.blocks)].data(), rows, s.hidden, w, b, s.outputs,
                   out);
    if (!training) return;
    // Loss and its gradient: d/dy of sum (y - t)^2 / (global_rows * outputs).
    const double scale = 2.0 / (static_cast<double>(global_rows) * s.outputs);
    double sum = 0.0;
    for (std::size_t e = 0; e < static_cast<std::size_t>(rows) * s.outputs; ++e) {
      const double diff = static_cast<double>(out[e]) - target[e];
      sum += diff * diff;
      dy[e] = static_cast<float>(scale * diff);
    }
    sse = sum;
  }

  void output_backward(graph::Module& m) {
    auto& pw = m.param("weight");
    auto& pb = m.param("bias");
    const float* w = as_f32(pw.data(), w_scratch);
    GradTarget gw(pw, gw_scratch), gb(pb, gb_scratch);
    linear_backward(h[static_cast<std::size_t>(s.blocks)].data(), rows, s.hidden, w, s.outputs,
                    dy.data(), gw, gb, d_h.data(), false);
  }

  void block_backward(graph::Module& m, std::size_t i) {
    const int H = s.hidden;
    auto &p1 = m.param("w1"), &q1 = m.param("b1"), &p2 = m.param("w2"), &q2 = m.param("b2");
    const float* w1 = as_f32(p1.data(), w_scratch);
    const float* w2 = as_f32(p2.data(), w2_scratch);
    const std::size_t n = static_cast<std::size_t>(rows) * H;
    const float* ai = a[i].data();
    // relu(a) for dW2 (into d_a, overwritten below by the pre-activation gradient).
    for (std::size_t e = 0; e < n; ++e)
      d_a[e] = ai[e] > 0.f ? ai[e] : 0.f;
    {
      GradTarget g2(p2, gw2_scratch), gb2(q2, gb2_scratch);
      // dW2 += d_h^T relu(a); db2 += colsum d_h.
      linear_backward(d_a.data(), rows, H, w2, H, d_h.data(), g2, gb2, nullptr, false);
    }
    // d_a = (d_h W2) * (a > 0).
    if (rows > 0)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, H, H, 1.f, d_h.data(), H, w2, H,
                  0.f, d_a.data(), H);
    for (std::size_t e = 0; e < n; ++e)
      if (!(ai[e] > 0.f)) d_a[e] = 0.f;
    // dW1 += d_a^T h_i; db1 += colsum d_a; d_h += d_a W1 (the residual path keeps d_h).
    GradTarget g1(p1, gw_scratch), gb1(q1, gb_scratch);
    linear_backward(h[i].data(), rows, H, w1, H, d_a.data(), g1, gb1, d_h.data(), true);
  }

  void input_backward(graph::Module& m) {
    auto& pw = m.param("weight");
    auto& pb = m.param("bias");
    GradTarget gw(pw, gw_scratch), gb(pb, gb_scratch);
    linear_backward(x, rows, s.inputs, nullptr, s.hidden, d_h.data(), gw, gb, nullptr, false);
  }
};

ResidualMlp::ResidualMlp(MlpShape shape, std::uint64_t seed)
    : shape_(shape), root_(graph::Module::make_root("model")), impl_(std::make_unique<Impl>()) {
  if (shape.inputs <= 0 || shape.hidden <= 0 || shape.outputs <= 0 || shape.blocks < 0)
    throw InvalidArgument(
        "ResidualMlp: inputs, hidden and outputs must be > 0 and blocks >= 0 (got " +
        std::to_string(shape.inputs) + ", " + std::to_string(shape.hidden) + ", " +
        std::to_string(shape.outputs) + ", " + std::to_string(shape.blocks) + ")");
  impl_->s = shape;
  Impl* im = impl_.get();
  const std::int64_t H = shape.hidden;
  std::uint64_t stream = 0;
  // torch.nn.Linear's initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)); the second layer of
  // each block is scaled down by sqrt(blocks) so the residual stack starts near identity.
  auto uniform_init = [&](graph::Parameter& p, double bound) {
    const std::uint64_t st = stream++;
    p.init_sharded([=](std::int64_t e) {
      return bound * (2.0 * uniform01(seed, st, static_cast<std::uint64_t>(e)) - 1.0);
    });
  };
  auto& in = root_->add_module("input");
  uniform_init(in.add_param("weight", {H, shape.inputs}), 1.0 / std::sqrt(double(shape.inputs)));
  uniform_init(in.add_param("bias", {H}), 1.0 / std::sqrt(double(shape.inputs)));
  in.on_forward([im](graph::Module& m) { im->input_forward(m); });
  in.on_backward([im](graph::Module& m) { im->input_backward(m); });

  auto& blocks = root_->add_module("blocks");
  const double b = 1.0 / std::sqrt(double(H));
  const double b2 = b / std::sqrt(double(std::max(1, shape.blocks)));
  for (int i = 0; i < shape.blocks; ++i) {
    auto& blk = blocks.add_module(std::to_string(i));
    uniform_init(blk.add_param("w1", {H, H}), b);
    uniform_init(blk.add_param("b1", {H}), b);
    uniform_init(blk.add_param("w2", {H, H}), b2);
    uniform_init(blk.add_param("b2", {H}), b2);
    const auto idx = static_cast<std::size_t>(i);
    blk.on_forward([im, idx](graph::Module& m) { im->block_forward(m, idx); });
    blk.on_backward([im, idx](graph::Module& m) { im->block_backward(m, idx); });
    blk.set_fully_shard_request(true);
  }
  auto& out = root_->add_module("output");
  uniform_init(out.add_param("weight", {shape.outputs, H}), b);
  uniform_init(out.add_param("bias", {shape.outputs}), b);
  out.on_forward([im](graph::Module& m) { im->output_forward(m); });
  out.on_backward([im](graph::Module& m) { im->output_backward(m); });
  root_->set_fully_shard_request(true);
}

ResidualMlp::~ResidualMlp() = default;

void ResidualMlp::materialize() {
  for (graph::Parameter* p : root_->parameters())
    p->materialize();
}

std::vector<std::string> ResidualMlp::identity() const {
  return {"model.native = residual_mlp", "model.inputs = " + std::to_string(shape_.inputs),
          "model.hidden = " + std::to_string(shape_.hidden),
          "model.outputs = " + std::to_string(shape_.outputs),
          "model.blocks = " + std::to_string(shape_.blocks)};
}

std::int64_t ResidualMlp::num_params() const noexcept {
  const std::int64_t I = shape_.inputs, H = shape_.hidden, O = shape_.outputs;
  return H * I + H + shape_.blocks * (2 * H * H + 2 * H) + O * H + O;
}

void ResidualMlp::shard(const DeviceMesh& mesh, const schedule::PlanOptions& options,
                        const std::function<void(const schedule::Plan&)>& before_creation) {
  if (impl_->executor) throw InvalidArgument("ResidualMlp::shard: the model is already sharded");
  if (mesh.ndim() > 2)
    throw InvalidArgument("ResidualMlp::shard: mesh " + mesh.describe() +
                          " must be 1-D (FSDP) or 2-D (HSDP: replicate, shard)");
  const schedule::MeshShape ms = schedule::MeshShape::of(mesh);
  impl_->plan.emplace(schedule::Scheduler::plan(*root_, ms, options));
  if (before_creation) {
    try {
      before_creation(*impl_->plan);
    } catch (...) {
      impl_->plan.reset();
      throw;
    }
  }
  fsdp::apply_fully_shard_requests(*root_, mesh, options.defaults);
  // Full-batch gradients from rank-local gradients already scaled by 1 / global rows: sum.
  for (graph::Module* m : root_->modules_preorder())
    if (auto* st = fsdp::fsdp_state(*m)) st->set_gradient_divide_factor(1.0);
  impl_->mesh.emplace(mesh);
  impl_->executor = std::make_unique<schedule::Executor>(*root_, mesh, *impl_->plan);
}

std::size_t ResidualMlp::activation_bytes(std::int64_t rows, DType param_dtype) const noexcept {
  const std::size_t r = static_cast<std::size_t>(std::max<std::int64_t>(rows, 0));
  const auto H = static_cast<std::size_t>(shape_.hidden),
             I = static_cast<std::size_t>(shape_.inputs),
             O = static_cast<std::size_t>(shape_.outputs),
             L = static_cast<std::size_t>(shape_.blocks);
  // Impl::resize: h (L + 1), a (L), d_h, d_a of H x rows; y, dy of O x rows.
  std::size_t floats = (2 * L + 3) * H * r + 2 * O * r;
  if (param_dtype != DType::f32) {  // f32 copies of the largest weights and their gradients
    const std::size_t w = std::max({H * I, L > 0 ? H * H : 0, O * H});
    const std::size_t w2 = L > 0 ? H * H : 0;
    const std::size_t b = std::max(H, O);
    floats += 2 * (w + w2 + b + (L > 0 ? H : 0));
  }
  return floats * sizeof(float);
}

std::size_t ResidualMlp::activations_held() const noexcept {
  const Impl& im = *impl_;
  std::size_t floats = 0;
  for (const auto& v : im.h)
    floats += v.capacity();
  for (const auto& v : im.a)
    floats += v.capacity();
  for (const std::vector<float>* v :
       {&im.y, &im.dy, &im.d_h, &im.d_a, &im.w_scratch, &im.w2_scratch, &im.b_scratch,
        &im.b2_scratch, &im.gw_scratch, &im.gb_scratch, &im.gw2_scratch, &im.gb2_scratch})
    floats += v->capacity();
  return floats * sizeof(float);
}

const schedule::Plan& ResidualMlp::plan() const {
  if (!impl_->plan) throw InvalidArgument("ResidualMlp::plan: call shard() first");
  return *impl_->plan;
}

schedule::Executor& ResidualMlp::executor() {
  if (!impl_->executor) throw InvalidArgument("ResidualMlp::executor: call shard() first");
  return *impl_->executor;
}

void ResidualMlp::set_batch(const float* x, const float* target, std::int64_t rows,
                            std::int64_t global_rows) {
  if (rows < 0 || global_rows < rows || global_rows <= 0 || rows > std::numeric_limits<int>::max())
    throw InvalidArgument("ResidualMlp::forward_backward: rows " + std::to_string(rows) +
                          " and global rows " + std::to_string(global_rows) +
                          " must satisfy 0 <= rows <= global rows, global rows > 0");
  Impl& im = *impl_;
  im.resize(static_cast<int>(rows));
  im.x = x;
  im.target = target;
  im.rows = static_cast<int>(rows);
  im.global_rows = global_rows;
  im.training = true;
  im.predict_out = nullptr;
  im.sse = 0.0;
}

double ResidualMlp::forward_backward(const float* x, const float* target, std::int64_t rows,
                                     std::int64_t global_rows) {
  set_batch(x, target, rows, global_rows);
  executor().step();
  impl_->training = false;
  return impl_->sse;
}

void ResidualMlp::predict(const float* x, std::int64_t rows, float* out) {
  if (rows < 0 || rows > std::numeric_limits<int>::max())
    throw InvalidArgument("ResidualMlp::predict: rows " + std::to_string(rows) +
                          " must be in [0, 2^31)");
  Impl& im = *impl_;
  im.resize(static_cast<int>(rows));
  im.x = x;
  im.rows = static_cast<int>(rows);
  im.training = false;
  im.predict_out = out;
  executor().forward();
  im.predict_out = nullptr;
  // Evaluation has no backward: reshard every group and clear the iteration's state.
  fsdp::fsdp_state(*root_)->reset_iter_state();
}

}  // namespace fullshard::apps
