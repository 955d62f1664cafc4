#include "fullshard/schedule/groups.hpp"

#include "fullshard/fsdp/fully_shard.hpp"

#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

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

std::size_t PlannedGroup::gather_bytes() const noexcept {
  const auto gsn = static_cast<std::size_t>(layout.shard_numel);
  const auto W = static_cast<std::size_t>(layout.world);
  if (W == 1) return param_dtype == orig_dtype ? 0 : gsn * dtype_size(param_dtype);
  return W * gsn * dtype_size(param_dtype);
}

std::string PlannedGroup::reshard_string() const {
  if (reshard_after_forward == -1) return "true";
  if (reshard_after_forward == 1) return "false";
  return std::to_string(reshard_after_forward);
}

namespace {

void postorder(const graph::Module& m, std::vector<const graph::Module*>& out) {
  for (std::size_t i = 0; i < m.num_children(); ++i)
    postorder(m.child(i), out);
  out.push_back(&m);
}

// torch's named_parameters order: own parameters, then each child's, recursively.
void parameters(const graph::Module& m, std::vector<const graph::Parameter*>& out) {
  for (std::size_t i = 0; i < m.num_params(); ++i)
    out.push_back(&m.param(i));
  for (std::size_t i = 0; i < m.num_children(); ++i)
    parameters(m.child(i), out);
}

bool requested(const graph::Module& m) {
  const nlohmann::json& r = m.fully_shard_request();
  return !(r.is_null() || (r.is_boolean() && !r.get<bool>()));
}

}  // namespace

std::vector<PlannedGroup> plan_groups(const graph::Module& root, int shard_size,
                                      const fsdp::FullyShardOptions& defaults) {
  if (shard_size < 1)
    throw InvalidArgument("plan_groups: the shard group size must be >= 1, got " +
                          std::to_string(shard_size));
  const int W = shard_size;
  std::vector<PlannedGroup> groups;
  std::unordered_map<const graph::Parameter*, int> grouped;  // parameter -> group
  std::unordered_map<const graph::Module*, int> group_of;    // module with a request -> group

  std::int64_t model_bytes = 0;  // see the byte checks below

  std::vector<const graph::Module*> order;
  postorder(root, order);
  for (const graph::Module* m : order) {
    if (!requested(*m)) continue;
    const nlohmann::json& req = m->fully_shard_request();
    const std::string where =
        (m->json_path().empty() ? (m->is_root() ? std::string("(root)") : m->fqn())
                                : m->json_path()) +
        ".fully_shard";
    if (!req.is_boolean() && !req.is_object())
      throw ConfigError(where + ": expected true, false or an object of options");
    PlannedGroup g;
    g.options = fsdp::options_from_request(req, defaults, where);
    g.where = where;
    g.name = m->fqn().empty() ? "<root>" : m->fqn();
    g.modules = {m};

    std::unordered_set<const graph::Parameter*> ignored;
    for (const auto& fqn : g.options.ignored_params) {
      const graph::Parameter* p = m->try_find_param(fqn);
      if (!p)
        throw InvalidArgument("fully_shard(" + g.name + "): ignored parameter '" + fqn +
                              "' does not exist in the module");
      ignored.insert(p);
    }

    std::vector<const graph::Parameter*> all;
    parameters(*m, all);
    std::vector<const graph::Parameter*> params;
    std::vector<ShardLayout> layouts;
    for (const graph::Parameter* p : all) {
      if (grouped.count(p) || ignored.count(p)) continue;
      Placement pl = Placement::Shard(0);
      if (g.options.shard_placement_fn)
        if (auto chosen = g.options.shard_placement_fn(*p)) pl = *chosen;
      if (!pl.is_shard())
        throw InvalidArgument("fully_shard(" + g.name + "): parameter '" + p->fqn() +
                              "': shard_placement_fn must return a Shard placement (ignore the "
                              "parameter to keep it replicated)");
      layouts.push_back(shard_layout(p->shape(), pl, W, 0, "parameter '" + p->fqn() + "'"));
      params.push_back(p);
    }

    // The engine's ParamGroup checks, in its order.
    if (!params.empty()) g.orig_dtype = params[0]->dtype();
    for (const graph::Parameter* p : params)
      if (p->dtype() != g.orig_dtype)
        throw InvalidArgument(
            "fully_shard(" + g.name + "): parameters '" + params[0]->fqn() + "' (" +
            dtype_name(g.orig_dtype) + ") and '" + p->fqn() + "' (" + dtype_name(p->dtype()) +
            ") have different dtypes; one communication group holds one dtype, so give them "
            "separate fully_shard calls");
    g.param_dtype = g.options.mp_policy.param_dtype.value_or(g.orig_dtype);
    g.reduce_dtype = g.options.mp_policy.reduce_dtype.value_or(g.param_dtype);
    g.layout = kernels::make_group_layout(layouts);
    g.layout.world = W;  // also for a group without parameters
    // Byte counts from user shapes, checked here so that shard_bytes(), unsharded_bytes(),
    // gather_bytes() and the scheduler's sums of them over groups cannot wrap: every buffer a
    // group can hold at once (all-gather and reduce-scatter buffers, unsharded parameters and
    // gradients, sharded parameters and gradients), summed over all groups, fits in int64.
    {
      const auto ctx = [&] { return "fully_shard(" + g.name + ")"; };
      const auto widest = static_cast<std::int64_t>(std::max(
          {dtype_size(g.orig_dtype), dtype_size(g.param_dtype), dtype_size(g.reduce_dtype)}));
      const std::int64_t gathered = checked_mul(
          checked_mul(g.layout.shard_numel, static_cast<std::int64_t>(W), ctx), widest, ctx);
      const std::int64_t arena = checked_mul(g.layout.arena_numel, widest, ctx);
      const std::int64_t shard = checked_mul(g.layout.shard_numel, widest, ctx);
      std::int64_t group_total = checked_mul(gathered, 2, ctx);
      group_total = checked_add(group_total, checked_mul(arena, 2, ctx), ctx);
      group_total = checked_add(group_total, checked_mul(shard, 2, ctx), ctx);
      model_bytes = checked_add(model_bytes, group_total,
                                [&] { return ctx() + ": the buffers of all groups together"; });
    }

    const int k = g.options.reshard_after_forward.value();
    if (k >= 1 && W % k != 0)
      throw InvalidArgument("fully_shard(" + g.name +
                            "): reshard_after_forward=" + std::to_string(k) +
                            " must divide the shard group size " + std::to_string(W));
    if (k < -1) throw InvalidArgument("fully_shard(" + g.name + "): bad reshard_after_forward");
    g.reshard_after_forward = (k >= 1 && k == W) ? -1 : k;  // 0: resolved below

    const int index = static_cast<int>(groups.size());
    for (const graph::Parameter* p : params) {
      grouped[p] = index;
      g.param_fqns.push_back(p->fqn());
    }
    group_of[m] = index;
    groups.push_back(std::move(g));
  }

  // Roots: groups of modules with no requesting ancestor. Automatic reshard_after_forward
  // resolves to false for a root group, true for the others (ParamGroup::attach).
  for (auto& g : groups) {
    const graph::Module* top = g.modules.front();
    for (const graph::Module* up = top->parent(); up; up = up->parent())
      if (group_of.count(up)) top = up;
    g.root_group = group_of.at(top);
    g.is_root = top == g.modules.front();
    if (g.reshard_after_forward == 0) g.reshard_after_forward = g.is_root ? 1 : -1;
  }
  return groups;
}

}  // namespace fullshard::schedule
