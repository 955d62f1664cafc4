#include "fullshard/fsdp/fully_shard.hpp"

#include <algorithm>
#include <set>
#include <unordered_map>

#include "fullshard/base/error.hpp"
#include "lib/fsdp/front_end.hpp"
#include "lib/fsdp/group_access.hpp"
#include "lib/fsdp/group_rules.hpp"
#include "lib/fsdp/param_group.hpp"
#include "lib/fsdp/running_backend.hpp"
#include "lib/mesh/agreement.hpp"

namespace fullshard::fsdp {

namespace {

// The per-module slot of graph::Module holds a shared_ptr<FSDPModule>.
std::shared_ptr<FSDPModule> state_ptr(graph::Module& m) {
  return std::static_pointer_cast<FSDPModule>(m.extension());
}

// Parameters already in a group (from earlier calls on submodules).
std::set<const graph::Parameter*> grouped_params(graph::Module& m) {
  std::set<const graph::Parameter*> out;
  for (auto* sub : m.modules_preorder())
    if (auto st = state_ptr(*sub))
      for (auto* p : group_of(*st).params())
        out.insert(p);
  return out;
}

}  // namespace

struct FSDPModule::Key {};
ParamGroup& group_of(const FSDPModule& st) {
  return *st.group_;
}

FSDPModule::FSDPModule(const Key&, graph::Module& module, DeviceMesh mesh,
                       FullyShardOptions options, std::shared_ptr<ParamGroup> group)
    : module_(&module),
      mesh_(std::move(mesh)),
      options_(std::move(options)),
      group_(std::move(group)) {}

FSDPModule* fsdp_state(graph::Module& module) noexcept {
  return state_ptr(module).get();
}

FSDPModule& fully_shard(graph::Module& module, const DeviceMesh& mesh,
                        const FullyShardOptions& options) {
  return fully_shard(std::vector<graph::Module*>{&module}, mesh, options);
}

FSDPModule& fully_shard(const std::vector<graph::Module*>& modules, const DeviceMesh& mesh,
                        const FullyShardOptions& options) {
  if (modules.empty()) throw InvalidArgument("fully_shard: no module given");
  const std::string name = detail::group_name(modules);
  if (mesh.ndim() > 2)
    throw InvalidArgument("fully_shard(" + name + "): the mesh has " + std::to_string(mesh.ndim()) +
                          " dims; use a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP)");
  std::set<graph::Module*> seen;
  for (auto* m : modules) {
    if (!seen.insert(m).second)
      throw InvalidArgument("fully_shard(" + name + "): module '" + m->fqn() + "' is listed twice");
    if (state_ptr(*m))
      throw InvalidArgument("fully_shard has already been applied to module '" +
                            (m->fqn().empty() ? m->name() : m->fqn()) + "'");
    for (auto* sub : m->modules_preorder())
      if (auto st = state_ptr(*sub); st && group_of(*st).attached())
        throw InvalidArgument("fully_shard(" + name + "): submodule '" + sub->fqn() +
                              "' has already run forward; apply fully_shard bottom-up to every "
                              "module before the first forward");
  }

  // A parameter already in the group of a module outside these subtrees (an ancestor or a
  // sibling list) would be in two groups.
  for (auto* m : modules)
    for (graph::Module* up = m->parent(); up; up = up->parent())
      if (auto st = state_ptr(*up))
        for (auto* p : group_of(*st).params())
          for (auto* mine : m->parameters())
            if (p == mine)
              throw InvalidArgument("fully_shard(" + name + "): parameter '" + p->fqn() +
                                    "' is already in the communication group of module '" +
                                    (up->fqn().empty() ? up->name() : up->fqn()) +
                                    "'; a parameter can be in one group only (apply fully_shard "
                                    "bottom-up, or group modules that share parameters in one "
                                    "list call)");

  // Ignored parameters, by FQN relative to the (first) module.
  std::set<const graph::Parameter*> ignored;
  for (const auto& fqn : options.ignored_params) {
    const graph::Parameter* p = nullptr;
    for (auto* m : modules)
      if ((p = m->try_find_param(fqn))) break;
    if (!p) detail::throw_unknown_ignored_param(name, fqn);
    ignored.insert(p);
  }

  // The group: every parameter of the modules not grouped by an earlier call on a submodule,
  // in the modules' parameter order.
  std::set<const graph::Parameter*> taken;
  for (auto* m : modules) {
    auto g = grouped_params(*m);
    taken.insert(g.begin(), g.end());
  }
  std::vector<graph::Parameter*> params;
  std::vector<ShardLayout> layouts;
  std::set<const graph::Parameter*> in_group;
  const std::string shard_dim = mesh.names().back();
  const int W = mesh.size(shard_dim);
  const int rank = mesh.coordinate(shard_dim);
  for (auto* m : modules)
    for (auto* p : m->parameters()) {
      if (taken.count(p) || ignored.count(p) || !in_group.insert(p).second) continue;
      const Placement pl = shard_placement(options, name, *p);
      layouts.push_back(shard_layout(p->shape(), pl, W, rank, "parameter '" + p->fqn() + "'"));
      params.push_back(p);
    }

  auto group = std::make_shared<ParamGroup>(name, modules, std::move(params), std::move(layouts),
                                            mesh, options);
  FSDPModule* first = nullptr;
  for (auto* m : modules) {
    auto st = std::make_shared<FSDPModule>(FSDPModule::Key{}, *m, mesh, options, group);
    m->extension() = st;
    if (!first) first = st.get();
  }
  return *first;
}

// ---- Lazy initialisation ----------------------------------------------------------------

namespace detail {

// The root is the outermost module with FSDP state above (or at) `m`; it creates the root
// context shared by every group of its subtree. Runs at the first forward or unshard.
void ensure_initialized(FSDPModule& st) {
  if (group_of(st).attached()) return;
  graph::Module* root = &st.module();
  for (graph::Module* m = root->parent(); m; m = m->parent())
    if (fsdp_state(*m)) root = m;
  FSDPModule* root_state = fsdp_state(*root);
  auto ctx = std::make_shared<RootContext>();
  std::vector<engine::Group*> groups;
  std::vector<ParamGroup*> mine;
  for (FSDPModule* s : root_state->subtree_states()) {
    ParamGroup& g = group_of(*s);
    if (g.attached()) continue;
    g.attach(ctx);
    groups.push_back(&g.engine());
    mine.push_back(&g);
  }
  engine::attach(ctx->root, groups);

  // Before the root's first collective, the ranks compare what they declared.
  const DeviceMesh& mesh = group_of(*root_state).mesh();
  std::vector<std::string> items;
  items.reserve(mine.size() + 1);
  std::string m = "mesh shape (";
  for (int i = 0; i < mesh.ndim(); ++i)
    m += (i ? ", " : "") + mesh.names()[static_cast<std::size_t>(i)] + "=" +
         std::to_string(mesh.shape()[static_cast<std::size_t>(i)]);
  items.push_back(m + ")");
  for (ParamGroup* g : mine) {
    const engine::Group& e = g->engine();
    std::string it = "group " + g->name() + ": dtypes " + dtype_name(e.info.orig_dtype) + "/" +
                     dtype_name(e.info.param_dtype) + "/" + dtype_name(e.info.reduce_dtype) +
                     ", reshard_after_forward " + e.reshard_after_forward.to_string() + ", params";
    for (const graph::Parameter* p : g->params())
      it += " " + p->fqn() + " " + shape_string(p->shape()) + " " + dtype_name(p->dtype());
    items.push_back(std::move(it));
  }
  agree_across_ranks(mesh, items,
                     "the FSDP configuration of root '" + detail::group_name(*root_state) + "'");
}

}  // namespace detail

std::vector<FSDPModule*> FSDPModule::subtree_states() {
  std::vector<FSDPModule*> out;
  for (auto* m : module_->modules_preorder())
    if (auto* s = fsdp_state(*m)) out.push_back(s);
  return out;
}

bool FSDPModule::is_root() const {
  for (graph::Module* m = module_->parent(); m; m = m->parent())
    if (fsdp_state(*m)) return false;
  return true;
}

std::vector<std::string> FSDPModule::group_fqns() const {
  std::vector<std::string> out;
  for (auto* p : group_->params())
    out.push_back(p->fqn());
  return out;
}

const kernels::GroupLayout& FSDPModule::group_layout() const {
  return group_->layout();
}

bool FSDPModule::is_sharded() const noexcept {
  return group_->sharded_idle();
}

std::size_t FSDPModule::pool_bytes_in_use() const {
  return group_->attached() ? group_->context()->backend.bytes_in_use() : 0;
}
std::size_t FSDPModule::pool_peak_bytes() const {
  return group_->attached() ? group_->context()->backend.peak_bytes_in_use() : 0;
}
void FSDPModule::reset_pool_peak() {
  detail::ensure_initialized(*this);
  group_->context()->backend.reset_peak();
}
// ---- Controls -------------------------------------------------------------------------------

void UnshardHandle::wait() {
  if (group_) engine::wait_unshard(group_->engine());
  group_.reset();
}

UnshardHandle FSDPModule::unshard(bool async_op) {
  detail::ensure_initialized(*this);
  engine::issue_unshard(group_->engine());
  UnshardHandle h(group_);
  if (!async_op) h.wait();
  return h;
}

void FSDPModule::reshard() {
  if (!group_->attached()) return;  // never unsharded
  engine::reshard(group_->engine());
}

namespace {
template <class F>
void for_states(FSDPModule& self, bool recurse, F&& f) {
  if (!recurse) {
    f(group_of(self));
    return;
  }
  for (FSDPModule* s : self.subtree_states())
    f(group_of(*s));
}

std::vector<engine::Group*> groups_of(const std::vector<graph::Module*>& modules, const char* what,
                                      const graph::Module& self) {
  std::vector<engine::Group*> out;
  for (auto* m : modules) {
    FSDPModule* st = fsdp_state(*m);
    if (!st)
      throw InvalidArgument(std::string(what) + " on '" + self.fqn() + "': module '" + m->fqn() +
                            "' is not fully_shard'ed");
    out.push_back(&group_of(*st).engine());
  }
  return out;
}
}  // namespace

void FSDPModule::set_reshard_after_forward(ReshardAfterForward v, bool recurse) {
  for_states(*this, recurse, [&](ParamGroup& g) { g.set_reshard_after_forward(v); });
}
void FSDPModule::set_reshard_after_backward(bool v, bool recurse) {
  for_states(*this, recurse, [&](ParamGroup& g) { g.engine().reshard_after_backward = v; });
}
void FSDPModule::set_requires_gradient_sync(bool v, bool recurse) {
  for_states(*this, recurse, [&](ParamGroup& g) { g.engine().reduce_grads = v; });
}
void FSDPModule::set_fresh_gradients(bool v, bool recurse) {
  for_states(*this, recurse, [&](ParamGroup& g) {
    if (v && g.space() != MemorySpace::host)
      throw InvalidArgument("set_fresh_gradients(true) on '" + g.name() +
                            "': host meshes only (the callbacks on a CUDA mesh add into grad())");
    engine::Group& e = g.engine();
    if (e.fresh_grads != v && e.backward_begun())
      throw InvalidArgument("set_fresh_gradients on '" + g.name() +
                            "': the group's backward has begun");
    e.fresh_grads = v;
    if (!v)
      for (graph::Parameter* p : g.params())
        p->set_grad_fresh(false);
  });
}
void FSDPModule::set_requires_all_reduce(bool v, bool recurse) {
  for_states(*this, recurse, [&](ParamGroup& g) { g.engine().all_reduce_grads = v; });
}
void FSDPModule::set_gradient_divide_factor(double factor) {
  if (!(factor > 0))
    throw InvalidArgument("set_gradient_divide_factor(" + std::to_string(factor) + ") on '" +
                          module_->fqn() + "': the factor must be > 0");
  engine::Group& g = group_->engine();
  // One rank, no_sync: the micro-batches' gradients are summed in the sharded gradients,
  // which their reduction will not divide (engine::Group::grads_are_sharded).
  if (g.sharded_grads_live && factor != (g.divide_factor > 0 ? g.divide_factor : 1.0))
    throw InvalidArgument("set_gradient_divide_factor(" + std::to_string(factor) + ") on '" +
                          module_->fqn() +
                          "': its one-rank group is accumulating gradients without sync; set "
                          "the factor before the first micro-batch or after the synchronised "
                          "backward");
  g.divide_factor = factor;
}
void FSDPModule::set_modules_to_forward_prefetch(const std::vector<graph::Module*>& modules) {
  group_->engine().forward_prefetch =
      groups_of(modules, "set_modules_to_forward_prefetch", *module_);
}
void FSDPModule::set_modules_to_backward_prefetch(const std::vector<graph::Module*>& modules) {
  group_->engine().backward_prefetch =
      groups_of(modules, "set_modules_to_backward_prefetch", *module_);
  group_->engine().explicit_backward_prefetch = true;
}
void FSDPModule::set_unshard_in_backward(bool v) {
  group_->engine().unshard_in_backward = v;
}
void FSDPModule::set_reduce_scatter_max_input_buffers(int k) {
  if (k < 1)
    throw InvalidArgument("set_reduce_scatter_max_input_buffers(" + std::to_string(k) +
                          "): at least 1 buffer is needed");
  detail::ensure_initialized(*this);
  group_->context()->root.max_reduce_buffers = k;
}
void FSDPModule::set_is_last_backward(bool v) {
  detail::ensure_initialized(*this);
  group_->context()->root.is_last_backward = v;
}

void FSDPModule::reset_iter_state() {
  if (!is_root())
    throw InvalidArgument("reset_iter_state() must be called on the root FSDP module, not on '" +
                          module_->fqn() + "'");
  if (!group_->attached()) return;
  engine::discard_iteration(group_->context()->root);
}

void FSDPModule::zero_grad(bool recurse) {
  if (group_->attached()) engine::wait_reductions(group_->context()->root, 0);
  if (!recurse) {
    group_->zero_grad();
    return;
  }
  for (FSDPModule* s : subtree_states())
    group_of(*s).zero_grad();
}

}  // namespace fullshard::fsdp

