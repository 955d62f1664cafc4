// Scheduler::plan: runs the FSDP engine (fullshard/fsdp/engine.hpp) over the graph on the
// planning backend below, which costs each operation with the cost model, records it and the
// pool acquisitions and releases in the engine's order, then list-schedules the operations
// on their streams. Nothing here decides what FSDP does: the engine does, as it does when it
// runs.
#include <algorithm>
#include <unordered_map>

#include "fullshard/base/error.hpp"
#include "fullshard/fsdp/engine.hpp"
#include "fullshard/schedule/plan.hpp"

namespace fullshard::schedule {

namespace {

namespace engine = fsdp::engine;

constexpr std::string_view kRoot = "<root>";

std::string_view display(const graph::Module& m) {
  return m.fqn().empty() ? kRoot : std::string_view(m.fqn());
}

// The planning backend: every operation becomes an Op of the plan with its cost.
class PlanningBackend final : public engine::Backend {
 public:
  PlanningBackend(Plan& plan, const CostModel& cost) : p_(plan), cost_(cost) {
    pool_in_use_.assign(p_.pool_roots.size(), 0);
    p_.pool_peak_bytes.assign(p_.pool_roots.size(), 0);
  }

  std::vector<double> durations;
  std::size_t in_use = 0;

  engine::Buf acquire(const engine::Group& g, engine::BufKind kind, std::int64_t numel,
                      DType dtype) override {
    engine::Buf b;
    b.kind = kind;
    b.held = true;
    b.bytes = static_cast<std::size_t>(numel) * dtype_size(dtype);
    event(g, b, BufferAction::alloc);
    return b;
  }
  void release(const engine::Group& g, engine::Buf& b) override {
    event(g, b, BufferAction::free);
    b = engine::Buf();
  }

  engine::Event gather_copy_in(const engine::OpDesc& d, engine::Group&, engine::Buf&) override {
    return emit(d, cost_.copy_ms(double(d.bytes)));
  }
  engine::Event all_gather(const engine::OpDesc& d, engine::Group& g, engine::Buf&, bool,
                           engine::Buf* slices) override {
    double bytes = double(d.bytes);
    if (slices) {  // inside the k-rank group: the share a W-rank all-gather would move
      const double W = g.info.world;
      bytes = bytes * (d.k - 1) / (W - 1);
    }
    return emit(d, cost_.time_ms(CollectiveKind::all_gather, MeshDim::shard, bytes));
  }
  engine::Event gather_copy_out(const engine::OpDesc& d, engine::Group&, const engine::Buf*,
                                engine::Buf&, engine::Buf*) override {
    return emit(d, cost_.copy_ms(double(d.bytes)));
  }
  engine::Event grad_init(const engine::OpDesc& d, engine::Group&, engine::Buf&) override {
    return emit(d, cost_.copy_ms(double(d.bytes)));
  }
  engine::Event reduce_copy_in(const engine::OpDesc& d, engine::Group&, engine::Buf&,
                               engine::Buf&) override {
    return emit(d, cost_.copy_ms(double(d.bytes)));
  }
  engine::Event reduce_scatter(const engine::OpDesc& d, engine::Group&, engine::Buf&,
                               engine::Buf&) override {
    return emit(d, cost_.time_ms(CollectiveKind::reduce_scatter, MeshDim::shard, double(d.bytes)));
  }
  engine::Event all_reduce(const engine::OpDesc& d, engine::Group&, engine::Buf&) override {
    return emit(d, cost_.time_ms(CollectiveKind::all_reduce, MeshDim::replicate, double(d.bytes)));
  }
  engine::Event accumulate(const engine::OpDesc& d, engine::Group&, engine::Buf&, engine::Buf&,
                           bool) override {
    return emit(d, cost_.copy_ms(double(d.bytes)));
  }
  engine::Event reduce_copy_out(const engine::OpDesc& d, engine::Group&, const engine::Buf&, double,
                                bool) override {
    return emit(d, cost_.copy_ms(double(d.bytes)));
  }
  engine::Event reshard(const engine::OpDesc& d, engine::Group&) override { return emit(d, 0.0); }
  engine::Event compute(const engine::OpDesc& d, graph::Module& m, engine::Phase ph) override {
    return emit(d, ph == engine::Phase::forward ? m.cost().forward_ms : m.cost().backward_ms);
  }
  void host_wait(const engine::OpDesc& d, const std::vector<engine::Event>&) override {
    emit(d, 0.0);
  }
  void host_wait(const engine::Event&) override {}
  void drop_sharded_grads(engine::Group&) override {}
  void show_sharded(engine::Group&) override {}
  void show_unsharded(engine::Group&) override {}
  void show_unsharded_grads(engine::Group&) override {}
  void show_sharded_grads(engine::Group&) override {}

 private:
  engine::Event emit(const engine::OpDesc& d, double ms) {
    Op op;
    op.id = d.id;
    op.stream = d.stream;
    op.kind = d.kind;
    op.group = d.group;
    op.module = display(*d.module);
    op.bytes = d.bytes;
    op.deps = d.deps;
    op.phase = d.phase;
    op.k = d.k;
    op.variant = d.variant;
    p_.ops.push_back(std::move(op));
    durations.push_back(ms);
    return {};
  }

