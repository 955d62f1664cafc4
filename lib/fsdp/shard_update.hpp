// An update of a group's shards run by its reduction, inside backward: an optimizer that
// steps each communication group as soon as the group's reduced gradient shard lands
// (torchtune's optimizer_in_backward, DeepSpeed's fused step), on the reduction's stream
// while backward goes on with the groups before it. optim::Optimizer::run_in_backward is the
// user API; this is what the engine calls.
//
// What changes for the user: after backward the parameters of such a group have been updated
// and show no gradient (grad() none: the reduced gradient was consumed); clip_grad_norm
// refuses them (a global norm needs every gradient before any update), and so do a backward
// that reduces with set_is_last_backward(false) and set_reshard_after_backward(false) on a
// group whose unsharded parameters are a copy. Micro-batches accumulate with
// set_requires_gradient_sync(false): only the synchronised backward reduces, so only it
// updates; under HSDP a deferred all-reduce (set_requires_all_reduce(false)) defers the
// update with it. A backward that fails part way leaves the groups whose reductions landed
// updated.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/kernels/element_update.hpp"
#include "fullshard/tensor/tensor.hpp"

namespace fullshard::fsdp {

/// A group as its update sees it when the reduction issues the update.
struct ShardGroupView {
  const std::string& name;
  const std::vector<graph::Parameter*>& params;  // layout order
  const kernels::GroupLayout& layout;            // members' slot offsets, gsn
  const Tensor& shards;  // the sharded storage: gsn elements of the original dtype
  void* stream;          // the CUDA stream the update runs on (nullptr: host)
};

class ShardUpdate {
 public:
  virtual ~ShardUpdate() = default;
  /// The element update of the group's whole shard (gsn elements, slot layout; padding stays
  /// zero) for this reduction: called on the host during backward, once per reduction, before
  /// the engine issues the reduction (its last pass runs the update: kernels::reduce_update)
  /// or the separate update that reads the stored gradients; the kernel runs later on the
  /// reduction's stream. The arrays it names must stay valid until the end of backward.
  /// Errors propagate out of backward.
  virtual kernels::ElementUpdate prepare(const ShardGroupView& group) = 0;
  /// State arrays per element the updates read and write (the byte account; 0 to 2).
  virtual int state_arrays() const = 0;
};

/// From the next backward on, `st`'s group ends each reduction with `update` (nullptr: no
/// longer). InvalidArgument naming the group when its parameters are not f32, its shards are
/// offloaded (CPUOffloadPolicy) or its backward has begun.
void update_in_backward(FSDPModule& st, std::shared_ptr<ShardUpdate> update);
/// Whether `st`'s group updates its shards inside backward.
bool updates_in_backward(const FSDPModule& st) noexcept;

}  // namespace fullshard::fsdp
