// One communication group's transport: its all-gather and reduce-scatter pairs with the copy
// kernels fused around them, the communicators and buffers they need. Four kinds exist
// (lib/transport): MPI on the host, node-local shared memory on the host (with HSDP its
// replicate all-reduce goes over MPI across nodes), shared memory inside each node with MPI
// across for a shard dim spanning nodes (two levels), NCCL on a CUDA device
// (CPUOffloadPolicy's host shards are a concern of that one alone). What each folds
// into its collectives is transport::fusions (fusions.hpp), the rule the planner costs by.
//
// Each operation is one engine operation (lib/fsdp/engine.hpp): it is issued through
// the root's Device on the operation's stream `c` (the engine's stream) and returns its
// completion; the caller marks the buffers it passed as used by it. No state travels from one
// operation to the next outside the engine's records (the shared-memory rounds are that transport's
// own protocol).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "fullshard/comm/communicator.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/transport/fusions.hpp"
#include "lib/transport/device.hpp"

namespace fullshard::transport {

/// The sharded storage of a group, kept by its owner (fsdp's ParamGroup, which shows it to
/// the parameters).
class ShardStore {
 public:
  /// The shards: gsn elements of the original dtype in slot layout, padding zero. A transport
  /// may move them (shared memory: into its window, where peers read them).
  virtual Tensor& shards() = 0;
  /// The sharded gradients (gsn elements, original dtype), allocated for a reduction to write.
  virtual Tensor& gradients_for_write() = 0;

 protected:
  ~ShardStore() = default;
};

/// What a group's transport is made from.
struct GroupSpec {
  std::shared_ptr<const std::string> name;  // the group's name (labels, messages)
  const Geometry* geometry = nullptr;       // kept by the owner, stable
  const kernels::GroupLayout* layout = nullptr;
  const DeviceMesh* mesh = nullptr;  // the group's mesh: its shard dim is the last
  ShardStore* store = nullptr;
  bool offloaded = false;  // CPUOffloadPolicy on a CUDA mesh: host shards
  bool pinned = false;     // ... page-locked (kernels read and write them in place)
};

class GroupTransport {
 public:
  virtual ~GroupTransport();
  GroupTransport(const GroupTransport&) = delete;
  GroupTransport& operator=(const GroupTransport&) = delete;

  Kind kind() const noexcept { return kind_; }
  Fusions fusions() const noexcept { return transport::fusions(kind_, geo()); }
  const std::string& name() const noexcept { return *spec_.name; }
  /// The shard dim's all-gather communicator (cold paths: a full gather for a state dict).
  comm::Communicator& gather_comm() const noexcept { return *ag_comm_; }
  /// The copy-out runs of the whole gathered buffer (in the mesh's memory).
  const kernels::CopyPlan& copy_out_plan() const noexcept { return copy_out_; }
  /// reshard_after_forward=k (1 < k < W): (re)makes the k-rank groups the post-forward gather
  /// runs in (consecutive ranks: e.g. a node's). Collective over the shard group, made when
  /// every rank makes the same call; nothing may be in flight on the all-gather stream.
  void split_post_forward(int k);