  void event(const engine::Group& g, const engine::Buf& b, BufferAction a) {
    if (b.bytes == 0) return;  // no pool block (an empty group)
    const auto pool = static_cast<std::size_t>(g.root->pool);
    auto& pin = pool_in_use_[pool];
    if (a == BufferAction::alloc) {
      pin += b.bytes;
      in_use += b.bytes;
      p_.pool_peak_bytes[pool] = std::max(p_.pool_peak_bytes[pool], pin);
    } else {
      pin -= b.bytes;
      in_use -= b.bytes;
    }
    BufferEvent e;
    e.op = ops_issued() - 1;
    e.kind = b.kind;
    e.group = g.id;
    e.bytes = b.bytes;
    e.action = a;
    e.pool = g.root->pool;
    e.in_use = in_use;
    p_.events.push_back(std::move(e));
  }

  Plan& p_;
  const CostModel& cost_;
  std::vector<std::size_t> pool_in_use_;
};

class PlanLookup final : public engine::GroupLookup {
 public:
  PlanLookup(engine::Backend& b, std::size_t n) : backend_(b) { at_.reserve(2 * n); }
  std::unordered_map<const graph::Module*, engine::Group*> at_;
  engine::Group* group_at(const graph::Module& m) const override {
    auto it = at_.find(&m);
    return it == at_.end() ? nullptr : it->second;
  }
  engine::Backend* default_backend() const override { return &backend_; }

