// fullshard::torch: the mirror of a LibTorch module tree, fully_shard on its modules, and the
// hooks around a sharded module's forward that LibTorch's autograd drives:
//   - pre-forward / post-forward around the forward call (ForwardCall);
//   - pre-backward: an identity autograd Function on the outputs, whose backward runs before
//     the module's backward (the all-gather, the implicit prefetch);
//   - post-backward: an identity Function on the inputs that require grad, whose backward runs
//     after the module's whole backward (autograd's gradients registered, the reduce-scatter);
//   - the root's end of backward: a callback queued on autograd's engine by the root's
//     pre-backward; it first finishes the modules whose post-backward never ran (no input
//     required grad, or unused outputs), as FSDP2's final callback does.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#if FULLSHARD_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "fullshard/base/error.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/schedule/executor.hpp"
#include "fullshard/torch/sharded_model.hpp"
#include "lib/fsdp/front_end.hpp"
#include "lib/fsdp/group_access.hpp"
#include "lib/torch/parameter_binding.hpp"

namespace fullshard::torch {

using namespace detail;  // the parameter bindings and the tensor conversions

struct ModuleState {
  ModelState* model = nullptr;
  ::torch::nn::Module* module = nullptr;
  graph::Module* mirror = nullptr;
  fsdp::FSDPModule* fsdp = nullptr;
  bool is_root = false;
  bool backward_pending = false;  // pre-backward ran, post-backward not yet
  std::vector<std::pair<graph::Parameter*, ParameterBinding*>> group;  // its group's params
};

// The sharded modules' own compute time and their hooks' time, while measured
// (ShardedModel::measure_compute): a frame per forward or backward in progress; a module's
// own time is its span (from the end of its pre-hook to the start of its post-hook) less the
// spans of the sharded modules inside it (their hooks' waits included); its hooks' time is the
// rest of its span.
struct ComputeClock {
  using Clock = std::chrono::steady_clock;
  struct Frame {
    ModuleState* state;
    Clock::time_point entered, started, ended;
    double inner_ms = 0;
  };
  struct Iteration {
    std::map<ModuleState*, std::pair<double, double>> modules;  // own forward, backward ms
    double hooks_ms = 0;
    bool complete = false;  // its backward ended (a step that failed part way is not one)
  };
  bool on = false;
  std::vector<Frame> forward, backward;  // in progress, innermost last
  std::vector<Iteration> iterations;     // per root forward with grad

