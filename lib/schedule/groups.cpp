#include "fullshard/schedule/groups.hpp"

#include "fullshard/fsdp/fully_shard.hpp"
#include "lib/fsdp/group_rules.hpp"

#include <algorithm>
#include <unordered_map>
#include <utility>

#include "fullshard/base/checked.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/tensor/sharding.hpp"
#include "lib/schedule/planner_entry.hpp"
#include "lib/tensor/shard_extent.hpp"

namespace fullshard::schedule {

std::size_t PlannedGroup::shard_bytes() const noexcept {
  return static_cast<std::size_t>(layout.shard_numel) * dtype_size(orig_dtype);
}

std::size_t PlannedGroup::unsharded_bytes() const noexcept {
  return static_cast<std::size_t>(layout.arena_numel) * dtype_size(param_dtype);
}

transport::Geometry PlannedGroup::geometry(int replicate) const {
  transport::Geometry g;
  g.shard_numel = layout.shard_numel;
  g.arena_numel = layout.arena_numel;
  g.world = layout.world;
  g.replicate = replicate;
  g.orig_dtype = orig_dtype;
  g.param_dtype = param_dtype;
  g.reduce_dtype = reduce_dtype;
  g.wire = wire;
  return g;
}

std::size_t PlannedGroup::gather_bytes() const {
  return geometry().gather_bytes();
}

namespace {

std::size_t count_requests(const graph::Module& m) {
  std::size_t n = m.requests_fully_shard() ? 1 : 0;
  for (std::size_t i = 0; i < m.num_children(); ++i)
    n += count_requests(m.child(i));
  return n;
}

// One walk over the graph forms every group (fully_shard's post-order), with no per-parameter
// lookups: the parameters a requested module's group takes are those of its subtree that no
// requested module below took, which the walk collects on one stack as it returns. A list
// group (fsdp::detail::graph_list_groups) sets its modules' candidates aside as the walk
// leaves each of them and is formed at the last, as apply_fully_shard_requests applies it.
class GroupBuilder {
 public:
  using Options = std::shared_ptr<const fsdp::FullyShardOptions>;
  // A list request met by a walk that assumed none (plan_groups_into walks again with them).
  struct ListFound {};

  GroupBuilder(int W, const fsdp::FullyShardOptions& defaults, PlannedGroups& out,
               const detail::RequestTable* table,
               const std::vector<fsdp::detail::GraphListGroup>* lists)
      : W_(W),
        defaults_(defaults),
        groups_(out),
        memory_(out.get_allocator()),
        table_(table ? table->calls.data() : nullptr) {
    if (!lists) return;
    lists_.resize(lists->size());
    for (std::size_t l = 0; l < lists->size(); ++l) {
      List& ls = lists_[l];
      ls.list = &(*lists)[l];
      ls.taken.resize(ls.list->modules.size());
      for (std::size_t i = 0; i < ls.list->modules.size(); ++i)
        member_.emplace(ls.list->modules[i], std::make_pair(l, i));
    }
  }

  // Appends to stack_ the parameters of m's subtree no group below took (torch's
  // named_parameters order: own parameters, then each child's), forming the groups on the way.
  void visit(const graph::Module& m, int requesting_ancestors) {
    const std::size_t index = preorder_++;
    List* list = nullptr;
    std::size_t slot = 0;
    if (!member_.empty())
      if (const auto it = member_.find(&m); it != member_.end()) {
        list = &lists_[it->second.first];
        slot = it->second.second;
      }
    const bool req = list || (table_ ? table_[index] != nullptr : m.requests_fully_shard());
    const std::size_t base = stack_.size();
    const std::size_t first_group = groups_.size();
    int position = -1;
    if (req) {
      if (!list)
        position = next_forward_++;
      else if (list->position < 0)  // a list's pre-forward: at its first module
        list->position = next_forward_++;
      if (list && slot == 0 && table_ && table_[index]) list->call = table_[index];
      ++requesting_ancestors;
    }
    for (std::size_t i = 0; i < m.num_params(); ++i)
      stack_.push_back(&m.param(i));
    for (std::size_t i = 0; i < m.num_children(); ++i) {
      // A large graph's modules and parameters are not in cache when the walk reaches them.
      m.prefetch_child(i + 6, 0);
      m.prefetch_child(i + 4, 1);
      m.prefetch_child(i + 2, 2);
      visit(m.child(i), requesting_ancestors);
    }
    if (!req) return;
    if (list) {  // (under a fully_shard'ed module: never a root)
      set_aside(*list, slot, base);
      if (list->list->last != &m) return;
      form_list(*list);
    } else {
      form(m, base, position, table_ ? table_[index] : nullptr);
    }
    if (requesting_ancestors == 1) {  // an outermost request: the root of what it formed
      const int root = static_cast<int>(groups_.size()) - 1;
      set_root(first_group, groups_.size(), root);
    }
  }

