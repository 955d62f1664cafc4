// Node-local shared-memory collectives for a shard dim inside one node (DeviceMesh::shm): the
// all-gather publishes each rank's shard and its copy-out reads every peer's where it lies;
// the reduce-scatter reads peers' unsharded gradients where they lie and, without HSDP, also
// divides, casts and accumulates into the sharded gradients. With HSDP the replicate
// all-reduce runs over MPI across nodes (the two-level composition). Private to
// lib/transport.
#pragma once

#include <memory>

#include "fullshard/comm/shm.hpp"
#include "fullshard/transport/detail/group_transport.hpp"

namespace fullshard::transport::detail {

std::unique_ptr<GroupTransport> make_shm_transport(GroupSpec spec, const comm::ShmComm& shm);

}  // namespace fullshard::transport::detail