// ---- The group as checkpoints, front ends and tests reach it (lib/fsdp/group_access.hpp) ----

namespace fullshard::fsdp::detail {

const std::string& group_name(const FSDPModule& m) noexcept {
  return group_of(m).name();
}
const std::vector<graph::Parameter*>& group_params(const FSDPModule& m) noexcept {
  return group_of(m).params();
}
bool owns_group(const FSDPModule& m) noexcept {
  return group_of(m).modules().front() == &m.module();
}
const Tensor& sharded_storage(const FSDPModule& m) noexcept {
  return group_of(m).sharded_storage();
}
std::string adopt_problem(const FSDPModule& m, const Tensor& storage) {
  return group_of(m).adopt_problem(storage);
}
void adopt_sharded_storage(FSDPModule& m, Tensor storage) {
  ParamGroup& g = group_of(m);
  const std::string problem = g.adopt_problem(storage);
  if (!problem.empty()) throw InvalidArgument("adopt_sharded_storage: " + problem);
  g.adopt_sharded_storage(std::move(storage));
}
void record_operations(FSDPModule& root, std::vector<engine::OpDesc>* log) {
  if (!root.is_root())
    throw InvalidArgument("record_operations() must be called on a root FSDP module, not on '" +
                          root.module().fqn() + "'");
  ensure_initialized(root);
  group_of(root).context()->backend.op_log = log;
}

}  // namespace fullshard::fsdp::detail

