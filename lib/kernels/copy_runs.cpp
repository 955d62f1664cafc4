// Group layouts and the copy runs of the all-gather copy-out and the reduce-scatter copy-in.
// Pure index arithmetic on the host, done once per group; the kernels only follow the runs.
#include <algorithm>
#include <string>

#include "fullshard/base/checked.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/kernels/shard_copy.hpp"

namespace fullshard::kernels {
namespace {

std::string member_name(std::size_t i, const ShardLayout& l) {
  return "make_group_layout: member " + std::to_string(i) + " " + shape_string(l.global_shape) +
         " " + l.placement.to_string();
}

// Appends r to runs, merged into the last run when the two are one contiguous copy (or the
// new run only adds zeros right after the last one's).
void append(std::vector<CopyRun>& runs, const CopyRun& r) {
  if (r.len == 0 && r.pad == 0) return;
  if (!runs.empty()) {
    CopyRun& last = runs.back();
    const std::int64_t dst_end = last.dst_offset + last.len + last.pad;
    if (r.dst_offset == dst_end) {
      if (last.pad == 0 && r.src_offset == last.src_offset + last.len) {
        last.len += r.len;
        last.pad = r.pad;
        return;
      }
      if (r.len == 0) {
        last.pad += r.pad;
        return;
      }
    }
  }
  runs.push_back(r);
}

// The size of the sharded dim.
std::int64_t dim_size(const ShardLayout& l) {
  return l.global_shape[static_cast<std::size_t>(l.placement.dim())];
}

}  // namespace

GroupLayout make_group_layout(const std::vector<ShardLayout>& layouts) {
  GroupLayout g;
  if (!layouts.empty()) g.world = layouts.front().world;
  g.members.reserve(layouts.size());
  for (std::size_t i = 0; i < layouts.size(); ++i) {
    const ShardLayout& l = layouts[i];
    if (l.placement.is_replicate())
      throw InvalidArgument(member_name(i, l) +
                            ": Replicate placement is not supported in a sharded group "
                            "(replicated parameters are all-reduced, not sharded)");
    if (l.world != g.world)
      throw InvalidArgument(member_name(i, l) + ": sharded over " + std::to_string(l.world) +
                            " ranks, but member 0 over " + std::to_string(g.world) +
                            "; a group has one world");
    GroupMember m;
    m.layout = l;
    m.slot_offset = g.shard_numel;
    m.arena_offset = g.arena_numel;
    // Sizes come from user shapes: the sums (and world * shard_numel, the gathered buffer) are
    // checked so that every offset of the runs below fits.
    g.shard_numel = checked_add(g.shard_numel, l.padded_numel(), [&] { return member_name(i, l); });
    g.arena_numel =
        checked_add(g.arena_numel, numel(l.global_shape), [&] { return member_name(i, l); });
    checked_mul(g.shard_numel, static_cast<std::int64_t>(g.world), [&] {
      return member_name(i, l) + ": the group's padded shards on " + std::to_string(g.world) +
             " ranks";
    });
    g.members.push_back(std::move(m));
  }
  return g;
}

namespace {

// Calls f(slot, arena, rows, chunk_elems) for every (outer index, rank) block of member m, in
// layout order: `slot` is the block's offset in the rank-major buffer, `arena` its offset in
// the unsharded arena (clamped to the member's end for ranks with no rows), `rows * inner`
// its valid elements and `chunk * inner` its padded size.
template <class F>
void for_each_member_block(const GroupLayout& g, const GroupMember& m, F&& f) {
  const ShardLayout& l = m.layout;
  const std::int64_t d = dim_size(l);
  for (std::int64_t o = 0; o < l.outer; ++o)
    for (int q = 0; q < g.world; ++q)
      f(q * g.shard_numel + m.slot_offset + o * l.chunk * l.inner,
        m.arena_offset + (o * d + std::min(q * l.chunk, d)) * l.inner, l.rows_of(q) * l.inner,
        l.chunk * l.inner);
}

// The same for every member, in layout order.
template <class F>
void for_each_block(const GroupLayout& g, F&& f) {
  for (const GroupMember& m : g.members)
    for_each_member_block(g, m, f);
}

}  // namespace

std::vector<CopyRun> all_gather_copy_out_runs(const GroupLayout& g) {
  std::vector<CopyRun> runs;
  for_each_block(g, [&](std::int64_t slot, std::int64_t arena, std::int64_t valid, std::int64_t) {
    if (valid > 0) append(runs, CopyRun{slot, arena, valid, 0});
  });
  return runs;
}

std::vector<CopyRun> reduce_scatter_copy_in_runs(const GroupLayout& g) {
  std::vector<CopyRun> runs;
  // Ranks with no rows get a run of zeros only (src unused, kept inside the member's range).
  for_each_block(
      g, [&](std::int64_t slot, std::int64_t arena, std::int64_t valid, std::int64_t padded) {
        append(runs, CopyRun{arena, slot, valid, padded - valid});
      });
  return runs;
}

std::vector<CopyRun> reduce_scatter_copy_in_member_runs(const GroupLayout& g, std::size_t member,
                                                        bool zeros) {
  if (member >= g.members.size())
    throw InvalidArgument("reduce_scatter_copy_in_member_runs: member " + std::to_string(member) +
                          " of a group of " + std::to_string(g.members.size()));
  const GroupMember& m = g.members[member];
  std::vector<CopyRun> runs;
  for_each_member_block(
      g, m, [&](std::int64_t slot, std::int64_t arena, std::int64_t valid, std::int64_t padded) {
        if (zeros)
          append(runs, CopyRun{0, slot, 0, padded});
        else
          append(runs, CopyRun{arena - m.arena_offset, slot, valid, padded - valid});
      });
  return runs;
}

}  // namespace fullshard::kernels
