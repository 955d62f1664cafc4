#include "lib/capi/trainer.hpp"

#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <filesystem>
#include <utility>

#include "fullshard/base/bounded_comm.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/base/mpi_wait.hpp"
#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/checkpoint/safetensors.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "fullshard/schedule/memory_account.hpp"
#include "fullshard/schedule/memory_budget.hpp"
#include "fullshard/schedule/plan.hpp"
#include "fullshard/torch/checkpoint.hpp"

namespace fullshard::capi {

namespace fst = fullshard::torch;
namespace F = ::torch::nn::functional;

namespace {

std::string shape_of(const at::Tensor& t) {
  std::string s = "(";
  for (std::int64_t d = 0; d < t.dim(); ++d)
    s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + ")";
}

// Each parameter tensor once (a GPT's head is its token embedding).
std::vector<at::Tensor> unique_parameters(::torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : m.parameters())
    if (std::none_of(out.begin(), out.end(), [&](const at::Tensor& q) { return q.is_same(p); }))
      out.push_back(p);
  return out;
}

}  // namespace

Trainer::Trainer(const DeviceMesh& mesh, Config config) : cfg_(std::move(config)), mesh_(mesh) {
  if (cfg_.threads > 0) at::set_num_threads(cfg_.threads);
  // Built whole (deferred_init false, TorchScript's buffers): the same on every rank and mesh.
  ::torch::manual_seed(cfg_.seed);
  model_ = build_model(cfg_.model, cfg_.dtype == DType::f64 ? at::kDouble : at::kFloat, cfg_.source,
                       cfg_.seed);
  for (const at::Tensor& p : unique_parameters(*model_.root))
    num_params_ += p.numel();
  if (mesh_.device_type() == DeviceType::cuda) {  // the rank's GPU (the runtime bound it)
    device_ = c10::Device(c10::kCUDA);
    model_.root->to(device_);
  }
  sharded_ = std::make_unique<fst::ShardedModel>(model_.root);
  shard();
  // Each rank fills its own rows, the values those of the whole model from cfg_.seed.
  if (model_.initialize) sharded_->initialize(model_.initialize);
  graph_params_ = sharded_->graph().parameters();

  std::vector<at::Tensor> params = unique_parameters(*model_.root);
  const OptimizerSpec& o = cfg_.optimizer;
  if (o.type == "adamw")
    opt_ = std::make_unique<::torch::optim::AdamW>(params, ::torch::optim::AdamWOptions(o.lr)
                                                               .betas({o.beta1, o.beta2})
                                                               .eps(o.eps)
                                                               .weight_decay(o.weight_decay));
  else
    opt_ = std::make_unique<::torch::optim::SGD>(
        params, ::torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
  if (cfg_.lr_schedule.type == "warmup_cosine")
    schedule_.emplace(o.lr, cfg_.lr_schedule.warmup_steps, cfg_.lr_schedule.total_steps,
                      cfg_.lr_schedule.min_lr);
}

Trainer::~Trainer() = default;

void Trainer::shard() {
  namespace sch = fullshard::schedule;
  sch::PlanOptions o;
  o.external_gradients = true;
  o.forward_prefetch_depth = cfg_.sharding.forward_prefetch;
  o.defaults.reshard_after_forward = cfg_.sharding.reshard_after_forward
                                         ? fsdp::ReshardAfterForward::automatic()
                                         : fsdp::ReshardAfterForward::never();
  o.defaults.mp_policy.param_dtype = cfg_.param_dtype;
  o.defaults.mp_policy.reduce_dtype = cfg_.reduce_dtype;
  sch::MeshShape shape;
  shape.shard_size = mesh_.size(mesh_.names().back());
  shape.replicate_size = mesh_.ndim() > 1 ? mesh_.size(mesh_.names().front()) : 1;

  const sch::Plan* plan = nullptr;
  std::optional<sch::Plan> explicit_plan;
  std::optional<sch::AutoPlan> auto_plan;
  if (cfg_.sharding.policy == "auto") {
    sch::AutoPlanOptions ao;
    ao.base = o;
    ao.memory_budget_bytes = std::size_t(cfg_.sharding.memory_budget_mb * 1024.0 * 1024.0);
    ao.state_bytes_per_param_byte =
        cfg_.optimizer.type == "adamw" ? 2.0 : (cfg_.optimizer.momentum > 0 ? 1.0 : 0.0);
    // The planner's own measure of its plans; the process peak is checked below.
    auto_plan.emplace(sharded_->auto_shard(mesh_, ao, model_.blocks));
    plan = &auto_plan->plan;
    check_memory(*plan);
  } else {
    graph::Module& g = sharded_->graph();
    if (cfg_.sharding.policy == "blocks")
      for (const ::torch::nn::Module* b : model_.blocks)
        g.module(sharded_->fqn(*b)).set_fully_shard_request(true);
    g.set_fully_shard_request(true);
    explicit_plan.emplace(sch::Scheduler::plan(g, shape, o));
    check_memory(*explicit_plan);
    sharded_->apply_plan(*explicit_plan, mesh_);
    plan = &*explicit_plan;
  }
  plan_.step_ms = plan->step_ms;
  plan_.peak_bytes = std::int64_t(plan->peak_bytes);
  plan_.sharded_bytes = std::int64_t(plan->sharded_bytes);
  plan_.groups = std::int64_t(plan->groups.size());
}

void Trainer::check_memory(const schedule::Plan& plan) {
  namespace sch = fullshard::schedule;
  const MemorySpec& m = cfg_.memory;
  // The account is of host memory; a CUDA mesh's parameters live on the device.
  if (mesh_.device_type() != DeviceType::cpu) return;
  sch::MemoryInputs in;
  in.optimizer_states = cfg_.optimizer.type == "adamw" ? 2 : (cfg_.optimizer.momentum > 0 ? 1 : 0);
  const std::string shard_dim = mesh_.names().back();
  in.shared_memory = mesh_.shm(shard_dim) != nullptr;
  if (const NodeSplit* split = mesh_.node_split(shard_dim)) in.nodes = split->nodes();
  in.rank = mesh_.coordinate(shard_dim);
  // LibTorch's activations are not declared to the planner: the account leaves them out.
  in.baseline = sch::process_memory().resident;
  const sch::MemoryAccount planned = sch::plan_memory(plan, in);
  plan_.process_peak_bytes = static_cast<std::int64_t>(planned.process_peak());
  if (m.check == "off") return;
  BoundedComm comm(mesh_.control_world(), "capi.memory", mesh_.timeout_s());
  const sch::MemoryBudget budget = sch::rank_memory_budget(
      comm, static_cast<std::size_t>(m.budget_mb * 1024.0 * 1024.0), "memory.budget_mb");
  sch::check_memory_budget(
      comm, planned, budget, m.check == "warn" ? sch::MemoryCheck::warn : sch::MemoryCheck::refuse,
      "more ranks shrink the shards, gradients and optimizer state; \"sharding\": "
      "{\"reshard_after_forward\": true} frees each block after its forward; a larger "
      "\"memory\": {\"budget_mb\"} where the node has it; \"memory\": {\"check\": "
      "\"warn\"} runs it anyway (LibTorch's activations are not in the account)");
}

double Trainer::lr() const {
  return schedule_ ? schedule_->lr(int(step_)) : cfg_.optimizer.lr;
}

at::Tensor Trainer::loss_of(const std::vector<at::Tensor>& in,
                            const std::vector<at::Tensor>& targets) {
  model_.check_inputs(in);
  last_input_ = in.empty() ? nullptr : in[0].data_ptr();
  if (model_.own_loss) {
    if (!targets.empty())
      throw InvalidArgument("the " + cfg_.model.type + " computes its loss (" + cfg_.loss +
                            ") from its input; pass no targets, not " +
                            std::to_string(targets.size()));
    return model_.own_loss(in);
  }
  // Shapes are checked against the outputs after the forward: a shape error leaves this
  // rank's forward unfinished, so it is checked against what the model promises first.
  const std::vector<at::Tensor> out = model_.forward(in);
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
    if (cfg_.loss == "cross_entropy") {
      if (t.dim() != y.dim() - 1 || t.size(0) != y.size(0))
        throw InvalidArgument("target " + std::to_string(i) + " has shape " + shape_of(t) +
                              "; cross_entropy takes class indices of shape (batch) for output " +
                              shape_of(y));
      l = F::cross_entropy(y, t.to(at::kLong));
    } else {
      if (!t.sizes().equals(y.sizes()))
        throw InvalidArgument("target " + std::to_string(i) + " has shape " + shape_of(t) +
                              " but output " + std::to_string(i) + " has shape " + shape_of(y));
      l = cfg_.loss == "mse"  ? F::mse_loss(y, t)
          : cfg_.loss == "l1" ? F::l1_loss(y, t)
                              : F::smooth_l1_loss(y, t);
    }
    loss = loss.defined() ? loss + l : l;
  }
  return loss;
}

