// Options of fully_shard: the C++ counterparts of FSDP2's keyword arguments.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/kernels/quantize.hpp"
#include "fullshard/tensor/placement.hpp"

namespace fullshard::graph {
class Parameter;
}

namespace fullshard::fsdp {

/// FSDP2's reshard_after_forward: None (automatic), a bool, or an int k (after forward each
/// rank keeps a 1/k slice of the unsharded parameters and the backward all-gather runs
/// inside a k-rank group; k must divide the shard group size; 1 means false, the shard group
/// size means true). The one form of the value: options, the engine's groups, planned groups
/// and the auto-planner's candidates all hold it (fsdp::reshard_json / options_from_request
/// are its JSON form).
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

/// Mixed precision: unset dtypes keep the parameter's own dtype.
struct MixedPrecisionPolicy {
  /// dtype of the all-gathered (unsharded) parameters and so of the compute.
  std::optional<DType> param_dtype;
  /// dtype of the gradient reduce-scatter (default: the compute dtype).
  std::optional<DType> reduce_dtype;
  /// dtype the module's callbacks should give their outputs (advisory: activations belong to
  /// the user's callbacks; read it with FSDPModule::output_dtype()).
  std::optional<DType> output_dtype;
  bool cast_forward_inputs = true;
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
};

struct FullyShardOptions {
  ReshardAfterForward reshard_after_forward = ReshardAfterForward::automatic();
  MixedPrecisionPolicy mp_policy;
  /// FQNs (relative to the module given to fully_shard) of parameters that are never sharded
  /// nor reduced.
  std::vector<std::string> ignored_params;
  /// Per-parameter placement (default Shard(0)); Shard(d > 0) needs dim d divisible by the
  /// shard group size.
  std::function<std::optional<Placement>(const graph::Parameter&)> shard_placement_fn;
  /// Unset: no offloading (FSDP2's OffloadPolicy()); set: CPUOffloadPolicy.
  std::optional<CPUOffloadPolicy> offload_policy;
  /// Compressed all-gather and reduce-scatter (default: none).
  CompressionPolicy compression;
};

}  // namespace fullshard::fsdp
