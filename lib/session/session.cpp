#include "fullshard/session/session.hpp"

#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>
#include <utility>

#include "fullshard/base/bounded_comm.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/base/json_reader.hpp"
#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/checkpoint/directory_claim.hpp"
#include "fullshard/checkpoint/format.hpp"
#include "fullshard/checkpoint/safetensors.hpp"
#include "fullshard/mesh/agreement.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "fullshard/schedule/compute_cost.hpp"
#include "fullshard/schedule/memory_account.hpp"
#include "fullshard/schedule/memory_budget.hpp"
#include "fullshard/schedule/plan.hpp"
#include "fullshard/session/non_finite_policy.hpp"
#include "fullshard/torch/sharded_model.hpp"
#include "lib/session/batch_agreement.hpp"
#include "lib/session/models.hpp"
#include "lib/session/optimizer.hpp"

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

// The lines of a configuration a checkpoint must have been saved with to load into this
// session: the model's shape (not how it was initialised or where its file was) and dtype,
// and the optimizer's type (its state is of that kind).
std::vector<std::string> identity_lines(const std::vector<std::string>& canonical) {
  std::vector<std::string> out;
  for (const std::string& l : canonical) {
    const bool model = l.rfind("model.", 0) == 0 && l.rfind("model.file ", 0) != 0 &&
                       l.rfind("model.deferred_init ", 0) != 0 &&
                       l.rfind("model.checkpoint_blocks ", 0) != 0 &&
                       l.rfind("model.dropout ", 0) != 0;
    if (model || l.rfind("dtype ", 0) == 0 || l.rfind("optimizer.type ", 0) == 0) out.push_back(l);
  }
  return out;
}

// Optimizer state arrays per parameter element (SGD 0 or 1, AdamW 2).
int state_arrays(const OptimizerSpec& o) {
  return o.type == "adamw" ? 2 : (o.momentum > 0 ? 1 : 0);
}

}  // namespace

Config read_config(const DeviceMesh& mesh, const std::string& path) {
  std::string text, error;
  try {
    text = fullshard::detail::read_text_file(path, "configuration");
  } catch (const Error& e) {
    error = e.message();
  }
  return parse_config(mesh, text, path, error);
}

Config parse_config(const DeviceMesh& mesh, const std::string& text, const std::string& source,
                    std::string read_error) {
  std::optional<Config> c;
  if (read_error.empty()) {
    try {
      c = parse_config(text, source);
    } catch (const ConfigError& e) {
      read_error = e.message();
    }
  }
  std::vector<std::string> items = {read_error.empty() ? std::string("configuration read")
                                                       : "configuration refused: " + read_error};
  if (c) items.insert(items.end(), c->canonical.begin(), c->canonical.end());
  agree_across_ranks(mesh, items, "the configuration " + source);
  if (!c) throw ConfigError(read_error);
  return std::move(*c);
}

struct Session::Impl {
  Config cfg;
  DeviceMesh mesh;
  std::unique_ptr<BoundedComm> control;  // the session's agreements (batch, checkpoints)
  // This run's hold on cfg.checkpoint.dir; released last (after a save in flight).
  std::unique_ptr<checkpoint::DirectoryClaim> claim;
  BuiltModel model;
  std::unique_ptr<fst::ShardedModel> sharded;
  std::unique_ptr<SessionOptimizer> opt;
  std::optional<optim::WarmupCosine> schedule;
  std::vector<graph::Parameter*> graph_params;
  std::int64_t step = 0;
  std::int64_t num_params = 0;
  PlanPrediction plan;
  // What the plan was made with (the calibration plans again with measured costs).
  sch::PlanOptions plan_options;
  int steps_here = 0;  // train_step calls of this session (a resumed one counts afresh)
  std::optional<NonFinitePolicy> non_finite;  // cfg.non_finite
  double optimizer_ms = 0;                    // summed over the calibration steps
  const void* last_input = nullptr;
  c10::Device device = c10::Device(c10::kCPU);
  Progress progress;
  nlohmann::json identity;  // identity_lines, kept in every checkpoint's metadata
  checkpoint::AsyncSave pending;
  bool in_flight = false;
  std::string pending_dir;
  // Set when a load or import was refused after it had replaced the parameters (a non-finite
  // value found in them): what was refused; the same on every rank.
  std::string refused_values;

