// fullshard::torch — FSDP2's fully_shard for LibTorch (PyTorch C++) models, with LibTorch's
// autograd driving the hooks. CMake target fullshard::torch (built when CMake finds Torch).
//
//   namespace fst = fullshard::torch;
//   auto model = std::make_shared<Net>();                  // any torch::nn::Module
//   fst::ShardedModel sharded(model);                      // mirrors its module tree
//   for (auto& block : model->blocks) sharded.fully_shard(*block, mesh);
//   sharded.fully_shard(*model, mesh);                     // the root last (bottom-up)
//   torch::optim::AdamW opt(sharded.parameters(), ...);    // the local shards, each once
//   auto loss = fst::call(model, x).pow(2).mean();         // forward through the hooks
//   loss.backward();                                       // reduce-scatters the gradients
//   opt.step();
//
// What a model's code changes: every call of a sharded module goes through fst::call
// (`x = block(x)` becomes `x = fst::call(block, x)`), the root's included. LibTorch modules
// have no forward hooks, so a parent that calls `child->forward(x)` directly runs the child
// on whatever its parameters show (the shards): an error in shapes, or wrong numbers.
//
// After fully_shard, model->parameters() are this rank's dim-0 shards (torch.chunk rule,
// FQNs unchanged); during a sharded module's forward and backward they are the unsharded
// parameters, over fullshard's buffers (no copy; their storage is dropped at reshard while
// autograd's saved tensors keep the storage object); after backward each param.grad() is
// this rank's shard of the full-batch gradient (the mean over the data-parallel ranks).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "fullshard/schedule/compute_cost.hpp"
#include "fullshard/schedule/plan.hpp"
#include "fullshard/torch/deferred_init.hpp"

namespace fullshard::torch {

// Opaque: a sharded model's and a sharded module's state (lib/torch/sharded_model.cpp).
struct ModelState;
struct ModuleState;

/// What ShardedModel::measure_compute recorded over the root's training forwards (each with its
/// backward): the means over the faster half of them by their measured total (modules and
/// hooks; the fastest of three): what the steady steps take (warm-up and interruptions only
/// add time), and the parts add up.
struct MeasuredCompute {
  /// Per sharded module (by FQN, "" for the root): its own forward and backward ms.
  std::map<std::string, schedule::ModuleTime> modules;
  /// The sharded modules' FSDP hooks, all of them, per forward and backward.
  double hooks_ms = 0;
  /// The root's training forwards recorded whose backward ended (one that failed part way is
  /// not counted).
  std::size_t iterations = 0;
};

/// fullshard's side of one LibTorch model: its module tree mirrored as fullshard's module
/// graph (names, parameter shapes and dtypes), the FSDP states fully_shard gives its modules,
/// and the bindings of its parameters. Keep it alive while the model trains; not copyable.
class ShardedModel {
 public:
  /// Mirrors `root`'s module tree (registration order, torch FQNs; the root's name is not part
  /// of any FQN). Parameters must be contiguous f32, f64, f16 or bf16 tensors (InvalidArgument
  /// naming the FQN otherwise). A parameter registered in two modules (tied embedding and
  /// output head) is one graph parameter at its first FQN; put both modules in one group
  /// (FSDP2's rule: shard neither of them on its own, so the root's group holds it).
  explicit ShardedModel(std::shared_ptr<::torch::nn::Module> root,
                        const std::string& root_name = "model");
  template <class Impl>
  explicit ShardedModel(const ::torch::nn::ModuleHolder<Impl>& root,
                        const std::string& root_name = "model")
      : ShardedModel(std::static_pointer_cast<::torch::nn::Module>(root.ptr()), root_name) {}
  ~ShardedModel();
  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;

