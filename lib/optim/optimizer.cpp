#include "fullshard/optim/optimizer.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <deque>
#include <set>

#include "fullshard/base/error.hpp"
#include "fullshard/comm/stream.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "lib/fsdp/group_access.hpp"
#include "lib/fsdp/shard_update.hpp"
#include "lib/kernels/finite_scan.hpp"
#include "lib/tensor/staging.hpp"

namespace fullshard::optim {

struct DeviceExec {
  // The kernels layer's instances the element updates run on: the host's, and one per
  // stream for device shards (made on first use).
  kernels::ExecStream host = kernels::ExecStream::host();
  std::deque<std::pair<void*, kernels::ExecStream>> streams;
  const kernels::ExecStream& exec(MemorySpace space, void* stream) {
    if (space != MemorySpace::device) return host;
    for (const auto& [s, e] : streams)
      if (s == stream) return e;
    streams.emplace_back(stream, kernels::ExecStream::device(stream));
    return streams.back().second;
  }
#if defined(KOKKOS_ENABLE_CUDA)
  std::deque<std::pair<void*, Kokkos::Cuda>> instances;  // references stay valid
  // The instance on `stream` (nullptr: Kokkos' default instance).
  const Kokkos::Cuda& on(void* stream) {
    for (const auto& [s, exec] : instances)
      if (s == stream) return exec;
    instances.emplace_back(stream, stream == nullptr
                                       ? Kokkos::Cuda()
                                       : Kokkos::Cuda(static_cast<cudaStream_t>(stream)));
    return instances.back().second;
  }
#endif
};

// What the FSDP groups call (fsdp::ShardUpdate); outlives its optimizer harmlessly: a group
// that still holds it after the optimizer went gets an error naming it.
class InBackward final : public fsdp::ShardUpdate {
 public:
  InBackward(Optimizer& opt, int states) : opt_(&opt), states_(states) {}
  kernels::ElementUpdate prepare(const fsdp::ShardGroupView& g) override {
    if (opt_ == nullptr)
      throw InvalidArgument("fsdp group " + g.name +
                            ": its optimizer inside backward was destroyed; call "
                            "run_in_backward(false) before destroying it");
    return opt_->prepare_group(g);
  }
  int state_arrays() const override { return states_; }
  void detach() noexcept { opt_ = nullptr; }

