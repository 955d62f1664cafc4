// What each operation of a group's transport does, in the units a cost model prices: the copy
// kernels' bytes, the 8-bit codec's passes, and the collective with the link it crosses. With
// transport::fusions (what a transport folds into its collectives) this is the one description
// of a transport's work: the running transports (lib/transport) do it, and the planner
// (lib/schedule) asks these functions for every planned operation and prices the answer with
// its CostModel. Inline and without a virtual call: the planner makes about twelve per module.
// Not installed.
#pragma once

#include "fullshard/transport/fusions.hpp"

namespace fullshard::transport {

/// One operation's work.
struct Charge {
  double copy_bytes = 0.0;      ///< copy kernels (casts, packs, accumulation): bytes written
  double quant_elements = 0.0;  ///< passes of the 8-bit encode or decode, elements
  bool collective = false;      ///< a collective (the fields below)
  CollectiveKind kind = CollectiveKind::all_gather;
  /// Over the node's shared memory, its copy kernels included (else over the dim's network).
  bool shared_memory = false;
  /// The collective's bytes per rank: the shard a rank contributes to an all-gather, the
  /// shard it receives from a reduce-scatter, the buffer of an all-reduce.
  double bytes_per_rank = 0.0;
};

namespace charges {

constexpr Charge copy(double bytes) noexcept {
  Charge c;
  c.copy_bytes = bytes;
  return c;
}
constexpr Charge codec(double elements) noexcept {
  Charge c;
  c.quant_elements = elements;
  return c;
}
constexpr Charge collective(CollectiveKind kind, double bytes_per_rank,
                            bool shared_memory = false) noexcept {
  Charge c;
  c.collective = true;
  c.kind = kind;
  c.shared_memory = shared_memory;
  c.bytes_per_rank = bytes_per_rank;
  return c;
}

// Each engine operation of a group whose transport is `k` (transport::group_kind) and geometry
// `g`; `bytes` is the operation's (engine::OpDesc::bytes).

/// This rank's shard into its slot: encoded (compressed all-gather) or cast / copied.
constexpr Charge gather_copy_in(const Geometry& g, double bytes) noexcept {
  return g.compressed_gather() ? codec(double(g.shard_numel)) : copy(bytes);
}
/// The all-gather over the shard dim; `slice_group` k > 0: inside the k-rank group from the
/// kept slices (reshard_after_forward=k), which moves the share a W-rank gather would.
constexpr Charge all_gather(Kind k, const Geometry& g, double bytes, int slice_group) noexcept {
  if (slice_group > 0)
    return collective(CollectiveKind::all_gather,
                      bytes * (slice_group - 1) / (double(g.world) - 1));
  if (fusions(k, g).gather_in_copy_out) return Charge();  // a publish; the copy-out gathers
  return collective(CollectiveKind::all_gather, bytes);
}
/// The gathered slots into the unsharded parameters: the shared-memory gather itself (every
/// peer's shard read where it lies), the decode of a compressed gather, or a copy.
constexpr Charge gather_copy_out(Kind k, const Geometry& g, double bytes,
                                 bool from_slices) noexcept {
  if (fusions(k, g).gather_in_copy_out && !from_slices)
    return collective(CollectiveKind::all_gather,
                      double(g.shard_numel) * double(dtype_size(g.param_dtype)), true);
  if (g.compressed_gather()) return codec(double(g.arena_numel));
  return copy(bytes);
}
/// The unsharded gradients into the reduce-scatter's input (none: read in place).
constexpr Charge reduce_copy_in(Kind k, const Geometry& g, double bytes) noexcept {
  return fusions(k, g).reduce_reads_in_place ? Charge() : copy(bytes);
}
/// The reduce-scatter over the shard dim: compressed, W chunks encoded, sent as an all-to-all
/// of a reduce-scatter's traffic, decoded and summed; on shared memory, each rank's chunk summed
/// from its peers' gradients (with the copy-out when fused).
constexpr Charge reduce_scatter(Kind k, const Geometry& g, double bytes) noexcept {
  if (g.compressed_reduce()) {
    Charge c = collective(CollectiveKind::reduce_scatter, bytes);
    c.quant_elements = 2.0 * double(g.world) * double(g.shard_numel);
    return c;
  }
  return collective(CollectiveKind::reduce_scatter, bytes, g.world > 1 && k == Kind::shm);
}
/// The reduced shard into the sharded gradients (none: done by the reduce-scatter).
constexpr Charge reduce_copy_out(Kind k, const Geometry& g, double bytes) noexcept {
  return fusions(k, g).copy_out_in_reduce ? Charge() : copy(bytes);
}
/// HSDP's all-reduce over the replicate dim (MPI or NCCL on every transport).
constexpr Charge all_reduce(double bytes) noexcept {
  return collective(CollectiveKind::all_reduce, bytes);
}

}  // namespace charges
}  // namespace fullshard::transport