 private:
  // A list group being collected: per module (the list's order) the parameters its subtree
  // left, and where its first module came in forward order.
  struct List {
    const fsdp::detail::GraphListGroup* list = nullptr;
    Options options;                // of its first module's request (its ignored parameters)
    const Options* call = nullptr;  // a table's options for it, if any
    std::vector<const graph::Parameter*> ignored;
    std::vector<std::vector<const graph::Parameter*>> taken;
    int position = -1;
  };

  void set_root(std::size_t from, std::size_t to, int root) {
    for (std::size_t g = from; g < to; ++g) {
      PlannedGroup& pg = groups_[g];
      pg.root_group = root;
      pg.is_root = static_cast<int>(g) == root;
      pg.reshard_after_forward = pg.reshard_after_forward.resolved(pg.is_root);
    }
  }

  // The options of module m's request (one that sets none: the shared defaults).
  Options request_options(const graph::Module& m) {
    const graph::ShardRequest& req = *m.fully_shard_request();  // one asking for fully_shard
    if (lists_.empty() && !req.group_with.empty()) throw ListFound{};
    if (req.sets_no_option()) {
      if (!shared_defaults_)
        shared_defaults_ = std::make_shared<const fsdp::FullyShardOptions>(defaults_);
      return shared_defaults_;
    }
    return std::make_shared<const fsdp::FullyShardOptions>(
        fsdp::options_from_request(req, defaults_));
  }

  // A new group (in place: a throw discards every group; its lists in the groups' arena).
  PlannedGroup& start(Options options, int position) {
    PlannedGroup& g = groups_.emplace_back(memory_);
    g.options = std::move(options);
    g.forward_index = position;
    g.layout.world = W_;
    return g;
  }

  // Appends parameter p to group g (its shard extent, the engine's ParamGroup checks).
  void add(PlannedGroup& g, const graph::Parameter* p) {
    const Placement pl = fsdp::shard_placement(*g.options, g.name, *p);
    ShardExtent e;
    if (pl.dim() != 0 || !detail::try_shard_extent_dim0(p->first_extent(), p->inner_numel(), W_, e))
      e = shard_extent(p->shape(), pl, W_, [&] { return "parameter '" + p->fqn() + "'"; });
    if (g.params.empty())
      g.orig_dtype = p->dtype();
    else
      fsdp::detail::check_group_dtype(g.name, *g.params[0], *p);
    const auto ctx = [&] { return "fully_shard(" + g.name + ")"; };
    g.layout.shard_numel = checked_add(g.layout.shard_numel, e.padded_numel, ctx);
    g.layout.arena_numel = checked_add(g.layout.arena_numel, e.numel, ctx);
    g.params.push_back(p);
  }