 private:
  Optimizer* opt_;
  int states_;
};

namespace {

constexpr double kPi = 3.14159265358979323846;

std::string pname(const graph::Parameter& p) {
  return "parameter '" + p.fqn() + "'";
}

void check_hyper(bool ok, const std::string& what, double v) {
  if (!ok || !std::isfinite(v))
    throw InvalidArgument("optimizer: bad " + what + " " + std::to_string(v));
}

// The compute stream of the mesh `p` is sharded over (nullptr: host shard, or outside FSDP).
// The FSDP state owning parameter `p` (nullptr: outside FSDP).
fsdp::FSDPModule* state_of(graph::Parameter& p) {
  for (graph::Module* m = &p.module(); m != nullptr; m = m->parent())
    if (fsdp::FSDPModule* st = fsdp::fsdp_state(*m)) return st;
  return nullptr;
}

// The distinct FSDP states owning `params`, in first-use order.
std::vector<fsdp::FSDPModule*> states_of(const std::vector<graph::Parameter*>& params) {
  std::vector<fsdp::FSDPModule*> states;
  std::set<fsdp::FSDPModule*> seen;
  for (graph::Parameter* p : params)
    if (fsdp::FSDPModule* st = state_of(*p); st != nullptr && seen.insert(st).second)
      states.push_back(st);
  return states;
}

void* stream_of(graph::Parameter& p) {
  if (p.data().space() != MemorySpace::device) return nullptr;
  const fsdp::FSDPModule* st = state_of(p);
  return st ? st->mesh().compute_stream().native_handle() : nullptr;
}

// A copy of `t` in `space`, copied on `stream` (after the kernels enqueued there).
Tensor copy_of(const Tensor& t, MemorySpace space, void* stream, const std::string& what) {
  Tensor out =
      space == MemorySpace::host && t.space() == MemorySpace::device
          ? ::fullshard::detail::pinned_host_tensor(t.shape(), t.dtype(), "fullshard::optim_state")
          : Tensor::empty(t.shape(), t.dtype(), space, "fullshard::optim_state",
                          MemoryPart::optimizer_state);
  if (t.space() == MemorySpace::host && space == MemorySpace::host)
    copy_bytes(out, t);
  else
    ::fullshard::detail::copy_on_stream(out, t, stream, what);
  return out;
}

// Runs the element-wise kernel `k` (k(e) for e in [0, n)) where `space` is: a Kokkos kernel
// of the CUDA execution space on `stream` for device memory (asynchronous), a plain loop on
// the host otherwise (the host path's code and speed, bit for bit).
template <class Kernel>
void for_each_element(const char* label, const Kernel& k, std::int64_t n, MemorySpace space,
                      void* stream, DeviceExec& execs) {
#if defined(KOKKOS_ENABLE_CUDA)
  if (space == MemorySpace::device) {
    if (n == 0) return;
    Kokkos::parallel_for(
        label,
        Kokkos::RangePolicy<Kokkos::Cuda, Kokkos::IndexType<std::int64_t>>(execs.on(stream), 0, n),
        k);
    return;
  }
#else
  (void)label, (void)space, (void)stream, (void)execs;
#endif
  // The kernels' arrays never overlap: no run-time alias check.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#pragma GCC ivdep
#endif
  for (std::int64_t e = 0; e < n; ++e)
    k(e);
}

// g[e] *= coef (rounded to f32), as clip_grad_norm's host path does through Tensor::set.
struct ScaleKernel {
  float* g;
  double coef;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e) const {
    g[e] = static_cast<float>(static_cast<double>(g[e]) * coef);
  }
};

// Sum of g[e]^2 in double (clip_grad_norm on device gradients).
struct SumSqKernel {
  const float* g;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e, double& acc) const {
    const double x = g[e];
    acc += x * x;
  }
};

}  // namespace

Optimizer::Optimizer(std::vector<graph::Parameter*> params)
    : params_(std::move(params)), exec_(std::make_shared<DeviceExec>()) {
  for (const graph::Parameter* p : params_) {
    if (p == nullptr) throw InvalidArgument("optimizer: null parameter in the list");
    if (!index_.emplace(p, index_.size()).second)
      throw InvalidArgument("optimizer: " + pname(*p) + " is listed twice");
    if (p->dtype() != DType::f32)
      throw InvalidArgument("optimizer: " + pname(*p) + " has dtype " + dtype_name(p->dtype()) +
                            "; only f32 parameters are supported");
  }
  state_.resize(params_.size());
  no_decay_.assign(params_.size(), false);
}

void Optimizer::set_no_weight_decay(const std::vector<graph::Parameter*>& params) {
  std::vector<bool> no_decay(params_.size(), false);
  for (const graph::Parameter* p : params) {
    const auto at = p ? index_.find(p) : index_.end();
    if (at == index_.end())
      throw InvalidArgument(
          "optimizer: set_no_weight_decay: " + (p ? pname(*p) : std::string("a null parameter")) +
          " is not a parameter of this optimizer");
    no_decay[at->second] = true;
  }
  std::swap(no_decay_, no_decay);
  try {
    check_group_decay(runs_in_backward());
  } catch (...) {
    std::swap(no_decay_, no_decay);
    throw;
  }
}

bool Optimizer::has_weight_decay(const graph::Parameter& p) const {
  const auto at = index_.find(&p);
  return at == index_.end() || !no_decay_[at->second];
}

void Optimizer::check_group_decay(bool in_backward) const {
  if (!in_backward) return;
  for (fsdp::FSDPModule* st : states_of(params_)) {
    const graph::Parameter *with = nullptr, *without = nullptr;
    for (graph::Parameter* q : fsdp::detail::group_params(*st))
      (has_weight_decay(*q) ? with : without) = q;
    if (with && without)
      throw InvalidArgument("optimizer: FSDP group '" + fsdp::detail::group_name(*st) +
                            "' holds '" + with->fqn() + "' (with weight decay) and '" +
                            without->fqn() +
                            "' (without): inside backward a group's update is one rule over "
                            "its whole shard; group them apart, or step after backward");
  }
}