  static double ms(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  }
  void enter(std::vector<Frame>& stack, ModuleState* s, Clock::time_point entered) {
    stack.push_back(Frame{s, entered, Clock::now(), {}, 0.0});
  }
  // Before `s`'s post-hook: ends its (innermost) frame into `out` and records its own time;
  // false when it has none (measuring started inside it).
  bool own(std::vector<Frame>& stack, ModuleState* s, bool backward_pass, Frame& out) {
    const Clock::time_point now = Clock::now();
    for (std::size_t i = stack.size(); i-- > 0;)
      if (stack[i].state == s) {
        out = stack[i];
        out.ended = now;
        stack.erase(stack.begin() + static_cast<std::ptrdiff_t>(i));
        if (!iterations.empty()) {
          auto& t = iterations.back().modules[s];
          (backward_pass ? t.second : t.first) += ms(out.started, now) - out.inner_ms;
        }
        return true;
      }
    return false;
  }
  // After its post-hook: the hooks' time, and its whole span is inner time of the frame
  // around it.
  void leave(std::vector<Frame>& stack, const Frame& f) {
    const Clock::time_point now = Clock::now();
    if (!iterations.empty())
      iterations.back().hooks_ms += ms(f.entered, f.started) + ms(f.ended, now);
    if (!stack.empty()) stack.back().inner_ms += ms(f.entered, now);
  }
};

struct ModelState {
  std::shared_ptr<::torch::nn::Module> root;
  std::unique_ptr<graph::Module> graph;
  std::unordered_map<const ::torch::nn::Module*, graph::Module*> mirror_of;
  std::unordered_map<std::string, at::Tensor> param_of;      // by FQN
  std::unordered_set<std::string> deferred;                  // meta parameters' FQNs
  std::vector<std::pair<std::string, at::Tensor>> whole;     // meta buffers, ignored params
  std::vector<std::pair<std::string, std::string>> aliases;  // tied: (FQN, first FQN)
  std::unordered_map<const ::torch::nn::Module*, std::unique_ptr<ModuleState>> states;
  std::vector<std::unique_ptr<ParameterBinding>> bindings;
  ModuleState* root_state = nullptr;
  int root_depth = 0;                 // the root's forward calls in progress
  bool inference = false;             // the root's forward runs without grad
  bool end_queued = false;            // the end-of-backward callback is queued
  std::vector<ModuleState*> pending;  // pre-backward order
  ComputeClock clock;
};

namespace {

std::mutex registry_mutex;
std::unordered_map<const ::torch::nn::Module*, ModuleState*>& registry() {
  static std::unordered_map<const ::torch::nn::Module*, ModuleState*> r;
  return r;
}

std::string describe(const ModuleState& s) {
  return s.is_root ? "the root module" : "module '" + s.mirror->fqn() + "'";
}

// ---- the hooks ---------------------------------------------------------------------------

// On a CUDA mesh the copy-in reads autograd's gradients on the reduce-scatter stream after
// the engine let them go: LibTorch's caching allocator must not hand their blocks out again
// before that stream's work ran (record_stream, as FSDP2 keeps them for its copy-in).
void record_on_copy_in_stream(ModuleState& s) {
#if FULLSHARD_TORCH_CUDA
  const DeviceMesh& mesh = s.fsdp->mesh();
  if (mesh.device_type() != DeviceType::cuda) return;
  auto* native = static_cast<cudaStream_t>(
      mesh.device_stream(comm::StreamKind::reduce_scatter).native_handle());
  for (auto& [param, binding] : s.group) {
    const at::Tensor& g = binding->param().grad();
    if (g.defined() && g.is_cuda())
      g.record_stream(c10::cuda::getStreamFromExternal(native, g.device().index()));
  }
#else
  (void)s;
#endif
}

void post_backward(ModuleState& s) {
  if (!s.backward_pending) return;
  s.backward_pending = false;
  ComputeClock& clock = s.model->clock;
  ComputeClock::Frame f{};
  const bool timed = clock.on && clock.own(clock.backward, &s, true, f);
  for (auto& [param, binding] : s.group)
    binding->register_gradient(*param);
  record_on_copy_in_stream(s);
  fsdp::post_backward(*s.mirror);
  if (timed) clock.leave(clock.backward, f);
}

void end_backward(ModelState& m) {
  m.end_queued = false;
  std::vector<ModuleState*> pending;
  pending.swap(m.pending);
  for (ModuleState* s : pending)
    if (s != m.root_state) post_backward(*s);
  post_backward(*m.root_state);
  if (m.clock.on && !m.clock.iterations.empty()) m.clock.iterations.back().complete = true;
}

// torch's zero_grad(set_to_none) dropped the sharded gradients of `s`'s group: so does
// fullshard (else the next reduction would accumulate into them). Checked where no show
// since the user's last chance to drop them can have put them back: at the root's
// pre-forward (for every group) and at each group's pre-backward (a zero_grad between
// forward and backward).
void sync_dropped_gradients(ModuleState& s) {
  bool dropped = false;
  for (auto& [param, binding] : s.group)
    dropped = dropped || binding->gradient_dropped(*param);
  if (!dropped) return;
  for (auto& [param, binding] : s.group)
    if (!binding->gradient_dropped(*param) && param->grad().defined())
      throw InvalidArgument("fullshard::torch: " + describe(s) +
                            ": some gradients of its group were set to none and others were "
                            "not (" +
                            param->fqn() +
                            "); zero all of a group's gradients the "
                            "same way (optimizer.zero_grad())");
  s.fsdp->zero_grad(/*recurse=*/false);
}

void pre_backward(ModuleState& s) {
  ModelState& m = *s.model;
  if (s.is_root && !m.end_queued) {
    m.end_queued = true;
    ::torch::autograd::Engine::get_default_engine().queue_callback([&m] { end_backward(m); });
  }
  if (s.backward_pending) return;
  const auto entered = m.clock.on ? ComputeClock::Clock::now() : ComputeClock::Clock::time_point{};
  sync_dropped_gradients(s);
  s.backward_pending = true;
  m.pending.push_back(&s);
  fsdp::pre_backward(*s.mirror);
  if (m.clock.on) m.clock.enter(m.clock.backward, &s, entered);
}

using ::torch::autograd::AutogradContext;
using ::torch::autograd::variable_list;

// An identity autograd node over a module's tensors whose backward calls `Hook` (once, when
// the gradients of all of them are there): on the outputs, pre_backward runs before the
// module's backward; on the inputs, post_backward after the module's whole backward.
template <void (*Hook)(ModuleState&)>
struct Boundary : ::torch::autograd::Function<Boundary<Hook>> {
  static variable_list forward(AutogradContext* ctx, at::TensorList xs, int64_t state) {
    ctx->saved_data["state"] = state;
    ctx->set_materialize_grads(false);
    return xs.vec();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Hook(*reinterpret_cast<ModuleState*>(ctx->saved_data["state"].toInt()));
    grads.emplace_back();  // the state argument
    return grads;
  }
};
using PreBackward = Boundary<pre_backward>;
using PostBackward = Boundary<post_backward>;

// Routes the tensors that require grad through Fn (one autograd node for all of them).
template <class Fn>
std::vector<at::Tensor> through(std::vector<at::Tensor> ts, ModuleState& s) {
  if (!::torch::GradMode::is_enabled()) return ts;
  std::vector<at::Tensor> diff;
  for (const at::Tensor& t : ts)
    if (t.defined() && t.requires_grad()) diff.push_back(t);
  if (diff.empty()) return ts;
  std::vector<at::Tensor> out = Fn::apply(at::TensorList(diff), reinterpret_cast<int64_t>(&s));
  std::size_t k = 0;
  for (at::Tensor& t : ts)
    if (t.defined() && t.requires_grad()) t = out[k++];
  return ts;
}

// ---- the mirror ----------------------------------------------------------------------------

void mirror(ModelState& m, ::torch::nn::Module& tm, graph::Module& gm,
            std::unordered_map<const c10::TensorImpl*, std::string>& seen) {
  m.mirror_of[&tm] = &gm;
  for (const auto& item : tm.named_parameters(/*recurse=*/false)) {
    const at::Tensor& t = item.value();
    const std::string fqn = gm.fqn().empty() ? item.key() : gm.fqn() + "." + item.key();
    if (!t.defined()) continue;
    auto [it, fresh] = seen.emplace(t.unsafeGetTensorImpl(), fqn);
    if (!fresh) {
      // A tied parameter (an embedding and an output head): one graph parameter, at its first
      // FQN; its binding updates the one tensor both modules hold. Its group must cover
      // every module that uses it (FSDP2's rule): the root's, unless a common ancestor's.
      m.aliases.emplace_back(fqn, it->second);
      continue;
    }
    if (!t.is_contiguous())
      throw InvalidArgument("fullshard::torch: parameter '" + fqn +
                            "' is not contiguous; make it contiguous before sharding");
    const DType dt = dtype_of(t.scalar_type(), "parameter '" + fqn + "'");
    Shape shape(t.sizes().begin(), t.sizes().end());
    if (shape.empty()) shape = {1};
    graph::Parameter& p = gm.add_param(item.key(), shape, dt, t.requires_grad());
    m.param_of[p.fqn()] = t;
    if (t.is_meta()) {  // deferred initialisation: no values (fully_shard's shards are zeros)
      m.deferred.insert(p.fqn());
      continue;
    }
    auto keep = std::make_shared<at::Tensor>(t.detach());
    p.set_data(Tensor::from_owner(keep, t.data_ptr(), shape, dt,
                                  t.is_cuda() ? MemorySpace::device : MemorySpace::host));
  }
  for (const auto& child : tm.named_children())
    mirror(m, *child.value(), gm.add_module(child.key()), seen);
}

// Deferred initialisation, at the root's fully_shard: what fully_shard does not shard (buffers,
// ignored parameters) and is still on the meta device becomes a zero tensor on `device`.
void materialize_whole(ModelState& m, const c10::Device& device) {
  auto materialize = [&](const std::string& fqn, at::Tensor t) {
    if (!t.defined() || !t.is_meta()) return;
    const at::Tensor real = at::zeros(t.sizes(), t.options().device(device));
    t.unsafeGetTensorImpl()->shallow_copy_from(real.getIntrusivePtr());
    m.whole.emplace_back(fqn, t);
  };
  for (graph::Parameter* p : m.graph->parameters()) {
    at::Tensor t = m.param_of.at(p->fqn());
    if (p->binding() || !t.is_meta()) continue;
    materialize(p->fqn(), t);
    auto keep = std::make_shared<at::Tensor>(t.detach());
    p->set_data(Tensor::from_owner(keep, t.data_ptr(), p->shape(), p->dtype(),
                                   t.is_cuda() ? MemorySpace::device : MemorySpace::host));
  }
  for (const auto& item : m.root->named_buffers(/*recurse=*/true))
    materialize(item.key(), item.value());
}

// On a CUDA mesh the compute stream is the one LibTorch computes on (its current stream at the
// root's forward): the copy-outs into the unsharded parameters and the engine's waits are
// ordered with the model's kernels on it, and backward runs on the forward's streams.
void use_torch_stream(ModelState& m) {
#if FULLSHARD_TORCH_CUDA
  const DeviceMesh* last = nullptr;
  for (auto& [module, st] : m.states) {
    const DeviceMesh& mesh = st->fsdp->mesh();
    if (mesh.device_type() != DeviceType::cuda || &mesh == last) continue;
    mesh.set_compute_stream(c10::cuda::getCurrentCUDAStream().stream());
    last = &mesh;
  }
#else
  (void)m;
#endif
}

}  // namespace

ModuleState* module_state(const ::torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(module);
  return it == registry().end() ? nullptr : it->second;
}

ForwardCall::ForwardCall(ModuleState& s) : state_(&s) {
  ModelState& m = *s.model;
  if (!m.root_state)
    throw InvalidArgument("fullshard::torch: " + describe(s) +
                          " was called before fully_shard was applied to the root module; "
                          "call fully_shard on the model's root last, then call the root");
  // (the clock is read only while measuring: a step that is not measured pays nothing for it)
  const auto entered = m.clock.on ? ComputeClock::Clock::now() : ComputeClock::Clock::time_point{};
  const bool recompute = m.root_depth == 0 && !m.pending.empty();
  if (s.is_root) {
    if (m.root_depth++ == 0) {
      use_torch_stream(m);
      m.inference = !::torch::GradMode::is_enabled();
      for (auto& [module, st] : m.states)
        sync_dropped_gradients(*st);
      if (m.clock.on && !m.inference) m.clock.iterations.emplace_back();
    }
  } else if (m.root_depth == 0 && !recompute) {
    throw InvalidArgument("fullshard::torch: " + describe(s) +
                          " was called outside its FSDP root's forward; call the root "
                          "(fullshard::torch::call(model, ...)) and let it call its children");
  }
  fsdp::pre_forward(*s.mirror);
  // Measured in a training forward; a recomputation inside backward is backward time.
  if (m.clock.on && !m.inference && m.pending.empty()) m.clock.enter(m.clock.forward, &s, entered);
}

ForwardCall::~ForwardCall() {
  if (finished_) return;
  ModelState& m = *state_->model;
  ComputeClock::Frame f{};
  if (m.clock.on) m.clock.own(m.clock.forward, state_, false, f);  // left by an exception
  if (state_->is_root) --m.root_depth;
}

namespace {
// Mixed precision: floating-point tensors in `dtype` (FSDP2's cast_forward_inputs and
// output_dtype).
void cast_floating(std::vector<at::Tensor>& ts, DType dtype) {
  const c10::ScalarType to = scalar_type(dtype);
  for (at::Tensor& t : ts)
    if (t.defined() && t.is_floating_point() && t.scalar_type() != to) t = t.to(to);
}
}  // namespace

std::vector<at::Tensor> ForwardCall::inputs(std::vector<at::Tensor> tensors) {
  const fsdp::MixedPrecisionPolicy& mp = state_->fsdp->options().mp_policy;
  if (mp.cast_forward_inputs && mp.param_dtype) cast_floating(tensors, *mp.param_dtype);
  return through<PostBackward>(std::move(tensors), *state_);
}

std::vector<at::Tensor> ForwardCall::outputs(std::vector<at::Tensor> tensors) {
  ModuleState& s = *state_;
  ModelState& m = *s.model;
  ComputeClock::Frame f{};
  const bool timed = m.clock.on && m.clock.own(m.clock.forward, &s, false, f);
  fsdp::post_forward(*s.mirror);
  finished_ = true;
  if (timed) m.clock.leave(m.clock.forward, f);
  if (s.is_root && --m.root_depth == 0 && m.inference) {
    // No backward follows: every group reshards, the root's too.
    for (fsdp::FSDPModule* st : s.fsdp->subtree_states())
      if (!st->is_sharded()) st->reshard();
  }
  if (const auto& out = s.fsdp->options().mp_policy.output_dtype) cast_floating(tensors, *out);
  return through<PreBackward>(std::move(tensors), s);
}

// ---- ShardedModel ----------------------------------------------------------------------------

ShardedModel::ShardedModel(std::shared_ptr<::torch::nn::Module> root, const std::string& root_name)
    : state_(std::make_unique<ModelState>()) {
  if (!root) throw InvalidArgument("fullshard::torch::ShardedModel: the root module is null");
  state_->root = std::move(root);
  state_->graph = graph::Module::make_root(root_name);
  std::unordered_map<const c10::TensorImpl*, std::string> seen;
  mirror(*state_, *state_->root, *state_->graph, seen);
}

ShardedModel::~ShardedModel() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (auto& [module, st] : state_->states)
    registry().erase(module);
  // The parameters keep the views they show (shards and sharded gradients stay valid).
  for (graph::Module* gm : state_->graph->modules_preorder())
    for (std::size_t i = 0; i < gm->num_params(); ++i)
      gm->param(i).set_binding(nullptr);
}

