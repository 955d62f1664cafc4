#include "lib/transport/offloaded_shards.hpp"

#include "lib/tensor/staging.hpp"

namespace fullshard::transport::detail {

Tensor OffloadedShards::staging(Device& dev, comm::StreamKind c) const {
  if (spec_.pinned) return Tensor();
  return dev.scratch(c, spec_.geometry->shard_numel, spec_.geometry->orig_dtype, "offload_staging",
                     *spec_.name);
}

void OffloadedShards::copy(Device& dev, comm::StreamKind c, void* dst, const void* src,
                           const char* what) const {
  const Geometry& I = *spec_.geometry;
  ::fullshard::detail::copy_async(
      dst, src, static_cast<std::size_t>(I.shard_numel) * dtype_size(I.orig_dtype),
      dev.stream(c, *spec_.mesh).native_handle(), [&] {
        return std::string("CPUOffloadPolicy of group ") + *spec_.name + ": " + what + " on the " +
               (c == comm::StreamKind::compute ? "compute" : comm::stream_name(c)) + " stream";
      });
}

}  // namespace fullshard::transport::detail