void Optimizer::step() {
  // Check everything before writing anything.
  for (const graph::Parameter* p : params_) {
    const Tensor& g = p->grad();
    if (!g.defined()) continue;  // no gradient
    const Tensor& d = p->data();
    if (d.dtype() != DType::f32 || g.dtype() != DType::f32)
      throw InvalidArgument("optimizer: " + pname(*p) + ": data and gradient must be f32");
    if (d.space() != g.space())
      throw InvalidArgument("optimizer: " + pname(*p) + ": data in " +
                            memory_space_name(d.space()) + " memory but gradient in " +
                            memory_space_name(g.space()) + " memory");
    if (d.shape() != g.shape())
      throw InvalidArgument("optimizer: " + pname(*p) + ": gradient shape " +
                            shape_string(g.shape()) + " differs from the data's " +
                            shape_string(d.shape()));
  }
  // After a backward that updated groups inside it, the rest of the step is the same step.
  if (!stepped_in_backward_) ++step_;
  stepped_in_backward_ = false;
  const std::size_t ns = state_names().size();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    graph::Parameter& p = *params_[i];
    const Tensor& g = p.grad();
    if (!g.defined()) continue;
    bool fresh = false;
    if (state_[i].size() != ns || (ns > 0 && state_[i][0].shape() != p.data().shape())) {
      state_[i].clear();
      for (std::size_t s = 0; s < ns; ++s)
        state_[i].push_back(Tensor::zeros(p.data().shape(), DType::f32, p.data().space(),
                                          "fullshard::optim_state", MemoryPart::optimizer_state));
      fresh = true;
    }
    stream_ = stream_of(p);
    updating_no_decay_ = no_decay_[i];
    update(p, g, state_[i], fresh, step_);
  }
  stream_ = nullptr;
  updating_no_decay_ = false;
}

void Optimizer::update(graph::Parameter& p, const Tensor& grad, std::vector<Tensor>& state,
                       bool fresh, std::int64_t step) {
  kernels::ElementUpdate u;
  if (!element_update(u, fresh, step))
    throw InvalidArgument("optimizer: " + pname(p) +
                          ": this optimizer has no update rule (override update() or "
                          "element_update())");
  if (updating_no_decay_) u.weight_decay = 0.0;
  u.param = p.data().data_as<float>();
  u.state0 = !state.empty() ? state[0].data_as<float>() : nullptr;
  u.state1 = state.size() > 1 ? state[1].data_as<float>() : nullptr;
  kernels::apply_update(exec_->exec(grad.space(), stream_), u, grad.data_as<float>(), grad.numel());
}

Optimizer::~Optimizer() {
  if (in_backward_) in_backward_->detach();
}

void Optimizer::run_in_backward(bool enable) {
  const std::vector<fsdp::FSDPModule*> states = states_of(params_);
  if (!enable) {
    for (fsdp::FSDPModule* st : states)
      fsdp::update_in_backward(*st, nullptr);
    if (in_backward_) in_backward_->detach();
    in_backward_.reset();
    groups_.clear();
    stepped_in_backward_ = false;
    return;
  }
  kernels::ElementUpdate probe;
  if (!element_update(probe, true, 1))
    throw InvalidArgument(
        "optimizer: run_in_backward needs an element-wise optimizer (SGD, AdamW); this one "
        "only has update()");
  // Every parameter of each group must be ours: the update covers the group's whole shard.
  for (fsdp::FSDPModule* st : states)
    for (graph::Parameter* q : fsdp::detail::group_params(*st))
      if (index_.count(q) == 0)
        throw InvalidArgument("optimizer: run_in_backward: FSDP group '" +
                              fsdp::detail::group_name(*st) + "' holds parameter '" + q->fqn() +
                              "', which this optimizer does not (its update covers the whole "
                              "group: give the optimizer every parameter of the group)");
  check_group_decay(true);  // one decay rule per group
  auto update = std::make_shared<InBackward>(*this, probe.state_arrays());
  std::size_t done = 0;
  try {
    for (; done < states.size(); ++done)
      fsdp::update_in_backward(*states[done], update);
  } catch (...) {  // all or none: the groups registered so far step after backward again
    for (std::size_t i = 0; i < done; ++i)
      fsdp::update_in_backward(*states[i], in_backward_);
    update->detach();
    throw;
  }
  if (in_backward_) in_backward_->detach();
  in_backward_ = std::move(update);
  groups_.clear();
  base_step_ = step_;
  stepped_in_backward_ = false;
}