fsdp::FSDPModule& ShardedModel::fully_shard(::torch::nn::Module& module, const DeviceMesh& mesh,
                                            const fsdp::FullyShardOptions& options) {
  return fully_shard(std::vector<::torch::nn::Module*>{&module}, mesh, options);
}

fsdp::FSDPModule& ShardedModel::fully_shard(const std::vector<::torch::nn::Module*>& modules,
                                            const DeviceMesh& mesh,
                                            const fsdp::FullyShardOptions& options) {
  ModelState& m = *state_;
  if (modules.empty())
    throw InvalidArgument("fullshard::torch::fully_shard: an empty list of modules");
  std::vector<graph::Module*> mirrors;
  for (::torch::nn::Module* module : modules) {
    auto it = module ? m.mirror_of.find(module) : m.mirror_of.end();
    if (it == m.mirror_of.end())
      throw InvalidArgument("fullshard::torch::fully_shard: the module (" +
                            (module ? module->name() : std::string("null")) +
                            ") is not part of this model");
    mirrors.push_back(it->second);
  }
  auto name = [](const graph::Module& gm) {
    return gm.is_root() ? std::string("root module") : "'" + gm.fqn() + "'";
  };
  if (m.root_state)
    throw InvalidArgument("fullshard::torch::fully_shard(" + name(*mirrors.front()) +
                          "): the root module is already sharded; apply fully_shard bottom-up, "
                          "the root last");
  // Every parameter this call may group lives on the mesh's device, or on the meta device
  // (deferred initialisation); a foreign-device tensor has no values fully_shard could shard.
  const bool cuda = mesh.device_type() == DeviceType::cuda;
  for (graph::Module* gm : mirrors)
    for (graph::Parameter* p : gm->parameters()) {
      const at::Tensor& t = m.param_of.at(p->fqn());
      const bool on_mesh = t.is_meta() || (cuda ? t.device().is_cuda() : t.device().is_cpu());
      if (p->binding() || on_mesh) continue;  // grouped already, or where it belongs
      throw InvalidArgument("fullshard::torch::fully_shard(" + name(*gm) + "): parameter '" +
                            p->fqn() + "' is on " + t.device().str() + ", but the mesh is a " +
                            device_type_name(mesh.device_type()) +
                            " mesh; move the model to the mesh's device first");
    }
  fsdp::FSDPModule& st = mirrors.size() == 1 ? fsdp::fully_shard(*mirrors.front(), mesh, options)
                                             : fsdp::fully_shard(mirrors, mesh, options);
  fsdp::use_external_gradients(st);
  const c10::Device device =
      cuda ? c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice() : c10::kCPU;
  // The group's parameters, bound once; every module of a list group sees all of them (the
  // engine reduces the group after the last module's backward; registering a gradient that
  // autograd has not made yet is a no-op).
  std::vector<std::pair<graph::Parameter*, detail::ParameterBinding*>> group;
  for (graph::Parameter* p : fsdp::detail::group_params(st)) {
    m.bindings.push_back(
        std::make_unique<detail::ParameterBinding>(m.param_of.at(p->fqn()), device));
    detail::ParameterBinding* b = m.bindings.back().get();
    p->set_binding(b);
    b->data_shown(*p, true);
    b->grad_shown(*p, true);
    group.emplace_back(p, b);
  }
  for (std::size_t i = 0; i < modules.size(); ++i) {
    auto s = std::make_unique<ModuleState>();
    s->model = &m;
    s->module = modules[i];
    s->mirror = mirrors[i];
    s->fsdp = &st;
    s->is_root = mirrors[i]->is_root();
    s->group = group;
    if (s->is_root) {
      m.root_state = s.get();
      materialize_whole(m, device);
    }
    ModuleState* raw = s.get();
    m.states[modules[i]] = std::move(s);
    std::lock_guard<std::mutex> lock(registry_mutex);
    registry()[modules[i]] = raw;
  }
  return st;
}

