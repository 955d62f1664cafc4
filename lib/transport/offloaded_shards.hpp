// CPUOffloadPolicy on a CUDA mesh: the group's shards and sharded gradients are host memory
// around device collectives. Pinned shards are read and written by the device kernels in
// place (the copies are fused into the copy-in and copy-out); pageable ones go through a
// device staging buffer (a copy into pageable memory returns once done: the host blocks
// there, as FSDP2's). Private to lib/transport.
#pragma once

#include "lib/transport/group_transport.hpp"

namespace fullshard::transport::detail {

class OffloadedShards {
 public:
  explicit OffloadedShards(const GroupSpec& spec) : spec_(spec) {}
  /// Pageable shards: a device buffer of one group shard (orig dtype) for channel `c`,
  /// released (an event on c) with the tensor. Pinned: undefined (kernels use them in place).
  Tensor staging(Device& dev, comm::StreamKind c) const;
  /// One group shard (orig dtype) from `src` to `dst` on channel c (cudaMemcpyAsync).
  void copy(Device& dev, comm::StreamKind c, void* dst, const void* src, const char* what) const;

 private:
  const GroupSpec& spec_;
};

}  // namespace fullshard::transport::detail
