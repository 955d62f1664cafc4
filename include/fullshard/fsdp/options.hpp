// Options of fully_shard: the C++ counterparts of FSDP2's keyword arguments.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/graph/shard_request.hpp"
#include "fullshard/tensor/placement.hpp"

namespace fullshard::graph {
class Parameter;
}

namespace fullshard::fsdp {

// Declared with the graph (a module's request holds them): fullshard/graph/shard_request.hpp.
using graph::CompressionPolicy;
using graph::CPUOffloadPolicy;
using graph::ReshardAfterForward;

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