kernels::ElementUpdate Optimizer::prepare_group(const fsdp::ShardGroupView& g) {
  const std::size_t ns = state_names().size();
  const std::int64_t gsn = g.layout.shard_numel;
  const auto [it, inserted] = groups_.try_emplace(&g.layout);
  GroupState& gs = it->second;
  if (inserted) gs.step = base_step_;  // a group counts its steps from the optimizer's
  bool fresh = false;
  if (gs.state.size() != ns || (ns > 0 && gs.state[0].numel() != gsn)) {
    // The group's state in slot layout (padding zero), seeded with the per-parameter state a
    // load or earlier steps left; the per-parameter state then views it.
    std::vector<Tensor> state;
    for (std::size_t s = 0; s < ns; ++s)
      state.push_back(Tensor::zeros({gsn}, DType::f32, g.shards.space(), "fullshard::optim_state",
                                    MemoryPart::optimizer_state));
    bool seeded = false;
    for (std::size_t m = 0; m < g.params.size(); ++m) {
      const auto at = index_.find(g.params[m]);
      if (at == index_.end())
        throw InvalidArgument("fsdp group " + g.name + ": parameter '" + g.params[m]->fqn() +
                              "' is not in its optimizer inside backward");
      std::vector<Tensor>& own = state_[at->second];
      const kernels::GroupMember& mem = g.layout.members[m];
      for (std::size_t s = 0; s < ns; ++s) {
        Tensor view = state[s].flat_view(mem.slot_offset, mem.layout.local_shape);
        if (own.size() == ns && own[s].numel() == view.numel()) {
          if (view.space() == MemorySpace::host && own[s].space() == MemorySpace::host)
            copy_bytes(view, own[s]);
          else
            ::fullshard::detail::copy_on_stream(view, own[s], g.stream,
                                                "optimizer state of '" + g.params[m]->fqn() + "'");
          seeded = true;
        }
      }
      own.clear();
      for (std::size_t s = 0; s < ns; ++s)
        own.push_back(state[s].flat_view(mem.slot_offset, mem.layout.local_shape));
    }
    gs.state = std::move(state);
    fresh = !seeded;
  }
  ++gs.step;
  step_ = std::max(step_, gs.step);
  stepped_in_backward_ = true;
  kernels::ElementUpdate u;
  element_update(u, fresh, gs.step);
  // One rule for the whole shard: run_in_backward refused groups that mix the two.
  if (!g.params.empty() && !has_weight_decay(*g.params.front())) u.weight_decay = 0.0;
  u.param = g.shards.data_as<float>();
  u.state0 = ns > 0 ? gs.state[0].data_as<float>() : nullptr;
  u.state1 = ns > 1 ? gs.state[1].data_as<float>() : nullptr;
  return u;
}

void Optimizer::zero_grad() {
  for (fsdp::FSDPModule* st : states_of(params_))
    st->zero_grad();
  for (graph::Parameter* p : params_) {
    Tensor g = p->grad();
    if (!g.defined() || g.numel() == 0) continue;
    if (g.space() == MemorySpace::host) {
      g.fill(0.0);
    } else if (state_of(*p) == nullptr) {  // a device gradient outside FSDP (FSDP zeroed its own)
      if (g.dtype() != DType::f32)
        throw InvalidArgument("optimizer: zero_grad of " + pname(*p) +
                              ": device gradients must be f32");
      for_each_element("fullshard::optim::zero_grad", ScaleKernel{g.data_as<float>(), 0.0},
                       g.numel(), g.space(), stream_of(*p), *exec_);
    }
  }
}

