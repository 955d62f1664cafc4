// What a communication group's transport folds into its collectives. The rules are written
// once, here: the running transports (lib/transport) follow them, and the work each operation
// does (lib/transport/charges.hpp), which the planner (lib/schedule) prices without a
// virtual call per planned operation, is derived from them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "fullshard/base/dtype.hpp"
#include "fullshard/kernels/element_update.hpp"
#include "fullshard/kernels/quantize.hpp"

namespace fullshard::transport {

/// How a communication group's collectives travel.
enum class Kind : std::uint8_t {
  mpi,   ///< host memory, MPI (inside a node and across nodes)
  shm,   ///< host memory, node-local shared memory (a shard dim inside one node)
  nccl,  ///< device memory, NCCL
  /// host memory, a shard dim spanning nodes (DeviceMesh::node_split): shared memory inside
  /// each node, MPI across nodes ("shm+mpi")
  two_level,
};
const char* kind_name(Kind k) noexcept;

/// The collectives of a group: all-gather and reduce-scatter over its shard dim, all-reduce
/// over HSDP's replicate dim.
enum class CollectiveKind { all_gather, reduce_scatter, all_reduce };

/// One communication group as its transport sees it.
/// (32 bytes: the engine's GroupInfo extends it, and a plan holds 100,000 of them.)
struct Geometry {
  std::int64_t shard_numel = 0;  ///< gsn: the padded group shard (slot layout)
  std::int64_t arena_numel = 0;  ///< the unsharded parameters
  int world = 1;                 ///< shard group size W
  int rank = 0;                  ///< this rank's place in the shard group
  int replicate = 1;             ///< HSDP replicate size (1: FSDP)
  DType orig_dtype = DType::f32;
  DType param_dtype = DType::f32;
  DType reduce_dtype = DType::f32;
  /// Compressed collectives (make_wire): bits 0-1 the all-gather's code (0 none, 1 int8,
  /// 2 fp8_e4m3), bit 2 the reduce-scatter's (int8), bits 3-7 log2 of the block.
  std::uint8_t wire = 0;

  bool cast() const noexcept { return param_dtype != orig_dtype; }

