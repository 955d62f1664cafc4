// DeviceMesh: an N-D grid of ranks with named dims. Rank r of the mesh's base communicator
// sits at the row-major coordinates of r in the shape (as torch's init_device_mesh does).
// Each dim has its own communicators (one per channel, so that all-gather, reduce-scatter
// and all-reduce streams never share an MPI communicator).
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "fullshard/comm/communicator.hpp"
#include "fullshard/comm/shm.hpp"
#include "fullshard/runtime/settings.hpp"

namespace fullshard {

class Runtime;

namespace detail {
struct MeshState;
}

/// The stream a communicator is meant for. Every dim has one communicator per channel.
enum class Channel { main, all_gather, reduce_scatter, all_reduce };
const char* channel_name(Channel c) noexcept;

class DeviceMesh {
 public:
  /// Mesh over all ranks of `runtime`'s world. `names` has one entry per dim; the product of
  /// `shape` must equal the world size. Collective over the world.
  DeviceMesh(const Runtime& runtime, std::vector<int> shape, std::vector<std::string> names);
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

  /// The communicator along `dim` (ranks that differ only in that dim) for `channel`.
  comm::Communicator& comm(const std::string& dim, Channel channel = Channel::main) const;
  /// The stream that the collectives of `channel` run on: one per channel per mesh (copies of
  /// a mesh share it), created on first use as a worker or caller stream (host_progress()).
  /// Using a channel's communicators only on the channel's stream is what keeps two streams
  /// from ever sharing an MPI communicator.
  comm::Stream& stream(Channel channel) const;
  /// The node-local shared memory of a dim (fullshard/comm/shm.hpp), over the same ranks in
  /// the same order as its communicators; nullptr when the dim's FSDP host collectives go
  /// through MPI: a dim of size 1, a dim whose ranks span nodes, or
  /// FULLSHARD_HOST_COLLECTIVES=mpi.
  const comm::ShmComm* shm(const std::string& dim) const;
  /// The transport choice the mesh was made with (FULLSHARD_HOST_COLLECTIVES).
  HostCollectives host_collectives() const noexcept;
  /// Communicator over all ranks of the mesh.
  comm::Communicator& world_comm() const;
  /// The MPI communicator under a dim's main channel and under the whole mesh (MPI
  /// bootstraps every mesh): for control messages of layers that keep raw MPI (checkpoint
  /// agreement), never for the collectives the mesh's communicators carry.
  MPI_Comm control_comm(const std::string& dim) const;
  MPI_Comm control_world() const;
  /// Bytes issued by this rank on the mesh's communicators (every dim and channel, and the
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
  /// How the mesh's channel streams run (the Runtime's setting, or the constructor's).
  HostProgress host_progress() const noexcept;

  /// "(replicate=2, shard=2) rank 3 at (1, 1)".
  std::string describe() const;

 private:
  explicit DeviceMesh(std::shared_ptr<const detail::MeshState> s) : s_(std::move(s)) {}
  std::shared_ptr<const detail::MeshState> s_;
};

}  // namespace fullshard
