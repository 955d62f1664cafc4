#include "fullshard/session/session.hpp"

#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <set>
#include <utility>

#include "fullshard/base/bounded_comm.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/checkpoint/directory_claim.hpp"
#include "fullshard/checkpoint/format.hpp"
#include "fullshard/checkpoint/safetensors.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "fullshard/schedule/compute_cost.hpp"
#include "fullshard/schedule/memory_account.hpp"
#include "fullshard/schedule/memory_budget.hpp"
#include "fullshard/schedule/plan.hpp"
#include "fullshard/torch/sharded_model.hpp"
#include "lib/base/json_reader.hpp"
#include "lib/base/message_of.hpp"
#include "lib/mesh/agreement.hpp"
#include "lib/session/batch_agreement.hpp"
#include "lib/session/models.hpp"
#include "lib/session/non_finite_policy.hpp"
#include "lib/session/optimizer.hpp"
#include "lib/session/session_core.hpp"
#include "lib/session/torch_host_bytes.hpp"

namespace fullshard::session {

namespace fst = fullshard::torch;
namespace F = ::torch::nn::functional;
namespace sch = fullshard::schedule;

namespace {

std::string shape_of(const at::Tensor& t) {
  std::string s = "(";
  for (std::int64_t d = 0; d < t.dim(); ++d)
    s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + ")";
}

}  // namespace

struct Session::Impl : SessionCore {
  BuiltModel model;
  std::unique_ptr<fst::ShardedModel> sharded;
  std::int64_t num_params = 0;
  // What the plan was made with (the calibration plans again with measured costs).
  sch::PlanOptions plan_options;
  int steps_here = 0;       // train_step calls of this session (a resumed one counts afresh)
  double optimizer_ms = 0;  // summed over the calibration steps
  const void* last_input = nullptr;
  c10::Device device = c10::Device(c10::kCPU);
  TorchHostBytes* torch_bytes = nullptr;  // LibTorch's host bytes (null: not counted)

  Impl(const DeviceMesh& m, Config c) : SessionCore(m, std::move(c), /*native=*/false) {}
  // The optimizer and a save in flight go before the model they hold.
  ~Impl() override { release(); }

