// Scheduler::plan: runs the FSDP engine (fullshard/fsdp/engine.hpp) over the graph on the
// planning backend below, which costs each operation with the cost model, records it and the
// pool acquisitions and releases in the engine's order, then list-schedules the operations
// on their streams. Nothing here decides what FSDP does: the engine does, as it does when it
// runs.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/schedule/plan.hpp"
#include "lib/base/arena.hpp"
#include "lib/base/prefetch.hpp"
#include "lib/fsdp/engine.hpp"
#include "lib/fsdp/state_machine.hpp"
#include "lib/schedule/planner_entry.hpp"
#include "lib/transport/charges.hpp"

namespace fullshard::schedule {

namespace {

namespace engine = fsdp::engine;

constexpr std::size_t kReservePerGroup = 16;  // operations and buffer events

// The planning backend: every operation becomes an Op of the plan with its cost.
// The cost model's prices of the pieces a transport's operation is made of
// (transport::charges).
struct Prices {
  const CostModel& cost;
  double copy(double bytes) const noexcept { return cost.copy_ms(bytes); }
  double codec(double elements) const noexcept { return cost.quant_ms(elements); }
  double collective(CollectiveKind k, double bytes_per_rank) const noexcept {
    return cost.time_ms(k, k == CollectiveKind::all_reduce ? MeshDim::replicate : MeshDim::shard,
                        bytes_per_rank);
  }
  double shm_collective(CollectiveKind k, double bytes_per_rank) const {
    return cost.shm_time_ms(k, MeshDim::shard, bytes_per_rank);
  }
};

class PlanningBackend final : public engine::Backend {
 public:
  PlanningBackend(Plan& plan, const CostModel& cost) : p_(plan), cost_(cost), prices_{cost} {
    pool_in_use_.assign(p_.pool_roots.size(), 0);
    p_.pool_peak_bytes.assign(p_.pool_roots.size(), 0);
  }

  std::size_t in_use = 0;

  // The record the engine fills in: the plan's next op.
  engine::OpDesc& op_record() override {
    write_ahead(p_.ops);
    return p_.ops.emplace_back();
  }

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