double Trainer::train_step(const std::vector<at::Tensor>& inputs,
                           const std::vector<at::Tensor>& targets) {
  const double rate = lr();
  for (auto& group : opt_->param_groups())
    group.options().set_lr(rate);
  opt_->zero_grad();
  at::Tensor loss;
  try {
    loss = loss_of(inputs, targets);
  } catch (...) {
    // A bad target found after the forward: the groups the forward left unsharded (the
    // root's) show their shards again, so the optimizer and checkpoints see the shards.
    try {
      sharded_->state(*model_.root).reset_iter_state();
    } catch (...) {
    }
    throw;
  }
  loss.backward();
  if (cfg_.grad_clip > 0) optim::clip_grad_norm(graph_params_, cfg_.grad_clip, mesh_);
  opt_->step();
  ++step_;
  return loss.item<double>();
}

std::vector<at::Tensor> Trainer::predict(const std::vector<at::Tensor>& inputs) {
  ::torch::NoGradGuard no_grad;
  model_.check_inputs(inputs);
  last_input_ = inputs.empty() ? nullptr : inputs[0].data_ptr();
  model_.root->eval();
  std::vector<at::Tensor> out;
  try {
    out = model_.forward(inputs);
  } catch (...) {
    model_.root->train();
    throw;
  }
  model_.root->train();
  return out;
}