  void shard();
  // The plan is one forward and backward: calibrated where a step is one (no accumulation).
  bool calibrating() const {
    return steps_here >= 1 && steps_here <= cfg.sharding.calibrate_steps &&
           device.type() == c10::kCPU && cfg.accumulation == 1;
  }
  void calibrate();
  void predict_step(const sch::Plan& p);
  // The process's anonymous resident memory where the account's baseline is measured: before
  // sharding (the model built, on the meta device unless built whole).
  std::int64_t anonymous_before = 0;
  /// After a training step: LibTorch's allocations above what it held before the step (its
  /// activations and scratch), and from the second step on the process's anonymous memory at
  /// the step's peak above anonymous_before (the baseline's) beyond the planned parts (the
  /// library's less its shared-memory windows, and the activations): the account's untracked. Each
  /// becomes the largest measured, and the planned process peak with them.
  void note_step_bytes(std::int64_t bytes) {
    planned.activations =
        std::max(planned.activations, std::size_t(std::max<std::int64_t>(bytes, 0)));
    if (steps_here >= 1) {
      const std::size_t windows = sch::own_window_bytes(mesh);
      const std::size_t library = planned.library() > windows ? planned.library() - windows : 0;
      const std::int64_t u = torch_bytes->anonymous_peak() - anonymous_before -
                             std::int64_t(library + planned.activations);
      planned.untracked = std::max(planned.untracked, std::size_t(std::max<std::int64_t>(u, 0)));
    }
    if (plan.process_peak_bytes > 0)
      plan.process_peak_bytes = static_cast<std::int64_t>(planned.process_peak());
  }
  void check_memory_of(const sch::Plan& plan) {
    // LibTorch's activations are not declared to the planner: the check before creation leaves
    // them out; the first training step measures them (note_step_bytes).
    check_memory(plan, 0,
                 "more ranks shrink the shards, gradients and optimizer state; " +
                     cfg.setting("sharding.reshard_after_forward", "true", "true") +
                     " frees each block after its forward; a larger " +
                     cfg.setting("memory.budget_mb", "...") + " where the node has it; " +
                     cfg.setting("memory.check", "\"warn\"", "warn") +
                     " runs it anyway (LibTorch's activations and what no part holds are measured "
                     "by the first steps, not checked here)");
  }
  /// Before a model is built whole on every rank (model.deferred_init false): its parameter
  /// count (from its keys, nothing built) against the rank's memory, so that a model too large
  /// is refused naming its keys before LibTorch allocates it. Collective.
  void check_whole_build(at::ScalarType dtype);
  /// build_model, with a tensor LibTorch cannot allocate named as the model's keys.
  BuiltModel build(const ModelSpec& spec, at::ScalarType dtype) const;
  /// "model.type = gpt, model.d_model = 128, ...": the keys that size the model.
  std::string model_keys() const;
  at::Tensor loss_of(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets);
  /// What the ranks agree on before a step (detail::describe_batch), or "refused (...)" with
  /// `error` set when this rank's batch is not one the model takes.
  enum class Use { train, evaluate, predict };
  std::string batch_of(const std::vector<at::Tensor>& inputs,
                       const std::vector<at::Tensor>& targets, Use use, std::string& error) const;
  /// After a forward that failed part way (a bad target found after it): the groups the
  /// forward left unsharded (the root's) show their shards again, so that the optimizer and
  /// checkpoints see the shards.
  void reshard_after_failure() noexcept {
    try {
      fsdp::FSDPModule& root = sharded->state(*model.root);
      root.reset_iter_state();
      root.set_requires_gradient_sync(true);
    } catch (...) {
    }
  }
};

Session::Session(const DeviceMesh& mesh, Config config)
    : impl_(std::make_unique<Impl>(mesh, std::move(config))) {
  Impl& s = *impl_;
  attach(s);
  if (s.cfg.threads > 0) at::set_num_threads(s.cfg.threads);
  ::torch::manual_seed(s.cfg.seed);  // TorchScript's buffers and deferred_init false
  // LibTorch's allocations counted from here on (an allocator installed later over the
  // counter still passes them to it).
  if (s.mesh.device_type() == DeviceType::cpu) s.torch_bytes = TorchHostBytes::get();
  s.check_whole_build(s.cfg.dtype == DType::f64 ? at::kDouble : at::kFloat);
  // Built on every rank; a rank that cannot (its copy of a file, its memory) is named on every
  // rank instead of leaving the others waiting in the first collective.
  {
    std::string error;
    int kind = 0;  // 1 IoError, 2 ConfigError, 3 another error
    try {
      s.model = s.build(s.cfg.model, s.cfg.dtype == DType::f64 ? at::kDouble : at::kFloat);
    } catch (const IoError& e) {
      error = e.message(), kind = 1;
    } catch (const ConfigError& e) {
      error = e.message(), kind = 2;
    } catch (const std::exception& e) {
      error = fullshard::detail::message_of(e), kind = 3;
    }
    int first = error.empty() ? s.mesh.size() : s.mesh.rank();
    s.control->allreduce(&first, 1, MPI_INT, MPI_MIN, "model build (MPI_Iallreduce)");
    if (first < s.mesh.size()) {
      s.control->bcast(error, first, "model build (MPI_Ibcast)");
      s.control->bcast(&kind, 1, MPI_INT, first, "model build (MPI_Ibcast)");
      const std::string text =
          s.mesh.rank() == first ? error : "rank " + std::to_string(first) + ": " + error;
      if (kind == 1) throw IoError(text);
      if (kind == 2) throw ConfigError(text);
      throw Error(text);
    }
  }
  if (s.mesh.device_type() == DeviceType::cuda) {  // the rank's GPU (the runtime bound it)
    s.device = c10::Device(c10::kCUDA);
    s.model.root->to(s.device);
  }
  s.sharded = std::make_unique<fst::ShardedModel>(s.model.root);
  for (const at::Tensor& p : s.sharded->parameters())
    s.num_params += p.numel();
  s.shard();
  // Each rank fills its own rows, the values those of the whole model from cfg.seed.
  if (s.model.initialize) s.sharded->initialize(s.model.initialize);
#if defined(__GLIBC__)
  // A model built or read whole (a TorchScript file, model.deferred_init false) freed its full
  // parameters group by group while sharding; the heap gives those pages back to the system.
  if (s.cfg.model.type == "torchscript" || !s.cfg.model.deferred_init) malloc_trim(0);
#endif
  s.start(s.sharded->graph(), make_optimizer(s.cfg, *s.sharded));
}

Session::~Session() = default;

void Session::Impl::shard() {
  // The baseline, before the auto-planner (which shards as it plans) or the plan's shards.
  const sch::ProcessMemory before = sch::process_memory();
  baseline_resident = before.resident;
  anonymous_before = std::int64_t(before.anonymous);
  sch::PlanOptions o = plan_options_of_config();
  o.external_gradients = true;
  const sch::MeshShape shape = sch::MeshShape::of(mesh);

  const sch::Plan* p = nullptr;
  std::optional<sch::Plan> explicit_plan;
  std::optional<sch::AutoPlan> auto_plan;
  if (cfg.sharding.policy == "auto") {
    sch::AutoPlanOptions ao;
    ao.base = o;
    ao.memory_budget_bytes = std::size_t(cfg.sharding.memory_budget_mb * 1024.0 * 1024.0);
    ao.state_bytes_per_param_byte = state_arrays(cfg.optimizer);
    add_allowed_compressions(ao);
    // The planner's own measure of its plans; the process peak is checked below.
    auto_plan.emplace(sharded->auto_shard(mesh, ao, model.blocks));
    p = &auto_plan->plan;
    check_memory_of(*p);
  } else {
    graph::Module& g = sharded->graph();
    std::vector<std::string> blocks;
    for (const ::torch::nn::Module* b : model.blocks)
      blocks.push_back(sharded->fqn(*b));
    request_groups(g, blocks);
    explicit_plan.emplace(sch::Scheduler::plan(g, shape, o));
    check_memory_of(*explicit_plan);
    sharded->apply_plan(*explicit_plan, mesh);
    p = &*explicit_plan;
  }
  plan_options = p->options;
  predict_step(*p);
}

void Session::Impl::predict_step(const sch::Plan& p) {
  record_plan(p, device.type() == c10::kCPU);
}

void Session::Impl::calibrate() {
  const fst::MeasuredCompute measured = sharded->measured_compute();
  sharded->measure_compute(false);
  // The ranks' mean: every rank plans the same step (the map's order is the same everywhere).
  std::vector<double> v;
  for (const auto& [fqn, t] : measured.modules) {
    v.push_back(t.forward_ms);
    v.push_back(t.backward_ms);
  }
  v.push_back(optimizer_ms / cfg.sharding.calibrate_steps);
  v.push_back(measured.hooks_ms);
  control->allreduce(v.data(), int(v.size()), MPI_DOUBLE, MPI_SUM,
                     "plan calibration (MPI_Iallreduce)");
  for (double& x : v)
    x /= mesh.size();
  graph::Module& g = sharded->graph();
  std::size_t i = 0;
  for (const auto& entry : measured.modules) {
    graph::Cost& c = g.module(entry.first).cost();
    c.forward_ms = v[i++];
    c.backward_ms = v[i++];
    c.declared = true;
  }
  plan.optimizer_ms = v[i++];
  plan.calibrated_iterations = std::int64_t(measured.iterations);
  // The FSDP work as it ran (the hooks: collectives, copies and the waits for them; on a host
  // whose ranks share cores, waits for peers that were off their core) against the cost
  // model's operations for it: the model's times scaled by the ratio.
  const double hooks_ms = v[i];
  const sch::Plan with_modules = sch::Scheduler::plan(g, sch::MeshShape::of(mesh), plan_options);
  double modelled_ms = 0;
  for (const sch::Op& op : with_modules.ops)
    if (op.kind != sch::OpKind::forward && op.kind != sch::OpKind::backward)
      modelled_ms += op.end_ms - op.start_ms;
  if (hooks_ms > 0 && modelled_ms > 0) {
    plan.communication_scale = hooks_ms / modelled_ms;
    plan_options.cost =
        plan_options.cost.value_or(sch::mesh_defaults(mesh)).scaled(plan.communication_scale);
    predict_step(sch::Scheduler::plan(g, sch::MeshShape::of(mesh), plan_options));
  } else {
    predict_step(with_modules);
  }
}

std::string Session::Impl::model_keys() const {
  std::string keys;
  for (const std::string& l : cfg.canonical)
    if (l.rfind("model.", 0) == 0 && l.rfind("model.deferred_init ", 0) != 0 &&
        l.rfind("model.dropout ", 0) != 0 && l.rfind("model.checkpoint_blocks ", 0) != 0)
      keys += (keys.empty() ? "" : ", ") + l;
  return keys;
}

BuiltModel Session::Impl::build(const ModelSpec& spec, at::ScalarType dtype) const {
  try {
    return build_model(spec, dtype, cfg.source, cfg.seed);
  } catch (const c10::Error& e) {
    // One of the model's tensors does not fit in memory: LibTorch's message names neither the
    // model nor the keys.
    std::string what = e.what_without_backtrace();
    if (what.find("can't allocate memory") == std::string::npos) throw;
    const std::size_t at = what.find("you tried to allocate");
    what = at == std::string::npos ? std::string("a tensor") : what.substr(at + 4);
    what = what.substr(0, what.find('.'));
    throw ConfigError(cfg.source + ": the model (" + model_keys() +
                      ") cannot be built: LibTorch could not allocate memory (" + what +
                      "); choose a smaller model or give it more memory");
  }
}

void Session::Impl::check_whole_build(at::ScalarType dtype) {
  const MemorySpec& m = cfg.memory;
  const std::int64_t params = parameter_count(cfg.model, cfg.source);
  if (cfg.model.deferred_init || params < 0 || m.check == "off" ||
      mesh.device_type() != DeviceType::cpu)
    return;
  const double whole = double(params) * double(at::elementSize(dtype));
  BoundedComm comm(mesh.control_world(), "session.memory", mesh.timeout_s());
  const sch::MemoryBudget budget = sch::rank_memory_budget(
      comm, static_cast<std::size_t>(m.budget_mb * 1024.0 * 1024.0), "memory.budget_mb");
  const double need = whole + double(sch::process_memory().resident);
  // The lowest rank it does not fit, and its budget: the same message on every rank.
  int over = budget.bytes > 0 && need > double(budget.bytes) ? mesh.rank() : mesh.size();
  control->allreduce(&over, 1, MPI_INT, MPI_MIN, "whole-model memory check (MPI_Iallreduce)");
  if (over == mesh.size()) return;
  char where[64];
  std::snprintf(where, sizeof where, "%.2f GiB", double(budget.bytes) / double(1 << 30));
  std::string budget_text = std::string(where) + " (" + budget.source + ")";
  control->bcast(budget_text, over, "whole-model memory check (MPI_Ibcast)");
  char size[64];
  std::snprintf(size, sizeof size, "%.2f GiB", whole / double(1 << 30));
  const std::string message =
      "the model (" + model_keys() + ") has " + std::to_string(params) + " parameters, " + size +
      " in " + at::toString(dtype) +
      ", which every rank builds whole before sharding (\"model\": {\"deferred_init\": "
      "false}), but rank " +
      std::to_string(over) + " may use " + budget_text + "; build only each rank's rows with " +
      cfg.setting("model.deferred_init", "true") +
      ", choose a smaller model, or give it more memory (" +
      cfg.setting("memory.check", "\"warn\"", "warn") + " runs it anyway)";
  if (m.check == "refuse") throw sch::MemoryBudgetExceeded(cfg.source + ": " + message);
  if (mesh.rank() == 0) std::fprintf(stderr, "fullshard: warning: %s\n", message.c_str());
}

at::Tensor Session::Impl::loss_of(const std::vector<at::Tensor>& in,
                                  const std::vector<at::Tensor>& targets) {
  last_input = in.empty() ? nullptr : in[0].data_ptr();
  if (model.own_loss) return model.own_loss(in);
  // Shapes are checked against the outputs after the forward: a shape error leaves this
  // rank's forward unfinished, so it is checked against what the model promises first.
  const std::vector<at::Tensor> out = model.forward(in);
  if (targets.size() != out.size())
    throw InvalidArgument("the model gives " + std::to_string(out.size()) + " output" +
                          (out.size() == 1 ? "" : "s") + " but " + std::to_string(targets.size()) +
                          " targets were given");
  at::Tensor loss;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const at::Tensor& t = targets[i];
    // Mixed precision computes in param_dtype; the loss is taken in the targets' dtype.
    const at::Tensor y = at::isFloatingType(out[i].scalar_type()) &&
                                 at::isFloatingType(t.scalar_type()) &&
                                 out[i].scalar_type() != t.scalar_type()
                             ? out[i].to(t.scalar_type())
                             : out[i];
    at::Tensor l;
    if (cfg.loss == "cross_entropy") {
      if (t.dim() != y.dim() - 1 || t.size(0) != y.size(0))
        throw InvalidArgument("target " + std::to_string(i) + " has shape " + shape_of(t) +
                              "; cross_entropy takes class indices of shape (batch) for output " +
                              shape_of(y));
      l = F::cross_entropy(y, t.to(at::kLong));
    } else {
      if (!t.sizes().equals(y.sizes()))
        throw InvalidArgument("target " + std::to_string(i) + " has shape " + shape_of(t) +
                              " but output " + std::to_string(i) + " has shape " + shape_of(y));
      l = cfg.loss == "mse"  ? F::mse_loss(y, t)
          : cfg.loss == "l1" ? F::l1_loss(y, t)
                             : F::smooth_l1_loss(y, t);
    }
    loss = loss.defined() ? loss + l : l;
  }
  return loss;
}

