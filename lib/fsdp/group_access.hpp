// An FSDP module's communication group as the checkpoint layer, the front ends and the
// plan-versus-run tests reach it: its storage, its parameters, the engine's operation log.
// Not user API (not installed); FSDPModule keeps the controls a user needs.
#pragma once

#include <string>
#include <vector>

#include "fullshard/fsdp/fully_shard.hpp"
#include "lib/fsdp/engine.hpp"

namespace fullshard::fsdp::detail {

/// The group's name ("layers.0", "<root>", "a+b" for a list).
const std::string& group_name(const FSDPModule& m) noexcept;
/// The parameters of the group, in layout order.
const std::vector<graph::Parameter*>& group_params(const FSDPModule& m) noexcept;
/// True for the first module of its group (a list group has several FSDPModules).
bool owns_group(const FSDPModule& m) noexcept;
/// This rank's group shard in slot layout (FSDPModule::group_layout()), original dtype,
/// padding zero. Checkpoints load into it without a staging copy.
const Tensor& sharded_storage(const FSDPModule& m) noexcept;
/// Why `storage` cannot replace the sharded storage (empty when it can): same shape, dtype
/// and memory space, and the group sharded with no all-gather in flight.
std::string adopt_problem(const FSDPModule& m, const Tensor& storage);
/// Replaces the sharded storage (InvalidArgument with adopt_problem's reason; padding zero)
/// and shows the new shards on the parameters. Views of the old storage keep the old values.
void adopt_sharded_storage(FSDPModule& m, Tensor storage);
/// Root only: appends every operation the engine issues from now on to `log` (nullptr
/// stops), in the format of the planner's operations, for plan-versus-run comparisons.
void record_operations(FSDPModule& root, std::vector<engine::OpDesc>* log);

}  // namespace fullshard::fsdp::detail