  // Each operation's time: its work as the group's transport describes it
  // (transport::charges), at the cost model's prices.
  engine::Event gather_copy_in(const engine::OpDesc& d, engine::Group& g, engine::Buf&) override {
    return emit(d, transport::charges::gather_copy_in(g.info, double(d.bytes), prices_));
  }
  engine::Event all_gather(const engine::OpDesc& d, engine::Group& g, engine::Buf&, bool,
                           engine::Buf* slices) override {
    return emit(d, transport::charges::all_gather(kind(g), g.info, double(d.bytes),
                                                  slices ? d.k : 0, prices_));
  }
  engine::Event gather_copy_out(const engine::OpDesc& d, engine::Group& g, const engine::Buf*,
                                engine::Buf&, engine::Buf*) override {
    // From the kept slices when the group was resharded to k after forward.
    const bool from_slices = g.state == engine::ShardedState::sharded_post_forward;
    return emit(d, transport::charges::gather_copy_out(kind(g), g.info, double(d.bytes),
                                                       from_slices, prices_));
  }
  engine::Event grad_init(const engine::OpDesc& d, engine::Group&, engine::Buf&) override {
    return emit(d, cost_.copy_ms(double(d.bytes)));
  }
  engine::Event reduce_copy_in(const engine::OpDesc& d, engine::Group& g, engine::Buf&,
                               engine::Buf&) override {
    return emit(d, transport::charges::reduce_copy_in(kind(g), g.info, double(d.bytes), prices_));
  }
  engine::Event reduce_scatter(const engine::OpDesc& d, engine::Group& g, engine::Buf&,
                               engine::Buf&, const transport::ReduceSpec&) override {
    return emit(d, transport::charges::reduce_scatter(kind(g), g.info, double(d.bytes), prices_));
  }
  engine::Event all_reduce(const engine::OpDesc& d, engine::Group&, engine::Buf&) override {
    return emit(d, transport::charges::all_reduce(double(d.bytes), prices_));
  }
  engine::Event accumulate(const engine::OpDesc& d, engine::Group&, engine::Buf&, engine::Buf&,
                           bool) override {
    return emit(d, cost_.copy_ms(double(d.bytes)));
  }
  engine::Event reduce_copy_out(const engine::OpDesc& d, engine::Group& g, const engine::Buf&,
                                const transport::ReduceSpec&) override {
    return emit(d, transport::charges::reduce_copy_out(kind(g), g.info, double(d.bytes), prices_));
  }
  engine::Event update_shards(const engine::OpDesc& d, engine::Group&) override {
    return emit(d, transport::charges::update(double(d.bytes), prices_));
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
  // The group's transport: the shard dim's (CostModel::transport), or MPI for a compressed
  // group (transport::group_kind), as the running side chooses.
  transport::Kind kind(const engine::Group& g) const noexcept {
    return transport::group_kind(cost_.transport(MeshDim::shard), g.info);
  }

  // The op just begun, list-scheduled as it is issued: it starts when its stream is free and
  // the ops it waits for (all issued before it) have ended.
  engine::Event emit(const engine::OpDesc& d, double ms) {
    Op& op = p_.ops.back();  // d itself
    const auto stream = static_cast<std::size_t>(d.stream);
    double start = free_at_[stream];
    for (int dep : op.deps) {
      if (dep < 0 || dep >= op.id) bad_dep(d, dep);
      start = std::max(start, p_.ops[static_cast<std::size_t>(dep)].end_ms);
    }
    const double end = start + ms;
    op.start_ms = start;
    op.end_ms = end;
    free_at_[stream] = end;
    if (end > p_.step_ms) p_.step_ms = end;
    return {};
  }
  [[noreturn]] static void bad_dep(const engine::OpDesc& d, int dep) {
    throw InvalidArgument("Scheduler::plan: op " + std::to_string(d.id) + " waits for op " +
                          std::to_string(dep) + ", not issued before it (internal)");
  }

  void event(const engine::Group& g, const engine::Buf& b, BufferAction a) {
    if (b.bytes == 0) return;  // no pool block (an empty group)
    const auto pool = static_cast<std::size_t>(g.root->pool);
    auto& pin = pool_in_use_[pool];
    if (a == BufferAction::alloc) {
      pin += b.bytes;
      in_use += b.bytes;
      p_.pool_peak_bytes[pool] = std::max(p_.pool_peak_bytes[pool], pin);
      // An acquisition belongs to the op just begun, of the phase being issued.
      p_.peak_bytes = std::max(p_.peak_bytes, in_use);
      auto& phase_peak = phase == Phase::forward ? p_.forward_peak_bytes : p_.backward_peak_bytes;
      phase_peak = std::max(phase_peak, in_use);
    } else {
      pin -= b.bytes;
      in_use -= b.bytes;
    }
    write_ahead(p_.events);
    BufferEvent& e = p_.events.emplace_back();
    e.op = ops_issued() - 1;
    e.group = g.id;
    e.kind = b.kind;
    e.action = a;
    e.bytes = b.bytes;
  }

  // Records are appended to fresh memory, several streams at once: ask the cache for the
  // line a few records ahead (a hint: beyond the reserve it touches nothing).
  template <class V>
  static void write_ahead(const V& v) noexcept {
    const auto end = reinterpret_cast<std::uintptr_t>(v.data()) + v.size() * sizeof(v[0]);
    prefetch_lines<1, true>(reinterpret_cast<const void*>(end + 256));
  }

  Plan& p_;
  const CostModel& cost_;
  const Prices prices_;
  std::vector<std::size_t> pool_in_use_;
  double free_at_[engine::kNumStreams] = {0, 0, 0, 0};  // when each stream is next free
};

// Module -> its engine group, as the traversal asks: forward visits the modules in pre-order
// and backward in reverse post-order, so the group modules come in forward order and then
// in reverse formation order (plan_groups forms groups in post-order). Each lookup compares
// the module with the next group's module: no table, and the groups are read in sequence.
// A traversal that met a group out of that order leaves groups unvisited, which finish()
// reports.
//
// A plan with list groups (fully_shard({a, b}): one group met at each of its modules) looks
// its groups up in a table from module to group instead (one class, so that the engine is
// compiled once for the planner).
class PlanLookup final : public engine::GroupLookup {
 public:
  using ByModule = std::unordered_map<const graph::Module*, engine::Group*>;
  /// `order`: the group indices in the order met (nullptr: the reverse of index order).
  /// `by_module`: the table of a plan with list groups (its `n` the modules in it), or null.
  PlanLookup(engine::Backend& b, engine::Group* groups, std::size_t n, const int* order,
             const ByModule* by_module = nullptr)
      : backend_(b), groups_(groups), n_(n), order_(order), by_module_(by_module) {}
  engine::Group* group_at(const graph::Module& m) const override {
    if (by_module_) {
      const auto it = by_module_->find(&m);
      if (it == by_module_->end()) return nullptr;
      ++next_;
      return it->second;
    }
    if (next_ == n_) return nullptr;
    engine::Group* g = &groups_[at(next_)];
    if (g->info.module != &m) return nullptr;
    ++next_;
    // The engine writes the groups it meets: ask the cache for one a few groups ahead.
    if (next_ + kAhead < n_)
      prefetch_lines<sizeof(engine::Group), true>(&groups_[at(next_ + kAhead)]);
    return g;
  }
  engine::Backend* default_backend() const override { return &backend_; }
  void finish(const char* pass) const {
    if (next_ != n_)
      throw InvalidArgument(std::string("Scheduler::plan: the ") + pass + " traversal met " +
                            std::to_string(next_) + " of " + std::to_string(n_) +
                            " groups in the expected order (internal)");
  }