std::string Session::Impl::batch_of(const std::vector<at::Tensor>& inputs,
                                    const std::vector<at::Tensor>& targets, Use use,
                                    std::string& error) const {
  const bool training = use == Use::train;
  // This rank's checks first (count, dtypes, the shapes the model takes): a refusal joins the
  // agreement as this rank's batch, so that every rank reports it instead of waiting.
  const std::int64_t rows = inputs.empty() ? 0 : inputs.front().size(0);
  try {
    model.check_inputs(inputs);
    for (std::size_t i = 0; i < inputs.size(); ++i)
      if (at::isFloatingType(model.input_dtype) && inputs[i].scalar_type() != model.input_dtype)
        throw InvalidArgument("input " + std::to_string(i) + " is " +
                              at::toString(inputs[i].scalar_type()) + "; the model takes " +
                              at::toString(model.input_dtype) +
                              " (Session::input_dtype(): convert it first)");
    if (use != Use::predict && model.own_loss && !targets.empty())
      throw InvalidArgument("the " + cfg.model.type + " computes its loss (" + cfg.loss +
                            ") from its input; pass no targets, not " +
                            std::to_string(targets.size()));
    if (training && cfg.accumulation > 1 && rows < cfg.accumulation)
      throw InvalidArgument("train_step: the batch has " + std::to_string(rows) +
                            " samples, fewer than \"accumulation\": " +
                            std::to_string(cfg.accumulation) + " micro-batches");
  } catch (const InvalidArgument& e) {
    error = e.message();
    return "refused (" + error + ")";
  }
  std::string d = detail::describe_batch(inputs, targets);
  for (std::size_t i = 0; i < targets.size(); ++i)
    if (targets[i].dim() > 0 && targets[i].size(0) != rows)
      d += " [targets[" + std::to_string(i) + "] has " + std::to_string(targets[i].size(0)) +
           " samples, inputs[0] " + std::to_string(rows) + "]";
  return d;
}