  /// The wire byte of a compression: `gather` the all-gather's code (none: uncompressed),
  /// `reduce_int8` the reduce-scatter's, 2^log2_block elements per scale.
  static std::uint8_t make_wire(std::optional<kernels::QuantCode> gather, bool reduce_int8,
                                int log2_block) noexcept {
    return static_cast<std::uint8_t>((gather ? 1 + static_cast<int>(*gather) : 0) |
                                     (reduce_int8 ? 4 : 0) |
                                     ((gather || reduce_int8) ? (log2_block & 31) << 3 : 0));
  }
  /// The all-gather sends block-scaled 8-bit codes (a shard group of one rank sends nothing).
  constexpr bool compressed_gather() const noexcept { return world > 1 && (wire & 3) != 0; }
  /// The reduce-scatter sends int8 codes, summed in f32 on the receiving rank.
  constexpr bool compressed_reduce() const noexcept { return world > 1 && (wire & 4) != 0; }
  kernels::QuantCode gather_code() const noexcept {
    return (wire & 3) == 2 ? kernels::QuantCode::fp8_e4m3 : kernels::QuantCode::int8;
  }
  /// "int8/int8/256": the all-gather's code, the reduce-scatter's ("none" for a plain one)
  /// and the block; "" without compression.
  std::string wire_text() const;
  /// Elements per scale of both compressed collectives.
  std::int64_t quant_block() const noexcept { return std::int64_t{1} << (wire >> 3); }
  /// One rank's packed slot of the compressed all-gather / reduce-scatter (codes, scales; a
  /// multiple of 4 bytes).
  std::int64_t packed_slot_bytes() const {
    return kernels::quant_packed_bytes(shard_numel, quant_block());
  }
  /// The int8 reduce-scatter's output buffer: [the reduced shard in the reduce dtype (HSDP
  /// only: it goes to the replicate all-reduce; 4-byte aligned) | W packed slots sent | W
  /// received]. reduce_sum_bytes() is where the sent slots begin.
  std::size_t reduce_sum_bytes() const {
    return replicate > 1
               ? (static_cast<std::size_t>(shard_numel) * dtype_size(reduce_dtype) + 3) / 4 * 4
               : 0;
  }
  std::size_t compressed_reduce_bytes() const {
    return reduce_sum_bytes() +
           2 * static_cast<std::size_t>(world) * static_cast<std::size_t>(packed_slot_bytes());
  }
  /// A rank's slot of the all-gather buffer as a collective's (count, dtype): the shard in the
  /// parameter dtype, or its packed codes as f32 words.
  std::int64_t gather_slot_numel() const {
    return compressed_gather() ? packed_slot_bytes() / 4 : shard_numel;
  }
  DType gather_dtype() const noexcept { return compressed_gather() ? DType::f32 : param_dtype; }
  std::size_t gather_slot_bytes() const {
    return static_cast<std::size_t>(gather_slot_numel()) * dtype_size(gather_dtype());
  }
  /// The all-gather buffer: W slots; one rank: the cast shard, or none (the copy-out reads the
  /// shards themselves).
  std::size_t gather_bytes() const {
    if (world == 1)
      return cast() ? static_cast<std::size_t>(shard_numel) * dtype_size(param_dtype) : 0;
    return static_cast<std::size_t>(world) * gather_slot_bytes();
  }
};
static_assert(sizeof(Geometry) <= 32, "Geometry: keep the engine's GroupInfo in one cache line");

/// How one reduction treats the sharded gradients (the engine decides, once per reduction).
struct ReduceSpec {
  double divisor = 1.0;     ///< FSDP2's gradient divide factor
  bool accumulate = false;  ///< add into the sharded gradients (else overwrite them)
  /// The optimizer inside backward, fused (update_in_copy_out): the pass that would write the
  /// sharded gradients runs this update of the shards instead and writes no gradient (no
  /// accumulation then). Valid while the reduction's operations are issued.
  const kernels::ElementUpdate* update = nullptr;
};

/// The operations a transport folds into another for one group.
struct Fusions {
  /// The all-gather only publishes this rank's shard; the copy-out reads every peer's shard
  /// where it lies, so the copy-out is the gather (not for the k-rank gather from slices).
  bool gather_in_copy_out = false;
  /// The reduce-scatter reads the unsharded gradients where they lie: the copy-in copies nothing.
  bool reduce_reads_in_place = false;
  /// The reduce-scatter also divides, casts and accumulates into the sharded gradients: the
  /// copy-out has nothing left to do.
  bool copy_out_in_reduce = false;
  /// The reduce-scatter's sum is pre-multiplied by 1/divisor: the copy-out divides no more.
  bool divide_in_reduce = false;
  /// An optimizer inside backward runs in the pass that writes the reduced gradient shard
  /// (the copy-out, or the reduce-scatter that folds it in), which stores no gradient
  /// (update_in_copy_out).
  bool update_in_copy_out = false;
  /// The engine's buffers the transport never touches (the engine only reserves their bytes
  /// in the pool's count, Device::reserve; schedule::plan_memory leaves them out): the
  /// all-gather buffer where the copy-out is the gather (not for the k-rank gather from
  /// slices), the reduce-scatter's input where one node's sum reads the gradients in place,
  /// its output where the shared-memory sum writes the sharded gradients.
  bool gather_buffer_unused = false;
  bool reduce_input_unused = false;
  bool reduce_output_unused = false;
};

/// Whether the pass that writes a group's reduced gradient shard can run the optimizer's
/// element update instead (kernels::reduce_update, kernels::reduce_sources_update): every
/// transport's copy-out and shared-memory sum; not the int8 reduce-scatter's decode, which
/// writes the gradients for a separate update. (A one-rank group whose backward writes the
/// sharded gradients has no such pass: its update follows the compute.)
constexpr bool update_in_copy_out(const Geometry& g) noexcept {
  return !(g.compressed_reduce() && g.replicate == 1);
}

/// The transport a group of `g` runs on when its mesh's shard dim offers `k`: a compressed
/// group leaves shared memory for MPI (the shared-memory transport reads each peer's shard
/// where it lies: there is no message to make smaller), which inside a node is Open MPI's own
/// shared memory.
constexpr Kind group_kind(Kind k, const Geometry& g) noexcept {
  return (k == Kind::shm || k == Kind::two_level) &&
                 (g.compressed_gather() || g.compressed_reduce())
             ? Kind::mpi
             : k;
}

/// `k`: the group's transport (group_kind).
constexpr Fusions fusions(Kind k, const Geometry& g) noexcept {
  Fusions f;
  f.update_in_copy_out = update_in_copy_out(g);
  if (g.world <= 1) return f;  // no collective over the shard group
  if (g.compressed_reduce()) {
    // The receiving rank decodes, sums, divides, casts and accumulates in one pass; with HSDP
    // the sum goes to the all-reduce first.
    f.copy_out_in_reduce = g.replicate == 1;
    f.divide_in_reduce = g.replicate == 1;
    return f;
  }
  if (k == Kind::shm) {
    f.gather_in_copy_out = true;
    f.reduce_reads_in_place = true;
    f.copy_out_in_reduce = g.replicate == 1;  // with HSDP the sum goes to the all-reduce first
    f.reduce_input_unused = true;
  } else if (k == Kind::two_level) {
    // The all-gather across nodes fills the node's windows, the copy-out reads every slot
    // where it lies; the node's sum reads the gradients in place, and the sum of the nodes'
    // sums (after an all-to-all across them, through the reduce-scatter's input) divides,
    // casts and accumulates as on one node.
    f.gather_in_copy_out = true;
    f.reduce_reads_in_place = true;
    f.copy_out_in_reduce = g.replicate == 1;
  }
  if (k == Kind::shm || k == Kind::two_level) {
    f.gather_buffer_unused = f.gather_in_copy_out;
    f.reduce_output_unused = f.copy_out_in_reduce;
  } else if (k == Kind::nccl) {
    // 16-bit reductions sum in NCCL and divide in the copy-out: NCCL would round 1/divisor to
    // the reduce dtype (1/3 -> 0.3340 in bf16) where the host path divides in f32.
    f.divide_in_reduce = g.reduce_dtype == DType::f32 || g.reduce_dtype == DType::f64;
  }
  return f;
}

}  // namespace fullshard::transport
