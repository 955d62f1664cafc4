// fully_shard: FSDP2's entry point for a declared module graph.
//
// Call it bottom-up (each layer, then the root). Each call forms one communication group of
// the module's parameters not already grouped by an earlier call on a submodule; a list
// forms one group of several modules. The parameters are replaced by their local shards
// (Parameter::data() becomes this rank's shard; FQNs never change); the hooks
// (hooks.hpp) all-gather them around forward and backward and reduce-scatter the gradients.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fullshard/fsdp/options.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/mesh/device_mesh.hpp"

namespace fullshard::fsdp {

class FSDPModule;
// Opaque: a communication group's parameters, buffers and transport (lib/fsdp/param_group.hpp).
class ParamGroup;

/// Returned by FSDPModule::unshard(true): wait() completes the all-gather and registers the
/// unsharded parameters.
class UnshardHandle {
 public:
  UnshardHandle() = default;
  void wait();

 private:
  friend class FSDPModule;
  explicit UnshardHandle(std::shared_ptr<ParamGroup> g) : group_(std::move(g)) {}
  std::shared_ptr<ParamGroup> group_;
};

/// The FSDP controls of a module fully_shard was applied to (FSDP2's FSDPModule methods).
/// Methods that take `recurse` apply to every FSDP module of the subtree when it is true.
class FSDPModule {
 public:
  graph::Module& module() const noexcept { return *module_; }

  /// All-gathers this module's group and registers the unsharded parameters until reshard().
  /// With async_op the all-gather is only issued; the returned handle's wait() finishes it.
  UnshardHandle unshard(bool async_op = false);
  /// Frees the unsharded parameters and registers the shards again (not recursive).
  void reshard();

  void set_reshard_after_forward(ReshardAfterForward value, bool recurse = true);
  void set_reshard_after_backward(bool value, bool recurse = true);
  /// false: backward accumulates unsharded gradients without communication (no_sync).
  void set_requires_gradient_sync(bool value, bool recurse = true);
  /// HSDP: false reduce-scatters but defers the replicate all-reduce (accumulating).
  void set_requires_all_reduce(bool value, bool recurse = true);
  /// Gradients are divided by this factor instead of the data-parallel size.
  void set_gradient_divide_factor(double factor);
  void set_modules_to_forward_prefetch(const std::vector<graph::Module*>& modules);
  void set_modules_to_backward_prefetch(const std::vector<graph::Module*>& modules);
  /// false: skip the all-gather in backward (the module's backward needs no parameters).
  void set_unshard_in_backward(bool value);
  /// Reduce-scatter input buffers in flight at once (default 1).
  void set_reduce_scatter_max_input_buffers(int k);
  /// false: the root's end of backward does not finalise (more micro-batches follow).
  void set_is_last_backward(bool value);
  /// true: an opt-in of the callback contract that saves a pass over the gradients: they are
  /// not zeroed before backward; while Parameter::grad_fresh() is true (until the first
  /// backward callback of the parameter's module returns) a callback assigns the gradient,
  /// every element, instead of adding into it; gradients no callback wrote are zeroed at the
  /// group's post-backward. Micro-batches without sync still accumulate (only the first
  /// backward after a reduction starts fresh). Host meshes (InvalidArgument on a CUDA mesh);
  /// set it before a backward begins. Gradients from a front end's autograd
  /// (use_external_gradients) are always fresh and ignore it.
  void set_fresh_gradients(bool value, bool recurse = true);
  /// After an exception in a user callback: waits for in-flight collectives, reshards every
  /// group and clears the iteration's state; the iteration's gradients are discarded.
  /// Root only.
  void reset_iter_state();
  /// Drops the sharded gradients of this module's subtree (the optimizer's zero_grad), or of
  /// this module's group only (`recurse` false).
  void zero_grad(bool recurse = true);