fsdp::FSDPModule& ShardedModel::state(const ::torch::nn::Module& module) const {
  auto it = state_->states.find(&module);
  if (it == state_->states.end())
    throw InvalidArgument("fullshard::torch: fully_shard was not applied to module '" +
                          fqn(module) + "'");
  return *it->second->fsdp;
}

graph::Module& ShardedModel::graph() const {
  return *state_->graph;
}

std::vector<at::Tensor> ShardedModel::parameters() const {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const at::Tensor& p : state_->root->parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

const std::string& ShardedModel::fqn(const ::torch::nn::Module& module) const {
  auto it = state_->mirror_of.find(&module);
  if (it == state_->mirror_of.end())
    throw InvalidArgument("fullshard::torch: the module (" + module.name() +
                          ") is not part of this model");
  return it->second->fqn();
}

::torch::nn::Module& ShardedModel::module(const std::string& fqn) const {
  const graph::Module* gm = state_->graph->find_module(fqn);
  if (gm)
    for (const auto& [tm, mirror] : state_->mirror_of)
      if (mirror == gm) return *const_cast<::torch::nn::Module*>(tm);
  throw InvalidArgument("fullshard::torch: the model has no module '" + fqn + "'");
}

void ShardedModel::initialize(const std::function<void(const LocalShard&)>& init) {
  ModelState& m = *state_;
  if (!m.root_state)
    throw InvalidArgument(
        "fullshard::torch::ShardedModel::initialize: fully_shard was not applied to the root "
        "module yet; the shards exist once every fully_shard call ran (the root last)");
  ::torch::NoGradGuard no_grad;
  std::unordered_map<const graph::Module*, ModuleState*> state_of;
  for (auto& [module, st] : m.states)
    state_of[st->mirror] = st.get();
  std::unordered_set<const fsdp::FSDPModule*> done;  // a list group's modules share one
  for (graph::Module* gm : m.graph->modules_preorder()) {
    auto it = state_of.find(gm);
    if (it == state_of.end() || !done.insert(it->second->fsdp).second) continue;
    ModuleState& s = *it->second;
    const auto& members = s.fsdp->group_layout().members;  // layout order, as s.group
    for (std::size_t i = 0; i < s.group.size(); ++i) {
      auto& [param, binding] = s.group[i];
      if (!m.deferred.count(param->fqn())) continue;
      if (!s.fsdp->is_sharded())
        throw InvalidArgument("fullshard::torch::ShardedModel::initialize: " + describe(s) +
                              " is unsharded; initialize outside forward and backward (or "
                              "reshard() it first)");
      LocalShard shard;
      shard.fqn = param->fqn();
      shard.tensor = binding->param();
      shard.full_shape.assign(param->shape().begin(), param->shape().end());
      shard.row_offset = members[i].layout.global_offset.front();
      shard.sharded = true;
      if (shard.tensor.dim() == 0) shard.tensor = shard.tensor.view({1});
      init(shard);
    }
  }
  for (const auto& [fqn, t] : m.whole) {
    LocalShard whole;
    whole.fqn = fqn;
    whole.tensor = t;
    whole.full_shape.assign(t.sizes().begin(), t.sizes().end());
    init(whole);
  }
}

void ShardedModel::apply_plan(const schedule::Plan& plan, const DeviceMesh& mesh) {
  if (!plan.options.external_gradients)
    throw InvalidArgument(
        "fullshard::torch::apply_plan: the plan was made without "
        "PlanOptions::external_gradients; a LibTorch model's gradients come from autograd "
        "(plan it with external_gradients = true)");
  std::vector<const schedule::PlannedGroup*> groups;
  for (const schedule::PlannedGroup& g : plan.groups)
    groups.push_back(&g);
  // Bottom-up: deeper modules first (stable: the plan's order among equals).
  std::stable_sort(groups.begin(), groups.end(), [](const auto* a, const auto* b) {
    return a->modules.front()->depth() > b->modules.front()->depth();
  });
  for (const schedule::PlannedGroup* g : groups) {
    std::vector<::torch::nn::Module*> members;
    for (const graph::Module* gm : g->modules)
      members.push_back(&module(gm->fqn()));
    fully_shard(members, mesh, *g->options);
  }
  schedule::apply_plan_policies(*state_->graph, plan);
}

void ShardedModel::measure_compute(bool on) {
  ComputeClock& c = state_->clock;
  if (on && state_->root_depth > 0)
    throw InvalidArgument(
        "fullshard::torch::ShardedModel::measure_compute: called inside the root's forward; "
        "start measuring between steps");
  if (on) {
    for (auto& [module, st] : state_->states)
      if (st->fsdp->mesh().device_type() != DeviceType::cpu)
        throw InvalidArgument("fullshard::torch::ShardedModel::measure_compute: " + describe(*st) +
                              " computes on a GPU; the host clock measures the CPU only");
    c.iterations.clear();
  }
  c.on = on;
  c.forward.clear();
  c.backward.clear();
}

MeasuredCompute ShardedModel::measured_compute() const {
  const ComputeClock& c = state_->clock;
  MeasuredCompute out;
  for (const auto& [module, st] : state_->states)
    out.modules[st->mirror->fqn()] = schedule::ModuleTime{};
  std::vector<const ComputeClock::Iteration*> done;
  for (const auto& it : c.iterations)
    if (it.complete) done.push_back(&it);
  out.iterations = done.size();
  if (done.empty()) return out;
  // The mean over the faster half of the iterations by their measured total (modules and
  // hooks): what the steps after a warm-up take (the first steps run slower for a while, and
  // interruptions only add time), and its parts still add up (where ranks share cores, a rank
  // is off its core in a module in one iteration and in a hook's wait in the next: the parts'
  // own medians would add up to more than an iteration takes).
  const std::size_t n = done.size();
  std::vector<double> total(n, 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    total[i] = done[i]->hooks_ms;
    for (const auto& [st, t] : done[i]->modules)
      total[i] += t.first + t.second;
  }
  std::vector<std::size_t> order(n);
  for (std::size_t i = 0; i < n; ++i)
    order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return total[a] < total[b]; });
  const std::size_t keep = std::max<std::size_t>(1, n / 2);
  for (std::size_t k = 0; k < keep; ++k) {
    const ComputeClock::Iteration& it = *done[order[k]];
    for (const auto& [st, t] : it.modules) {
      schedule::ModuleTime& m = out.modules[st->mirror->fqn()];
      m.forward_ms += t.first / double(keep);
      m.backward_ms += t.second / double(keep);
    }
    out.hooks_ms += it.hooks_ms / double(keep);
  }
  return out;
}

