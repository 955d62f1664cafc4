// The rules that form a communication group, shared by fully_shard (the running groups) and
// the planner (schedule::plan_groups), so that both name groups alike and refuse the same
// input with the same message. Not user API (not installed).
#pragma once

#include <string>
#include <vector>

#include "fullshard/graph/module.hpp"

namespace fullshard::fsdp::detail {

/// The name of the group fully_shard(m) forms: m's FQN, "<root>" for a root module.
const std::string& module_group_name(const graph::Module& m);
/// The name of the group fully_shard(modules) forms: their group names joined by '+'.
template <class ModulePtr>
std::string group_name(const std::vector<ModulePtr>& modules) {
  std::string s;
  for (const auto* m : modules)
    s += (s.empty() ? "" : "+") + module_group_name(*m);
  return s;
}

/// One communication group holds one dtype: InvalidArgument naming the group and both
/// parameters (`p`'s dtype is not that of the group's first parameter `first`).
[[noreturn]] void throw_mixed_dtypes(const std::string& group, const graph::Parameter& first,
                                     const graph::Parameter& p);
inline void check_group_dtype(const std::string& group, const graph::Parameter& first,
                              const graph::Parameter& p) {
  if (p.dtype() != first.dtype()) throw_mixed_dtypes(group, first, p);
}

/// A list group a graph declares: `"fully_shard": {"group_with": ["head"]}` on module `embed`
/// is fully_shard({embed, head}) with embed's options (FQNs relative to the graph's root).
/// fully_shard applies it where its last module comes in post-order (bottom-up: every
/// request below its modules is applied first).
struct GraphListGroup {
  /// The declaring module first, then group_with's modules in their order.
  std::vector<const graph::Module*> modules;
  /// The module met last in post-order (where the group is formed).
  const graph::Module* last = nullptr;
};

/// The list groups of a graph's requests, in pre-order of their declaring modules, checked:
/// ConfigError naming the JSON path for a group_with that is not an array of FQNs of the
/// graph's modules, a module listed twice (or in two lists, or with its own request), a
/// module inside another of the same list, a module under no fully_shard'ed module or
/// modules under different outermost ones (a list group is never a root), or a
/// fully_shard'ed module that holds some of the list's modules but not the last (its group
/// would take their parameters before the list is formed).
std::vector<GraphListGroup> graph_list_groups(const graph::Module& root);

/// InvalidArgument: an ignored parameter's FQN names no parameter of the group's modules.
[[noreturn]] void throw_unknown_ignored_param(const std::string& group, const std::string& fqn);

}  // namespace fullshard::fsdp::detail
