#include "fullshard/session/native_session.hpp"

#include <chrono>
#include <cmath>
#include <set>
#include <utility>

#include "fullshard/base/error.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "lib/kernels/finite_scan.hpp"
#include "lib/session/session_core.hpp"

namespace fullshard::session {

namespace sch = fullshard::schedule;

namespace {

// "input holds nan at [3, 2]" for the first non-finite value of a rows x cols array; "".
std::string non_finite_at(const float* v, std::int64_t rows, std::int64_t cols, const char* what) {
  if (rows <= 0 || cols <= 0 || v == nullptr) return {};
  const std::int64_t i = kernels::first_non_finite(v, rows * cols);
  if (i < 0) return {};
  return std::string(what) + " holds " +
         (std::isnan(v[i]) ? "nan"
          : v[i] > 0       ? "inf"
                           : "-inf") +
         " at [" + std::to_string(i / cols) + ", " + std::to_string(i % cols) + "]";
}

}  // namespace

struct NativeSession::Impl : SessionCore {
  NativeModel& model;
  std::optional<sch::AutoPlan> auto_plan;  // the auto policy's choice

  Impl(const DeviceMesh& m, NativeModel& net, Config c)
      : SessionCore(m, std::move(c), /*native=*/true, net.identity()), model(net) {}
  ~Impl() override { release(); }