 private:
  engine::Backend& backend_;
};

// The engine groups of the plan's groups, as rank 0 of the mesh sees them, with the plan's
// policies (what the executor applies to the FSDP modules).
std::vector<engine::Group> engine_groups(const Plan& p) {
  std::vector<engine::Group> out(p.groups.size());
  for (std::size_t i = 0; i < p.groups.size(); ++i) {
    const PlannedGroup& pg = p.groups[i];
    engine::Group& g = out[i];
    g.id = static_cast<int>(i);
    engine::GroupInfo& I = g.info;
    I.name = pg.name;
    I.module = pg.modules.front();
    I.num_modules = static_cast<int>(pg.modules.size());
    I.world = pg.shard_size();
    I.rank = 0;
    I.replicate = p.mesh.replicate;
    I.shard_numel = pg.layout.shard_numel;
    I.arena_numel = pg.layout.arena_numel;
    I.orig_dtype = pg.orig_dtype;
    I.param_dtype = pg.param_dtype;
    I.reduce_dtype = pg.reduce_dtype;
    g.reshard_after_forward = pg.reshard_after_forward;
    g.reshard_after_backward = p.options.reshard_after_backward;
    g.reduce_grads = p.options.requires_gradient_sync;
    g.all_reduce_grads = p.options.requires_all_reduce;
    g.unshard_in_backward = p.options.no_unshard_in_backward.count(pg.name) == 0;
    if (p.options.backward_prefetch == BackwardPrefetch::none) g.explicit_backward_prefetch = true;
  }
  for (std::size_t i = 0; i < p.groups.size(); ++i)
    for (int t : p.forward_prefetch[i])
      out[i].forward_prefetch.push_back(&out[static_cast<std::size_t>(t)]);
  for (const auto& [name, targets] : p.options.backward_prefetch_targets) {
    engine::Group& g = out[static_cast<std::size_t>(p.group_index(name))];
    g.explicit_backward_prefetch = true;
    g.backward_prefetch.clear();
    for (const std::string& t : targets)
      g.backward_prefetch.push_back(&out[static_cast<std::size_t>(p.group_index(t))]);
  }
  return out;
}

// Groups in the order of their first pre-forward: the pre-order of their modules.
void preorder_groups(const graph::Module& m,
                     const std::unordered_map<const graph::Module*, int>& at,
                     std::vector<int>& out) {
  auto it = at.find(&m);
  if (it != at.end()) out.push_back(it->second);
  for (std::size_t i = 0; i < m.num_children(); ++i)
    preorder_groups(m.child(i), at, out);
}

std::vector<int> forward_order(const graph::Module& root, const std::vector<PlannedGroup>& groups) {
  std::unordered_map<const graph::Module*, int> at;
  at.reserve(2 * groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g)
    at[groups[g].modules.front()] = static_cast<int>(g);
  std::vector<int> out;
  out.reserve(groups.size());
  preorder_groups(root, at, out);
  return out;
}

// List scheduling: each op starts when its stream is free and its dependencies ended.
void schedule(Plan& p, const std::vector<double>& dur, std::size_t end_bytes) {
  double free_at[engine::kNumStreams] = {0, 0, 0, 0};
  for (Op& op : p.ops) {
    double start = free_at[static_cast<int>(op.stream)];
    for (int d : op.deps)
      start = std::max(start, p.ops[static_cast<std::size_t>(d)].end_ms);
    op.start_ms = start;
    op.end_ms = start + dur[static_cast<std::size_t>(op.id)];
    free_at[static_cast<int>(op.stream)] = op.end_ms;
    p.step_ms = std::max(p.step_ms, op.end_ms);
  }
  for (const BufferEvent& e : p.events) {
    if (e.action != BufferAction::alloc) continue;
    p.peak_bytes = std::max(p.peak_bytes, e.in_use);
    if (p.ops[static_cast<std::size_t>(e.op)].phase == Phase::forward)
      p.forward_peak_bytes = std::max(p.forward_peak_bytes, e.in_use);
    else
      p.backward_peak_bytes = std::max(p.backward_peak_bytes, e.in_use);
  }
  p.end_bytes = end_bytes;
}

}  // namespace

Plan Scheduler::plan(const graph::Module& root, MeshShape mesh, const PlanOptions& options) {
  if (mesh.shard < 1 || mesh.replicate < 1)
    throw InvalidArgument("Scheduler::plan: mesh sizes must be >= 1, got shard " +
                          std::to_string(mesh.shard) + " x replicate " +
                          std::to_string(mesh.replicate));
  if (options.forward_prefetch_depth < 0)
    throw InvalidArgument("Scheduler::plan: forward_prefetch_depth must be >= 0, got " +
                          std::to_string(options.forward_prefetch_depth));
  if (options.reduce_scatter_max_input_buffers < 1)
    throw InvalidArgument("Scheduler::plan: reduce_scatter_max_input_buffers must be >= 1, got " +
                          std::to_string(options.reduce_scatter_max_input_buffers));
  Plan p;
  p.mesh = mesh;
  p.options = options;
  if (!p.options.cost) p.options.cost = CostModel::defaults(mesh);
  p.groups = plan_groups(root, mesh.shard, options.defaults);
  auto require_group = [&p](const std::string& name, const char* option) {
    if (p.group_index(name) >= 0) return;
    std::string names;
    for (const auto& g : p.groups)
      names += (names.empty() ? "" : ", ") + g.name;
    throw InvalidArgument(std::string("Scheduler::plan: ") + option + ": no group named '" + name +
                          "' (groups: " + (names.empty() ? "none" : names) + ")");
  };
  for (const std::string& name : options.no_unshard_in_backward)
    require_group(name, "no_unshard_in_backward");
  for (const auto& [name, targets] : options.backward_prefetch_targets) {
    require_group(name, "backward_prefetch_targets");
    for (const std::string& t : targets)
      require_group(t, "backward_prefetch_targets");
  }
  for (const auto& g : p.groups) {
    p.sharded_bytes += g.shard_bytes();
    p.grad_bytes += g.shard_bytes();
  }

  p.forward_order = forward_order(root, p.groups);
  p.forward_prefetch.assign(p.groups.size(), {});
  const auto depth = static_cast<std::size_t>(options.forward_prefetch_depth);
  const auto& order = p.forward_order;
  for (std::size_t i = 0; i < order.size(); ++i)
    for (std::size_t j = i + 1; j < order.size() && j <= i + depth; ++j)
      p.forward_prefetch[static_cast<std::size_t>(order[i])].push_back(order[j]);
  for (std::size_t g = 0; g < p.groups.size(); ++g)
    if (p.groups[g].is_root) p.pool_roots.push_back(static_cast<int>(g));

  // The engine, on the planning backend: one root per root group (one pool each).
  std::vector<engine::Group> groups = engine_groups(p);
  const CostModel cost = *p.options.cost;
  PlanningBackend backend(p, cost);
  std::vector<engine::Root> roots;
  roots.reserve(p.pool_roots.size());
  std::unordered_map<int, std::size_t> root_of;  // root group -> its Root
  for (std::size_t r = 0; r < p.pool_roots.size(); ++r) {
    roots.emplace_back(backend, static_cast<int>(r));
    roots.back().max_reduce_buffers = options.reduce_scatter_max_input_buffers;
    roots.back().is_last_backward = options.is_last_backward;
    root_of[p.pool_roots[r]] = r;
  }
  std::vector<std::vector<engine::Group*>> members(roots.size());
  for (int g : p.forward_order)
    members[root_of.at(p.groups[static_cast<std::size_t>(g)].root_group)].push_back(
        &groups[static_cast<std::size_t>(g)]);
  for (std::size_t r = 0; r < roots.size(); ++r)
    engine::attach(roots[r], members[r]);

  PlanLookup lookup(backend, groups.size());
  for (std::size_t g = 0; g < p.groups.size(); ++g)
    for (const graph::Module* m : p.groups[g].modules)
      lookup.at_[m] = &groups[g];
  const std::size_t n = p.groups.size() + 1;
  p.ops.reserve(16 * n);
  p.events.reserve(12 * n);
  backend.durations.reserve(16 * n);

  // The planning backend never calls a callback nor changes the graph.
  auto& graph = const_cast<graph::Module&>(root);
  engine::forward(graph, lookup);
  engine::begin_backward(backend);
  engine::backward(graph, lookup);
  schedule(p, backend.durations, backend.in_use);
  return p;
}

}  // namespace fullshard::schedule
