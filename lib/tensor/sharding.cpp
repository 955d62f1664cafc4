#include "fullshard/tensor/sharding.hpp"

#include <algorithm>

#include "fullshard/base/error.hpp"
#include "lib/tensor/shard_extent.hpp"

namespace fullshard {

std::int64_t ShardLayout::rows_of(int q) const noexcept {
  if (placement.is_replicate()) return chunk;
  const std::int64_t d = global_shape[static_cast<std::size_t>(placement.dim())];
  return std::clamp<std::int64_t>(d - static_cast<std::int64_t>(q) * chunk, 0, chunk);
}

ShardLayout shard_layout(const Shape& global_shape, Placement placement, int world, int rank,
                         const std::string& what) {
  if (world < 1 || rank < 0 || rank >= world)
    throw InvalidArgument(what + ": rank " + std::to_string(rank) + " is not in a world of " +
                          std::to_string(world));
  if (global_shape.empty())
    throw InvalidArgument(what + ": a 0-d (scalar) tensor cannot be sharded; give it shape (1,)");
  checked_numel(global_shape, what);  // extents >= 0, product fits: the products below do too

  ShardLayout l;
  l.global_shape = global_shape;
  l.placement = placement;
  l.world = world;
  l.rank = rank;
  l.local_shape = global_shape;
  l.global_offset.assign(global_shape.size(), 0);
  const int nd = static_cast<int>(global_shape.size());
  if (placement.is_replicate()) {
    l.chunk = global_shape[0];
    l.local_rows = l.chunk;
    for (int i = 1; i < nd; ++i)
      l.inner *= global_shape[i];
    return l;
  }
  const int d = placement.dim();
  if (d >= nd)
    throw InvalidArgument(what + ": " + placement.to_string() + " is out of range for shape " +
                          shape_string(global_shape));
  const std::int64_t D = global_shape[d];
  if (d > 0 && D % world != 0)
    throw InvalidArgument(what + ": " + placement.to_string() + " needs dim " + std::to_string(d) +
                          " (size " + std::to_string(D) + ") divisible by the " +
                          std::to_string(world) + " ranks of the shard group; use Shard(0) or " +
                          "another dim");
  l.chunk = D / world + (D % world != 0 ? 1 : 0);  // ceil(D / W); D + W - 1 could overflow
  l.local_rows = l.rows_of(rank);
  l.local_shape[d] = l.local_rows;
  l.global_offset[d] = std::min<std::int64_t>(static_cast<std::int64_t>(rank) * l.chunk, D);
  for (int i = 0; i < d; ++i)
    l.outer *= global_shape[i];
  for (int i = d + 1; i < nd; ++i)
    l.inner *= global_shape[i];
  // The padded shards of all ranks (the all-gather buffer) can hold more elements than the
  // tensor: outer * (chunk * world) * inner must fit too.
  checked_mul(checked_mul(checked_mul(l.outer, l.chunk, what), l.inner, what),
              static_cast<std::int64_t>(world),
              [&] { return what + ": the padded shards of " + std::to_string(world) + " ranks"; });
  return l;
}

namespace detail {

bool try_shard_extent(const Shape& global_shape, Placement placement, int world,
                      ShardExtent& out) noexcept {
  const int nd = static_cast<int>(global_shape.size());
  if (world < 1 || nd == 0 || placement.is_replicate()) return false;
  const int d = placement.dim();
  if (d < 0 || d >= nd) return false;
  const std::int64_t D = global_shape[static_cast<std::size_t>(d)];
  if (d > 0 && D % world != 0) return false;
  std::int64_t n = 1, rest = 1;  // numel, and the product of the other dims
  for (int i = 0; i < nd; ++i) {
    const std::int64_t x = global_shape[static_cast<std::size_t>(i)];
    if (x < 0 || __builtin_mul_overflow(n, x, &n)) return false;
    if (i != d && __builtin_mul_overflow(rest, x, &rest)) return false;
  }
  return padded_shard_extent(D, rest, n, world, out);
}

}  // namespace detail

}  // namespace fullshard
