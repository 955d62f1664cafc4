// DeviceMesh: an N-D grid of ranks with named dims. Rank r of the mesh's base communicator
// sits at the row-major coordinates of r in the shape (as torch's init_device_mesh does).
// Each dim has its own communicators (one per stream kind, so that all-gather, reduce-scatter
// and all-reduce streams never share an MPI communicator).
//
// A mesh has a device type, as torch's init_device_mesh("cuda", ...) does. A CPU mesh runs
// FSDP's collectives on host memory over MPI (or node-local shared memory). A CUDA mesh
// (one GPU per rank, the device the Runtime bound) also owns, per dim and stream kind used, an
// NCCL communicator created on first use and bootstrapped over the dim's MPI ranks (the
// ncclUniqueId is broadcast under the mesh's timeout), one CUDA stream per stream kind plus a
// compute stream: the FSDP
// engine's device resources (its buffers come from a stream-ordered device pool per FSDP root
// on these streams, lib/fsdp; the pool is a tensor-layer type). Both kinds keep the MPI
// communicators (comm(), world_comm(), control_comm()) for host memory and control messages.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "fullshard/comm/communicator.hpp"
#include "fullshard/runtime/settings.hpp"

namespace fullshard {

class Runtime;

namespace comm {
// Opaque: a node's shared memory among a dim's ranks (private to the library; the transports
// use it).
class ShmComm;
}  // namespace comm

// Opaque: a mesh's communicators and streams (lib/mesh/device_mesh.cpp).
struct MeshState;

/// A mesh dim whose ranks span nodes, every node holding the same number (more than one) of
/// them, grouped by node for the two-level host transport: shared memory among the dim's ranks
/// of a node, MPI across nodes among the ranks with the same place in their node. Nodes are
/// numbered by their lowest rank in the dim, local ranks by their rank in the dim; a rank's
/// place need not follow its rank in the dim (any rank layout works). Made with the mesh
/// (DeviceMesh::node_split).
class NodeSplit {
 public:
  NodeSplit(std::unique_ptr<comm::ShmComm> local,
            std::vector<std::unique_ptr<comm::Communicator>> across, int node,
            std::vector<int> dim_ranks);
  ~NodeSplit();
  /// The dim's ranks on this rank's node (local rank: the place on the node).
  const comm::ShmComm& local() const noexcept { return *local_; }
  /// The dim's ranks with this rank's local rank, one per node (rank n: node n), for
  /// `kind`'s stream.
  comm::Communicator& across(comm::StreamKind kind) const;
  int nodes() const noexcept { return nodes_; }
  /// This rank's node (its rank in across()).
  int node() const noexcept { return node_; }
  int ranks_per_node() const noexcept { return ranks_per_node_; }
  /// The rank in the dim of local rank `local` on node `node`.
  int dim_rank(int node, int local) const {
    return dim_ranks_.at(static_cast<std::size_t>(node * ranks_per_node() + local));
  }
  /// Traffic of the shared memory and of the communicators across nodes.
  comm::Traffic traffic() const;