  /// fully_shard on a module of the model (collective over `mesh`; bottom-up: blocks first,
  /// the root last). Its parameters not grouped by an earlier call become one communication
  /// group; the torch parameters become this rank's shards at once. Returns the FSDP controls
  /// (unshard, reshard, set_requires_gradient_sync, prefetch lists, ...).
  fsdp::FSDPModule& fully_shard(::torch::nn::Module& module, const DeviceMesh& mesh,
                                const fsdp::FullyShardOptions& options = {});
  /// FSDP2's fully_shard([m1, m2, ...]): one communication group for several modules (a list
  /// group), unsharded at the first module's forward and resharded after the last's; the
  /// gradients are reduce-scattered once, after the backward of every module of the list.
  fsdp::FSDPModule& fully_shard(const std::vector<::torch::nn::Module*>& modules,
                                const DeviceMesh& mesh,
                                const fsdp::FullyShardOptions& options = {});
  template <class Impl>
  fsdp::FSDPModule& fully_shard(const ::torch::nn::ModuleHolder<Impl>& module,
                                const DeviceMesh& mesh,
                                const fsdp::FullyShardOptions& options = {}) {
    return fully_shard(*module.ptr(), mesh, options);
  }

  /// The FSDP state of a module fully_shard was applied to (InvalidArgument otherwise).
  fsdp::FSDPModule& state(const ::torch::nn::Module& module) const;
  /// The model's module graph (Scheduler::plan plans it; its parameters show what the torch
  /// parameters show).
  graph::Module& graph() const;
  /// The model's parameter tensors, each once, in registration order: give these to an
  /// optimizer. LibTorch's Module::parameters() lists a tensor once per module that registers
  /// it, so a tied weight (a GPT's output head is its token embedding) would be stepped twice
  /// per step by an optimizer given that list.
  std::vector<at::Tensor> parameters() const;
  /// The FQN of a module of the model ("" for the root).
  const std::string& fqn(const ::torch::nn::Module& module) const;
  /// The module at `fqn` ("" for the root); InvalidArgument naming it when there is none.
  ::torch::nn::Module& module(const std::string& fqn) const;

  /// Deferred initialisation (fullshard/torch/deferred_init.hpp): calls `init` once for each
  /// tensor that was on the meta device when the model was mirrored, in FQN order: every
  /// sharded parameter with this rank's shard, then the buffers and ignored parameters whole.
  /// `init` writes the values in place (NoGradGuard is on). Ranks that hold the same rows
  /// (HSDP's replicas) must write the same values: draw them from a generator seeded by the
  /// shard coordinate, or compute them from the FQN and the row. Call after the root's
  /// fully_shard, outside forward and backward (InvalidArgument otherwise); again to
  /// re-initialise. Not collective.
  void initialize(const std::function<void(const LocalShard&)>& init);

  /// Shards the model as `plan` says (Scheduler::plan of graph() with fully_shard requests on
  /// its modules and PlanOptions::external_gradients, the way fullshard::torch runs): the
  /// plan's fully_shard calls, bottom-up, with each group's options, then the plan's policies
  /// (prefetch, reduce-scatter buffers, ...). A LibTorch run then issues the plan's operations
  /// and its pool peak is the plan's. Collective over `mesh`.
  void apply_plan(const schedule::Plan& plan, const DeviceMesh& mesh);
  /// The auto-planner on this model (schedule::auto_plan with external gradients): chooses
  /// which of `candidates` (the modules the model calls through fullshard::torch::call, as an
  /// FSDP2 auto-wrap policy names them; no other module can be a group: LibTorch's modules
  /// call their children directly) become groups besides the root, and the policies, under
  /// options.memory_budget_bytes; applies them (apply_plan) and returns what it chose. Call
  /// before any fully_shard. Collective. InvalidArgument for a candidate outside the model;
  /// schedule::AutoPlanInfeasible when nothing fits.
  schedule::AutoPlan auto_shard(const DeviceMesh& mesh, schedule::AutoPlanOptions options,
                                const std::vector<const ::torch::nn::Module*>& candidates);