  /// This rank's shard, cast to the parameter dtype, into its slot of `dst` (W > 1) or all of
  /// it (one rank).
  virtual comm::Work gather_copy_in(Device& dev, comm::StreamKind c, Held& dst) = 0;
  /// The all-gather of every rank's shard into `dst`; `in_place`: the copy-in wrote this
  /// rank's slot.
  virtual comm::Work all_gather(Device& dev, comm::StreamKind c, Held& dst, bool in_place) = 0;
  /// reshard_after_forward=k: the gather inside the k-rank group from the kept slices.
  comm::Work all_gather_slices(Device& dev, comm::StreamKind c, Held& dst, Held& slices, int k);
  /// The gathered shards (`src`; null: the shards themselves, one rank without a cast) into
  /// the unsharded parameters `arena`, and with `keep` the W/k slots this rank serves after
  /// forward. `from_slices`: the gather was all_gather_slices.
  virtual comm::Work gather_copy_out(Device& dev, comm::StreamKind c, const Held* src,
                                     bool from_slices, Held& arena, Held* keep, int k) = 0;
  /// Zeroes the unsharded gradients.
  comm::Work zero_grads(Device& dev, comm::StreamKind c, Held& grads);
  /// The unsharded gradients into the reduce-scatter's rank-major input (reduce dtype).
  virtual comm::Work reduce_copy_in(Device& dev, comm::StreamKind c, Held& grads, Held& input) = 0;
  /// The same from a front end's gradients (each parameter's grad(); undefined: zeros).
  virtual comm::Work external_copy_in(Device& dev, comm::StreamKind c, std::vector<Tensor> grads,
                                      Held& input) = 0;
  /// The reduce-scatter over the shard group into `output` (fused per fusions()).
  virtual comm::Work reduce_scatter(Device& dev, comm::StreamKind c, Held& input, Held& output,
                                    const ReduceSpec& spec) = 0;
  /// HSDP: the all-reduce of the reduced shard over the replicate dim.
  comm::Work all_reduce(Device& dev, comm::StreamKind c, Held& data);
  /// dst = (accumulate ? dst : 0) + src (the deferred HSDP all-reduce's partial sums).
  comm::Work accumulate(Device& dev, comm::StreamKind c, Held& src, Held& dst, bool accumulate);
  /// sharded gradients = (accumulate ? them : 0) + cast(src / divisor).
  virtual comm::Work reduce_copy_out(Device& dev, comm::StreamKind c, Held& src,
                                     const ReduceSpec& spec) = 0;

  /// The group joins a root whose operations run on `dev`.
  virtual void attach(Device& dev);
  /// The unsharded gradients live in the transport's own memory (take_grads_buffer gives it):
  /// the engine only reserves their bytes in the pool's count (Device::reserve).
  virtual bool provides_grads() const noexcept { return false; }
  /// The engine acquired the unsharded gradients: a transport whose peers read them where
  /// they lie puts its window's memory in `grads` (keeping the reservation for the count).
  virtual void take_grads_buffer(Held& grads);
  /// ... and gives them back (the window's next writer waits for its readers instead).
  virtual void return_grads_buffer(Held& grads);
  /// The shards may change from here on (optimizer, checkpoint load): peers have read them.
  virtual void before_shards_change();

 protected:
  GroupTransport(Kind kind, GroupSpec spec, kernels::ExecTarget target);
  const Geometry& geo() const noexcept { return *spec_.geometry; }
  const kernels::GroupLayout& layout() const noexcept { return *spec_.layout; }
  const DeviceMesh& mesh() const noexcept { return *spec_.mesh; }
  ShardStore& store() const noexcept { return *spec_.store; }
  comm::Stream& stream(const Device& dev, comm::StreamKind c) const {
    return dev.stream(c, mesh());
  }
  comm::LazyLabel label(const char* op) const;
  /// Per member, the copy-in runs from its own gradient and the runs of zeros for a member
  /// without one (external gradients; built on first use).
  const kernels::CopyPlan& member_copy_in_plan(std::size_t member, bool zeros);
  /// Runs the copy-in of external gradients into `to` (rank-major, reduce dtype).
  comm::Work external_copy(Device& dev, comm::StreamKind c, std::vector<Tensor> grads, void* to);

  Kind kind_;
  GroupSpec spec_;
  kernels::ExecTarget target_;
  comm::Communicator* ag_comm_ = nullptr;
  comm::Communicator* rs_comm_ = nullptr;
  comm::Communicator* ar_comm_ = nullptr;
  std::unique_ptr<comm::Communicator> post_forward_comm_;  // k-rank groups
  kernels::CopyPlan copy_out_;
  kernels::CopyPlan copy_in_;
  kernels::CopyPlan zeros_;                        // zero_grads on a device (built on first use)
  std::vector<kernels::CopyPlan> member_copy_in_;  // [2 * member + zeros], external grads
};

/// The transport of a group on its mesh: NCCL on a CUDA mesh; on a CPU mesh shared memory
/// when the shard dim lies inside a node (DeviceMesh::shm), shared memory inside each node and
/// MPI across when it spans nodes evenly (DeviceMesh::node_split), else MPI; compressed groups
/// go over MPI. ConfigError when FULLSHARD_HOST_COLLECTIVES=shm cannot be had.
std::unique_ptr<GroupTransport> make_group_transport(GroupSpec spec);

}  // namespace fullshard::transport
