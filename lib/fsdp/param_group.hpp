// The engine behind fully_shard: one communication group's storage and its all-gather /
// reduce-scatter data flow — private to lib/fsdp.
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/comm/mpi_communicator.hpp"
#include "fullshard/comm/stream.hpp"
#include "fullshard/fsdp/options.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/tensor/buffer_pool.hpp"

namespace fullshard::fsdp {
class FSDPModule;
}

namespace fullshard::fsdp::detail {

class ParamGroup;

/// Creates the comm context of the root above `st` and attaches every group of its subtree
/// (the first forward or unshard does this; the executor does it up front).
void ensure_initialized(FSDPModule& st);

/// Shared by every group under one root: the buffer pool (whose accounting is the memory the
/// plan predicts), the post-forward order and the reduce-scatters in flight. The streams are
/// the groups' meshes' channel streams (DeviceMesh::stream).
class CommContext {
 public:
  CommContext();
  ~CommContext();

  BufferPool pool;
  std::vector<ParamGroup*> post_forward_order;
  int max_reduce_buffers = 1;
  bool is_last_backward = true;
  bool in_backward = false;

  /// A reduce-scatter (and what follows it on its streams) with the buffers it uses.
  struct PendingReduce {
    comm::Work done;
    Tensor input;
    Tensor output;
  };
  std::deque<PendingReduce> pending_reduces;
  /// Waits for the oldest reduce-scatters until at most `keep` are in flight and drops their
  /// buffers. Rethrows the first error after all were waited for.
  void wait_reduces(std::size_t keep);
};

enum class ShardedState { sharded, sharded_post_forward, unsharded };

class ParamGroup : public std::enable_shared_from_this<ParamGroup> {
 public:
  ParamGroup(std::string name, std::vector<graph::Module*> modules,
             std::vector<graph::Parameter*> params, std::vector<ShardLayout> layouts,
             const DeviceMesh& mesh, const FullyShardOptions& options);

  ~ParamGroup();
  ParamGroup(const ParamGroup&) = delete;
  ParamGroup& operator=(const ParamGroup&) = delete;

  const std::string& name() const noexcept { return name_; }
  bool gather_in_flight() const noexcept { return gather_in_flight_; }
  int mesh_rank() const noexcept { return mesh_.rank(); }
  const std::vector<graph::Module*>& modules() const noexcept { return modules_; }
  const std::vector<graph::Parameter*>& params() const noexcept { return params_; }
  const kernels::GroupLayout& layout() const noexcept { return layout_; }
  ShardedState state() const noexcept { return state_; }
  int shard_size() const noexcept { return W_; }
  DType orig_dtype() const noexcept { return orig_dtype_; }
  DType param_dtype() const noexcept { return param_dtype_; }
  DType reduce_dtype() const noexcept { return reduce_dtype_; }
  const Tensor& sharded_storage() const noexcept { return sharded_; }
  /// Why `storage` cannot replace the sharded storage (empty when it can): it must have the
  /// storage's shape, dtype and memory space, and the group must be sharded with no
  /// all-gather in flight.
  std::string adopt_problem(const Tensor& storage) const;
  /// Replaces the sharded storage by `storage` (checked with adopt_problem first; its padding
  /// zero) and registers its views: a checkpoint load without a copy. Views of the old
  /// storage (e.g. from an earlier sharded_state_dict) keep the old values.
  void adopt_sharded_storage(Tensor storage) noexcept;
  const Tensor& sharded_grads() const noexcept { return sharded_grads_; }
  /// CPUOffloadPolicy given: sharded state stays in host memory (the host engine keeps it
  /// there anyway; the GPU engine copies around its collectives).
  bool offload_to_cpu() const noexcept { return offload_.has_value(); }

  void attach(std::shared_ptr<CommContext> ctx, bool is_root_group);
  CommContext* context() const noexcept { return ctx_.get(); }
  bool attached() const noexcept { return ctx_ != nullptr; }

  // Policies (FSDPModule setters).
  void set_reshard_after_forward(ReshardAfterForward v);
  int reshard_after_forward() const noexcept { return reshard_after_forward_; }
  bool reshard_after_backward = true;
  bool reduce_grads = true;
  bool all_reduce_grads = true;
  bool unshard_in_backward = true;
  double divide_factor = 0.0;  // 0: the data-parallel size

  /// Issues the all-gather (copy-in, collective) unless unsharded or already in flight.
  void issue_unshard();
  /// Finishes the all-gather (wait, copy-out) and registers the unsharded parameters.
  void wait_unshard();
  /// Frees the unsharded parameters and registers the shards.
  void reshard();
  /// The post-forward step: reshard, keep a 1/k slice, or keep everything.
  void post_forward_reshard();
  /// Backward start: unsharded gradients (zeroed, or the ones accumulated without sync).
  void prepare_gradients();
  /// Backward end: reduce-scatter (and HSDP all-reduce) the gradients into the sharded
  /// gradients, or keep accumulating without sync.
  void reduce_gradients();
  /// Drops every unsharded buffer and iteration state (reset_iter_state); no waiting.
  void discard_iteration_state();
  void zero_grad();
  /// The group's full parameters in their original dtype, in a fresh arena (layout order);
  /// one all-gather. Collective over the shard group.
  Tensor gather_full();
  int shard_rank() const noexcept { return rank_; }

  // Bookkeeping of the hooks, per iteration.
  int forward_calls = 0;  // pre-forward hooks of this group's modules in this pass
  int forward_done = 0;   // post-forward hooks
  int backward_calls = 0;
  int backward_done = 0;
  std::vector<std::size_t> post_forward_indices;

 private:
  // Waits for the all-gather in flight; on error drops its buffer and rethrows.
  void await_gather();
  void register_sharded();
  void register_unsharded();
  std::string label(const char* op) const;

  std::string name_;
  std::vector<graph::Module*> modules_;
  std::vector<graph::Parameter*> params_;
  kernels::GroupLayout layout_;
  int W_ = 1;
  int rank_ = 0;
  int replicate_size_ = 1;
  DType orig_dtype_ = DType::f32;
  DType param_dtype_ = DType::f32;
  DType reduce_dtype_ = DType::f32;
  std::optional<CPUOffloadPolicy> offload_;
  comm::MpiCommunicator* ag_comm_ = nullptr;
  comm::MpiCommunicator* rs_comm_ = nullptr;
  comm::MpiCommunicator* ar_comm_ = nullptr;
  std::unique_ptr<comm::MpiCommunicator> post_forward_comm_;  // k-rank groups
  int reshard_after_forward_ = 0;  // 0 automatic (resolved at attach), -1 true, k >= 1
  int post_forward_k_ = 0;         // k of the existing post-forward communicator
  kernels::CopyPlan copy_out_;
  kernels::CopyPlan copy_in_;
  std::shared_ptr<CommContext> ctx_;
  DeviceMesh mesh_;

  ShardedState state_ = ShardedState::sharded;
  Tensor sharded_;             // gsn elements, orig dtype, padding zero (slot layout)
  Tensor sharded_grads_;       // gsn elements, orig dtype, or undefined
  Tensor arena_;               // unsharded parameters, param dtype
  Tensor grad_arena_;          // unsharded gradients, param dtype
  Tensor post_forward_shard_;  // (W/k)*gsn, param dtype
  Tensor partial_reduce_;      // HSDP: deferred all-reduce accumulation, reduce dtype
  bool gather_in_flight_ = false;
  comm::Work gather_work_;
  Tensor gather_buffer_;
};

}  // namespace fullshard::fsdp::detail