 private:
  static constexpr std::size_t kAhead = 2;
  // The group met i-th.
  std::size_t at(std::size_t i) const noexcept {
    return order_ ? static_cast<std::size_t>(order_[i]) : n_ - 1 - i;
  }

  engine::Backend& backend_;
  engine::Group* groups_;
  std::size_t n_;
  const int* order_;
  const ByModule* by_module_;
  mutable std::size_t next_ = 0;
};

using EngineGroups = std::vector<engine::Group, ArenaAllocator<engine::Group>>;

// One pass over the plan's groups: the persistent byte totals, the forward order, the roots,
// and the engine groups as rank 0 of the mesh sees them, with the plan's policies (what the
// executor applies to the FSDP modules).
EngineGroups engine_groups(Plan& p, const ArenaAllocator<engine::Group>& memory) {
  const std::size_t n = p.groups.size();
  EngineGroups out(memory);
  out.reserve(n);  // each group constructed and filled in one pass
  p.forward_order.assign(n, 0);
  std::map<int, std::size_t> scratch;  // per root group: an optimizer inside backward's
  for (std::size_t i = 0; i < n; ++i) {
    const PlannedGroup& pg = p.groups[i];
    p.sharded_bytes += pg.shard_bytes();
    p.grad_bytes += pg.shard_bytes();
    p.forward_order[static_cast<std::size_t>(pg.forward_index)] = static_cast<int>(i);
    if (pg.is_root) p.pool_roots.push_back(static_cast<int>(i));
    engine::Group& g = out.emplace_back();
    g.id = static_cast<int>(i);
    engine::GroupInfo& I = g.info;
    I.name = pg.name;
    I.module = pg.modules.front();
    I.num_modules = static_cast<int>(pg.modules.size());
    static_cast<transport::Geometry&>(I) = pg.geometry(p.mesh.replicate_size);
    g.reshard_after_forward = pg.reshard_after_forward;
    g.reshard_after_backward = p.options.reshard_after_backward;
    g.reduce_grads = p.options.requires_gradient_sync;
    g.all_reduce_grads = p.options.requires_all_reduce;
    g.external_grads = p.options.external_gradients;
    g.shards_offloaded = pg.options && pg.options->offload_policy.has_value();
    g.update_state_arrays = static_cast<std::int8_t>(p.options.optimizer_in_backward_states);
    g.fresh_grads = p.options.fresh_gradients;
    // What fsdp::update_in_backward refuses when running.
    if (g.updates_in_backward() && (g.shards_offloaded || pg.orig_dtype != DType::f32))
      throw InvalidArgument("Scheduler::plan: group " + pg.name +
                            ": an optimizer inside backward needs f32 shards that are not "
                            "offloaded (CPUOffloadPolicy), as update_in_backward does");
    if (g.updates_in_backward() && !g.grads_are_sharded()) {
      // No sharded gradients: the update runs in the pass that writes the reduced shard, or
      // (transport::update_in_copy_out false) reads it from a scratch per root and stream (the
      // largest such shard; a plan has one mesh, whose reductions all end on one stream).
      p.grad_bytes -= pg.shard_bytes();
      if (!transport::update_in_copy_out(I)) {
        std::size_t& s = scratch[pg.root_group];
        s = std::max(s, pg.shard_bytes());
      }
    }
    if (p.options.backward_prefetch == BackwardPrefetch::none) g.explicit_backward_prefetch = true;
  }
  for (const auto& [root, bytes] : scratch)
    p.grad_bytes += bytes;
  p.forward_prefetch.assign(n, {});
  const auto depth = static_cast<std::size_t>(p.options.forward_prefetch_depth);
  const auto& order = p.forward_order;
  if (depth > 0)
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = i + 1; j < n && j <= i + depth; ++j) {
        const auto from = static_cast<std::size_t>(order[i]);
        p.forward_prefetch[from].push_back(order[j]);
        out[from].forward_prefetch.push_back(&out[static_cast<std::size_t>(order[j])]);
      }
  for (int g : p.no_unshard_in_backward)
    out[static_cast<std::size_t>(g)].unshard_in_backward = false;
  for (const auto& [group, targets] : p.backward_prefetch_targets) {
    engine::Group& g = out[static_cast<std::size_t>(group)];
    g.explicit_backward_prefetch = true;
    g.backward_prefetch.clear();
    for (int t : targets)
      g.backward_prefetch.push_back(&out[static_cast<std::size_t>(t)]);
  }
  return out;
}

}  // namespace

Plan Scheduler::plan(const graph::Module& root, MeshShape mesh, const PlanOptions& options) {
  Plan p;
  replan(p, root, mesh, options);
  return p;
}

namespace {

// Scheduler::replan, with the calls of `calls` when given (detail::replan_calls).
void replan_with(Plan& out, const graph::Module& root, MeshShape mesh, const PlanOptions& options,
                 const detail::RequestTable* calls) {
  std::shared_ptr<Arena> arena = out.ops.get_allocator().arena();
  out = Plan();  // its containers let go of the arena
  if (mesh.shard_size < 1 || mesh.replicate_size < 1)
    throw InvalidArgument("Scheduler::plan: mesh sizes must be >= 1, got shard " +
                          std::to_string(mesh.shard_size) + " x replicate " +
                          std::to_string(mesh.replicate_size));
  if (options.forward_prefetch_depth < 0)
    throw InvalidArgument("Scheduler::plan: forward_prefetch_depth must be >= 0, got " +
                          std::to_string(options.forward_prefetch_depth));
  if (options.reduce_scatter_max_input_buffers < 1)
    throw InvalidArgument("Scheduler::plan: reduce_scatter_max_input_buffers must be >= 1, got " +
                          std::to_string(options.reduce_scatter_max_input_buffers));
  if (options.optimizer_in_backward_states < -1 || options.optimizer_in_backward_states > 2)
    throw InvalidArgument(
        "Scheduler::plan: optimizer_in_backward_states must be -1 (none) or 0 to 2, got " +
        std::to_string(options.optimizer_in_backward_states));
  if (options.optimizer_in_backward_states >= 0 && !options.is_last_backward &&
      options.requires_gradient_sync)
    throw InvalidArgument(
        "Scheduler::plan: an optimizer inside backward needs is_last_backward = true");
  Plan p;
  p.mesh = mesh;
  p.options = options;
  if (!p.options.cost) p.options.cost = CostModel::defaults(mesh);
  // One arena for the plan's records and the engine's scratch, sized for at most one group
  // per module and the engine's 12-14 operations and buffer events per group (more take a
  // further block).
  const std::size_t modules = root.num_descendants() + 1;
  const std::size_t per_group = sizeof(PlannedGroup) + sizeof(engine::Group) +
                                kReservePerGroup * (sizeof(Op) + sizeof(BufferEvent));
  // (At most 1 GiB at first: the estimate counts a group per module, and the operations of
  // larger graphs can take further blocks as they come.)
  const std::size_t expected = std::min(modules * per_group + (64 << 10), std::size_t(1) << 30);
  if (arena && arena.use_count() == 1 && arena->reusable_bytes() >= expected)
    arena->reset();  // the previous plan's memory, nobody else's
  else
    arena = std::make_shared<Arena>(expected);
  p.groups = PlannedGroups(ArenaAllocator<PlannedGroup>(arena));
  const bool lists =
      detail::plan_groups_into(p.groups, root, mesh.shard_size, options.defaults, modules, calls);
  // The policies' group names, resolved once (the engine's groups and an executor read the
  // indices).
  detail::resolve_policy_groups(p);
  // The engine, on the planning backend: one root per root group (one pool each).
  auto groups = engine_groups(p, ArenaAllocator<engine::Group>(arena));
  const CostModel cost = *p.options.cost;
  PlanningBackend backend(p, cost);
  std::vector<engine::Root> roots;
  roots.reserve(p.pool_roots.size());
  std::vector<std::size_t> root_of(p.groups.size());  // root group -> its Root
  for (std::size_t r = 0; r < p.pool_roots.size(); ++r) {
    roots.emplace_back(backend, static_cast<int>(r));
    roots.back().max_reduce_buffers = options.reduce_scatter_max_input_buffers;
    roots.back().is_last_backward = options.is_last_backward;
    root_of[static_cast<std::size_t>(p.pool_roots[r])] = r;
  }
  std::vector<std::vector<engine::Group*>> members(roots.size());
  for (int g : p.forward_order) {
    const auto gi = static_cast<std::size_t>(g);
    // One root (the usual graph) holds every group: no need to read which.
    const std::size_t r =
        roots.size() == 1 ? 0 : root_of[static_cast<std::size_t>(p.groups[gi].root_group)];
    members[r].push_back(&groups[gi]);
  }
  for (std::size_t r = 0; r < roots.size(); ++r)
    engine::attach(roots[r], members[r]);

  const std::size_t n = modules;
  p.events = decltype(p.events)(ArenaAllocator<BufferEvent>(arena));
  p.events.reserve(kReservePerGroup * n);
  p.ops = decltype(p.ops)(ArenaAllocator<Op>(arena));  // last: its reserve's unused tail
  p.ops.reserve(kReservePerGroup * n);

  // The planning backend never calls a callback nor changes the graph.
  auto& graph = const_cast<graph::Module&>(root);
  using Engine = engine::detail::StateMachine<PlanningBackend>;  // no virtual call per op
  // A group is met at its module: in forward order by the forward pass, in reverse formation
  // order by the backward pass; a list group at each of its modules (by table).
  PlanLookup::ByModule by_module;
  std::size_t list_modules = 0;
  if (lists)
    for (std::size_t j = 0; j < p.groups.size(); ++j)
      for (const graph::Module* m : p.groups[j].modules) {
        by_module.emplace(m, &groups[j]);
        ++list_modules;
      }
  const PlanLookup::ByModule* table = lists ? &by_module : nullptr;
  const std::size_t met = table ? list_modules : groups.size();
  const PlanLookup forward_lookup(backend, groups.data(), met, p.forward_order.data(), table);
  const PlanLookup backward_lookup(backend, groups.data(), met, nullptr, table);
  Engine::forward(graph, forward_lookup);
  forward_lookup.finish("forward");
  Engine::begin_backward(backend);
  Engine::backward(graph, backward_lookup);
  backward_lookup.finish("backward");
  p.end_bytes = backend.in_use;
  out = std::move(p);
}

}  // namespace

void Scheduler::replan(Plan& out, const graph::Module& root, MeshShape mesh,
                       const PlanOptions& options) {
  replan_with(out, root, mesh, options, nullptr);
}

}  // namespace fullshard::schedule

namespace fullshard::detail {

void replan_calls(schedule::Plan& out, const graph::Module& root, schedule::MeshShape mesh,
                  const schedule::PlanOptions& options, const RequestTable* calls) {
  schedule::replan_with(out, root, mesh, options, calls);
}

}  // namespace fullshard::detail