  bool is_root() const;
  std::optional<DType> output_dtype() const noexcept { return options_.mp_policy.output_dtype; }
  const FullyShardOptions& options() const noexcept { return options_; }
  /// FQNs of the parameters in this module's communication group, in layout order.
  std::vector<std::string> group_fqns() const;
  const kernels::GroupLayout& group_layout() const;
  const DeviceMesh& mesh() const noexcept { return mesh_; }
  /// True when the group shows its shards (no unsharded parameters, no all-gather in flight).
  bool is_sharded() const noexcept;
  /// The FSDP modules of this module's subtree, this one first (pre-order).
  std::vector<FSDPModule*> subtree_states();

  // ---- the root's buffer pool (the memory Plan::peak_bytes predicts) ----
  std::size_t pool_bytes_in_use() const;
  std::size_t pool_peak_bytes() const;
  void reset_pool_peak();

  /// Opaque: only lib/fsdp constructs FSDPModules (fully_shard).
  struct Key;
  FSDPModule(const Key& key, graph::Module& module, DeviceMesh mesh, FullyShardOptions options,
             std::shared_ptr<ParamGroup> group);

 private:
  friend ParamGroup& group_of(const FSDPModule& st);
  graph::Module* module_;
  DeviceMesh mesh_;
  FullyShardOptions options_;
  std::shared_ptr<ParamGroup> group_;
};

/// Applies FSDP to `module` over `mesh` (1-D: FSDP; 2-D: HSDP with dims (replicate, shard)).
/// Collective: every rank of the mesh must make the same calls in the same order. Errors:
/// applying twice to one module, an ignored parameter that does not exist, Shard(d > 0) on a
/// dim not divisible by the shard group size, a bad reshard_after_forward, parameters of
/// different dtypes in one group (give them separate groups).
FSDPModule& fully_shard(graph::Module& module, const DeviceMesh& mesh,
                        const FullyShardOptions& options = {});
/// One communication group for several modules (e.g. tied or chunked-loss modules).
FSDPModule& fully_shard(const std::vector<graph::Module*>& modules, const DeviceMesh& mesh,
                        const FullyShardOptions& options = {});

/// The FSDP state of a module, or nullptr when fully_shard was not applied to it.
FSDPModule* fsdp_state(graph::Module& module) noexcept;

/// The placement fully_shard(name) gives parameter `p`: options.shard_placement_fn's choice,
/// Shard(0) by default. InvalidArgument naming the group and the parameter when the function
/// returns anything but a Shard placement.
Placement shard_placement(const FullyShardOptions& options, const std::string& name,
                          const graph::Parameter& p);

/// Group `name`'s compression policy as transport::Geometry::wire. InvalidArgument naming the
/// group for a block that is not a power of two from 8 to 2^20, or a reduce-scatter code
/// other than int8.
std::uint8_t compression_wire(const CompressionPolicy& policy, const std::string& name);

/// Where a module's request is, for messages: "<JSON path>.fully_shard" for a module from a
/// graph file, else "<fqn>.fully_shard" ("(root).fully_shard" for the root).
std::string request_path(const graph::Module& module);

/// The options of a module's request (graph::ShardRequest): `defaults` with the options the
/// request sets replacing theirs.
FullyShardOptions options_from_request(const graph::ShardRequest& request,
                                       const FullyShardOptions& defaults);

/// Applies fully_shard, bottom-up, to every module whose request asks for it
/// (graph::Module::requests_fully_shard: a graph file's "fully_shard": true or an object of
/// options), with options_from_request(request, defaults). A request with group_with (FQNs of
/// other modules, relative to `root`) makes one list call, fully_shard({module, ...}),
/// applied where the last of its modules comes in post-order (ConfigError naming the
/// request's path for a list that cannot be formed). Returns the number of calls made.
int apply_fully_shard_requests(graph::Module& root, const DeviceMesh& mesh,
                               const FullyShardOptions& defaults = {});

}  // namespace fullshard::fsdp
