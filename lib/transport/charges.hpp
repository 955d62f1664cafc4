// What each operation of a group's transport does, in the pieces a cost model prices: copy
// kernels' bytes, passes of the 8-bit codec, and a collective with the link it crosses. With
// transport::fusions (what a transport folds into its collectives) this is the one description
// of a transport's work: the running transports (lib/transport) do it, and the planner
// (lib/schedule) asks these functions for every planned operation with its prices. Templates
// over the prices, inlined: no virtual call and nothing built per operation (the planner makes
// about twelve per module). Not installed.
#pragma once

#include "fullshard/transport/fusions.hpp"

namespace fullshard::transport::charges {

// `P` prices the pieces, in ms: copy(bytes written), codec(elements passed),
// collective(kind, bytes per rank) over the dim's network (all_reduce: HSDP's replicate dim,
// the others the shard dim), shm_collective(kind, bytes per rank) over the node's shared memory
// with its copy kernels included. Bytes per rank: the shard a rank contributes to an
// all-gather, the shard it receives from a reduce-scatter, the buffer of an all-reduce.
// Each function takes the group's transport `k` (transport::group_kind), its geometry `g` and
// the operation's bytes (engine::OpDesc::bytes).

/// This rank's shard into its slot: encoded (compressed all-gather) or cast / copied.
template <typename P>
constexpr double gather_copy_in(const Geometry& g, double bytes, const P& p) {
  return g.compressed_gather() ? p.codec(double(g.shard_numel)) : p.copy(bytes);
}
/// The all-gather over the shard dim (shm+mpi: its part across nodes, priced as the shard
/// dim's collective of the cost model); `slice_group` k > 0: inside the k-rank group from the
/// kept slices (reshard_after_forward=k), which moves the share a W-rank gather would.
template <typename P>
constexpr double all_gather(Kind k, const Geometry& g, double bytes, int slice_group, const P& p) {
  if (slice_group > 0)
    return p.collective(CollectiveKind::all_gather,
                        bytes * (slice_group - 1) / (double(g.world) - 1));
  // shm: a publish, the copy-out gathers; shm+mpi: the gather across nodes fills the windows
  if (k == Kind::shm && fusions(k, g).gather_in_copy_out) return 0.0;
  return p.collective(CollectiveKind::all_gather, bytes);
}
/// The gathered slots into the unsharded parameters: the shared-memory gather itself (every
/// peer's shard read where it lies), the decode of a compressed gather, or a copy.
template <typename P>
constexpr double gather_copy_out(Kind k, const Geometry& g, double bytes, bool from_slices,
                                 const P& p) {
  if (fusions(k, g).gather_in_copy_out && !from_slices)
    return p.shm_collective(CollectiveKind::all_gather,
                            double(g.shard_numel) * double(dtype_size(g.param_dtype)));
  if (g.compressed_gather()) return p.codec(double(g.arena_numel));
  return p.copy(bytes);
}
/// The unsharded gradients into the reduce-scatter's input (nothing: read in place).
template <typename P>
constexpr double reduce_copy_in(Kind k, const Geometry& g, double bytes, const P& p) {
  return fusions(k, g).reduce_reads_in_place ? 0.0 : p.copy(bytes);
}
/// The reduce-scatter over the shard dim: compressed, W chunks encoded, sent as an all-to-all
/// of a reduce-scatter's traffic, W decoded and summed; on shared memory, each rank's chunk
/// summed from its peers' gradients (with the copy-out when fused).
template <typename P>
constexpr double reduce_scatter(Kind k, const Geometry& g, double bytes, const P& p) {
  if (g.compressed_reduce())
    return p.codec(2.0 * double(g.world) * double(g.shard_numel)) +
           p.collective(CollectiveKind::reduce_scatter, bytes);
  if (g.world > 1 && k == Kind::shm) return p.shm_collective(CollectiveKind::reduce_scatter, bytes);
  // shm+mpi: the node's sum reads every peer's chunks for the ranks of the same place on each
  // node (W chunks, as the one-node sum), then the part across nodes (an all-to-all of the
  // nodes' sums and their sum, which the shard dim's calibrated pair prices).
  if (g.world > 1 && k == Kind::two_level)
    return p.shm_collective(CollectiveKind::reduce_scatter, bytes) +
           p.collective(CollectiveKind::reduce_scatter, bytes);
  return p.collective(CollectiveKind::reduce_scatter, bytes);
}
/// The reduced shard into the sharded gradients (nothing: done by the reduce-scatter).
template <typename P>
constexpr double reduce_copy_out(Kind k, const Geometry& g, double bytes, const P& p) {
  return fusions(k, g).copy_out_in_reduce ? 0.0 : p.copy(bytes);
}
/// The optimizer's update inside backward (engine::Group::update_bytes: `bytes` read and
/// written), priced as a copy that reads and writes half of them.
template <typename P>
constexpr double update(double bytes, const P& p) {
  return p.copy(bytes / 2);
}
/// HSDP's all-reduce over the replicate dim (MPI or NCCL on every transport).
template <typename P>
constexpr double all_reduce(double bytes, const P& p) {
  return p.collective(CollectiveKind::all_reduce, bytes);
}

}  // namespace fullshard::transport::charges
