// How a module of the graph asks to be sharded: the fully_shard request a graph file (its
// "fully_shard" key, docs/graph-format.md) or the code building a graph attaches to a module,
// and the policy values a request holds. The fsdp layer applies requests
// (fsdp::apply_fully_shard_requests) and the planner plans them; both read this one typed form
// (the JSON form is the graph file's: parse_graph_json reads it, graph_to_json writes it,
// json_graph.hpp). fsdp names the policies too (fsdp::ReshardAfterForward, ...:
// fullshard/fsdp/options.hpp).
#pragma once

#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/kernels/quantize.hpp"

namespace fullshard::graph {

/// FSDP2's reshard_after_forward: None (automatic), a bool, or an int k (after forward each
/// rank keeps a 1/k slice of the unsharded parameters and the backward all-gather runs
/// inside a k-rank group; k must divide the shard group size; 1 means false, the shard group
/// size means true). The one form of the value: requests, options, the engine's groups,
/// planned groups and the auto-planner's candidates all hold it (graph::reshard_json is its
/// JSON form).
class ReshardAfterForward {
 public:
  /// True for every group except the root's (whose parameters are needed again first).
  static ReshardAfterForward automatic() { return ReshardAfterForward(0); }
  static ReshardAfterForward always() { return ReshardAfterForward(-1); }
  static ReshardAfterForward never() { return ReshardAfterForward(1); }
  static ReshardAfterForward group_size(int k) { return ReshardAfterForward(k); }
  ReshardAfterForward(bool b) : ReshardAfterForward(b ? -1 : 1) {}  // NOLINT: implicit on purpose
  /// An int would convert to bool (2 meaning true): the int form is group_size(k).
  template <typename Int,
            typename = std::enable_if_t<std::is_integral_v<Int> && !std::is_same_v<Int, bool>>>
  ReshardAfterForward(Int) = delete;

  bool is_automatic() const noexcept { return v_ == 0; }
  /// True: after forward each rank keeps only its shard.
  bool reshards() const noexcept { return v_ == -1; }
  /// False: the unsharded parameters stay until backward.
  bool keeps_unsharded() const noexcept { return v_ == 1; }
  /// The int form's k (>= 1), or -1 for true, 0 for automatic.
  int value() const noexcept { return v_; }

  /// The value a group whose shard group has `world` ranks runs with: k == world as true;
  /// automatic stays automatic (see resolved). InvalidArgument naming `group` when k does not
  /// divide `world` or the value is not one of the forms above.
  ReshardAfterForward for_shard_group(int world, const std::string& group) const {
    if (v_ < -1 || (v_ >= 1 && world % v_ != 0)) refuse(world, group);
    return v_ == world ? always() : *this;
  }
  /// Automatic resolved as FSDP2 does: false for a root's group, true for the others; any
  /// other value unchanged.
  ReshardAfterForward resolved(bool is_root) const noexcept {
    return v_ != 0 ? *this : ReshardAfterForward(is_root ? 1 : -1);
  }
  /// "automatic", "true", "false" or k.
  std::string to_string() const;

  friend bool operator==(ReshardAfterForward a, ReshardAfterForward b) noexcept {
    return a.v_ == b.v_;
  }
  friend bool operator!=(ReshardAfterForward a, ReshardAfterForward b) noexcept {
    return a.v_ != b.v_;
  }

 private:
  explicit ReshardAfterForward(int v) : v_(v) {}
  [[noreturn]] void refuse(int world, const std::string& group) const;
  int v_;
};

/// FSDP2's CPUOffloadPolicy: the sharded parameters, their gradients and the optimizer state
/// stay in host memory; only unsharded parameters, unsharded gradients and communication
/// buffers live on the device, where the collectives run. On a CUDA mesh the host-to-device
/// copy of the shard is part of the all-gather copy-in (the cast kernel reads the pinned
/// shard in place; without a cast the shard is copied into the gather buffer) on the
/// all-gather stream, and the device-to-host copy of the reduced gradient shard is part of
/// the reduce-scatter copy-out (the kernel writes the pinned gradients in place) on the
/// reduce-scatter stream; the host waits for the gradients at the end of the last backward
/// (FSDP2's), and the optimizer steps on the host. `pin_memory` gives page-locked host memory
/// (Kokkos::CudaHostPinnedSpace), which the device kernels read and write directly; without
/// it the shards are pageable and every copy goes through a device staging buffer and
/// cudaMemcpyAsync, which blocks the host for the device-to-host copies (docs/gpu.md, "CPU
/// offload on the GPU path").
///
/// On a CPU mesh sharded state is host memory already: the policy is accepted and validated,
/// gives exactly the host path's results, and pin_memory has no effect.
struct CPUOffloadPolicy {
  bool pin_memory = true;

