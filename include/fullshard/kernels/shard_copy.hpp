// The shard copy kernels: the only passes fullshard makes over parameter and gradient bytes
// around its collectives. All work on flat buffers described by copy runs computed once per
// communication group, so the same kernels run on any Kokkos execution space.
//
// Layouts (W ranks, a group of parameters p with ShardLayout l_p):
// - group shard ("slot layout"): every parameter's padded shard, concatenated:
//   gsn = sum_p l_p.padded_numel() elements; parameter p starts at slot_offset_p. A rank's
//   sharded parameters and gradients are stored this way, padding zero.
// - all-gather buffer: W group shards, rank-major: W * gsn elements; rank q's slot starts at
//   q * gsn. The reduce-scatter input has the same layout.
// - unsharded arena: every parameter's full tensor, concatenated (no padding), parameter p at
//   arena_offset_p. Unsharded parameters and unsharded gradients live in arenas.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/tensor/sharding.hpp"

namespace fullshard::kernels {

/// Copy `len` elements from src[src_offset...] to dst[dst_offset...] (casting between the two
/// buffers' dtypes), then write `pad` zeros at dst[dst_offset + len ...].
struct CopyRun {
  std::int64_t src_offset = 0;
  std::int64_t dst_offset = 0;
  std::int64_t len = 0;
  std::int64_t pad = 0;
};

/// One parameter's place in a group's layouts.
struct GroupMember {
  ShardLayout layout;
  std::int64_t slot_offset = 0;   // in the group shard
  std::int64_t arena_offset = 0;  // in the unsharded arena
};

/// The layouts of a group: members with their offsets, gsn and the arena size, computed from
/// the members' layouts in order.
struct GroupLayout {
  std::vector<GroupMember> members;
  int world = 1;
  std::int64_t shard_numel = 0;  // gsn
  std::int64_t arena_numel = 0;  // sum of unsharded numels
};
GroupLayout make_group_layout(const std::vector<ShardLayout>& layouts);

/// Runs that unpack an all-gather buffer into the unsharded arena (padding skipped).
std::vector<CopyRun> all_gather_copy_out_runs(const GroupLayout& g);
/// Runs that pack the unsharded gradient arena into the reduce-scatter input (chunks along
/// the shard dim, rank-major, padding written as zeros).
std::vector<CopyRun> reduce_scatter_copy_in_runs(const GroupLayout& g);
/// The runs of reduce_scatter_copy_in_runs that belong to one member, reading from that
/// member's own gradient (src offsets from its start: gradients that are separate tensors);
/// with `zeros`, the same destination written as zeros (a member without a gradient).
std::vector<CopyRun> reduce_scatter_copy_in_member_runs(const GroupLayout& g, std::size_t member,
                                                        bool zeros);

/// Where a kernel runs: on the host, or on the default (device) execution space.
enum class ExecTarget { host, device };

class CopyPlan;

// Opaque: a stream's execution-space instances and a plan's runs
// (lib/kernels/exec_stream_impl.hpp).
struct CopyPlanImpl;
struct ExecStreamImpl;

/// An execution-space instance the kernels are enqueued on (kokkos-comm's pairing of a stream
/// with its work): the host execution space, or the device space's instance over a CUDA
/// stream. Kernels on one ExecStream run in order; none of them fences; fence() waits for
/// everything enqueued. Copies share the instance.
class ExecStream {
 public:
  /// Kokkos::DefaultHostExecutionSpace.
  static ExecStream host();
  /// Kokkos::DefaultExecutionSpace; with a CUDA Kokkos, an instance over `cuda_stream` (a
  /// cudaStream_t, nullptr for the default stream). Without a device backend this is the
  /// host space.
  static ExecStream device(void* cuda_stream = nullptr);
  ExecStream() : ExecStream(host()) {}
  ExecTarget target() const noexcept;
  /// Blocks until every kernel enqueued on this instance has finished.
  void fence() const;

 private:
  friend struct ExecStreamImpl;
  explicit ExecStream(std::shared_ptr<const ExecStreamImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const ExecStreamImpl> impl_;
  friend void run_copies(const CopyPlan&, const void*, DType, void*, DType, const ExecStream&);
  friend void cast_copy(const ExecStream&, const void*, DType, void*, DType, std::int64_t);
  friend void reduce_copy_out(const ExecStream&, const void*, DType, void*, DType, std::int64_t,
                              double, bool);
};

/// A list of runs placed in the memory of its execution target, built once per group and
/// reused every step (no per-step allocation or host-to-device transfer of the runs).
class CopyPlan {
 public:
  CopyPlan() = default;
  CopyPlan(ExecTarget where, const std::vector<CopyRun>& runs);
  ExecTarget target() const noexcept;
  std::size_t size() const noexcept;
  /// Elements read (sum of len) and written (sum of len + pad).
  std::int64_t elements_read() const noexcept;
  std::int64_t elements_written() const noexcept;

 private:
  friend void run_copies(const CopyPlan&, const void*, DType, void*, DType, const ExecStream&);
  friend struct CopyPlanImpl;
  std::shared_ptr<const CopyPlanImpl> impl_;
};

/// Executes a plan's runs from `src` (dtype src_t) to `dst` (dtype dst_t). One pass,
/// enqueued on `on` (whose target must be the plan's) without a fence.
void run_copies(const CopyPlan& plan, const void* src, DType src_t, void* dst, DType dst_t,
                const ExecStream& on);
/// The same on the default instance of the plan's target, returning when it is done.
void run_copies(const CopyPlan& plan, const void* src, DType src_t, void* dst, DType dst_t);

/// dst[i] = cast(src[i]) for i < n (all-gather copy-in: cast the group shard to param_dtype
/// into this rank's slot). With equal dtypes this is a plain copy.
void cast_copy(ExecTarget where, const void* src, DType src_t, void* dst, DType dst_t,
               std::int64_t n);
/// cast_copy enqueued on `on` without a fence.
void cast_copy(const ExecStream& on, const void* src, DType src_t, void* dst, DType dst_t,
               std::int64_t n);

/// dst[i] = (accumulate ? dst[i] : 0) + cast(src[i] / divisor) for i < n (reduce-scatter
/// copy-out: divide, cast to the parameter dtype, accumulate into the sharded gradient). The
/// division is done in f32 (f64 for f64 buffers); divisor 1 skips it.
void reduce_copy_out(ExecTarget where, const void* src, DType src_t, void* dst, DType dst_t,
                     std::int64_t n, double divisor, bool accumulate);
/// reduce_copy_out enqueued on `on` without a fence.
void reduce_copy_out(const ExecStream& on, const void* src, DType src_t, void* dst, DType dst_t,
                     std::int64_t n, double divisor, bool accumulate);

}  // namespace fullshard::kernels
