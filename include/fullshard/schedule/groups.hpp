// Communication groups without communication: the groups fsdp::apply_fully_shard_requests
// would form for a module graph, with their layouts and resolved options, computed from the
// graph alone (no MPI, no DeviceMesh). The scheduler plans on these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/base/arena_allocator.hpp"
#include "fullshard/base/dtype.hpp"
#include "fullshard/fsdp/options.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/transport/fusions.hpp"

namespace fullshard::schedule {

/// The sizes of a group's layouts (kernels::GroupLayout without its members): the same on
/// every rank.
struct GroupExtent {
  /// Shard group size the layout was computed for.
  int world = 1;
  /// gsn: one rank's padded group shard (slot layout), in elements.
  std::int64_t shard_numel = 0;
  /// The unsharded parameters (the arena), in elements.
  std::int64_t arena_numel = 0;
};

/// One communication group, as fully_shard would form it. Its lists live where the group
/// does (the plan's arena, see Plan).
struct PlannedGroup {
  PlannedGroup() = default;
  /// A group whose lists take their memory from `memory`.
  explicit PlannedGroup(const ArenaAllocator<const graph::Module*>& memory)
      : modules(memory), params(memory) {}

  /// The module FQN, "<root>" for the graph's root module (fully_shard's group name).
  std::string name;
  /// The modules of the group: one, or a list group's (a request's "group_with": the
  /// declaring module first, then the modules it names).
  std::vector<const graph::Module*, ArenaAllocator<const graph::Module*>> modules;
  /// The group's parameters, in layout order (pointers into the graph).
  std::vector<const graph::Parameter*, ArenaAllocator<const graph::Parameter*>> params;
  GroupExtent layout;
  DType orig_dtype = DType::f32;
  DType param_dtype = DType::f32;
  DType reduce_dtype = DType::f32;
  /// The compressed collectives (transport::Geometry::wire).
  std::uint8_t wire = 0;
  /// reshard_after_forward as the engine runs it (checked for the shard group, automatic
  /// resolved): true, false, or k in (1, W) (keep a 1/k slice, gather backward in k ranks).
  fsdp::ReshardAfterForward reshard_after_forward = fsdp::ReshardAfterForward::always();
  /// True for the group of an outermost fully_shard'ed module (FSDP's root: it owns the
  /// buffer pool and the streams of every group under it).
  bool is_root = false;
  /// Index (in the plan_groups result) of the root group this group belongs to.
  int root_group = 0;
  /// Position in forward order: the order of the groups' first pre-forward, which is the
  /// pre-order of their modules.
  int forward_index = 0;
  /// The options fully_shard was called with (defaults overridden by the request object).
  /// The groups of a `true` request share one copy of the defaults.
  std::shared_ptr<const fsdp::FullyShardOptions> options;

  /// Shard group size the layout was computed for.
  int shard_size() const noexcept { return layout.world; }
  /// FQNs of the group's parameters, in layout order.
  std::vector<std::string> param_fqns() const;
  /// The full layout of `rank` (members with their shard layouts and offsets).
  kernels::GroupLayout group_layout(int rank = 0) const;
  /// Where the request came from, e.g. "modules[1].fully_shard" (for messages).
  std::string where() const;
  /// gsn * sizeof(orig dtype): the persistent sharded storage (padded, slot layout) per rank.
  std::size_t shard_bytes() const noexcept;
  /// arena_numel * sizeof(param dtype): the unsharded parameters (and unsharded gradients).
  std::size_t unsharded_bytes() const noexcept;
  /// The all-gather buffer the engine takes from the pool when it issues the all-gather
  /// (transport::Geometry::gather_bytes): W * gsn * sizeof(param dtype), or W packed slots
  /// when compressed; with W == 1, gsn * sizeof(param dtype) when a cast is needed and 0 (no
  /// buffer: the shards are read directly) otherwise.
  std::size_t gather_bytes() const;
  /// The group's sizes and dtypes as its transport sees them (on rank 0 of a mesh with
  /// `replicate` replicas).
  transport::Geometry geometry(int replicate = 1) const;
};

/// The groups fsdp::apply_fully_shard_requests(root, mesh, defaults) forms on a mesh whose
/// shard dim has `shard_size` ranks, in the order it forms them (post-order over modules
/// whose fully_shard request is true or an object; a list group where its last module
/// comes). A group holds its modules' parameters not already grouped by a submodule's group,
/// minus its ignored_params. Errors are those of
/// fully_shard and of the request parsing: ConfigError naming the JSON path of a bad option,
/// InvalidArgument naming the group for an unknown ignored parameter, mixed dtypes, a
/// reshard_after_forward that does not divide `shard_size`, or a bad Shard(d) placement.
using PlannedGroups = std::vector<PlannedGroup, ArenaAllocator<PlannedGroup>>;
PlannedGroups plan_groups(const graph::Module& root, int shard_size,
                          const fsdp::FullyShardOptions& defaults = {});

}  // namespace fullshard::schedule