  Impl(const DeviceMesh& m, Config c) : cfg(std::move(c)), mesh(m) {}

  void shard();
  // The plan is one forward and backward: calibrated where a step is one (no accumulation).
  bool calibrating() const {
    return steps_here >= 1 && steps_here <= cfg.sharding.calibrate_steps &&
           device.type() == c10::kCPU && cfg.accumulation == 1;
  }
  void calibrate();
  void predict_step(const sch::Plan& p);
  void check_memory(const sch::Plan& plan);
  /// Before a model is built whole on every rank (model.deferred_init false): its parameter
  /// count (from its keys, nothing built) against the rank's memory, so that a model too large
  /// is refused naming its keys before LibTorch allocates it. Collective.
  void check_whole_build(at::ScalarType dtype);
  /// build_model, with a tensor LibTorch cannot allocate named as the model's keys.
  BuiltModel build(const ModelSpec& spec, at::ScalarType dtype) const;
  /// "model.type = gpt, model.d_model = 128, ...": the keys that size the model.
  std::string model_keys() const;
  /// A step found holding a non-finite value (`what`, agreed by every rank): counted, and
  /// skipped (returns NaN) or, by the policy, an InvalidArgument on every rank.
  double non_finite_step(const std::string& what, bool applied = false);
  /// Refuses parameters holding a non-finite value (`when`: "initial", "imported", ...):
  /// InvalidArgument on every rank naming the lowest rank's first such parameter. Collective.
  void check_parameters_finite(const std::string& when);
  /// InvalidArgument naming `call` while the parameters hold refused values (refused_values):
  /// nothing trains, predicts or saves them until a load or an import succeeds.
  void check_usable(const char* call) const {
    if (!refused_values.empty())
      throw InvalidArgument(std::string(call) + ": the parameters hold the values of " +
                            refused_values +
                            ", which were refused; load a checkpoint or import weights that "
                            "hold finite values first (or create the session again)");
  }
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
  std::string dir_or_configured(const std::string& dir, const char* call) const;
  checkpoint::SaveOptions save_options(const std::string& dir) const;
  nlohmann::json metadata() const { return {{"session", identity}}; }
  void check_identity(const std::string& dir);
  void committed(const std::string& step_dir, std::int64_t step, bool async) {
    if (progress.on_save) progress.on_save(SaveMetrics{step, step_dir, async});
  }
};

Session::Session(const DeviceMesh& mesh, Config config)
    : impl_(std::make_unique<Impl>(mesh, std::move(config))) {
  Impl& s = *impl_;
  // A configuration built in C++ is checked as a file is, and the ranks agree on it.
  std::string error;
  std::vector<std::string> lines;
  try {
    lines = canonical_lines(s.cfg);
  } catch (const ConfigError& e) {
    error = e.message();
  }
  std::vector<std::string> items = {error.empty() ? "configuration valid"
                                                  : "configuration refused: " + error};
  items.insert(items.end(), lines.begin(), lines.end());
  const std::string source = s.cfg.source.empty() ? "<session configuration>" : s.cfg.source;
  agree_across_ranks(s.mesh, items, "the configuration " + source);
  if (!error.empty()) throw ConfigError(error);
  s.cfg.canonical = lines;
  s.identity = identity_lines(lines);
  s.non_finite.emplace(
      s.cfg.non_finite, "\"non_finite\": {\"policy\": \"stop\"}",
      "\"non_finite\": {\"max_skipped\": " + std::to_string(s.cfg.non_finite.max_skipped) + "}");
  s.control = BoundedComm::duplicate(s.mesh.control_world(), "session", s.mesh.timeout_s());

  // Before anything is built: a bad checkpoint directory must not cost a whole job.
  if (!s.cfg.checkpoint.dir.empty()) {
    checkpoint::check_directory(s.cfg.checkpoint.dir, s.mesh);
    checkpoint::ClaimOptions co;
    co.resume = s.cfg.checkpoint.resume;
    co.start_over = s.cfg.checkpoint.start_over;
    co.resume_hint = "\"checkpoint\": {\"resume\": true} (fullshard-train-gpt: --resume)";
    co.start_over_hint =
        "\"checkpoint\": {\"start_over\": true} (fullshard-train-gpt: --start-over)";
    s.claim = std::make_unique<checkpoint::DirectoryClaim>(s.cfg.checkpoint.dir, s.mesh, co);
  }

  if (s.cfg.threads > 0) at::set_num_threads(s.cfg.threads);
  ::torch::manual_seed(s.cfg.seed);  // TorchScript's buffers and deferred_init false
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
  s.graph_params = s.sharded->graph().parameters();
  s.check_parameters_finite("initial");
  s.opt = make_optimizer(s.cfg, *s.sharded);
  if (s.cfg.lr_schedule.type == "warmup_cosine")
    s.schedule.emplace(s.cfg.optimizer.lr, s.cfg.lr_schedule.warmup_steps,
                       s.cfg.lr_schedule.total_steps, s.cfg.lr_schedule.min_lr);

  if (s.cfg.checkpoint.resume) {
    // Resumed when the directory holds a checkpoint (rank 0 looks; every rank follows).
    int found = 0;
    if (s.mesh.rank() == 0)
      found = std::filesystem::exists(std::filesystem::path(s.cfg.checkpoint.dir) / "latest");
    s.control->bcast(&found, 1, MPI_INT, 0, "resume (MPI_Ibcast)");
    if (found) load();
  }
}