double Session::train_step(const std::vector<at::Tensor>& inputs,
                           const std::vector<at::Tensor>& targets) {
  Impl& s = *impl_;
  s.check_usable("train_step");
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  const std::string batch = s.batch_of(inputs, targets, Impl::Use::train, error);
  std::string bad = error.empty() ? detail::non_finite_in(inputs, "input") : std::string();
  if (bad.empty() && error.empty()) bad = detail::non_finite_in(targets, "target");
  bad = detail::agree_on_batch(*s.control, batch, "train_step", bad);
  if (!error.empty()) throw InvalidArgument(error);
  if (!bad.empty()) return s.non_finite_step(bad + " (found before the forward)");
  const int k = s.cfg.accumulation;
  const std::int64_t rows = inputs.empty() ? 0 : inputs.front().size(0);
  const double rate = s.lr();
  // The calibration steps (after the first, which faults the buffers in) time the modules.
  const bool measuring = s.calibrating();
  if (measuring && s.steps_here == 1) s.sharded->measure_compute(true);
  // What LibTorch allocates in the step (host memory; a CUDA mesh's activations are the
  // device's, outside the host account).
  TorchHostBytes* const torch_bytes = s.torch_bytes;
  const std::int64_t torch_held = torch_bytes ? torch_bytes->now() : 0;
  if (torch_bytes) torch_bytes->reset_peak();
  s.opt->begin_step(rate);
  fsdp::FSDPModule& root = s.sharded->state(*s.model.root);
  // The loss of the step, read back once (on a GPU, one synchronisation per step).
  at::Tensor total;
  auto forward_backward = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& tg,
                              double weight) {
    at::Tensor loss;
    try {
      loss = s.loss_of(in, tg);
    } catch (...) {
      s.reshard_after_failure();
      throw;
    }
    if (weight != 1.0) loss = loss * weight;
    loss.backward();
    total = total.defined() ? total + loss.detach() : loss.detach();
  };
  if (k == 1) forward_backward(inputs, targets, 1.0);
  std::int64_t lo = 0;
  for (int mb = 0; k > 1 && mb < k; ++mb) {
    // Micro-batch mb: sizes differing by at most one (rows / k, the first rows % k one more),
    // its loss weighted by its share of the batch, so that the step is the whole batch's.
    const std::int64_t len = rows / k + (mb < rows % k ? 1 : 0);
    std::vector<at::Tensor> in = inputs, tg = targets;
    for (at::Tensor& t : in)
      t = t.narrow(0, lo, len);
    for (at::Tensor& t : tg)
      if (t.dim() > 0) t = t.narrow(0, lo, len);
    lo += len;
    root.set_requires_gradient_sync(mb == k - 1);
    forward_backward(in, tg, double(len) / double(rows));
  }
  const auto optimizer_start = std::chrono::steady_clock::now();  // the backward's end
  const double loss = total.item<double>();
  SessionCore::StepTotals totals;
  const std::string bad_step = s.check_step(loss, double(rows), {}, totals);
  if (!bad_step.empty()) return s.non_finite_step(bad_step, s.cfg.optimizer.in_backward);
  s.apply_step(totals);
  if (torch_bytes) {
    torch_bytes->sample();  // the step's end (after the optimizer)
    s.note_step_bytes(torch_bytes->peak() - torch_held);
  }
  ++s.steps_here;  // first: a calibration that fails is not tried again at every step
  if (measuring) {
    s.optimizer_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                                optimizer_start)
                          .count();
    if (s.steps_here == 1 + s.cfg.sharding.calibrate_steps) s.calibrate();
  }
  s.report_step(loss, rate, start, optimizer_start);
  return loss;
}

