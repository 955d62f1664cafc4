#include "fullshard/schedule/groups.hpp"

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

std::string PlannedGroup::reshard_string() const {
  if (reshard_after_forward == -1) return "true";
  if (reshard_after_forward == 1) return "false";
  return std::to_string(reshard_after_forward);
}

namespace {

bool requested(const graph::Module& m) {
  const nlohmann::json& r = m.fully_shard_request();
  return !(r.is_null() || (r.is_boolean() && !r.get<bool>()));
}

std::size_t count_requests(const graph::Module& m) {
  std::size_t n = requested(m) ? 1 : 0;
  for (std::size_t i = 0; i < m.num_children(); ++i)
    n += count_requests(m.child(i));
  return n;
}

std::string where_of(const graph::Module& m) {
  return (m.json_path().empty() ? (m.is_root() ? std::string("(root)") : m.fqn()) : m.json_path()) +
         ".fully_shard";
}

// One walk over the graph forms every group (fully_shard's post-order), with no per-parameter
// lookups: the parameters a requested module's group takes are those of its subtree that no
// requested module below took, which the walk collects on one stack as it returns.
class GroupBuilder {
 public:
  GroupBuilder(int W, const fsdp::FullyShardOptions& defaults, PlannedGroups& out)
      : W_(W), defaults_(defaults), groups_(out), memory_(out.get_allocator()) {}

  // Appends to stack_ the parameters of m's subtree no group below took (torch's
  // named_parameters order: own parameters, then each child's), forming the groups on the way.
  void visit(const graph::Module& m, int requesting_ancestors) {
    const bool req = requested(m);
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
    form(m, base, position);
    if (requesting_ancestors == 1) {  // an outermost request: the root of what it formed
      const int root = static_cast<int>(groups_.size()) - 1;
      for (std::size_t g = first_group; g < groups_.size(); ++g) {
        PlannedGroup& pg = groups_[g];
        pg.root_group = root;
        pg.is_root = static_cast<int>(g) == root;
        if (pg.reshard_after_forward == 0) pg.reshard_after_forward = pg.is_root ? 1 : -1;
      }
    }
  }

 private:
  // The group of requested module m from the candidates stack_[base...]; its ignored
  // parameters stay on the stack for the groups above.
  void form(const graph::Module& m, std::size_t base, int position) {
    const nlohmann::json& req = m.fully_shard_request();
    if (!req.is_boolean() && !req.is_object())
      throw ConfigError(where_of(m) + ": expected true, false or an object of options");
    // In place (a throw discards every group), its lists in the groups' arena.
    PlannedGroup& g = groups_.emplace_back(memory_);
    if (req.is_boolean()) {
      if (!shared_defaults_)
        shared_defaults_ = std::make_shared<const fsdp::FullyShardOptions>(defaults_);
      g.options = shared_defaults_;
    } else {
      g.options = std::make_shared<const fsdp::FullyShardOptions>(
          fsdp::options_from_request(req, defaults_, where_of(m)));
    }
    const fsdp::FullyShardOptions& options = *g.options;
    if (m.fqn().empty())  // (not a conditional expression: that copies the name twice)
      g.name = "<root>";
    else
      g.name = m.fqn();
    g.modules.push_back(&m);
    g.forward_index = position;
    g.layout.world = W_;

    std::vector<const graph::Parameter*> ignored;
    for (const auto& fqn : options.ignored_params) {
      const graph::Parameter* p = m.try_find_param(fqn);
      if (!p)
        throw InvalidArgument("fully_shard(" + g.name + "): ignored parameter '" + fqn +
                              "' does not exist in the module");
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
      if (g.params.empty()) g.orig_dtype = p->dtype();
      if (p->dtype() != g.orig_dtype)
        throw InvalidArgument(
            "fully_shard(" + g.name + "): parameters '" + g.params[0]->fqn() + "' (" +
            dtype_name(g.orig_dtype) + ") and '" + p->fqn() + "' (" + dtype_name(p->dtype()) +
            ") have different dtypes; one communication group holds one dtype, so give them "
            "separate fully_shard calls");
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

    const int k = options.reshard_after_forward.value();
    if (k >= 1 && W_ % k != 0)
      throw InvalidArgument("fully_shard(" + g.name +
                            "): reshard_after_forward=" + std::to_string(k) +
                            " must divide the shard group size " + std::to_string(W_));
    if (k < -1) throw InvalidArgument("fully_shard(" + g.name + "): bad reshard_after_forward");
    g.reshard_after_forward = (k >= 1 && k == W_) ? -1 : k;  // 0: resolved by visit()
  }

  const int W_;
  const fsdp::FullyShardOptions& defaults_;
  PlannedGroups& groups_;
  const ArenaAllocator<const graph::Module*> memory_;               // the groups' allocator
  std::shared_ptr<const fsdp::FullyShardOptions> shared_defaults_;  // of the `true` requests
  std::vector<const graph::Parameter*> stack_;
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
  return modules.empty() ? name : where_of(*modules.front());
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

void plan_groups_into(schedule::PlannedGroups& out, const graph::Module& root, int shard_size,
                      const fsdp::FullyShardOptions& defaults, std::size_t requests) {
  if (shard_size < 1)
    throw InvalidArgument("plan_groups: the shard group size must be >= 1, got " +
                          std::to_string(shard_size));
  out.clear();
  out.reserve(requests);
  schedule::GroupBuilder(shard_size, defaults, out).visit(root, 0);
}

}  // namespace fullshard::detail
