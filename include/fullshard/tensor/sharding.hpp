// The sharding rule: which part of a tensor each rank owns.
//
// Shard(0) follows torch.chunk exactly: chunk = ceil(D / W) rows; rank r owns rows
// [r*chunk, min(D, (r+1)*chunk)), possibly none (D=5, W=4 gives 2, 2, 1, 0 rows). Shard(d)
// with d > 0 needs D % W == 0. For the collectives every rank's shard is padded to
// `chunk` along the sharded dim; the padding is never part of the user-visible shard.
#pragma once

#include <cstdint>
#include <string>

#include "fullshard/tensor/placement.hpp"
#include "fullshard/tensor/shape.hpp"

namespace fullshard {

struct ShardLayout {
  Shape global_shape;
  Placement placement = Placement::Shard(0);
  int world = 1;
  int rank = 0;
  /// This rank's unpadded shard.
  Shape local_shape;
  /// Global index of the shard's first element, per dim.
  std::vector<std::int64_t> global_offset;
  /// Extent of every rank's padded shard along the sharded dim (ceil(D/W)).
  std::int64_t chunk = 0;
  /// Rows (along the sharded dim) this rank really owns: chunk, fewer, or 0.
  std::int64_t local_rows = 0;
  /// Product of the dims before / after the sharded dim.
  std::int64_t outer = 1;
  std::int64_t inner = 1;

  std::int64_t local_numel() const noexcept { return numel(local_shape); }
  /// Elements of one rank's padded shard: outer * chunk * inner.
  std::int64_t padded_numel() const noexcept { return outer * chunk * inner; }
  /// Rows owned by rank q (any q in [0, world)).
  std::int64_t rows_of(int q) const noexcept;
};

/// Computes the layout of `global_shape` with `placement` for `rank` of `world`. Throws
/// InvalidArgument naming `what` (e.g. the parameter's FQN) for a 0-d tensor, a shard dim out
/// of range, or Shard(d > 0) with a dim size not divisible by `world`.
ShardLayout shard_layout(const Shape& global_shape, Placement placement, int world, int rank,
                         const std::string& what);

}  // namespace fullshard
