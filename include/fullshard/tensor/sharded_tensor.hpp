// A tensor sharded over the ranks of a mesh dim: this rank's local shard plus the global
// metadata (global shape, placement, offsets) needed to reassemble or reshard it.
#pragma once

#include "fullshard/tensor/sharding.hpp"
#include "fullshard/tensor/tensor.hpp"

namespace fullshard {

struct ShardedTensor {
  /// This rank's unpadded shard (shape layout.local_shape).
  Tensor local;
  ShardLayout layout;

  const Shape& global_shape() const noexcept { return layout.global_shape; }
  Placement placement() const noexcept { return layout.placement; }
  /// Global index of local's first element, per dim.
  const std::vector<std::int64_t>& global_offset() const noexcept { return layout.global_offset; }
};

}  // namespace fullshard