  // The group of requested module m from the candidates stack_[base...]; its ignored
  // parameters stay on the stack for the groups above.
  void form(const graph::Module& m, std::size_t base, int position, const Options* call) {
    PlannedGroup& g = start(call ? *call : request_options(m), position);
    g.name = fsdp::detail::module_group_name(m);
    g.modules.push_back(&m);
    std::vector<const graph::Parameter*> ignored;
    for (const auto& fqn : g.options->ignored_params) {
      const graph::Parameter* p = m.try_find_param(fqn);
      if (!p) fsdp::detail::throw_unknown_ignored_param(g.name, fqn);
      ignored.push_back(p);
    }
    const auto is_ignored = [&ignored](const graph::Parameter* p) {
      return !ignored.empty() && std::find(ignored.begin(), ignored.end(), p) != ignored.end();
    };
    std::size_t kept = base;  // the ignored candidates, compacted in place
    std::size_t n = 0;
    for (std::size_t i = base; i < stack_.size(); ++i)
      n += is_ignored(stack_[i]) ? 0 : 1;
    g.params.reserve(n);
    for (std::size_t i = base; i < stack_.size(); ++i) {
      const graph::Parameter* p = stack_[i];
      if (is_ignored(p))
        stack_[kept++] = p;
      else
        add(g, p);
    }
    stack_.resize(kept);
    finish(g);
  }

  // A list's module `slot` is done: its candidates stack_[base...] go to the list (its ignored
  // parameters, those of the first of the list's modules that has each, stay on the stack).
  void set_aside(List& ls, std::size_t slot, std::size_t base) {
    if (!ls.options) {
      const graph::Module& first = *ls.list->modules.front();
      ls.options = request_options(first);
      for (const auto& fqn : ls.options->ignored_params) {
        const graph::Parameter* p = nullptr;
        for (const graph::Module* x : ls.list->modules)
          if ((p = x->try_find_param(fqn))) break;
        if (!p) fsdp::detail::throw_unknown_ignored_param(list_name(ls), fqn);
        ls.ignored.push_back(p);
      }
    }
    std::size_t kept = base;
    for (std::size_t i = base; i < stack_.size(); ++i) {
      const graph::Parameter* p = stack_[i];
      if (std::find(ls.ignored.begin(), ls.ignored.end(), p) != ls.ignored.end())
        stack_[kept++] = p;
      else
        ls.taken[slot].push_back(p);
    }
    stack_.resize(kept);
  }

  static std::string list_name(const List& ls) {  // fully_shard's: "a+b"
    return fsdp::detail::group_name(ls.list->modules);
  }

  void form_list(List& ls) {
    PlannedGroup& g = start(ls.call ? *ls.call : ls.options, ls.position);
    g.name = list_name(ls);
    std::size_t n = 0;
    for (const auto& t : ls.taken)
      n += t.size();
    g.modules.reserve(ls.list->modules.size());
    for (const graph::Module* m : ls.list->modules)
      g.modules.push_back(m);
    g.params.reserve(n);
    for (auto& t : ls.taken) {
      for (const graph::Parameter* p : t)
        add(g, p);
      t.clear();
    }
    finish(g);
  }

  // The group's dtypes, compression, byte bounds and reshard_after_forward.
  void finish(PlannedGroup& g) {
    const fsdp::FullyShardOptions& options = *g.options;
    const auto ctx = [&] { return "fully_shard(" + g.name + ")"; };
    g.param_dtype = options.mp_policy.param_dtype.value_or(g.orig_dtype);
    g.reduce_dtype = options.mp_policy.reduce_dtype.value_or(g.param_dtype);
    g.wire = fsdp::compression_wire(options.compression, g.name);
    // Byte counts from user shapes, checked here so that shard_bytes(), unsharded_bytes(),
    // gather_bytes() and the scheduler's sums of them over groups cannot wrap: every buffer a
    // group can hold at once (all-gather and reduce-scatter buffers, unsharded parameters and
    // gradients, sharded parameters and gradients), summed over all groups, fits in int64.
    {
      const auto widest = static_cast<std::int64_t>(std::max(
          {dtype_size(g.orig_dtype), dtype_size(g.param_dtype), dtype_size(g.reduce_dtype)}));
      const std::int64_t gathered = checked_mul(
          checked_mul(g.layout.shard_numel, static_cast<std::int64_t>(W_), ctx), widest, ctx);
      const std::int64_t arena = checked_mul(g.layout.arena_numel, widest, ctx);
      const std::int64_t shard = checked_mul(g.layout.shard_numel, widest, ctx);
      std::int64_t group_total = checked_mul(gathered, 2, ctx);
      group_total = checked_add(group_total, checked_mul(arena, 2, ctx), ctx);
      group_total = checked_add(group_total, checked_mul(shard, 2, ctx), ctx);
      model_bytes_ = checked_add(model_bytes_, group_total,
                                 [&] { return ctx() + ": the buffers of all groups together"; });
    }
    // (automatic: resolved when its root is known)
    g.reshard_after_forward = options.reshard_after_forward.for_shard_group(W_, g.name);
  }

