// The rules that form a communication group, shared by fully_shard (the running groups) and
// the planner (schedule::plan_groups), so that both name groups alike and refuse the same
// input with the same message. Not user API (not installed).
#pragma once

#include <string>

#include "fullshard/graph/module.hpp"

namespace fullshard::fsdp::detail {

/// The name of the group fully_shard(m) forms: m's FQN, "<root>" for a root module.
std::string module_group_name(const graph::Module& m);

/// One communication group holds one dtype: InvalidArgument naming the group and both
/// parameters (`p`'s dtype is not that of the group's first parameter `first`).
[[noreturn]] void throw_mixed_dtypes(const std::string& group, const graph::Parameter& first,
                                     const graph::Parameter& p);
inline void check_group_dtype(const std::string& group, const graph::Parameter& first,
                              const graph::Parameter& p) {
  if (p.dtype() != first.dtype()) throw_mixed_dtypes(group, first, p);
}

/// InvalidArgument: an ignored parameter's FQN names no parameter of the group's modules.
[[noreturn]] void throw_unknown_ignored_param(const std::string& group, const std::string& fqn);

}  // namespace fullshard::fsdp::detail
