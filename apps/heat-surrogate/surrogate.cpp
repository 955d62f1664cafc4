#include "surrogate.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "fullshard/base/error.hpp"
#include "streams.hpp"

namespace fullshard::apps::heat {
namespace {}  // namespace

void Surrogate::sum_in_place(double* v, int n, const char* what) {
  sums_.allreduce(v, n, MPI_DOUBLE, MPI_SUM, what);
}

Surrogate::Surrogate(const Options& o, MPI_Comm train_comm, double timeout_s, HostProgress progress)
    : o_(o),
      comm_(train_comm),
      sums_(train_comm, "heat.train", timeout_s),
      mesh_(train_comm, {[&] {
              int n = 1;
              MPI_Comm_size(train_comm, &n);
              return n;
            }()},
            {"shard"}, timeout_s, progress) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  const int span = 2 * o.radius + 1;
  patch_ = span * span;
  stride_ = patch_ + 2;
  inputs_ = patch_ + 1;
  MlpShape shape;
  shape.inputs = inputs_;
  shape.hidden = o.hidden;
  shape.outputs = 1;
  shape.blocks = o.blocks;
  model_ = std::make_unique<ResidualMlp>(shape, o.seed);
  const std::int64_t max_rows = o.batch / size_ + 1;
  session_ = std::make_unique<session::NativeSession>(mesh_, *model_, session_config(o), max_rows);
  x_.reserve(static_cast<std::size_t>(o.buffer) * inputs_);
  y_.reserve(static_cast<std::size_t>(o.buffer));
}

Surrogate::~Surrogate() = default;

session::Config Surrogate::session_config(const Options& o) {
  session::Config c;
  c.source = "heat-surrogate's options";
  c.model.type = "native";
  c.optimizer.type = "adamw";
  c.optimizer.lr = o.lr;
  c.optimizer.weight_decay = o.weight_decay;
  c.lr_schedule.type = "warmup_cosine";
  c.lr_schedule.warmup_steps = o.warmup_steps();
  c.lr_schedule.total_steps = o.optimizer_steps();
  c.lr_schedule.min_lr = 0.05 * o.lr;
  c.grad_clip = o.clip;
  c.param_dtype = o.plan.defaults.mp_policy.param_dtype;
  c.reduce_dtype = o.plan.defaults.mp_policy.reduce_dtype;
  c.sharding.reshard_after_forward = o.plan.defaults.reshard_after_forward;
  c.sharding.forward_prefetch = o.plan.forward_prefetch_depth;
  c.seed = o.seed;
  c.option_names = {{"sharding.reshard_after_forward", "--reshard"}};
  return c;
}

void Surrogate::fix_scales(const std::vector<float>& records) {
  // Sums over every training rank's first records: [records, sum (p - c)^2 off the centre,
  // sum (u - c)^2, sum c, sum c^2].
  double s[5] = {0, 0, 0, 0, 0};
  const int centre = patch_ / 2;
  const std::size_t n = records.size() / stride_;
  for (std::size_t r = 0; r < n; ++r) {
    const float* rec = records.data() + r * stride_;
    const double c = rec[centre];
    for (int i = 0; i < patch_; ++i)
      if (i != centre) s[1] += (rec[i] - c) * (rec[i] - c);
    s[2] += (rec[patch_ + 1] - c) * (rec[patch_ + 1] - c);
    s[3] += c;
    s[4] += c * c;
  }
  s[0] = static_cast<double>(n);
  sum_in_place(s, 5, "feature scales");
  auto positive = [](double v) { return v > 0 && std::isfinite(v) ? v : 1.0; };
  const double count = std::max(s[0], 1.0);
  s_in_ = positive(std::sqrt(s[1] / (count * (patch_ - 1))));
  s_out_ = positive(std::sqrt(s[2] / count));
  mean_c_ = s[3] / count;
  s_c_ = positive(std::sqrt(std::max(0.0, s[4] / count - mean_c_ * mean_c_)));
  scaled_ = true;
}

void Surrogate::features(const float* rec, float* x) const {
  const int centre = patch_ / 2;
  const double c = rec[centre];
  for (int i = 0; i < patch_; ++i)
    x[i] = static_cast<float>((rec[i] - c) / s_in_);
  x[centre] = static_cast<float>((c - mean_c_) / s_c_);
  x[patch_] = static_cast<float>(rec[patch_] / s_out_);
}

void Surrogate::add(const std::vector<float>& records) {
  if (records.size() % stride_ != 0)
    throw InvalidArgument("heat-surrogate: a record batch of " + std::to_string(records.size()) +
                          " floats is not a multiple of " + std::to_string(stride_));
  if (!scaled_) fix_scales(records);
  const std::size_t n = records.size() / stride_;
  const int capacity = o_.buffer;
  for (std::size_t r = 0; r < n; ++r) {
    const float* rec = records.data() + r * stride_;
    if (size_rows_ < capacity) {
      x_.resize(x_.size() + inputs_);
      y_.push_back(0.0f);
      ++size_rows_;
    }
    const std::size_t row = static_cast<std::size_t>(next_row_);
    features(rec, x_.data() + row * inputs_);
    y_[row] = static_cast<float>((rec[patch_ + 1] - rec[patch_ / 2]) / s_out_);
    next_row_ = (next_row_ + 1) % capacity;
  }
  received_ += static_cast<std::int64_t>(n);
}

