// The sizes of a tensor's sharding without its layout (shard_layout): the planner's hot path.
#pragma once

#include <cstdint>
#include <utility>

#include "fullshard/tensor/sharding.hpp"

namespace fullshard {

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