  const int W_;
  const fsdp::FullyShardOptions& defaults_;
  PlannedGroups& groups_;
  const ArenaAllocator<const graph::Module*> memory_;  // the groups' allocator
  Options shared_defaults_;                            // of the `true` requests
  const Options* const* table_;                        // or nullptr
  std::vector<List> lists_;
  std::unordered_map<const graph::Module*, std::pair<std::size_t, std::size_t>> member_;
  std::vector<const graph::Parameter*> stack_;
  std::size_t preorder_ = 0;
  int next_forward_ = 0;
  std::int64_t model_bytes_ = 0;
};

}  // namespace

std::vector<std::string> PlannedGroup::param_fqns() const {
  std::vector<std::string> out;
  out.reserve(params.size());
  for (const graph::Parameter* p : params)
    out.push_back(p->fqn());
  return out;
}

kernels::GroupLayout PlannedGroup::group_layout(int rank) const {
  std::vector<ShardLayout> layouts;
  layouts.reserve(params.size());
  const fsdp::FullyShardOptions none;  // a group made by hand: the defaults
  for (const graph::Parameter* p : params)
    layouts.push_back(shard_layout(p->shape(),
                                   fsdp::shard_placement(options ? *options : none, name, *p),
                                   layout.world, rank, "parameter '" + p->fqn() + "'"));
  kernels::GroupLayout l = kernels::make_group_layout(layouts);
  l.world = layout.world;  // also for a group without parameters
  return l;
}

std::string PlannedGroup::where() const {
  return modules.empty() ? name : fsdp::request_path(*modules.front());
}

PlannedGroups plan_groups(const graph::Module& root, int shard_size,
                          const fsdp::FullyShardOptions& defaults) {
  PlannedGroups groups;
  detail::plan_groups_into(groups, root, shard_size, defaults, detail::count_group_requests(root));
  return groups;
}

}  // namespace fullshard::schedule

namespace fullshard::detail {

std::size_t count_group_requests(const graph::Module& root) {
  return schedule::count_requests(root);
}

bool plan_groups_into(schedule::PlannedGroups& out, const graph::Module& root, int shard_size,
                      const fsdp::FullyShardOptions& defaults, std::size_t requests,
                      const RequestTable* table) {
  if (table && table->calls.size() != root.num_descendants() + 1)
    throw InvalidArgument("plan_groups: a request table of " + std::to_string(table->calls.size()) +
                          " entries for a graph of " + std::to_string(root.num_descendants() + 1) +
                          " modules");
  if (shard_size < 1)
    throw InvalidArgument("plan_groups: the shard group size must be >= 1, got " +
                          std::to_string(shard_size));
  out.clear();
  out.reserve(requests);
  if (table && table->lists && !table->lists->empty()) {
    schedule::GroupBuilder(shard_size, defaults, out, table, table->lists).visit(root, 0);
    return true;
  }
  try {
    schedule::GroupBuilder(shard_size, defaults, out, table, nullptr).visit(root, 0);
    return false;
  } catch (const schedule::GroupBuilder::ListFound&) {
    // A graph with list groups (rare): they are found and checked first, then the walk
    // forms them where fully_shard does. A graph without any pays no extra walk.
    out.clear();
    const auto lists = fsdp::detail::graph_list_groups(root);
    schedule::GroupBuilder(shard_size, defaults, out, nullptr, &lists).visit(root, 0);
    return !lists.empty();
  }
}

}  // namespace fullshard::detail
