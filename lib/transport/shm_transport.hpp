// Node-local shared-memory collectives for a shard dim inside one node (DeviceMesh::shm): the
// all-gather publishes each rank's shard and its copy-out reads every peer's where it lies;
// the reduce-scatter reads peers' unsharded gradients where they lie and, without HSDP, also
// divides, casts and accumulates into the sharded gradients. With HSDP the replicate
// all-reduce runs over MPI across nodes. With `split` (a shard dim spanning nodes,
// DeviceMesh::node_split) the same inside each node and MPI across nodes: Kind::two_level.
// Private to lib/transport.
#pragma once

#include <memory>

#include "lib/comm/shm.hpp"
#include "lib/transport/group_transport.hpp"

namespace fullshard::transport::detail {

/// `shm`: the shard dim's (or, with `split`, the node's) shared memory.
std::unique_ptr<GroupTransport> make_shm_transport(GroupSpec spec, const comm::ShmComm& shm,
                                                   const NodeSplit* split = nullptr);

}  // namespace fullshard::transport::detail