Session::~Session() = default;

void Session::Impl::shard() {
  sch::PlanOptions o;
  o.external_gradients = true;
  // The plan has each group's update inside its reduction (its state arrays in the account).
  if (cfg.optimizer.in_backward) o.optimizer_in_backward_states = state_arrays(cfg.optimizer);
  o.forward_prefetch_depth = cfg.sharding.forward_prefetch;
  o.defaults.reshard_after_forward = cfg.sharding.reshard_after_forward;
  o.defaults.mp_policy.param_dtype = cfg.param_dtype;
  o.defaults.mp_policy.reduce_dtype = cfg.reduce_dtype;
  o.defaults.compression = cfg.sharding.compression;
  const sch::MeshShape shape = sch::MeshShape::of(mesh);
  // The collectives as this mesh runs them (shared memory where the ranks share a node).
  o.cost = sch::mesh_defaults(mesh);

  const sch::Plan* p = nullptr;
  std::optional<sch::Plan> explicit_plan;
  std::optional<sch::AutoPlan> auto_plan;
  if (cfg.sharding.policy == "auto") {
    sch::AutoPlanOptions ao;
    ao.base = o;
    ao.memory_budget_bytes = std::size_t(cfg.sharding.memory_budget_mb * 1024.0 * 1024.0);
    ao.state_bytes_per_param_byte = state_arrays(cfg.optimizer);
    // The planner's own measure of its plans; the process peak is checked below.
    auto_plan.emplace(sharded->auto_shard(mesh, ao, model.blocks));
    p = &auto_plan->plan;
    check_memory(*p);
  } else {
    graph::Module& g = sharded->graph();
    // List groups: each list's first module asks for the group with the others; a module of a
    // list is not a group of its own.
    std::set<std::string> listed;
    for (const auto& group : cfg.sharding.groups)
      for (const std::string& name : group) {
        sharded->module(name);  // InvalidArgument naming a module the model does not have
        listed.insert(name);
      }
    if (cfg.sharding.policy == "blocks")
      for (const ::torch::nn::Module* b : model.blocks) {
        const std::string& name = sharded->fqn(*b);
        if (!listed.count(name)) g.module(name).set_fully_shard_request(true);
      }
    for (const auto& group : cfg.sharding.groups) {
      graph::ShardRequest r;
      r.group_with.assign(group.begin() + 1, group.end());
      g.module(group.front()).set_fully_shard_request(r);
    }
    g.set_fully_shard_request(true);
    explicit_plan.emplace(sch::Scheduler::plan(g, shape, o));
    check_memory(*explicit_plan);
    sharded->apply_plan(*explicit_plan, mesh);
    p = &*explicit_plan;
  }
  plan_options = p->options;
  predict_step(*p);
  plan.peak_bytes = std::int64_t(p->peak_bytes);
  plan.sharded_bytes = std::int64_t(p->sharded_bytes);
  plan.groups = std::int64_t(p->groups.size());
}