std::vector<at::Tensor> Session::predict(const std::vector<at::Tensor>& inputs) {
  Impl& s = *impl_;
  s.check_usable("predict");
  ::torch::NoGradGuard no_grad;
  std::string error;
  detail::agree_on_batch(*s.control, s.batch_of(inputs, {}, Impl::Use::predict, error), "predict");
  if (!error.empty()) throw InvalidArgument(error);
  s.last_input = inputs.empty() ? nullptr : inputs[0].data_ptr();
  s.model.root->eval();
  std::vector<at::Tensor> out;
  try {
    out = s.model.forward(inputs);
  } catch (...) {
    s.model.root->train();
    throw;
  }
  s.model.root->train();
  return out;
}

double Session::evaluate(const std::vector<at::Tensor>& inputs,
                         const std::vector<at::Tensor>& targets) {
  Impl& s = *impl_;
  s.check_usable("evaluate");
  ::torch::NoGradGuard no_grad;
  std::string error;
  detail::agree_on_batch(*s.control, s.batch_of(inputs, targets, Impl::Use::evaluate, error),
                         "evaluate");
  if (!error.empty()) throw InvalidArgument(error);
  s.model.root->eval();
  double loss = 0;
  try {
    loss = s.loss_of(inputs, targets).item<double>();
  } catch (...) {
    s.reshard_after_failure();
    s.model.root->train();
    throw;
  }
  s.model.root->train();
  return loss;
}

::torch::nn::Module& Session::module() const noexcept {
  return *impl_->model.root;
}
fst::ShardedModel& Session::sharded() const noexcept {
  return *impl_->sharded;
}
at::ScalarType Session::input_dtype() const noexcept {
  return impl_->model.input_dtype;
}
c10::Device Session::device() const noexcept {
  return impl_->device;
}
std::int64_t Session::num_params() const noexcept {
  return impl_->num_params;
}
const void* Session::last_input_data() const noexcept {
  return impl_->last_input;
}

}  // namespace fullshard::session
