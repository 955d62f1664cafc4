#include "fullshard/optim/optimizer.hpp"

#include <cmath>
#include <set>
#include <unordered_set>

#include "fullshard/base/error.hpp"
#include "fullshard/comm/stream.hpp"
#include "fullshard/fsdp/fully_shard.hpp"

namespace fullshard::optim {

namespace {

constexpr double kPi = 3.14159265358979323846;

std::string pname(const graph::Parameter& p) {
  return "parameter '" + p.fqn() + "'";
}

void check_hyper(bool ok, const std::string& what, double v) {
  if (!ok || !std::isfinite(v))
    throw InvalidArgument("optimizer: bad " + what + " " + std::to_string(v));
}

Tensor copy_of(const Tensor& t) {
  Tensor out = Tensor::empty(t.shape(), t.dtype(), MemorySpace::host, "fullshard::optim_state");
  copy_bytes(out, t);
  return out;
}

}  // namespace

Optimizer::Optimizer(std::vector<graph::Parameter*> params) : params_(std::move(params)) {
  std::unordered_set<const graph::Parameter*> seen;
  for (const graph::Parameter* p : params_) {
    if (p == nullptr) throw InvalidArgument("optimizer: null parameter in the list");
    if (!seen.insert(p).second)
      throw InvalidArgument("optimizer: " + pname(*p) + " is listed twice");
    if (p->dtype() != DType::f32)
      throw InvalidArgument("optimizer: " + pname(*p) + " has dtype " + dtype_name(p->dtype()) +
                            "; only f32 parameters are supported");
  }
  state_.resize(params_.size());
}

void Optimizer::step() {
  // Check everything before writing anything.
  for (const graph::Parameter* p : params_) {
    const Tensor& g = p->grad();
    if (!g.defined()) continue;  // no gradient
    const Tensor& d = p->data();
    if (d.dtype() != DType::f32 || g.dtype() != DType::f32)
      throw InvalidArgument("optimizer: " + pname(*p) + ": data and gradient must be f32");
    if (d.space() != MemorySpace::host || g.space() != MemorySpace::host)
      throw InvalidArgument("optimizer: " + pname(*p) + ": tensors must be in host memory");
    if (d.shape() != g.shape())
      throw InvalidArgument("optimizer: " + pname(*p) + ": gradient shape " +
                            shape_string(g.shape()) + " differs from the data's " +
                            shape_string(d.shape()));
  }
  ++step_;
  const std::size_t ns = state_names().size();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    graph::Parameter& p = *params_[i];
    const Tensor& g = p.grad();
    if (!g.defined()) continue;
    bool fresh = false;
    if (state_[i].size() != ns || (ns > 0 && state_[i][0].shape() != p.data().shape())) {
      state_[i].clear();
      for (std::size_t s = 0; s < ns; ++s)
        state_[i].push_back(Tensor::zeros(p.data().shape(), DType::f32, MemorySpace::host,
                                          "fullshard::optim_state"));
      fresh = true;
    }
    update(p, g, state_[i], fresh, step_);
  }
}

void Optimizer::zero_grad() {
  std::vector<fsdp::FSDPModule*> states;
  std::set<fsdp::FSDPModule*> seen;
  for (graph::Parameter* p : params_) {
    fsdp::FSDPModule* st = nullptr;
    for (graph::Module* m = &p->module(); m != nullptr && st == nullptr; m = m->parent())
      st = fsdp::fsdp_state(*m);
    if (st != nullptr && seen.insert(st).second) states.push_back(st);
  }
  for (fsdp::FSDPModule* st : states)
    st->zero_grad();
  for (graph::Parameter* p : params_) {
    Tensor g = p->grad();
    if (g.defined() && g.numel() > 0 && g.space() == MemorySpace::host) g.fill(0.0);
  }
}

std::map<std::string, Tensor> Optimizer::state_dict() const {
  std::map<std::string, Tensor> out;
  const std::vector<std::string> names = state_names();
  for (std::size_t i = 0; i < params_.size(); ++i)
    for (std::size_t s = 0; s < state_[i].size(); ++s)
      out[params_[i]->fqn() + "." + names[s]] = copy_of(state_[i][s]);
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
    if (t.dtype() != DType::f32 || t.space() != MemorySpace::host)
      throw InvalidArgument("load_state_dict: key '" + key + "' must be an f32 host tensor");
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
    for (const std::string& n : names)
      state_[i].push_back(copy_of(state.at(params_[i]->fqn() + "." + n)));
  }
  step_ = step;
}