  /// Measures the sharded modules' own compute time, what the planner's module costs stand for
  /// (graph::Cost: a module's own work, without its children), and the time their FSDP hooks
  /// take: while on, each training forward and backward of a module fully_shard was applied to
  /// records its own time, the wall time from the end of its pre-hook (the all-gather waited
  /// for) to the start of its post-hook less the spans of the sharded modules it calls, and
  /// its hooks' time (the pre- and post-hook: all-gathers, reduce-scatters, copies and the
  /// waits for them). A recomputation inside backward (activation checkpointing) counts as
  /// backward time. true starts afresh; call between steps. CPU meshes only (InvalidArgument
  /// for a module on a GPU: the host clock does not see its kernels). Not collective.
  void measure_compute(bool on);
  /// What measure_compute recorded (see MeasuredCompute).
  MeasuredCompute measured_compute() const;

 private:
  std::unique_ptr<ModelState> state_;
};

/// The FSDP state of a module fully_shard was applied to, or nullptr (then call() is a plain
/// forward call).
ModuleState* module_state(const ::torch::nn::Module* module);

/// One forward call of a sharded module (what call() does; a front end whose modules take
/// other argument kinds can use it directly): the pre-forward hook at construction; the
/// post-backward boundary on the inputs (inputs()), the post-forward hook and the
/// pre-backward boundary on the outputs (outputs()).
class ForwardCall {
 public:
  explicit ForwardCall(ModuleState& state);
  /// A forward left by an exception: the root's call count goes back (no post-forward: call
  /// reset_iter_state() on the root's FSDP state, as with the native hooks).
  ~ForwardCall();
  ForwardCall(const ForwardCall&) = delete;
  ForwardCall& operator=(const ForwardCall&) = delete;
  /// The inputs, routed through the post-backward boundary where they require grad.
  std::vector<at::Tensor> inputs(std::vector<at::Tensor> tensors);
  /// Post-forward, then the outputs routed through the pre-backward boundary.
  std::vector<at::Tensor> outputs(std::vector<at::Tensor> tensors);

 private:
  ModuleState* state_;
  bool finished_ = false;
};

/// How call() routes a forward's arguments and results through the autograd boundaries: a
/// tensor, a vector of tensors and a tuple of tensors cross them; anything else passes as it
/// is.
struct ForwardArgs {
  template <class T>
  struct IsTensorTuple : std::false_type {};
  template <class... T>
  struct IsTensorTuple<std::tuple<T...>>
      : std::bool_constant<(std::is_same_v<std::decay_t<T>, at::Tensor> && ...)> {};

  /// Whether values of type T cross the boundaries.
  template <class T>
  static constexpr bool crosses =
      std::is_same_v<T, at::Tensor> || std::is_same_v<T, std::vector<at::Tensor>> ||
      IsTensorTuple<T>::value;

  /// Appends the tensors of one argument or result to `out`, in order.
  static void collect(std::vector<at::Tensor>& out, const at::Tensor& t) { out.push_back(t); }
  static void collect(std::vector<at::Tensor>& out, const std::vector<at::Tensor>& ts) {
    out.insert(out.end(), ts.begin(), ts.end());
  }
  template <class... T, std::enable_if_t<IsTensorTuple<std::tuple<T...>>::value, int> = 0>
  static void collect(std::vector<at::Tensor>& out, const std::tuple<T...>& t) {
    std::apply([&](const auto&... x) { (out.push_back(x), ...); }, t);
  }
  template <class T, std::enable_if_t<!crosses<std::decay_t<T>>, int> = 0>
  static void collect(std::vector<at::Tensor>&, const T&) {}

  /// The same argument or result with its tensors taken from `from`, in order from `i`.
  static at::Tensor replace(const at::Tensor&, const std::vector<at::Tensor>& from,
                            std::size_t& i) {
    return from[i++];
  }
  static std::vector<at::Tensor> replace(const std::vector<at::Tensor>& ts,
                                         const std::vector<at::Tensor>& from, std::size_t& i) {
    std::vector<at::Tensor> r(from.begin() + static_cast<std::ptrdiff_t>(i),
                              from.begin() + static_cast<std::ptrdiff_t>(i + ts.size()));
    i += ts.size();
    return r;
  }
  template <class... T, std::enable_if_t<IsTensorTuple<std::tuple<T...>>::value, int> = 0>
  static std::tuple<T...> replace(const std::tuple<T...>& t, const std::vector<at::Tensor>& from,
                                  std::size_t& i) {
    std::tuple<T...> r = t;
    std::apply([&](auto&... x) { ((x = from[i++]), ...); }, r);
    return r;
  }
  template <class T, std::enable_if_t<!crosses<std::decay_t<T>>, int> = 0>
  static T&& replace(T&& x, const std::vector<at::Tensor>&, std::size_t&) {
    return std::forward<T>(x);
  }