std::map<std::string, Tensor> Optimizer::state_dict() const {
  std::map<std::string, Tensor> out;
  const std::vector<std::string> names = state_names();
  for (std::size_t i = 0; i < params_.size(); ++i)
    for (std::size_t s = 0; s < state_[i].size(); ++s)
      out[params_[i]->fqn() + "." + names[s]] =
          copy_of(state_[i][s], MemorySpace::host, stream_of(*params_[i]),
                  "state_dict: '" + params_[i]->fqn() + "." + names[s] + "'");
  Tensor step = Tensor::zeros({1}, DType::f64);
  step.set(0, static_cast<double>(step_));
  out["step"] = step;
  return out;
}

std::map<std::string, Tensor> Optimizer::state_views() const {
  std::map<std::string, Tensor> out;
  const std::vector<std::string> names = state_names();
  for (std::size_t i = 0; i < params_.size(); ++i)
    for (std::size_t s = 0; s < state_[i].size(); ++s)
      out[params_[i]->fqn() + "." + names[s]] = state_[i][s];
  return out;
}

void Optimizer::check_state_dict(const std::map<std::string, Tensor>& state) const {
  checked_step(state);
}

// The checks of load_state_dict; returns the step and, per parameter, whether its state is
// present.
std::int64_t Optimizer::checked_step(const std::map<std::string, Tensor>& state,
                                     std::vector<bool>* has_state) const {
  const std::vector<std::string> names = state_names();
  auto step_it = state.find("step");
  if (step_it == state.end()) throw InvalidArgument("load_state_dict: missing key 'step'");
  const Tensor& st = step_it->second;
  if (st.numel() != 1 || st.space() != MemorySpace::host || st.data() == nullptr)
    throw InvalidArgument("load_state_dict: key 'step' must be a host tensor of one element");
  const double step_v = st.at(0);
  if (!(step_v >= 0) || step_v != std::floor(step_v) || step_v > 9.0e15)
    throw InvalidArgument("load_state_dict: key 'step' must be a non-negative integer, got " +
                          std::to_string(step_v));
  std::map<std::string, std::pair<std::size_t, std::size_t>> known;  // key -> (param, state)
  for (std::size_t i = 0; i < params_.size(); ++i)
    for (std::size_t s = 0; s < names.size(); ++s)
      known[params_[i]->fqn() + "." + names[s]] = {i, s};
  std::vector<std::size_t> present(params_.size(), 0);
  for (const auto& [key, t] : state) {
    if (key == "step") continue;
    auto it = known.find(key);
    if (it == known.end()) throw InvalidArgument("load_state_dict: unexpected key '" + key + "'");
    const graph::Parameter& p = *params_[it->second.first];
    if (t.dtype() != DType::f32 ||
        (t.space() != MemorySpace::host && t.space() != p.data().space()))
      throw InvalidArgument("load_state_dict: key '" + key + "' must be an f32 tensor in host " +
                            "memory or in the shard's (" + memory_space_name(p.data().space()) +
                            ") memory");
    if (t.numel() > 0 && t.data() == nullptr)
      throw InvalidArgument("load_state_dict: key '" + key + "' has no data");
    if (t.shape() != p.data().shape())
      throw InvalidArgument("load_state_dict: key '" + key + "' has shape " +
                            shape_string(t.shape()) + ", expected the local shard's " +
                            shape_string(p.data().shape()));
    ++present[it->second.first];
  }
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (present[i] != 0 && present[i] != names.size())
      for (const std::string& n : names)
        if (state.count(params_[i]->fqn() + "." + n) == 0)
          throw InvalidArgument("load_state_dict: missing key '" + params_[i]->fqn() + "." + n +
                                "'");
  if (has_state) {
    has_state->assign(params_.size(), false);
    for (std::size_t i = 0; i < params_.size(); ++i)
      (*has_state)[i] = present[i] != 0;
  }
  return static_cast<std::int64_t>(step_v);
}