schedule::AutoPlan ShardedModel::auto_shard(
    const DeviceMesh& mesh, schedule::AutoPlanOptions options,
    const std::vector<const ::torch::nn::Module*>& candidates) {
  if (!state_->states.empty())
    throw InvalidArgument(
        "fullshard::torch::auto_shard: fully_shard was already applied to "
        "this model; auto_shard makes every call itself");
  // Only the candidates are searched (no request); every other module never is a group.
  std::unordered_set<const graph::Module*> free;
  for (const ::torch::nn::Module* c : candidates) {
    auto it = c ? state_->mirror_of.find(c) : state_->mirror_of.end();
    if (it == state_->mirror_of.end())
      throw InvalidArgument("fullshard::torch::auto_shard: a candidate module (" +
                            (c ? c->name() : std::string("null")) + ") is not part of this model");
    free.insert(it->second);
  }
  for (graph::Module* gm : state_->graph->modules_preorder())
    if (!gm->is_root() && !free.count(gm)) gm->set_fully_shard_request(false);
  options.keep_requests = true;
  options.base.external_gradients = true;
  schedule::AutoPlan ap =
      schedule::auto_plan(*state_->graph, schedule::MeshShape::of(mesh), options);
  schedule::apply_auto_plan(*state_->graph, ap.choice);
  apply_plan(ap.plan, mesh);
  return ap;
}

}  // namespace fullshard::torch
