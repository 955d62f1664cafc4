#include "fullshard/schedule/groups.hpp"

#include "fullshard/fsdp/detail/group_rules.hpp"
#include "fullshard/fsdp/fully_shard.hpp"

#include <algorithm>

#include "fullshard/base/checked.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/tensor/sharding.hpp"

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
  std::size_t n = fsdp::requests_fully_shard(m.fully_shard_request()) ? 1 : 0;
  for (std::size_t i = 0; i < m.num_children(); ++i)
    n += count_requests(m.child(i));
  return n;
}

// One walk over the graph forms every group (fully_shard's post-order), with no per-parameter
// lookups: the parameters a requested module's group takes are those of its subtree that no
// requested module below took, which the walk collects on one stack as it returns.
class GroupBuilder {
 public:
  GroupBuilder(int W, const fsdp::FullyShardOptions& defaults, PlannedGroups& out,
               const detail::RequestTable* table)
      : W_(W),
        defaults_(defaults),
        groups_(out),
        memory_(out.get_allocator()),
        table_(table ? table->data() : nullptr) {}

  // Appends to stack_ the parameters of m's subtree no group below took (torch's
  // named_parameters order: own parameters, then each child's), forming the groups on the way.
  void visit(const graph::Module& m, int requesting_ancestors) {
    const std::size_t index = preorder_++;
    const bool req =
        table_ ? table_[index] != nullptr : fsdp::requests_fully_shard(m.fully_shard_request());
    const std::size_t base = stack_.size();
    const std::size_t first_group = groups_.size();
    int position = -1;
    if (req) {
      position = next_forward_++;
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
    form(m, base, position, table_ ? table_[index] : nullptr);
    if (requesting_ancestors == 1) {  // an outermost request: the root of what it formed
      const int root = static_cast<int>(groups_.size()) - 1;
      for (std::size_t g = first_group; g < groups_.size(); ++g) {
        PlannedGroup& pg = groups_[g];
        pg.root_group = root;
        pg.is_root = static_cast<int>(g) == root;
        pg.reshard_after_forward = pg.reshard_after_forward.resolved(pg.is_root);
      }
    }
  }

 private:
  // The group of requested module m from the candidates stack_[base...]; its ignored
  // parameters stay on the stack for the groups above.
  void form(const graph::Module& m, std::size_t base, int position,
            const std::shared_ptr<const fsdp::FullyShardOptions>* call) {
    const nlohmann::json& req = m.fully_shard_request();  // true or an object (a module's rule)
    // In place (a throw discards every group), its lists in the groups' arena.
    PlannedGroup& g = groups_.emplace_back(memory_);
    if (call) {
      g.options = *call;
    } else if (req.is_boolean()) {
      if (!shared_defaults_)
        shared_defaults_ = std::make_shared<const fsdp::FullyShardOptions>(defaults_);
      g.options = shared_defaults_;
    } else {
      g.options = std::make_shared<const fsdp::FullyShardOptions>(
          fsdp::options_from_request(req, defaults_, fsdp::request_path(m)));
    }
    const fsdp::FullyShardOptions& options = *g.options;
    g.name = fsdp::detail::module_group_name(m);
    g.modules.push_back(&m);
    g.forward_index = position;
    g.layout.world = W_;

    std::vector<const graph::Parameter*> ignored;
    for (const auto& fqn : options.ignored_params) {
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
    const auto ctx = [&] { return "fully_shard(" + g.name + ")"; };
    for (std::size_t i = base; i < stack_.size(); ++i) {
      const graph::Parameter* p = stack_[i];
      if (is_ignored(p)) {
        stack_[kept++] = p;
        continue;
      }
      const Placement pl = fsdp::shard_placement(options, g.name, *p);
      ShardExtent e;
      if (pl.dim() != 0 ||
          !detail::try_shard_extent_dim0(p->first_extent(), p->inner_numel(), W_, e))
        e = shard_extent(p->shape(), pl, W_, [&] { return "parameter '" + p->fqn() + "'"; });
      // The engine's ParamGroup checks, in its order.
      if (g.params.empty())
        g.orig_dtype = p->dtype();
      else
        fsdp::detail::check_group_dtype(g.name, *g.params[0], *p);
      g.layout.shard_numel = checked_add(g.layout.shard_numel, e.padded_numel, ctx);
      g.layout.arena_numel = checked_add(g.layout.arena_numel, e.numel, ctx);
      g.params.push_back(p);
    }
    stack_.resize(kept);
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

    // (automatic: resolved by visit())
    g.reshard_after_forward = options.reshard_after_forward.for_shard_group(W_, g.name);
  }

  const int W_;
  const fsdp::FullyShardOptions& defaults_;
  PlannedGroups& groups_;
  const ArenaAllocator<const graph::Module*> memory_;                   // the groups' allocator
  std::shared_ptr<const fsdp::FullyShardOptions> shared_defaults_;      // of the `true` requests
  const std::shared_ptr<const fsdp::FullyShardOptions>* const* table_;  // or nullptr
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

std::size_t count_group_requests(const graph::Module& root, const RequestTable* table) {
  if (!table) return schedule::count_requests(root);
  return static_cast<std::size_t>(
      std::count_if(table->begin(), table->end(), [](const auto* e) { return e != nullptr; }));
}

void plan_groups_into(schedule::PlannedGroups& out, const graph::Module& root, int shard_size,
                      const fsdp::FullyShardOptions& defaults, std::size_t requests,
                      const RequestTable* table) {
  if (table && table->size() != root.num_descendants() + 1)
    throw InvalidArgument("plan_groups: a request table of " + std::to_string(table->size()) +
                          " entries for a graph of " + std::to_string(root.num_descendants() + 1) +
                          " modules");
  if (shard_size < 1)
    throw InvalidArgument("plan_groups: the shard group size must be >= 1, got " +
                          std::to_string(shard_size));
  out.clear();
  out.reserve(requests);
  schedule::GroupBuilder(shard_size, defaults, out, table).visit(root, 0);
}

}  // namespace fullshard::detail