void Optimizer::load_state_dict(const std::map<std::string, Tensor>& state) {
  std::vector<bool> has_state;
  const std::int64_t step = checked_step(state, &has_state);
  const std::vector<std::string> names = state_names();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    state_[i].clear();
    if (!has_state[i]) continue;
    graph::Parameter& p = *params_[i];
    for (const std::string& n : names)
      state_[i].push_back(copy_of(state.at(p.fqn() + "." + n), p.data().space(), stream_of(p),
                                  "load_state_dict: '" + p.fqn() + "." + n + "'"));
  }
  step_ = base_step_ = step;
  groups_.clear();
  stepped_in_backward_ = false;
}

void Optimizer::load_state_dict(std::map<std::string, Tensor>&& state) {
  std::vector<bool> has_state;
  const std::int64_t step = checked_step(state, &has_state);
  const std::vector<std::string> names = state_names();
  // Allocate first, then move: nothing below can fail once the state is being replaced.
  std::vector<std::vector<Tensor>> next(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!has_state[i]) continue;
    graph::Parameter& p = *params_[i];
    next[i].reserve(names.size());
    for (const std::string& n : names) {
      Tensor& t = state.at(p.fqn() + "." + n);
      if (t.space() == p.data().space())
        next[i].push_back(std::move(t));
      else  // e.g. a checkpoint's host staging of a device shard's state
        next[i].push_back(copy_of(t, p.data().space(), stream_of(p),
                                  "load_state_dict: '" + p.fqn() + "." + n + "'"));
    }
  }
  state_.swap(next);
  step_ = base_step_ = step;
  groups_.clear();
  stepped_in_backward_ = false;
}

// ---- SGD ------------------------------------------------------------------------------------

SGD::SGD(std::vector<graph::Parameter*> params, double lr_, double momentum, double weight_decay,
         bool nesterov)
    : Optimizer(std::move(params)),
      lr(lr_),
      momentum_(momentum),
      weight_decay_(weight_decay),
      nesterov_(nesterov) {
  check_hyper(lr_ >= 0, "SGD learning rate", lr_);
  check_hyper(momentum >= 0, "SGD momentum", momentum);
  check_hyper(weight_decay >= 0, "SGD weight_decay", weight_decay);
  if (nesterov && momentum <= 0)
    throw InvalidArgument("optimizer: SGD nesterov momentum requires momentum > 0");
}

std::vector<std::string> SGD::state_names() const {
  if (momentum_ == 0) return {};
  return {"momentum_buffer"};
}

bool SGD::element_update(kernels::ElementUpdate& u, bool fresh, std::int64_t) const {
  u.rule = kernels::ElementUpdate::Rule::sgd;
  u.lr = lr;
  u.momentum = momentum_;
  u.weight_decay = weight_decay_;
  u.nesterov = nesterov_;
  u.fresh = fresh;
  return true;
}

// ---- AdamW ----------------------------------------------------------------------------------

AdamW::AdamW(std::vector<graph::Parameter*> params, double lr_, double beta1, double beta2,
             double eps, double weight_decay)
    : Optimizer(std::move(params)),
      lr(lr_),
      beta1_(beta1),
      beta2_(beta2),
      eps_(eps),
      weight_decay_(weight_decay) {
  check_hyper(lr_ >= 0, "AdamW learning rate", lr_);
  check_hyper(beta1 >= 0 && beta1 < 1, "AdamW beta1", beta1);
  check_hyper(beta2 >= 0 && beta2 < 1, "AdamW beta2", beta2);
  check_hyper(eps >= 0, "AdamW eps", eps);
  check_hyper(weight_decay >= 0, "AdamW weight_decay", weight_decay);
}

std::vector<std::string> AdamW::state_names() const {
  return {"exp_avg", "exp_avg_sq"};
}