 private:
  std::unique_ptr<comm::ShmComm> local_;
  std::vector<std::unique_ptr<comm::Communicator>> across_;  // per stream kind
  int nodes_ = 1;
  int node_ = 0;
  int ranks_per_node_ = 1;
  std::vector<int> dim_ranks_;  // [node * ranks_per_node + local]
};

/// Where a mesh's FSDP state lives and its collectives run.
enum class DeviceType {
  cpu,   ///< host memory; MPI (or node-local shared memory) collectives on host streams
  cuda,  ///< CUDA device memory; NCCL collectives on CUDA streams (one GPU per rank)
};
/// "cpu", "cuda".
const char* device_type_name(DeviceType d) noexcept;
/// "cpu" or "cuda" (torch's device type strings); InvalidArgument naming the string and the
/// accepted ones otherwise.
DeviceType parse_device_type(const std::string& s);

class DeviceMesh {
 public:
  /// Mesh over all ranks of `runtime`'s world. `names` has one entry per dim; the product of
  /// `shape` must equal the world size. Collective over the world.
  DeviceMesh(const Runtime& runtime, std::vector<int> shape, std::vector<std::string> names);
  /// The same on `device`. DeviceType::cuda needs a fullshard built with NCCL against a
  /// CUDA-enabled Kokkos (ConfigError naming what is missing otherwise) and a usable GPU on
  /// every rank (CommError naming the rank and the CUDA / NCCL call that failed). Collective.
  DeviceMesh(const Runtime& runtime, DeviceType device, std::vector<int> shape,
             std::vector<std::string> names);
  /// Over the ranks of `base` on `device`, with the collective timeout `timeout_s`.
  DeviceMesh(DeviceType device, MPI_Comm base, std::vector<int> shape,
             std::vector<std::string> names, double timeout_s);
  /// Mesh over the ranks of `base` (any communicator, e.g. the training ranks of a coupled
  /// simulation). `timeout_s` is the collective timeout of its communicators. `collectives`
  /// chooses the FSDP host collectives' transport per dim (shm()); `ranks_per_node` > 0
  /// pretends that consecutive world ranks share a node in groups of that many (tests of the
  /// two-level path on one machine).
  DeviceMesh(MPI_Comm base, std::vector<int> shape, std::vector<std::string> names,
             double timeout_s, HostProgress progress = HostProgress::inline_,
             HostCollectives collectives = HostCollectives::auto_, int ranks_per_node = 0);
  /// Node-aware 2-D mesh ("node", "local"): the local dim holds the ranks of one node
  /// (MPI shared-memory split, or the runtime's FULLSHARD_RANKS_PER_NODE override).
  /// Every node must run the same number of ranks.
  static DeviceMesh node_aware(const Runtime& runtime);
  /// Same over `base`, pretending `ranks_per_node` consecutive ranks share a node when it is
  /// > 0 (tests), else detecting nodes with MPI_Comm_split_type.
  static DeviceMesh node_aware(MPI_Comm base, int ranks_per_node, double timeout_s,
                               HostProgress progress = HostProgress::inline_,
                               HostCollectives collectives = HostCollectives::auto_);

  /// The device the mesh was made for (FSDP keeps shards, unsharded parameters and gradients
  /// in device memory on a CUDA mesh, in host memory on a CPU mesh).
  DeviceType device_type() const noexcept;

  int ndim() const noexcept;
  const std::vector<int>& shape() const noexcept;
  const std::vector<std::string>& names() const noexcept;
  /// Size of a dim by name; throws InvalidArgument naming the dim and the mesh's dims.
  int size(const std::string& dim) const;
  /// Number of ranks in the mesh.
  int size() const noexcept;
  /// Index of a dim by name (throws on an unknown name).
  int dim_index(const std::string& dim) const;
  /// This rank's rank in the mesh (row-major linear index of its coordinates).
  int rank() const noexcept;
  /// This rank's coordinates, one per dim.
  const std::vector<int>& coordinates() const noexcept;
  /// This rank's coordinate along one dim.
  int coordinate(const std::string& dim) const;