  /// The module object behind a ModuleHolder, a shared_ptr or a reference.
  template <class M>
  static auto* module_of(M& m) {
    if constexpr (std::is_base_of_v<::torch::nn::Module, std::decay_t<M>>)
      return &m;
    else
      return m.get();
  }
};

/// Calls `module->forward(args...)` (module: a ModuleHolder, a shared_ptr or the module) with
/// the FSDP hooks when fully_shard was applied to it: all-gather before, reshard after (by
/// reshard_after_forward), the pre-backward all-gather and the post-backward reduce-scatter
/// triggered by autograd. Tensor arguments, and results that are a tensor, a tuple of
/// tensors or a vector of tensors, cross the autograd boundaries; other arguments pass as
/// they are. Under torch::NoGradGuard (inference) no backward is expected: the root's call
/// reshards every group at its end. A module without FSDP state is called directly.
template <class M, class... Args>
auto call(M&& module, Args&&... args) {
  auto* impl = ForwardArgs::module_of(module);
  ModuleState* st = module_state(impl);
  if (!st) return impl->forward(std::forward<Args>(args)...);
  ForwardCall fc(*st);
  std::vector<at::Tensor> in;
  (ForwardArgs::collect(in, args), ...);
  in = fc.inputs(std::move(in));
  std::size_t i = 0;
  // Braced initialisation: the arguments are mapped left to right.
  std::tuple<decltype(ForwardArgs::replace(std::forward<Args>(args), in, i))...> mapped{
      ForwardArgs::replace(std::forward<Args>(args), in, i)...};
  auto out = std::apply([&](auto&&... a) { return impl->forward(std::forward<decltype(a)>(a)...); },
                        std::move(mapped));
  std::vector<at::Tensor> res;
  ForwardArgs::collect(res, out);
  res = fc.outputs(std::move(res));
  std::size_t j = 0;
  return ForwardArgs::replace(std::move(out), res, j);
}

/// A forward over tensors, kept by the checkpoint's autograd node until its backward ran.
using Recompute = std::function<at::Tensor(const std::vector<at::Tensor>&)>;
/// Runs `fn` on `inputs` under activation checkpointing (what checkpoint() does, for a forward
/// that is not one module's call): without autograd's saved activations in forward, and again
/// inside backward (the CPU RNG state of the forward restored, so dropout gives the same mask)
/// before the backward runs on the recomputed graph.
at::Tensor checkpointed(Recompute fn, std::vector<at::Tensor> inputs);

/// Activation checkpointing of one module (LibTorch's C++ API has none): `call(module,
/// inputs...)` whose activations are not kept; the forward runs again inside backward. With
/// fully_shard on the module the recomputation uses the group's backward all-gather (no second
/// all-gather of the same group). Tensor inputs, one tensor result. Without grad (inference)
/// it is a plain call().
template <class M, class... T>
at::Tensor checkpoint(M module, const T&... inputs) {
  static_assert(!std::is_base_of_v<::torch::nn::Module, M>,
                "checkpoint takes the module's ModuleHolder or shared_ptr (it keeps it until "
                "backward)");
  static_assert((std::is_same_v<T, at::Tensor> && ...), "checkpoint takes tensor inputs");
  if (!::torch::GradMode::is_enabled()) return call(module, inputs...);
  Recompute fn = [module](const std::vector<at::Tensor>& xs) mutable {
    std::size_t k = 0;
    // Braced initialisation: the inputs are taken left to right.
    std::tuple<T...> args{(static_cast<void>(sizeof(T)), xs[k++])...};
    return std::apply([&](auto&... x) { return call(module, x...); }, args);
  };
  return checkpointed(std::move(fn), {inputs...});
}

}  // namespace fullshard::torch