bool AdamW::element_update(kernels::ElementUpdate& u, bool, std::int64_t step) const {
  const double t = static_cast<double>(step);
  u.rule = kernels::ElementUpdate::Rule::adamw;
  u.lr = lr;
  u.weight_decay = weight_decay_;
  u.beta1 = beta1_;
  u.beta2 = beta2_;
  u.eps = eps_;
  u.step_size = lr / (1.0 - std::pow(beta1_, t));
  u.bc2_sqrt = std::sqrt(1.0 - std::pow(beta2_, t));
  return true;
}

// ---- clip_grad_norm -------------------------------------------------------------------------

double local_sum_squares(const std::vector<graph::Parameter*>& params, const DeviceMesh& mesh,
                         Values which) {
  const bool grads = which == Values::gradients;
  const char* who = grads ? "clip_grad_norm" : "local_sum_squares";
  double local = 0.0;
  std::vector<const Tensor*> on_device;  // f32 device tensors: summed by kernels
  for (graph::Parameter* p : params) {
    if (p == nullptr) throw InvalidArgument(std::string(who) + ": null parameter in the list");
    const Tensor& g = grads ? p->grad() : p->data();
    if (!g.defined()) continue;
    if (g.space() != MemorySpace::host) {
#if defined(KOKKOS_ENABLE_CUDA)
      if (g.dtype() != DType::f32)
        throw InvalidArgument(std::string(who) + ": " + pname(*p) + ": device tensor has dtype " +
                              dtype_name(g.dtype()) + "; only f32 is supported");
      on_device.push_back(&g);
      continue;
#else
      // A host-only Kokkos: "device" memory is host memory, read as on the host.
#endif
    }
    if (g.dtype() == DType::f32) {  // the common case, without a per-element dtype switch
      const float* x = g.data_as<const float>();
      double sum = 0.0;
      for (std::int64_t e = 0, n = g.numel(); e < n; ++e)
        sum += double(x[e]) * double(x[e]);
      local += sum;
      continue;
    }
    for (std::int64_t e = 0; e < g.numel(); ++e) {
      const double x = g.at(e);
      local += x * x;
    }
  }
#if defined(KOKKOS_ENABLE_CUDA)
  if (!on_device.empty()) {
    // One sum of squares per tensor into a device array (asynchronous, on the compute stream
    // after the backward), then one copy of that array to the host: the only wait.
    DeviceExec execs;  // the instance on the compute stream, for this call
    const Kokkos::Cuda& exec = execs.on(mesh.compute_stream().native_handle());
    Kokkos::View<double*, Kokkos::CudaSpace> sums(
        Kokkos::view_alloc(exec, std::string("fullshard::local_sum_squares")), on_device.size());
    for (std::size_t i = 0; i < on_device.size(); ++i) {
      const float* g = on_device[i]->data_as<const float>();
      const std::int64_t n = on_device[i]->numel();
      Kokkos::parallel_reduce(
          "fullshard::local_sum_squares::sum_sq",
          Kokkos::RangePolicy<Kokkos::Cuda, Kokkos::IndexType<std::int64_t>>(exec, 0, n),
          SumSqKernel{g}, Kokkos::subview(sums, i));
    }
    auto host = Kokkos::create_mirror_view(Kokkos::HostSpace(), sums);
    Kokkos::deep_copy(exec, host, sums);
    exec.fence("fullshard::local_sum_squares: the sums of squares");
    for (std::size_t i = 0; i < on_device.size(); ++i)
      local += host(i);
  }
#else
  (void)mesh;
#endif
  return local;
}

bool local_all_finite(const std::vector<graph::Parameter*>& params, const DeviceMesh& mesh,
                      Values which) {
  const bool grads = which == Values::gradients;
  std::vector<graph::Parameter*> rest;  // not host f32: summed (non-finite iff one element is)
  bool finite = true;
  for (graph::Parameter* p : params) {
    if (p == nullptr) throw InvalidArgument("local_all_finite: null parameter in the list");
    const Tensor& t = grads ? p->grad() : p->data();
    if (!t.defined()) continue;
    if (t.space() != MemorySpace::host || t.dtype() != DType::f32) {
      rest.push_back(p);
      continue;
    }
    finite = kernels::all_finite(static_cast<const float*>(t.data()), t.numel()) && finite;
  }
  return finite && std::isfinite(local_sum_squares(rest, mesh, which));
}

