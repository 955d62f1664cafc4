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

/// The sizes of a tensor's sharding, without its layout: numel(global_shape) and one rank's
/// padded shard (ShardLayout::padded_numel, the same on every rank).
struct ShardExtent {
  std::int64_t numel = 0;
  std::int64_t padded_numel = 0;
};

namespace detail {
/// The common case of shard_extent (a valid Shard(d), no overflow): true and `out` filled;
/// false sends the caller to shard_layout, which reports what is wrong.
bool try_shard_extent(const Shape& global_shape, Placement placement, int world,
                      ShardExtent& out) noexcept;
/// The extent of a shard of `numel` elements, `D` slices of `rest` elements along the shard
/// dim, over `world` >= 1 ranks: chunks of ceil(D / world) slices; false when the padded
/// group shard (world chunks) does not fit int64.
inline bool padded_shard_extent(std::int64_t D, std::int64_t rest, std::int64_t numel, int world,
                                ShardExtent& out) noexcept {
  const std::int64_t chunk = D / world + (D % world != 0 ? 1 : 0);
  std::int64_t padded = 0, all = 0;
  if (__builtin_mul_overflow(chunk, rest, &padded) ||
      __builtin_mul_overflow(padded, static_cast<std::int64_t>(world), &all))
    return false;
  out.numel = numel;
  out.padded_numel = padded;
  return true;
}
/// try_shard_extent for Shard(0) of a shape known by its dim-0 extent and the element count
/// of the other dims (both >= 0, their product fitting int64; a negative count sends the
/// caller to shard_extent): no pass over the shape.
inline bool try_shard_extent_dim0(std::int64_t first_extent, std::int64_t inner_numel, int world,
                                  ShardExtent& out) noexcept {
  if (world < 1 || inner_numel < 0) return false;
  return padded_shard_extent(first_extent, inner_numel, first_extent * inner_numel, world, out);
}
}  // namespace detail

/// shard_layout's sizes and checks without building the layout (the planner's hot path):
/// `what()` names the tensor, and is called only to report an error.
template <class What>
ShardExtent shard_extent(const Shape& global_shape, Placement placement, int world, What&& what) {
  ShardExtent e;
  if (detail::try_shard_extent(global_shape, placement, world, e)) return e;
  const ShardLayout l = shard_layout(global_shape, placement, world, 0, what());
  e.numel = numel(global_shape);
  e.padded_numel = l.padded_numel();
  return e;
}

}  // namespace fullshard
