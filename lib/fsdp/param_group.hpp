// The running side of one communication group: the sharded storage, the communicators and
// copy plans of the mesh's device, the parameters it registers views on, and the engine
// group (fullshard/fsdp/engine.hpp) that decides what happens when. Private to lib/fsdp.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "fullshard/comm/communicator.hpp"
#include "fullshard/fsdp/engine.hpp"
#include "fullshard/fsdp/options.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/mesh/device_mesh.hpp"

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

class ParamGroup {
 public:
  ParamGroup(std::string name, std::vector<graph::Module*> modules,
             std::vector<graph::Parameter*> params, std::vector<ShardLayout> layouts,
             const DeviceMesh& mesh, const FullyShardOptions& options);
  ~ParamGroup();
  ParamGroup(const ParamGroup&) = delete;
  ParamGroup& operator=(const ParamGroup&) = delete;

  const std::string& name() const noexcept { return engine_.info.name; }
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

  engine::Group& engine() noexcept { return engine_; }
  const engine::Group& engine() const noexcept { return engine_; }
  bool sharded_idle() const noexcept {
    return engine_.state == engine::ShardedState::sharded && !engine_.gather_in_flight;
  }

  void attach(std::shared_ptr<RootContext> ctx);
  bool attached() const noexcept { return ctx_ != nullptr; }
  RootContext* context() const noexcept { return ctx_.get(); }

  void set_reshard_after_forward(ReshardAfterForward v);

  const Tensor& sharded_storage() const noexcept { return sharded_; }
  std::string adopt_problem(const Tensor& storage) const;
  void adopt_sharded_storage(Tensor storage);
  /// The group's full parameters in their original dtype, in a fresh arena (layout order);
  /// one all-gather. Collective over the shard group.
  Tensor gather_full();
  void zero_grad();

  // Used by the running backend.
  comm::Communicator& ag_comm() const noexcept { return *ag_comm_; }
  comm::Communicator& rs_comm() const noexcept { return *rs_comm_; }
  comm::Communicator& ar_comm() const noexcept { return *ar_comm_; }
  comm::Communicator& post_forward_comm() const noexcept { return *post_forward_comm_; }
  const kernels::CopyPlan& copy_out_plan() const noexcept { return copy_out_; }
  const kernels::CopyPlan& copy_in_plan() const noexcept { return copy_in_; }
  Tensor& sharded() noexcept { return sharded_; }
  Tensor& sharded_grads() noexcept { return sharded_grads_; }
  void show_sharded();
  void show_sharded_grads();
  void show_unsharded(const Tensor& arena);
  void show_unsharded_grads(const Tensor& grads);

 private:
  std::vector<graph::Module*> modules_;
  std::vector<graph::Parameter*> params_;
  kernels::GroupLayout layout_;
  std::optional<CPUOffloadPolicy> offload_;
  comm::Communicator* ag_comm_ = nullptr;
  comm::Communicator* rs_comm_ = nullptr;
  comm::Communicator* ar_comm_ = nullptr;
  std::unique_ptr<comm::Communicator> post_forward_comm_;  // k-rank groups
  int post_forward_k_ = 0;  // k of the existing post-forward communicator
  kernels::CopyPlan copy_out_;
  kernels::CopyPlan copy_in_;
  DeviceMesh mesh_;
  Tensor sharded_;        // gsn elements, orig dtype, padding zero (slot layout)
  Tensor sharded_grads_;  // gsn elements, orig dtype, or undefined
  engine::Group engine_;
  std::shared_ptr<RootContext> ctx_;
};

/// The group of an FSDP module (lib/fsdp only).
ParamGroup& group_of(const FSDPModule& st);

}  // namespace fullshard::fsdp::detail
