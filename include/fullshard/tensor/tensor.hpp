// Tensor: a typed, shaped view of bytes held by a Kokkos View in a memory space. Copies
// share the bytes (like torch tensors); views created from a tensor keep its bytes alive.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "fullshard/base/dtype.hpp"
#include "fullshard/base/memory_ledger.hpp"
#include "fullshard/tensor/shape.hpp"

namespace fullshard {

/// Where a tensor's bytes live: host memory, or the memory of the default (device)
/// execution space (CUDA device memory in a CUDA-enabled Kokkos; host memory otherwise).
enum class MemorySpace { host, device };
const char* memory_space_name(MemorySpace s) noexcept;

class Tensor {
 public:
  /// An undefined tensor (no bytes).
  Tensor() = default;

  /// Uninitialised storage (Kokkos WithoutInitializing), labelled for Kokkos tools and
  /// charged to `part` of the memory ledger (fullshard/base/memory_ledger.hpp) while it lives.
  static Tensor empty(const Shape& shape, DType dtype, MemorySpace space = MemorySpace::host,
                      const std::string& label = "fullshard::tensor",
                      MemoryPart part = MemoryPart::other);
  /// Zero-filled storage.
  static Tensor zeros(const Shape& shape, DType dtype, MemorySpace space = MemorySpace::host,
                      const std::string& label = "fullshard::tensor",
                      MemoryPart part = MemoryPart::other);
  /// A view of memory the caller owns (and keeps alive).
  static Tensor wrap(void* data, const Shape& shape, DType dtype,
                     MemorySpace space = MemorySpace::host);
  /// A view of bytes kept alive by `owner`.
  static Tensor from_owner(std::shared_ptr<void> owner, void* data, const Shape& shape, DType dtype,
                           MemorySpace space);

  bool defined() const noexcept { return data_ != nullptr || numel() == 0; }
  void* data() const noexcept { return data_; }
  template <class T>
  T* data_as() const noexcept {
    return static_cast<T*>(data_);
  }
  DType dtype() const noexcept { return dtype_; }
  const Shape& shape() const noexcept { return shape_; }
  std::int64_t dim(int i) const { return shape_.at(static_cast<std::size_t>(i)); }
  int ndim() const noexcept { return static_cast<int>(shape_.size()); }
  std::int64_t numel() const noexcept { return fullshard::numel(shape_); }
  std::size_t nbytes() const noexcept {
    return static_cast<std::size_t>(numel()) * dtype_size(dtype_);
  }
  MemorySpace space() const noexcept { return space_; }
  const std::shared_ptr<void>& owner() const noexcept { return owner_; }

  /// The same bytes with another shape of equal numel.
  Tensor reshape(const Shape& shape) const;
  /// `shape` elements starting at flat element `offset` of this tensor's bytes.
  Tensor flat_view(std::int64_t offset, const Shape& shape) const;

  /// Host tensors only: element i (flat) as double, and writes (rounded to the dtype).
  double at(std::int64_t i) const;
  void set(std::int64_t i, double v);
  /// Host tensors only: fills every element with v.
  void fill(double v);

 private:
  std::shared_ptr<void> owner_;
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  Shape shape_;
  MemorySpace space_ = MemorySpace::host;
};

/// Copies `src` into `dst` (same numel and dtype; any memory spaces).
void copy_bytes(const Tensor& dst, const Tensor& src);

}  // namespace fullshard