double clip_grad_norm(const std::vector<graph::Parameter*>& params, double max_norm,
                      const DeviceMesh& mesh) {
  if (!(max_norm >= 0) || !std::isfinite(max_norm))
    throw InvalidArgument("clip_grad_norm: max_norm must be finite and >= 0, got " +
                          std::to_string(max_norm));
  for (graph::Parameter* p : params)
    if (const fsdp::FSDPModule* st = p ? state_of(*p) : nullptr;
        st != nullptr && fsdp::updates_in_backward(*st))
      throw InvalidArgument("clip_grad_norm: " + pname(*p) +
                            " is updated by its optimizer inside backward, which consumes its "
                            "gradient before the norm of all of them is known; clip with the "
                            "optimizer after backward (run_in_backward(false))");
  double local = local_sum_squares(params, mesh, Values::gradients);
  const std::string& dim = mesh.names().back();
  double total = 0.0;
  mesh.comm(dim, comm::StreamKind::compute)
      .all_reduce(&local, &total, 1, DType::f64, comm::ReduceOp::sum,
                  mesh.stream(comm::StreamKind::compute))
      .wait();
  const double norm = std::sqrt(total);
  scale_to_max_norm(params, norm, max_norm, mesh);
  return norm;
}

void scale_to_max_norm(const std::vector<graph::Parameter*>& params, double norm, double max_norm,
                       const DeviceMesh& mesh) {
  const double coef = max_norm / (norm + 1e-6);
  if (!(coef < 1.0)) return;  // within the norm (or a non-finite norm: nothing to scale by)
#if defined(KOKKOS_ENABLE_CUDA)
  void* stream = mesh.compute_stream().native_handle();
  DeviceExec execs;  // the instance on the compute stream, for the scaling
#else
  (void)mesh;
#endif
  for (graph::Parameter* p : params) {
    Tensor g = p->grad();
    if (!g.defined()) continue;
#if defined(KOKKOS_ENABLE_CUDA)
    if (g.space() == MemorySpace::device) {
      for_each_element("fullshard::clip_grad_norm::scale", ScaleKernel{g.data_as<float>(), coef},
                       g.numel(), g.space(), stream, execs);
      continue;
    }
#endif
    for (std::int64_t e = 0; e < g.numel(); ++e)
      g.set(e, g.at(e) * coef);
  }
}

// ---- WarmupCosine ---------------------------------------------------------------------------

WarmupCosine::WarmupCosine(double base_lr, int warmup_steps, int total_steps, double min_lr)
    : base_lr_(base_lr), min_lr_(min_lr), warmup_(warmup_steps), total_(total_steps) {
  if (!std::isfinite(base_lr) || !std::isfinite(min_lr) || min_lr < 0 || min_lr > base_lr)
    throw InvalidArgument("WarmupCosine: need 0 <= min_lr <= base_lr, got min_lr " +
                          std::to_string(min_lr) + ", base_lr " + std::to_string(base_lr));
  if (warmup_steps < 0 || total_steps <= warmup_steps)
    throw InvalidArgument("WarmupCosine: need 0 <= warmup_steps < total_steps, got " +
                          std::to_string(warmup_steps) + " and " + std::to_string(total_steps));
}

double WarmupCosine::lr(int step) const {
  if (step < 0) throw InvalidArgument("WarmupCosine: step " + std::to_string(step) + " < 0");
  if (step < warmup_) return base_lr_ * static_cast<double>(step) / static_cast<double>(warmup_);
  if (step >= total_) return min_lr_;
  const double progress =
      static_cast<double>(step - warmup_) / static_cast<double>(total_ - warmup_);
  return min_lr_ + (base_lr_ - min_lr_) * 0.5 * (1.0 + std::cos(kPi * progress));
}

}  // namespace fullshard::optim