  friend bool operator==(const CPUOffloadPolicy& a, const CPUOffloadPolicy& b) noexcept {
    return a.pin_memory == b.pin_memory;
  }
  friend bool operator!=(const CPUOffloadPolicy& a, const CPUOffloadPolicy& b) noexcept {
    return !(a == b);
  }
};

/// Compressed collectives (what DeepSpeed ZeRO++ calls qwZ and qgZ): opt-in, they change the
/// numbers. The all-gather sends each rank's shard as 8-bit codes with one f32 scale per
/// `block` elements (int8 or fp8 e4m3; each unsharded parameter is within half a code step of
/// its block's scale of the uncompressed one); the reduce-scatter sends every gradient chunk as
/// int8 codes with per-block scales (an all-to-all), and the receiving rank sums the decoded
/// chunks in f32 (each rank's contribution within half a step of its block). A group whose
/// shard group has one rank sends nothing and is not compressed. A compressed group runs on
/// the MPI transport (inside a node, Open MPI's shared memory). docs/compression.md.
struct CompressionPolicy {
  /// Code of the parameters' all-gather (unset: uncompressed).
  std::optional<kernels::QuantCode> all_gather;
  /// Code of the gradients' reduce-scatter: int8 only (unset: uncompressed).
  std::optional<kernels::QuantCode> reduce_scatter;
  /// Elements per scale: a power of two from 8 to 2^20.
  int block = 256;

  bool any() const noexcept { return all_gather || reduce_scatter; }

  friend bool operator==(const CompressionPolicy& a, const CompressionPolicy& b) noexcept {
    return a.all_gather == b.all_gather && a.reduce_scatter == b.reduce_scatter &&
           a.block == b.block;
  }
  friend bool operator!=(const CompressionPolicy& a, const CompressionPolicy& b) noexcept {
    return !(a == b);
  }
};

/// A module's fully_shard request: whether fully_shard is called on it and the options the
/// call sets; every option left unset comes from the defaults the requests are applied or
/// planned with (fsdp::options_from_request). In a graph file: `true` (no option set),
/// `false` (shard = false) or an object of options.
struct ShardRequest {
  /// false: the module is never a group of its own (an auto-planner keeps it so).
  bool shard = true;
  std::optional<ReshardAfterForward> reshard_after_forward;
  /// The mixed-precision dtypes (fsdp::MixedPrecisionPolicy's).
  std::optional<DType> param_dtype;
  std::optional<DType> reduce_dtype;
  std::optional<DType> output_dtype;
  /// FQNs (relative to the module) of parameters that are never sharded nor reduced.
  std::optional<std::vector<std::string>> ignored_params;
  /// Set: the call's offload policy, none when the inner value is empty.
  std::optional<std::optional<CPUOffloadPolicy>> offload_policy;
  std::optional<CompressionPolicy> compression;
  /// FQNs (relative to the graph's root) of the other modules of a list group,
  /// fully_shard({this module, group_with...}) with this request's options; applied where the
  /// last of them comes in post-order (docs/graph-format.md, "List groups").
  std::vector<std::string> group_with;

  /// The request of `"fully_shard": false`.
  static ShardRequest never() {
    ShardRequest r;
    r.shard = false;
    return r;
  }
  /// Whether the request sets no option (`"fully_shard": true`, or false).
  bool sets_no_option() const noexcept {
    return !reshard_after_forward && !param_dtype && !reduce_dtype && !output_dtype &&
           !ignored_params && !offload_policy && !compression;
  }

  friend bool operator==(const ShardRequest& a, const ShardRequest& b) {
    return a.shard == b.shard && a.reshard_after_forward == b.reshard_after_forward &&
           a.param_dtype == b.param_dtype && a.reduce_dtype == b.reduce_dtype &&
           a.output_dtype == b.output_dtype && a.ignored_params == b.ignored_params &&
           a.offload_policy == b.offload_policy && a.compression == b.compression &&
           a.group_with == b.group_with;
  }
  friend bool operator!=(const ShardRequest& a, const ShardRequest& b) { return !(a == b); }
};

}  // namespace fullshard::graph