  void shard(std::int64_t max_rows);
  /// What is wrong with this rank's arguments ("" when nothing).
  std::string bad_rows(std::int64_t rows, std::int64_t global_rows, const void* x, const void* y,
                       const char* call) const;
  /// Throws InvalidArgument on every rank naming the lowest rank whose `error` is not empty.
  /// Collective (one all-reduce).
  void agree_on_arguments(std::string error);
};

void NativeSession::Impl::shard(std::int64_t max_rows) {
  const std::size_t activations =
      model.activation_bytes(max_rows, cfg.param_dtype.value_or(DType::f32)) +
      std::size_t(std::max<std::int64_t>(max_rows, 0)) *
          std::size_t(model.inputs() + model.outputs()) * sizeof(float);
  sch::PlanOptions o = plan_options_of_config();
  o.fresh_gradients = model.assigns_fresh_gradients() && mesh.device_type() == DeviceType::cpu;
  graph::Module& g = model.root();
  const std::string& policy = cfg.sharding.policy;
  if (policy == "auto") {
    sch::AutoPlanOptions ao;
    ao.base = o;
    ao.memory_budget_bytes = std::size_t(cfg.sharding.memory_budget_mb * 1024.0 * 1024.0);
    ao.state_bytes_per_param_byte = state_arrays(cfg.optimizer);
    ao.keep_requests = false;  // the model's blocks are the baseline
    add_allowed_compressions(ao);
    // The planner plans within what the memory check checks, for the rank that needs the most
    // (the same inputs on every rank: one choice; rank 0 holds the largest row chunks).
    sch::MemoryInputs in = memory_inputs(activations);
    in.rank = 0;
    unsigned long long most[2] = {in.baseline, in.activations};
    control->allreduce(most, 2, MPI_UNSIGNED_LONG_LONG, MPI_MAX,
                       "auto-plan memory inputs (MPI_Iallreduce)");
    in.baseline = std::size_t(most[0]);
    in.activations = std::size_t(most[1]);
    ao.memory_of = [in](const sch::Plan& p) { return sch::plan_memory(p, in).process_peak(); };
    auto_plan.emplace(sch::auto_plan(g, sch::MeshShape::of(mesh), ao));
    sch::apply_auto_plan(g, auto_plan->choice);
    o = auto_plan->options;
  } else {
    request_groups(g, {});  // the model's own requests are its blocks
  }
  const std::string advice = "more ranks shrink the shards, gradients and optimizer state; " +
                             cfg.setting("sharding.reshard_after_forward", "true", "true") +
                             " frees each block after its forward; " +
                             cfg.setting("optimizer.in_backward", "true") +
                             " drops the sharded gradients; " +
                             cfg.setting("memory.check", "\"warn\"", "warn") + " runs it anyway";
  model.shard(mesh, o, [&](const sch::Plan& p) {
    check_memory(p, activations, advice);
    record_plan(p, mesh.device_type() == DeviceType::cpu);
  });
}

std::string NativeSession::Impl::bad_rows(std::int64_t rows, std::int64_t global_rows,
                                          const void* x, const void* y, const char* call) const {
  const bool arrays = rows > 0 && (x == nullptr || y == nullptr);
  if (rows >= 0 && global_rows >= rows && global_rows > 0 && !arrays) return {};
  return std::string(call) + ": rank " + std::to_string(mesh.rank()) + " passed " +
         std::to_string(rows) + " rows of a global batch of " + std::to_string(global_rows) +
         (arrays ? " without its arrays" : "") + " (0 <= rows <= global_rows, global_rows > 0)";
}

void NativeSession::Impl::agree_on_arguments(std::string error) {
  int first = error.empty() ? mesh.size() : mesh.rank();
  control->allreduce(&first, 1, MPI_INT, MPI_MIN, "arguments (MPI_Iallreduce)");
  if (first == mesh.size()) return;
  control->bcast(error, first, "arguments (MPI_Ibcast)");
  throw InvalidArgument(error);
}

NativeSession::NativeSession(const DeviceMesh& mesh, NativeModel& model, Config config,
                             std::int64_t max_rows)
    : impl_(std::make_unique<Impl>(mesh, model, std::move(config))) {
  Impl& s = *impl_;
  attach(s);
  s.shard(max_rows);
  s.start(model.root(), make_graph_optimizer(s.cfg, model.root()));
}

NativeSession::~NativeSession() = default;

double NativeSession::train_step(const float* x, const float* target, std::int64_t rows,
                                 std::int64_t global_rows) {
  Impl& s = *impl_;
  s.check_usable("train_step");
  const auto start = std::chrono::steady_clock::now();
  // A rank whose arguments are wrong takes part with no rows (the step is collective) and the
  // ranks refuse the step together after it, from the step's all-reduce.
  const std::string arg_error = s.bad_rows(rows, global_rows, x, target, "train_step");
  const std::int64_t my_rows = arg_error.empty() ? rows : 0;
  const std::int64_t my_global =
      arg_error.empty() ? global_rows : std::max<std::int64_t>(1, global_rows);
  if (!arg_error.empty()) x = target = nullptr;
  const std::int64_t in = s.model.inputs(), out = s.model.outputs();
  std::string input_problem = non_finite_at(x, my_rows, in, "the input");
  if (input_problem.empty()) input_problem = non_finite_at(target, my_rows, out, "the target");
  if (s.cfg.optimizer.in_backward) {
    // The update runs inside backward: bad arguments and a bad input are found before any
    // (one more all-reduce).
    s.agree_on_arguments(arg_error);
    int worst = input_problem.empty() ? s.mesh.size() : s.mesh.rank();
    s.control->allreduce(&worst, 1, MPI_INT, MPI_MIN, "input check (MPI_Iallreduce)");
    if (worst < s.mesh.size()) {
      s.control->bcast(input_problem, worst, "non-finite input (MPI_Ibcast)");
      return s.non_finite_step("rank " + std::to_string(worst) + ": " + input_problem +
                               " (found before the forward)");
    }
  }
  const double rate = s.lr();
  s.opt->begin_step(rate);
  const double sse = s.model.forward_backward(x, target, my_rows, my_global);
  const auto backward_end = std::chrono::steady_clock::now();
  SessionCore::StepTotals totals;
  // Beside the step's sums: bad arguments, and global_rows and its square (the ranks passed
  // the same one exactly when W * sum(g^2) = sum(g)^2).
  const double g = double(global_rows);
  double extra[3] = {arg_error.empty() ? 0.0 : 1.0, g, g * g};
  const std::string bad = s.check_step(sse, double(my_rows), input_problem, totals, extra, 3);
  const char* applied = s.cfg.optimizer.in_backward
                            ? " (the update inside backward was applied with the wrong scale)"
                            : " (nothing was applied)";
  if (extra[0] > 0) s.agree_on_arguments(arg_error);
  if (double(s.mesh.size()) * extra[2] != extra[1] * extra[1])
    throw InvalidArgument("train_step: the ranks passed different global_rows (their mean " +
                          std::to_string(extra[1] / s.mesh.size()) + ", this rank's " +
                          std::to_string(global_rows) + ")" + applied);
  if (totals.rows != double(global_rows))
    throw InvalidArgument(
        "train_step: the ranks passed " + std::to_string(std::int64_t(totals.rows)) +
        " rows together, but global_rows is " + std::to_string(global_rows) + applied);
  if (!bad.empty()) return s.non_finite_step(bad, s.cfg.optimizer.in_backward);
  s.apply_step(totals);
  const double loss = totals.loss / (double(global_rows) * double(out));
  s.report_step(loss, rate, start, backward_end);
  return loss;
}

double NativeSession::begin_external_step() {
  Impl& s = *impl_;
  s.check_usable("begin_external_step");
  const double rate = s.lr();
  s.opt->begin_step(rate);
  return rate;
}

void NativeSession::finish_external_step() {
  Impl& s = *impl_;
  if (s.cfg.grad_clip > 0) optim::clip_grad_norm(s.graph_params, s.cfg.grad_clip, s.mesh);
  s.opt->step();
  ++s.step;
}

const sch::AutoPlan* NativeSession::auto_plan() const noexcept {
  return impl_->auto_plan ? &*impl_->auto_plan : nullptr;
}

void NativeSession::predict(const float* x, std::int64_t rows, float* out) {
  Impl& s = *impl_;
  s.check_usable("predict");
  s.agree_on_arguments(s.bad_rows(rows, std::max<std::int64_t>(rows, 1), x, out, "predict"));
  s.model.predict(x, rows, out);
}

double NativeSession::evaluate(const float* x, const float* target, std::int64_t rows) {
  Impl& s = *impl_;
  s.check_usable("evaluate");
  s.agree_on_arguments(s.bad_rows(rows, std::max<std::int64_t>(rows, 1), x, target, "evaluate"));
  const std::int64_t O = s.model.outputs();
  std::vector<float> y(std::size_t(rows) * std::size_t(O));
  s.model.predict(x, rows, y.data());
  double sums[2] = {0, double(rows) * double(O)};
  for (std::size_t i = 0; i < y.size(); ++i) {
    const double d = double(y[i]) - double(target[i]);
    sums[0] += d * d;
  }
  s.control->allreduce(sums, 2, MPI_DOUBLE, MPI_SUM, "evaluation loss (MPI_Iallreduce)");
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
}

NativeModel& NativeSession::model() const noexcept {
  return impl_->model;
}
std::int64_t NativeSession::num_params() const noexcept {
  return impl_->model.num_params();
}

}  // namespace fullshard::session
