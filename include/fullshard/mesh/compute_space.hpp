// The compute stream of a mesh as a Kokkos execution-space instance, for user kernels in
// forward / backward callbacks (the rule: docs/guide/shard-a-model.md, "User compute on the right
// stream").
//
//   auto space = fullshard::compute_space(mesh);     // Kokkos::DefaultExecutionSpace
//   Kokkos::parallel_for(Kokkos::RangePolicy<>(space, 0, n), ...);
//   cublasSetStream(handle, fullshard::compute_cuda_stream(mesh));
//
// FSDP enqueues each group's copy-out into the unsharded parameters on this stream, and
// orders its reduce-scatter after what the backward callbacks enqueued on it, so kernels put
// there see the gathered parameters and produce the gradients without any host
// synchronisation. Header-only (it needs the application's Kokkos).
#pragma once

#include <Kokkos_Core.hpp>
#include <memory>
#include <type_traits>

#include "fullshard/mesh/device_mesh.hpp"

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace fullshard {

#if defined(KOKKOS_ENABLE_CUDA)
/// The cudaStream_t of `mesh`'s compute stream (nullptr, the legacy default stream, for a
/// CPU mesh: its compute is the host thread).
inline cudaStream_t compute_cuda_stream(const DeviceMesh& mesh) {
  return static_cast<cudaStream_t>(mesh.compute_stream().native_handle());
}
#endif

/// An instance of `ExecSpace` that runs on `mesh`'s compute stream: for Kokkos::Cuda on a
/// CUDA mesh, a copy of the mesh's Kokkos::Cuda(compute stream) instance, created once per
/// mesh (creating one allocates Kokkos' scratch memory; a copy is a reference) and kept until
/// the mesh and its copies are gone; otherwise (host spaces, CPU meshes) the default
/// instance, which runs where the callback runs.
template <class ExecSpace = Kokkos::DefaultExecutionSpace>
ExecSpace compute_space(const DeviceMesh& mesh) {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<ExecSpace, Kokkos::Cuda>) {
    if (mesh.device_type() == DeviceType::cuda)
      return *static_cast<const Kokkos::Cuda*>(
          mesh.compute_stream_cache([](void* stream) -> std::shared_ptr<void> {
            return std::make_shared<Kokkos::Cuda>(static_cast<cudaStream_t>(stream));
          }));
  }
#endif
  (void)mesh;
  return ExecSpace();
}

}  // namespace fullshard