// ---- Graph JSON requests --------------------------------------------------------------------

namespace fullshard::fsdp {

Placement shard_placement(const FullyShardOptions& options, const std::string& name,
                          const graph::Parameter& p) {
  Placement pl = Placement::Shard(0);
  if (options.shard_placement_fn)
    if (auto chosen = options.shard_placement_fn(p)) pl = *chosen;
  if (!pl.is_shard())
    throw InvalidArgument("fully_shard(" + name + "): parameter '" + p.fqn() +
                          "': shard_placement_fn must return a Shard placement (ignore the "
                          "parameter to keep it replicated)");
  return pl;
}

std::uint8_t compression_wire(const CompressionPolicy& policy, const std::string& name) {
  if (!policy.any()) return 0;
  const int b = policy.block;
  if (b < 8 || b > (1 << 20) || (b & (b - 1)) != 0)
    throw InvalidArgument("fully_shard(" + name + "): compression block " + std::to_string(b) +
                          " must be a power of two from 8 to 1048576 (elements per scale)");
  if (policy.reduce_scatter && *policy.reduce_scatter != kernels::QuantCode::int8)
    throw InvalidArgument("fully_shard(" + name +
                          "): the reduce-scatter's compression must be "
                          "int8 (got " +
                          kernels::quant_code_name(*policy.reduce_scatter) +
                          "; fp8 is for the all-gather)");
  int log2 = 0;
  while ((1 << log2) < b)
    ++log2;
  return transport::Geometry::make_wire(policy.all_gather, policy.reduce_scatter.has_value(), log2);
}

std::string request_path(const graph::Module& m) {
  return (m.json_path().empty() ? (m.is_root() ? std::string("(root)") : m.fqn()) : m.json_path()) +
         ".fully_shard";
}

FullyShardOptions options_from_request(const graph::ShardRequest& r,
                                       const FullyShardOptions& defaults) {
  FullyShardOptions o = defaults;
  if (r.reshard_after_forward) o.reshard_after_forward = *r.reshard_after_forward;
  if (r.param_dtype) o.mp_policy.param_dtype = r.param_dtype;
  if (r.reduce_dtype) o.mp_policy.reduce_dtype = r.reduce_dtype;
  if (r.output_dtype) o.mp_policy.output_dtype = r.output_dtype;
  if (r.ignored_params) o.ignored_params = *r.ignored_params;
  if (r.offload_policy) o.offload_policy = *r.offload_policy;
  if (r.compression) o.compression = *r.compression;
  return o;
}

int apply_fully_shard_requests(graph::Module& root, const DeviceMesh& mesh,
                               const FullyShardOptions& defaults) {
  // A list group is applied where its last module comes (every request below it first).
  const std::vector<detail::GraphListGroup> lists = detail::graph_list_groups(root);
  std::unordered_map<const graph::Module*, const detail::GraphListGroup*> member;
  for (const detail::GraphListGroup& g : lists)
    for (const graph::Module* m : g.modules)
      member.emplace(m, &g);
  int calls = 0;
  for (graph::Module* m : root.modules_postorder()) {
    if (const auto it = member.find(m); it != member.end()) {
      const detail::GraphListGroup& g = *it->second;
      if (g.last != m) continue;
      std::vector<graph::Module*> modules;
      for (const graph::Module* x : g.modules)
        modules.push_back(const_cast<graph::Module*>(x));  // (modules of `root`)
      fully_shard(modules, mesh,
                  options_from_request(*modules[0]->fully_shard_request(), defaults));
    } else if (m->requests_fully_shard()) {
      fully_shard(*m, mesh, options_from_request(*m->fully_shard_request(), defaults));
    } else {
      continue;
    }
    ++calls;
  }
  return calls;
}

}  // namespace fullshard::fsdp

namespace fullshard::fsdp {

void use_external_gradients(FSDPModule& st) {
  engine::Group& g = group_of(st).engine();
  if (g.backward_begun())
    throw InvalidArgument("use_external_gradients('" + detail::group_name(st) +
                          "'): the group's backward has already begun");
  g.external_grads = true;
}

}  // namespace fullshard::fsdp
