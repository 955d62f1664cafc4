// Staging device tensors through host memory (state dicts, checkpoints, optimizer state
// loads): page-locked host buffers and stream-ordered copies. Header-only: it needs the
// application's Kokkos (as fullshard/mesh/compute_space.hpp). With a host-only Kokkos every
// tensor is host-accessible and these are plain host allocations and memcpy.
#pragma once

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/tensor/tensor.hpp"

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace fullshard::detail {

/// Uninitialised host memory (MemorySpace::host) to stage device tensors through: CUDA
/// page-locked memory when Kokkos has CUDA (copies to and from the device run as DMA at full
/// bandwidth, without the driver's bounce buffer), ordinary host memory otherwise.
inline Tensor pinned_host_tensor(const Shape& shape, DType dtype, const std::string& label) {
#if defined(KOKKOS_ENABLE_CUDA)
  using View = Kokkos::View<std::byte*, Kokkos::CudaHostPinnedSpace>;
  const std::size_t n = static_cast<std::size_t>(numel(shape)) * dtype_size(dtype);
  auto v = std::make_shared<View>(Kokkos::view_alloc(Kokkos::WithoutInitializing, label), n);
  void* data = v->data();
  return Tensor::from_owner(std::move(v), data, shape, dtype, MemorySpace::host);
#else
  return Tensor::empty(shape, dtype, MemorySpace::host, label);
#endif
}

/// Copies `src` into `dst` (same dtype and numel, any memory spaces) on `stream` (a
/// cudaStream_t, nullptr: the legacy default stream) and returns when the copy is done: the
/// copy runs after everything enqueued on `stream` before (e.g. optimizer kernels on a
/// mesh's compute stream). Host to host is a memcpy. `what` names the tensor in errors.
inline void copy_on_stream(const Tensor& dst, const Tensor& src, void* stream,
                           const std::string& what) {
  if (dst.nbytes() != src.nbytes() || dst.dtype() != src.dtype())
    throw InvalidArgument(what + ": copy of " + shape_string(src.shape()) + " " +
                          dtype_name(src.dtype()) + " into " + shape_string(dst.shape()) + " " +
                          dtype_name(dst.dtype()));
  if (src.nbytes() == 0) return;
#if defined(KOKKOS_ENABLE_CUDA)
  if (dst.space() == MemorySpace::device || src.space() == MemorySpace::device) {
    auto s = static_cast<cudaStream_t>(stream);
    cudaError_t e = cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDefault, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    if (e != cudaSuccess)
      throw Error(what + ": staging copy of " + std::to_string(src.nbytes()) +
                  " bytes between host and device failed: " + cudaGetErrorString(e));
    return;
  }
#else
  (void)stream;
#endif
  std::memcpy(dst.data(), src.data(), src.nbytes());
}

/// True when `p` points into page-locked host memory that the device can read and write
/// (cudaHostAlloc / cudaHostRegister, e.g. pinned_host_tensor's): kernels may take it as
/// their source or destination. False for pageable or device memory, and always false with
/// a host-only Kokkos (there is no device).
inline bool is_pinned_host(const void* p) noexcept {
#if defined(KOKKOS_ENABLE_CUDA)
  if (p == nullptr) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // clears the error of an unknown pointer (old runtimes)
    return false;
  }
  return a.type == cudaMemoryTypeHost;
#else
  (void)p;
  return false;
#endif
}

/// Enqueues a copy of `bytes` bytes from `src` to `dst` (host or device, cudaMemcpyDefault)
/// on `stream` (a cudaStream_t) and returns without waiting for the device: the copy runs
/// after everything enqueued on `stream` before. Page-locked host memory is copied by DMA,
/// fully asynchronously (the host must not touch it until the stream has passed the copy);
/// with pageable host memory the CUDA runtime stages the bytes itself and may block the
/// host (a copy to pageable memory returns once it is done). Host to host, or a host-only
/// Kokkos: a memcpy. On a CUDA error throws Error with `what()` (called only then).
template <class What>
void copy_async(void* dst, const void* src, std::size_t bytes, void* stream, const What& what) {
  if (bytes == 0) return;
#if defined(KOKKOS_ENABLE_CUDA)
  const cudaError_t e =
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw Error(std::string(what()) + ": copy of " + std::to_string(bytes) +
                " bytes between host and device failed: " + cudaGetErrorString(e));
  }
#else
  (void)stream;
  (void)what;
  std::memcpy(dst, src, bytes);
#endif
}

/// Host bytes of tensors, one at a time: a host tensor is returned as it is; a device tensor
/// is copied (on `stream`) into one page-locked buffer, grown as needed and reused, so the
/// returned tensor is valid until the next host_of call.
class HostStager {
 public:
  explicit HostStager(void* stream) noexcept : stream_(stream) {}
  Tensor host_of(const Tensor& t, const std::string& what) {
    if (t.space() == MemorySpace::host || t.numel() == 0) return t;
    if (buffer_.nbytes() < t.nbytes())
      buffer_ = pinned_host_tensor({static_cast<std::int64_t>((t.nbytes() + 7) / 8)}, DType::f64,
                                   "fullshard::stage");
    Tensor h = Tensor::from_owner(buffer_.owner(), buffer_.data(), t.shape(), t.dtype(),
                                  MemorySpace::host);
    copy_on_stream(h, t, stream_, what);
    return h;
  }

 private:
  void* stream_;
  Tensor buffer_;
};

}  // namespace fullshard::detail