void Optimizer::load_state_dict(std::map<std::string, Tensor>&& state) {
  std::vector<bool> has_state;
  const std::int64_t step = checked_step(state, &has_state);
  const std::vector<std::string> names = state_names();
  // Allocate first, then move: nothing below can fail once the state is being replaced.
  std::vector<std::vector<Tensor>> next(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!has_state[i]) continue;
    next[i].reserve(names.size());
    for (const std::string& n : names)
      next[i].push_back(std::move(state.at(params_[i]->fqn() + "." + n)));
  }
  state_.swap(next);
  step_ = step;
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

void SGD::update(graph::Parameter& p, const Tensor& grad, std::vector<Tensor>& state, bool fresh,
                 std::int64_t) {
  float* w = p.data().data_as<float>();
  const float* g = grad.data_as<float>();
  float* b = state.empty() ? nullptr : state[0].data_as<float>();
  const std::int64_t n = grad.numel();
  for (std::int64_t e = 0; e < n; ++e) {
    double d = static_cast<double>(g[e]) + weight_decay_ * static_cast<double>(w[e]);
    if (b != nullptr) {
      const double buf = fresh ? d : momentum_ * static_cast<double>(b[e]) + d;
      b[e] = static_cast<float>(buf);
      d = nesterov_ ? d + momentum_ * buf : buf;
    }
    w[e] = static_cast<float>(static_cast<double>(w[e]) - lr * d);
  }
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

void AdamW::update(graph::Parameter& p, const Tensor& grad, std::vector<Tensor>& state, bool,
                   std::int64_t step) {
  float* w = p.data().data_as<float>();
  const float* g = grad.data_as<float>();
  float* m = state[0].data_as<float>();
  float* v = state[1].data_as<float>();
  const double t = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(beta1_, t);
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(beta2_, t));
  const double step_size = lr / bc1;
  const std::int64_t n = grad.numel();
  for (std::int64_t e = 0; e < n; ++e) {
    const double gd = g[e];
    double pw = static_cast<double>(w[e]) * (1.0 - lr * weight_decay_);
    const double md = beta1_ * static_cast<double>(m[e]) + (1.0 - beta1_) * gd;
    const double vd = beta2_ * static_cast<double>(v[e]) + (1.0 - beta2_) * gd * gd;
    m[e] = static_cast<float>(md);
    v[e] = static_cast<float>(vd);
    pw -= step_size * md / (std::sqrt(vd) / bc2_sqrt + eps_);
    w[e] = static_cast<float>(pw);
  }
}

// ---- clip_grad_norm -------------------------------------------------------------------------

double clip_grad_norm(const std::vector<graph::Parameter*>& params, double max_norm,
                      const DeviceMesh& mesh) {
  if (!(max_norm >= 0) || !std::isfinite(max_norm))
    throw InvalidArgument("clip_grad_norm: max_norm must be finite and >= 0, got " +
                          std::to_string(max_norm));
  double local = 0.0;
  for (const graph::Parameter* p : params) {
    if (p == nullptr) throw InvalidArgument("clip_grad_norm: null parameter in the list");
    const Tensor& g = p->grad();
    if (!g.defined()) continue;
    if (g.space() != MemorySpace::host)
      throw InvalidArgument("clip_grad_norm: " + pname(*p) + ": gradient not in host memory");
    for (std::int64_t e = 0; e < g.numel(); ++e) {
      const double x = g.at(e);
      local += x * x;
    }
  }
  const std::string& dim = mesh.names().back();
  double total = 0.0;
  mesh.comm(dim, Channel::main)
      .all_reduce(&local, &total, 1, DType::f64, comm::ReduceOp::sum, mesh.stream(Channel::main))
      .wait();
  const double norm = std::sqrt(total);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0)
    for (graph::Parameter* p : params) {
      Tensor g = p->grad();
      if (!g.defined()) continue;
      for (std::int64_t e = 0; e < g.numel(); ++e)
        g.set(e, g.at(e) * coef);
    }
  return norm;
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
