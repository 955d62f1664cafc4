#include "lib/fsdp/shard_update.hpp"

#include "fullshard/base/error.hpp"
#include "lib/fsdp/group_access.hpp"
#include "lib/fsdp/param_group.hpp"

namespace fullshard::fsdp {

void update_in_backward(FSDPModule& st, std::shared_ptr<ShardUpdate> update) {
  ParamGroup& pg = group_of(st);
  engine::Group& g = pg.engine();
  const std::string what = "update_in_backward('" + pg.name() + "'): ";
  if (g.backward_begun() || (g.root != nullptr && g.root->in_backward))
    throw InvalidArgument(what + "the group's backward has begun");
  if (update) {
    if (pg.orig_dtype() != DType::f32)
      throw InvalidArgument(what + "the group's parameters are " + dtype_name(pg.orig_dtype()) +
                            "; the update needs f32 shards");
    if (pg.offload_to_cpu())
      throw InvalidArgument(what +
                            "the group's shards are offloaded (CPUOffloadPolicy); the update "
                            "inside backward runs where the reduction runs: step it after "
                            "backward instead");
    const int states = update->state_arrays();
    if (states < 0 || states > 2)
      throw InvalidArgument(what + "the update names " + std::to_string(states) +
                            " state arrays (0 to 2)");
    g.update_state_arrays = static_cast<std::int8_t>(states);
  } else {
    g.update_state_arrays = -1;
  }
  pg.set_shard_update(std::move(update));
}

bool updates_in_backward(const FSDPModule& st) noexcept {
  return group_of(st).engine().updates_in_backward();
}

}  // namespace fullshard::fsdp
