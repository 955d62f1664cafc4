// The planner's ways in besides Scheduler::plan (kept out of the schedule namespace, whose
// files name fullshard::detail's helpers as detail::...): the auto-planner plans candidate
// fully_shard calls without changing the user's graph.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "fullshard/fsdp/options.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/schedule/groups.hpp"
#include "fullshard/schedule/plan.hpp"

namespace fullshard::fsdp::detail {
struct GraphListGroup;  // lib/fsdp/group_rules.hpp (private)
}

namespace fullshard::detail {
/// The fully_shard calls a planner forms groups for instead of the graph's requests: per
/// module in pre-order (the root first), the options of its call, or null for none; and the
/// graph's list groups, kept as they are (their options: their first module's entry; the
/// entries of their other modules are not read). The auto-planner's candidates, planned
/// without changing the user's graph.
struct RequestTable {
  std::vector<const std::shared_ptr<const fsdp::FullyShardOptions>*> calls;
  const std::vector<fsdp::detail::GraphListGroup>* lists = nullptr;
};
/// The number of modules with a fully_shard request (true or an object): plan_groups' size.
std::size_t count_group_requests(const graph::Module& root);
/// plan_groups into `out` (emptied; its allocator is kept), with room for `requests` groups;
/// the calls of `table` (one entry per module) instead of the graph's requests when given.
/// Returns whether a list group was formed (a group with several modules).
bool plan_groups_into(schedule::PlannedGroups& out, const graph::Module& root, int shard_size,
                      const fsdp::FullyShardOptions& defaults, std::size_t requests,
                      const RequestTable* table = nullptr);
}  // namespace fullshard::detail

namespace fullshard::detail {
/// Scheduler::replan with the fully_shard calls of `calls` (one entry per module, pre-order)
/// instead of the graph's requests (null: the graph's). The auto-planner's way in.
void replan_calls(schedule::Plan& out, const graph::Module& root, schedule::MeshShape mesh,
                  const schedule::PlanOptions& options, const RequestTable* calls);
/// Resolves the group names of p.options' policies (no_unshard_in_backward,
/// backward_prefetch_targets) into p's indices; InvalidArgument "Scheduler::plan: <option>: no
/// group named '<name>' (groups: ...)". Out of the scheduler's file: its code there would
/// change how GCC inlines the state machine.
void resolve_policy_groups(schedule::Plan& p);
}  // namespace fullshard::detail
