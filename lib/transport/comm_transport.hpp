// A group's collectives over the shard dim's communicators: MPI on a CPU mesh, NCCL on a CUDA
// mesh (the communicator of the mesh's device; fusions: NCCL's pre-multiplied sum). The copy
// kernels around them run on the root's Device. Private to lib/transport.
#pragma once

#include <optional>

#include "lib/transport/group_transport.hpp"
#include "lib/transport/offloaded_shards.hpp"

namespace fullshard::transport::detail {

class CommTransport : public GroupTransport {
 public:
  CommTransport(Kind kind, GroupSpec spec);

  void attach(Device& dev) override;
  comm::Work gather_copy_in(Device& dev, comm::StreamKind c, Held& dst) override;
  comm::Work all_gather(Device& dev, comm::StreamKind c, Held& dst, bool in_place) override;
  comm::Work gather_copy_out(Device& dev, comm::StreamKind c, const Held* src, bool from_slices,
                             Held& arena, Held* keep, int k) override;
  comm::Work reduce_copy_in(Device& dev, comm::StreamKind c, Held& grads, Held& input) override;
  comm::Work external_copy_in(Device& dev, comm::StreamKind c, std::vector<Tensor> grads,
                              Held& input) override;
  comm::Work reduce_scatter(Device& dev, comm::StreamKind c, Held& input, Held& output,
                            const ReduceSpec& spec) override;
  comm::Work reduce_copy_out(Device& dev, comm::StreamKind c, Held& src,
                             const ReduceSpec& spec) override;

 protected:
  /// The shards cast to the parameter dtype (compressed: encoded) into `to`, on channel c.
  comm::Work cast_shard(Device& dev, comm::StreamKind c, void* to);
  comm::Work compressed_reduce_scatter(Device& dev, comm::StreamKind c, Held& input, Held& output,
                                       const ReduceSpec& spec);

 private:
  std::optional<OffloadedShards> offload_;  // CPUOffloadPolicy (CUDA meshes)
};

}  // namespace fullshard::transport::detail
