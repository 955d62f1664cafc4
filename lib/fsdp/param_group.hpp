// The running side of one communication group: the sharded storage, the communicators and
// copy plans of the mesh's device, the parameters it registers views on, and the engine
// group (fullshard/fsdp/engine.hpp) that decides what happens when. Private to lib/fsdp.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "fullshard/fsdp/options.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "lib/fsdp/engine.hpp"
#include "lib/fsdp/shard_update.hpp"
#include "lib/transport/group_transport.hpp"

namespace fullshard::fsdp {
class FSDPModule;
}

namespace fullshard::fsdp::detail {

class RunningBackend;

/// One FSDP root's running backend and engine root, shared by every group under it.
struct RootContext;

/// Creates the root context above `st` and attaches every group of its subtree (the first
/// forward or unshard does this; the executor does it up front).
void ensure_initialized(FSDPModule& st);

}  // namespace fullshard::fsdp::detail

namespace fullshard::fsdp {

// The group's sharded storage is its transport's ShardStore.
class ParamGroup final : private transport::ShardStore {
 public:
  ParamGroup(std::string name, std::vector<graph::Module*> modules,
             std::vector<graph::Parameter*> params, std::vector<ShardLayout> layouts,
             const DeviceMesh& mesh, const FullyShardOptions& options);
  ~ParamGroup();
  ParamGroup(const ParamGroup&) = delete;
  ParamGroup& operator=(const ParamGroup&) = delete;

  const std::string& name() const noexcept { return *name_; }
  /// The name, shared (for the lazy labels of the group's operations).
  const std::shared_ptr<const std::string>& shared_name() const noexcept { return name_; }
  const std::vector<graph::Module*>& modules() const noexcept { return modules_; }
  const std::vector<graph::Parameter*>& params() const noexcept { return params_; }
  const kernels::GroupLayout& layout() const noexcept { return layout_; }
  const DeviceMesh& mesh() const noexcept { return mesh_; }
  int shard_size() const noexcept { return engine_.info.world; }
  int shard_rank() const noexcept { return engine_.info.rank; }
  DType orig_dtype() const noexcept { return engine_.info.orig_dtype; }
  DType param_dtype() const noexcept { return engine_.info.param_dtype; }
  DType reduce_dtype() const noexcept { return engine_.info.reduce_dtype; }
  bool offload_to_cpu() const noexcept { return offload_.has_value(); }
  /// Where the group's unsharded parameters, unsharded gradients and communication buffers
  /// live: device memory on a CUDA mesh, host memory on a CPU mesh.
  MemorySpace space() const noexcept { return space_; }
  /// Where its sharded parameters and sharded gradients (and so the optimizer state) live:
  /// space(), or host memory under CPUOffloadPolicy.
  MemorySpace shard_space() const noexcept { return shard_space_; }
  /// CPUOffloadPolicy on a CUDA mesh: host shards around device collectives (the running
  /// backend copies them host-to-device before the all-gather and the reduced gradient
  /// shard device-to-host after the reduce-scatter).
  bool offloaded() const noexcept { return space_ != shard_space_; }
  /// offloaded() with pin_memory: the shards and sharded gradients are page-locked, so the
  /// device kernels read and write them in place (no staging copy).
  bool offload_pinned() const noexcept { return offloaded() && offload_->pin_memory; }

  engine::Group& engine() noexcept { return engine_; }
  const engine::Group& engine() const noexcept { return engine_; }
  bool sharded_idle() const noexcept {
    return engine_.state == engine::ShardedState::sharded && !engine_.gather_in_flight;
  }

  void attach(std::shared_ptr<detail::RootContext> ctx);
  bool attached() const noexcept { return ctx_ != nullptr; }
  detail::RootContext* context() const noexcept { return ctx_.get(); }

  void set_reshard_after_forward(ReshardAfterForward v);
  /// The optimizer update its reductions end with (fsdp/shard_update.hpp), or null.
  ShardUpdate* shard_update() const noexcept { return update_.get(); }
  void set_shard_update(std::shared_ptr<ShardUpdate> u) noexcept { update_ = std::move(u); }

  const Tensor& sharded_storage() const noexcept { return sharded_; }
  std::string adopt_problem(const Tensor& storage) const;
  /// Under offload_pinned() a storage that is not page-locked (a checkpoint load's) is copied
  /// into the group's pinned storage instead (after the device's last reads of it), so the
  /// shards stay pinned.
  void adopt_sharded_storage(Tensor storage);
  /// The group's full parameters in their original dtype, in a fresh arena (layout order);
  /// one all-gather. Collective over the shard group.
  Tensor gather_full();
  void zero_grad();

  // Used by the running backend.
  transport::GroupTransport& transport() noexcept { return *transport_; }
  Tensor& sharded() noexcept { return sharded_; }
  Tensor& sharded_grads() noexcept { return sharded_grads_; }
  /// The sharded gradients (gsn elements, orig dtype, uninitialised) for a reduction that
  /// writes them: the storage zero_grad set aside when nobody else holds it (no allocation
  /// and no page faults per step), else a new tensor.
  void ensure_sharded_grads();
  /// zero_grad: the sharded gradients go (set to none, as FSDP2's); their storage is kept
  /// for ensure_sharded_grads.
  void drop_sharded_grads() noexcept;
  void show_sharded();
  void show_sharded_grads();
  void show_unsharded(const Tensor& arena);
  void show_unsharded_grads(const Tensor& grads);
  /// External gradients at pre-backward: grad() shows the ones a no_sync backward kept
  /// (`kept`), else none (the front end's autograd allocates them).
  void show_external_grads(bool kept);
  /// A no_sync backward: keeps the external gradients the parameters show (`keep`), or drops
  /// the kept ones.
  void keep_external_grads(bool keep);

 private:
  Tensor& shards() override { return sharded_; }
  // A group updated inside backward writes its reduced gradients into the root's scratch
  // (detail::RootContext::reduced_for); the update consumes them.
  Tensor& gradients_for_write() override;

  std::shared_ptr<const std::string> name_;  // never null; engine_.info.name views it
  std::vector<graph::Module*> modules_;
  std::vector<graph::Parameter*> params_;
  kernels::GroupLayout layout_;
  std::optional<CPUOffloadPolicy> offload_;
  int post_forward_k_ = 0;          // k of the transport's post-forward groups
  std::vector<Tensor> kept_grads_;  // external gradients a no_sync backward kept, per param
  DeviceMesh mesh_;
  MemorySpace space_ = MemorySpace::host;
  MemorySpace shard_space_ = MemorySpace::host;
  // New sharded storage or gradients (gsn elements, orig dtype, uninitialised) in
  // shard_space_: page-locked under offload_pinned().
  Tensor new_shard_tensor(const std::string& label, MemoryPart part) const;
  Tensor sharded_;        // gsn elements, orig dtype, padding zero (slot layout)
  Tensor sharded_grads_;  // gsn elements, orig dtype, or undefined
  Tensor spare_grads_;    // what drop_sharded_grads set aside, or undefined
  engine::Group engine_;
  std::unique_ptr<transport::GroupTransport> transport_;  // after the storage it may move
  std::shared_ptr<detail::RootContext> ctx_;
  std::shared_ptr<ShardUpdate> update_;
};

/// The group of an FSDP module (lib/fsdp only).
ParamGroup& group_of(const FSDPModule& st);

}  // namespace fullshard::fsdp