void Surrogate::train() {
  // This rank's share of the global minibatch (none while its buffer is empty).
  int rows = o_.batch / size_ + (rank_ < o_.batch % size_ ? 1 : 0);
  if (size_rows_ == 0) rows = 0;
  double global = rows;
  sum_in_place(&global, 1, "minibatch rows");
  if (global <= 0) return;  // no training rank has a sample yet
  const auto global_rows = static_cast<std::int64_t>(global);
  bx_.resize(static_cast<std::size_t>(rows) * inputs_);
  by_.resize(static_cast<std::size_t>(rows));
  for (int s = 0; s < o_.train_steps; ++s, ++step_) {
    for (int i = 0; i < rows; ++i) {
      const double u = uniform01(o_.seed, kStreamBatch + static_cast<std::uint64_t>(rank_),
                                 static_cast<std::uint64_t>(step_) * o_.batch + i);
      const auto row = std::min(static_cast<std::int64_t>(u * size_rows_), size_rows_ - 1);
      std::copy_n(x_.data() + row * inputs_, inputs_,
                  bx_.data() + static_cast<std::size_t>(i) * inputs_);
      by_[i] = y_[static_cast<std::size_t>(row)];
    }
    // The global mean loss; NaN for a step the session skipped (a non-finite value).
    const double loss = session_->train_step(bx_.data(), by_.data(), rows, global_rows);
    if (observer_) observer_(bx_, by_, rows, global_rows, loss);
    if (std::isfinite(loss)) {
      sse_since_ += loss * static_cast<double>(global_rows);
      rows_since_ += global_rows;
    }
    presented_ += global_rows;
  }
}

TrainProgress Surrogate::take_progress() {
  double received = static_cast<double>(received_);
  sum_in_place(&received, 1, "training progress");
  TrainProgress p;
  p.loss = rows_since_ > 0 ? sse_since_ / static_cast<double>(rows_since_) : 0.0;
  p.received = static_cast<std::int64_t>(received);
  p.presented = presented_;
  sse_since_ = 0;
  rows_since_ = 0;
  return p;
}

EvalResult Surrogate::evaluate(const std::vector<float>& records) {
  const int n = static_cast<int>(records.size() / stride_);
  bx_.resize(static_cast<std::size_t>(n) * inputs_);
  out_.resize(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r)
    features(records.data() + static_cast<std::size_t>(r) * stride_,
             bx_.data() + static_cast<std::size_t>(r) * inputs_);
  model_->predict(bx_.data(), n, out_.data());
  double v[3] = {0, 0, static_cast<double>(n)};
  for (int r = 0; r < n; ++r) {
    const float* rec = records.data() + static_cast<std::size_t>(r) * stride_;
    const double c = rec[patch_ / 2], truth = rec[patch_ + 1];
    const double model = c + s_out_ * out_[static_cast<std::size_t>(r)];
    v[0] += (model - truth) * (model - truth);
    v[1] += (c - truth) * (c - truth);
  }
  sum_in_place(v, 3, "held-out errors");
  EvalResult e;
  e.points = static_cast<std::int64_t>(v[2]);
  if (e.points > 0) {
    e.rmse_model = std::sqrt(v[0] / v[2]);
    e.rmse_trivial = std::sqrt(v[1] / v[2]);
  }
  return e;
}

Verdict decide(const EvalResult& last, double first_loss, double last_loss, double pass_ratio) {
  char buf[512];
  Verdict v;
  if (!last.baseline_ok()) {
    std::snprintf(buf, sizeof buf,
                  "verdict: FAIL: the no-change baseline is degenerate (no-change RMSE %.4g, "
                  "surrogate RMSE %.4g over %lld held-out points): the field does not change "
                  "measurably within a round, so no ratio can be judged; use a larger --cfl, "
                  "--interval or --steps",
                  last.rmse_trivial, last.rmse_model, static_cast<long long>(last.points));
  } else if (!(last.ratio() < pass_ratio)) {
    std::snprintf(buf, sizeof buf,
                  "verdict: FAIL: the surrogate does not beat no-change clearly (ratio %.3f, "
                  "needs < %.3g)",
                  last.ratio(), pass_ratio);
  } else if (!(last_loss < first_loss)) {
    std::snprintf(buf, sizeof buf, "verdict: FAIL: the training loss did not fall (%.4g -> %.4g)",
                  first_loss, last_loss);
  } else {
    std::snprintf(buf, sizeof buf,
                  "verdict: PASS: the surrogate beats no-change (ratio %.3f < %.3g)", last.ratio(),
                  pass_ratio);
    v.code = 0;
  }
  v.line = buf;
  return v;
}

}  // namespace fullshard::apps::heat
