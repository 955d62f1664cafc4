// What a communication group's transport folds into its collectives. The rules are written
// once, here: the running transports (lib/transport) follow them and the planner
// (lib/schedule) costs by them, without a virtual call per planned operation.
#pragma once

#include <cstdint>

#include "fullshard/base/dtype.hpp"

namespace fullshard::transport {

/// How a communication group's collectives travel.
enum class Kind : std::uint8_t {
  mpi,   ///< host memory, MPI (inside a node and across nodes)
  shm,   ///< host memory, node-local shared memory (a shard dim inside one node)
  nccl,  ///< device memory, NCCL
};
const char* kind_name(Kind k) noexcept;

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

  bool cast() const noexcept { return param_dtype != orig_dtype; }
};
static_assert(sizeof(Geometry) <= 32, "Geometry: keep the engine's GroupInfo in one cache line");

/// How one reduction treats the sharded gradients (the engine decides, once per reduction).
struct ReduceSpec {
  double divisor = 1.0;     ///< FSDP2's gradient divide factor
  bool accumulate = false;  ///< add into the sharded gradients (else overwrite them)
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
};

constexpr Fusions fusions(Kind k, const Geometry& g) noexcept {
  Fusions f;
  if (g.world <= 1) return f;  // no collective over the shard group
  if (k == Kind::shm) {
    f.gather_in_copy_out = true;
    f.reduce_reads_in_place = true;
    f.copy_out_in_reduce = g.replicate == 1;  // with HSDP the sum goes to the all-reduce first
  } else if (k == Kind::nccl) {
    // 16-bit reductions sum in NCCL and divide in the copy-out: NCCL would round 1/divisor to
    // the reduce dtype (1/3 -> 0.3340 in bf16) where the host path divides in f32.
    f.divide_in_reduce = g.reduce_dtype == DType::f32 || g.reduce_dtype == DType::f64;
  }
  return f;
}

}  // namespace fullshard::transport