void Trainer::save_checkpoint(const std::string& dir) {
  fst::save_checkpoint(dir, *sharded_, opt_.get(), step_);
}

void Trainer::load_checkpoint(const std::string& dir) {
  step_ = fst::load_checkpoint(dir, *sharded_, opt_.get()).step;
}

void Trainer::export_safetensors(const std::string& path) {
  // A full (unsharded) checkpoint beside the file, converted by rank 0, then removed.
  const std::string tmp = path + ".fullshard-export";
  checkpoint::SaveOptions so;
  so.kind = checkpoint::Kind::full;
  const std::string step_dir = checkpoint::save(tmp, sharded_->graph(), nullptr, step_, {}, {}, so);
  std::string error;
  if (mesh_.rank() == 0) {
    try {
      checkpoint::checkpoint_to_safetensors(step_dir, path);
    } catch (const std::exception& e) {
      error = detail::message_of(e);
    }
    std::error_code ec;
    std::filesystem::remove_all(tmp, ec);
  }
  // Every rank returns when the file is there (or with rank 0's error).
  int failed = error.empty() ? 0 : 1;
  MPI_Request r = MPI_REQUEST_NULL;
  MPI_Iallreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, mesh_.control_world(), &r);
  wait_mpi(r,
           WaitSite{"MPI_Iallreduce (safetensors export)", "the mesh's ranks", mesh_.rank(),
                    mesh_.size(), 0, ""},
           mesh_.timeout_s());
  if (failed)
    throw Error(error.empty() ? "rank 0 could not write the safetensors file '" + path + "'"
                              : error);
}

}  // namespace fullshard::capi