void Session::Impl::predict_step(const sch::Plan& p) {
  // A host mesh runs its collectives inline: the ops one after the other, not overlapped.
  plan.step_ms =
      (device.type() == c10::kCPU ? sch::serial_step_ms(p) : p.step_ms) + plan.optimizer_ms;
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

void Session::Impl::check_memory(const sch::Plan& p) {
  const MemorySpec& m = cfg.memory;
  // The account is of host memory; a CUDA mesh's parameters live on the device.
  if (mesh.device_type() != DeviceType::cpu) return;
  sch::MemoryInputs in;
  in.optimizer_states = state_arrays(cfg.optimizer);
  const std::string shard_dim = mesh.names().back();
  in.shared_memory = mesh.shm(shard_dim) != nullptr;
  if (const NodeSplit* split = mesh.node_split(shard_dim)) in.nodes = split->nodes();
  in.rank = mesh.coordinate(shard_dim);
  // LibTorch's activations are not declared to the planner: the account leaves them out.
  in.baseline = sch::process_memory().resident;
  const sch::MemoryAccount planned = sch::plan_memory(p, in);
  plan.process_peak_bytes = static_cast<std::int64_t>(planned.process_peak());
  if (m.check == "off") return;
  BoundedComm comm(mesh.control_world(), "session.memory", mesh.timeout_s());
  const sch::MemoryBudget budget = sch::rank_memory_budget(
      comm, static_cast<std::size_t>(m.budget_mb * 1024.0 * 1024.0), "memory.budget_mb");
  sch::check_memory_budget(
      comm, planned, budget, m.check == "warn" ? sch::MemoryCheck::warn : sch::MemoryCheck::refuse,
      "more ranks shrink the shards, gradients and optimizer state; \"sharding\": "
      "{\"reshard_after_forward\": true} frees each block after its forward; a larger "
      "\"memory\": {\"budget_mb\"} where the node has it; \"memory\": {\"check\": "
      "\"warn\"} runs it anyway (LibTorch's activations are not in the account)");
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
      std::to_string(over) + " may use " + budget_text +
      "; build only each rank's rows with \"model\": {\"deferred_init\": true} "
      "(fullshard-train-gpt: --deferred-init), choose a smaller model, or give it more memory "
      "(\"memory\": {\"check\": \"warn\"} runs it anyway)";
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
  const double rate = lr();
  // The calibration steps (after the first, which faults the buffers in) time the modules.
  const bool measuring = s.calibrating();
  if (measuring && s.steps_here == 1) s.sharded->measure_compute(true);
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
  const auto optimizer_start = std::chrono::steady_clock::now();
  // Non-finite values never reach the parameters: this rank's loss and gradients (inside
  // backward, already applied: the parameters) are checked with one all-reduce per step, the
  // gradient norm's when clipping. Only a bad step pays a second, to name the rank.
  const double loss = total.item<double>();
  const bool loss_ok = std::isfinite(loss);
  bool grads_ok = true, norm_bad = false;
  double norm = 0;
  if (s.cfg.grad_clip > 0) {
    // The sums of squares of the shard dim's first replica (under HSDP the others hold copies)
    // beside the count of ranks whose loss or gradients are not finite.
    const double local = optim::local_sum_squares(s.graph_params, s.mesh);
    grads_ok = std::isfinite(local);
    double sums[2] = {s.mesh.rank() < s.mesh.size(s.mesh.names().back()) ? local : 0.0,
                      loss_ok && grads_ok ? 0.0 : 1.0};
    s.control->allreduce(sums, 2, MPI_DOUBLE, MPI_SUM,
                         "gradient norm and non-finite check (MPI_Iallreduce)");
    norm = std::sqrt(sums[0]);
    norm_bad = !std::isfinite(norm) || sums[1] > 0;
  } else {
    grads_ok = optim::local_all_finite(
        s.graph_params, s.mesh,
        s.cfg.optimizer.in_backward ? optim::Values::parameters : optim::Values::gradients);
  }
  // The lowest rank with a bad value, its loss before its gradients: 2 rank + (0 loss, 1 grads).
  const int none = 2 * s.mesh.size();
  int worst = !loss_ok ? 2 * s.mesh.rank() : !grads_ok ? 2 * s.mesh.rank() + 1 : none;
  if (s.cfg.grad_clip == 0 || norm_bad)
    s.control->allreduce(&worst, 1, MPI_INT, MPI_MIN, "non-finite check (MPI_Iallreduce)");
  if (worst < none || norm_bad) {
    const std::string what =
        worst == none
            ? std::string("the gradients' norm is not finite")
            : "rank " + std::to_string(worst / 2) + ": " +
                  (worst % 2 == 0 ? std::string("the loss is not finite")
                   : s.cfg.optimizer.in_backward
                       ? "the parameters hold a non-finite value after the update inside backward"
                   : s.cfg.grad_clip > 0
                       ? "the gradients hold a non-finite value (or their sum of squares "
                         "overflows)"
                       : "the gradients hold a non-finite value");
    return s.non_finite_step(what, s.cfg.optimizer.in_backward);
  }
  if (s.cfg.grad_clip > 0) optim::scale_to_max_norm(s.graph_params, norm, s.cfg.grad_clip, s.mesh);
  s.opt->step();
  ++s.step;
  ++s.steps_here;  // first: a calibration that fails is not tried again at every step
  if (measuring) {
    s.optimizer_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                                optimizer_start)
                          .count();
    if (s.steps_here == 1 + s.cfg.sharding.calibrate_steps) s.calibrate();
  }
  if (s.progress.on_step) {
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    s.progress.on_step(StepMetrics{s.step, loss, rate, secs});
  }
  return loss;
}