  /// The communicator along `dim` (ranks that differ only in that dim) for `kind`: MPI,
  /// host memory, on every kind of mesh.
  comm::Communicator& comm(const std::string& dim,
                           comm::StreamKind kind = comm::StreamKind::compute) const;
  /// The communicator of the mesh's device along `dim` for `kind`: NCCL on a CUDA mesh
  /// (device memory, device_stream(kind)), comm(dim, kind) on a CPU mesh. A CUDA mesh
  /// creates each NCCL communicator on its first use (FSDP uses 3 in all: the shard dim's
  /// all-gather and reduce-scatter kinds, the replicate dim's all-reduce kind, got when
  /// fully_shard builds its groups), so the first call for a (dim, kind) is collective over
  /// the dim's ranks: every rank makes it, in the same order, outside an NCCL group
  /// (InvalidArgument inside one); a peer that never does ends in a CommError at the timeout.
  comm::Communicator& device_comm(const std::string& dim,
                                  comm::StreamKind kind = comm::StreamKind::compute) const;
  /// The NCCL communicators device_comm has created so far (0 on a CPU mesh).
  int device_comms_created() const noexcept;
  /// The stream device_comm(..., kind) runs on: the kind's CUDA stream on a CUDA mesh
  /// (created with the mesh, high priority, as FSDP2's communication streams), stream(kind)
  /// on a CPU mesh.
  comm::Stream& device_stream(comm::StreamKind kind) const;
  /// The stream user compute runs on: FSDP's copy-outs into the unsharded parameters are
  /// enqueued on it, and forward / backward callbacks must enqueue their kernels on it (or
  /// order their own streams after it). A CUDA stream on a CUDA mesh (native_handle() is the
  /// cudaStream_t; fullshard/mesh/compute_space.hpp gives the Kokkos execution-space instance);
  /// on a CPU mesh a caller stream (the host thread itself).
  comm::Stream& compute_stream() const;
  /// Makes `cuda_stream` (a cudaStream_t as void*: the application's or LibTorch's current
  /// stream; nullptr is the legacy default stream) the compute stream of this mesh and its
  /// copies; fullshard does not destroy it. The new stream first waits for what the old one
  /// had enqueued. Call between iterations (fullshard::torch does at each root forward: the
  /// stream LibTorch computes on). InvalidArgument on a CPU mesh. A no-op for the stream in use.
  void set_compute_stream(void* cuda_stream) const;
  /// For fullshard/mesh/compute_space.hpp: an object kept with the mesh's compute stream
  /// (one per mesh, shared by its copies, destroyed before the stream), made by
  /// `make(compute_stream().native_handle())` on the first call (and again after
  /// set_compute_stream); every call returns it. One slot: the compute stream's Kokkos
  /// execution-space instance.
  void* compute_stream_cache(std::shared_ptr<void> (*make)(void* native_stream)) const;
  /// The stream that the collectives of `kind` run on: one per stream kind per mesh (copies of
  /// a mesh share it), created on first use as a worker or caller stream (host_progress()).
  /// Using a kind's communicators only on that kind's stream is what keeps two streams
  /// from ever sharing an MPI communicator.
  comm::Stream& stream(comm::StreamKind kind) const;
  /// The node-local shared memory of a dim (private to the library), over the same ranks in
  /// the same order as its communicators; nullptr when the dim's FSDP host collectives go
  /// through MPI or the two-level transport: a dim of size 1, a dim whose ranks span nodes
  /// (node_split), or FULLSHARD_HOST_COLLECTIVES=mpi.
  const comm::ShmComm* shm(const std::string& dim) const;
  /// The dim's ranks grouped by node (the two-level host transport), or nullptr: a dim other
  /// than the last (FSDP's shard dim; made for it alone), a dim inside one node, nodes holding
  /// different numbers of the dim's ranks or one each, a CUDA mesh,
  /// FULLSHARD_HOST_COLLECTIVES=mpi.
  const NodeSplit* node_split(const std::string& dim) const;
  /// The transport choice the mesh was made with (FULLSHARD_HOST_COLLECTIVES).
  HostCollectives host_collectives() const noexcept;
  /// Communicator over all ranks of the mesh.
  comm::Communicator& world_comm() const;
  /// The MPI communicator under a dim's compute communicator and under the whole mesh (MPI
  /// bootstraps every mesh): for control messages of layers that keep raw MPI (checkpoint
  /// agreement), never for the collectives the mesh's communicators carry.
  MPI_Comm control_comm(const std::string& dim) const;
  MPI_Comm control_world() const;
  /// Bytes issued by this rank on the mesh's communicators (every dim and stream kind, and the
  /// world communicator) and its dims' shared memory since the mesh was created; see
  /// comm::Traffic.
  comm::Traffic traffic() const;

  /// 1-D mesh along one dim (collective; the result shares nothing with this mesh).
  DeviceMesh sub_mesh(const std::string& dim) const;
  /// 1-D mesh of several dims flattened in the given order (row-major), named `name`
  /// (default: the names joined with "_").
  DeviceMesh flatten(const std::vector<std::string>& dims, std::string name = "") const;

  /// Collective timeout of the mesh's communicators (seconds, 0 = none).
  double timeout_s() const noexcept;
  /// How the mesh's streams run (the Runtime's setting, or the constructor's).
  HostProgress host_progress() const noexcept;

  /// "(replicate=2, shard=2) rank 3 at (1, 1)", with " on cuda" for a CUDA mesh.
  std::string describe() const;

 private:
  explicit DeviceMesh(std::shared_ptr<const MeshState> s) : s_(std::move(s)) {}
  std::shared_ptr<const MeshState> s_;
};

/// torch's init_device_mesh(device_type, mesh_shape, mesh_dim_names=...): `device_type` is
/// "cpu" or "cuda" (parse_device_type). Collective over the runtime's world.
DeviceMesh init_device_mesh(const Runtime& runtime, const std::string& device_type,
                            std::vector<int> shape, std::vector<std::string> names);

}  // namespace fullshard