double Session::Impl::non_finite_step(const std::string& what, bool applied) {
  return non_finite->bad_step(step + 1, what, applied, mesh.rank());
}

void Session::Impl::check_parameters_finite(const std::string& when) {
  std::string first;
  for (graph::Parameter* p : graph_params)
    if (!optim::local_all_finite({p}, mesh, optim::Values::parameters)) {
      first = p->fqn();
      break;
    }
  int worst = first.empty() ? mesh.size() : mesh.rank();
  control->allreduce(&worst, 1, MPI_INT, MPI_MIN, "non-finite parameters (MPI_Iallreduce)");
  if (worst == mesh.size()) return;
  control->bcast(first, worst, "non-finite parameters (MPI_Ibcast)");
  throw InvalidArgument("the " + when + " parameters hold a non-finite value: '" + first +
                        "' (in rank " + std::to_string(worst) +
                        "'s shard); refused before any step uses them");
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

std::string Session::Impl::dir_or_configured(const std::string& dir, const char* call) const {
  if (!dir.empty()) return dir;
  if (cfg.checkpoint.dir.empty())
    throw InvalidArgument(std::string(call) +
                          ": no directory given and the configuration has no "
                          "\"checkpoint\": {\"dir\"}");
  return cfg.checkpoint.dir;
}

checkpoint::SaveOptions Session::Impl::save_options(const std::string& dir) const {
  checkpoint::SaveOptions o;
  o.keep_last = cfg.checkpoint.keep_last;
  // The configured directory is this run's: its saves carry the run and its retention spares
  // other runs' checkpoints.
  if (claim && dir == cfg.checkpoint.dir) claim->apply(o);
  return o;
}

std::string Session::save(const std::string& dir) {
  Impl& s = *impl_;
  s.check_usable("save");
  const std::string d = s.dir_or_configured(dir, "save");
  if (s.in_flight) wait_save();
  const std::string step_dir = s.opt->save(d, s.step, s.save_options(d), s.metadata());
  s.committed(step_dir, s.step, false);
  return step_dir;
}

void Session::save_async(const std::string& dir) {
  Impl& s = *impl_;
  s.check_usable("save_async");
  const std::string d = s.dir_or_configured(dir, "save_async");
  if (s.in_flight)
    throw InvalidArgument("save_async: the save of step " + std::to_string(s.pending.step()) +
                          " into '" + s.pending_dir +
                          "' is still in flight; wait for it (wait_save) or poll it (poll_save) "
                          "before starting another");
  s.pending = s.opt->save_async(d, s.step, s.save_options(d), s.metadata());
  s.in_flight = true;
  s.pending_dir = d;
}

bool Session::save_in_flight() const noexcept {
  return impl_->in_flight;
}

bool Session::poll_save() {
  Impl& s = *impl_;
  if (!s.in_flight) return true;
  bool done = false;
  try {
    done = s.pending.test();
  } catch (...) {
    s.in_flight = false;
    throw;
  }
  if (!done) return false;
  s.in_flight = false;
  // test() committed it: its step directory is the one wait() names (no communication now).
  s.committed(s.pending.wait(), s.pending.step(), true);
  return true;
}

std::string Session::wait_save() {
  Impl& s = *impl_;
  if (!s.in_flight)
    throw InvalidArgument(
        "wait_save: no checkpoint save is in flight (it was committed by an earlier "
        "poll_save or wait_save, or none was started)");
  std::string step_dir;
  try {
    step_dir = s.pending.wait();
  } catch (...) {
    s.in_flight = false;
    throw;
  }
  s.in_flight = false;
  s.committed(step_dir, s.pending.step(), true);
  return step_dir;
}

void Session::Impl::check_identity(const std::string& dir) {
  // Rank 0 reads the index's metadata; every rank compares it with its own identity.
  std::string text;
  if (mesh.rank() == 0) {
    try {
      const std::string step_dir = checkpoint::resolve_step_dir(dir);
      const checkpoint::Index index =
          checkpoint::parse_index(checkpoint::read_index_text(step_dir), step_dir);
      if (index.metadata.contains("session"))
        text = step_dir + "\n" + index.metadata["session"].dump();
    } catch (const std::exception&) {
      // No readable checkpoint: the load reports it.
    }
  }
  control->bcast(text, 0, "checkpoint identity (MPI_Ibcast)");
  if (text.empty()) return;  // saved by other code: the load checks the tensors
  const std::string step_dir = text.substr(0, text.find('\n'));
  const nlohmann::json saved = nlohmann::json::parse(text.substr(text.find('\n') + 1));
  std::vector<std::string> theirs;
  if (saved.is_array())
    for (const auto& l : saved)
      if (l.is_string()) theirs.push_back(l.get<std::string>());
  const std::vector<std::string> ours = identity.get<std::vector<std::string>>();
  auto key_of = [](const std::string& l) { return l.substr(0, l.find(" = ")); };
  for (std::size_t i = 0; i < std::max(ours.size(), theirs.size()); ++i) {
    const std::string a = i < theirs.size() ? theirs[i] : "(none)";
    const std::string b = i < ours.size() ? ours[i] : "(none)";
    if (a == b) continue;
    const std::string key = key_of(b == "(none)" ? a : b);
    const bool optimizer = key.rfind("optimizer.", 0) == 0;
    throw InvalidArgument("checkpoint '" + step_dir + "' was saved by another " +
                          (optimizer ? "optimizer" : "model") + ": " + a +
                          " there, but this session's configuration has " + b +
                          (optimizer ? " (its state would not fit; resume with the optimizer "
                                       "it was saved with)"
                                     : ""));
  }
}

std::int64_t Session::load(const std::string& dir) {
  Impl& s = *impl_;
  const std::string d = s.dir_or_configured(dir, "load");
  if (s.in_flight) wait_save();
  s.check_identity(d);
  const checkpoint::Loaded loaded = s.opt->load(d);
  const std::string what = "checkpoint's (" + loaded.step_dir + ")";
  try {
    s.check_parameters_finite(what);
  } catch (const InvalidArgument&) {
    s.refused_values = "the checkpoint '" + loaded.step_dir + "'";
    throw;
  }
  s.refused_values.clear();
  s.step = loaded.step;
  // Resumed in the run's own directory: the chain it continues is its lineage.
  if (s.claim && d == s.cfg.checkpoint.dir) s.claim->resumed_from(loaded.step_dir);
  return s.step;
}

void Session::export_safetensors(const std::string& path) {
  Impl& s = *impl_;
  s.check_usable("export_safetensors");
  // A full (unsharded) checkpoint beside the file, converted by rank 0, then removed.
  const std::string tmp = path + ".fullshard-export";
  checkpoint::SaveOptions so;
  so.kind = checkpoint::Kind::full;
  const std::string step_dir =
      checkpoint::save(tmp, s.sharded->graph(), nullptr, s.step, {}, {}, so);
  std::string error;
  if (s.mesh.rank() == 0) {
    try {
      checkpoint::checkpoint_to_safetensors(step_dir, path);
    } catch (const std::exception& e) {
      error = fullshard::detail::message_of(e);
      if (error.empty()) error = "rank 0 could not write the safetensors file '" + path + "'";
    }
    std::error_code ec;
    std::filesystem::remove_all(tmp, ec);
  }
  // Every rank returns when the file is there (or with rank 0's error).
  s.control->bcast(error, 0, "safetensors export (MPI_Ibcast)");
  if (!error.empty()) throw Error(error);
}

void Session::import_safetensors(const std::string& path) {
  Impl& s = *impl_;
  if (s.in_flight) wait_save();  // the save in flight reads the parameters
  std::string error;
  int io = 0;  // the failure is an IoError (a file that cannot be read), not a mismatch
  try {
    checkpoint::load_safetensors(path, s.sharded->graph());
  } catch (const std::exception& e) {
    error = fullshard::detail::message_of(e);
    io = dynamic_cast<const IoError*>(&e) != nullptr;
  }
  // A read error of one rank's rows is thrown on every rank (the first failing rank's); -1 in
  // the second word: some rank replaced its rows.
  int failed[2] = {error.empty() ? s.mesh.size() : s.mesh.rank(), error.empty() ? -1 : 0};
  s.control->allreduce(failed, 2, MPI_INT, MPI_MIN, "safetensors import (MPI_Iallreduce)");
  if (failed[0] == s.mesh.size()) {
    try {
      s.check_parameters_finite("imported (" + path + ")");
    } catch (const InvalidArgument&) {
      s.refused_values = "the safetensors file '" + path + "'";
      throw;
    }
    s.refused_values.clear();
    return;
  }
  s.control->bcast(error, failed[0], "safetensors import (MPI_Ibcast)");
  s.control->bcast(&io, 1, MPI_INT, failed[0], "safetensors import (MPI_Ibcast)");
  // The ranks that read their rows replaced them: the model would be part old, part new.
  if (failed[1] < 0) s.refused_values = "a safetensors file read in part ('" + path + "')";
  if (io) throw IoError(error);
  throw InvalidArgument(error);
}

void Session::set_progress(Progress progress) {
  impl_->progress = std::move(progress);
}

::torch::nn::Module& Session::module() const noexcept {
  return *impl_->model.root;
}
fst::ShardedModel& Session::sharded() const noexcept {
  return *impl_->sharded;
}
const Config& Session::config() const noexcept {
  return impl_->cfg;
}
const DeviceMesh& Session::mesh() const noexcept {
  return impl_->mesh;
}
at::ScalarType Session::input_dtype() const noexcept {
  return impl_->model.input_dtype;
}
c10::Device Session::device() const noexcept {
  return impl_->device;
}
std::int64_t Session::step() const noexcept {
  return impl_->step;
}
double Session::lr() const {
  return impl_->schedule ? impl_->schedule->lr(int(impl_->step)) : impl_->cfg.optimizer.lr;
}
std::int64_t Session::skipped_steps() const noexcept {
  return impl_->non_finite->skipped();
}
std::int64_t Session::num_params() const noexcept {
  return impl_->num_params;
}
std::size_t Session::optimizer_tensors() const {
  return impl_->opt->tensors();
}
const PlanPrediction& Session::plan() const noexcept {
  return impl_->plan;
}
const void* Session::last_input_data() const noexcept {
  return impl_->last_input;
}

}  // namespace fullshard::session
