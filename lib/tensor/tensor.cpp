#include "fullshard/tensor/tensor.hpp"

#include <Kokkos_Core.hpp>
#include <cstring>

#include "fullshard/base/error.hpp"

namespace fullshard {
namespace {

using HostBytes = Kokkos::View<std::byte*, Kokkos::HostSpace>;
using DeviceBytes = Kokkos::View<std::byte*, Kokkos::DefaultExecutionSpace::memory_space>;

// The bytes and their charge to the memory ledger, which ends with them.
template <class View>
struct Charged {
  View view;
  MemoryCharge charge;
};

template <class View>
std::shared_ptr<void> allocate(std::size_t bytes, const std::string& label, MemoryPart part,
                               bool device, void** data) {
  auto v = std::make_shared<Charged<View>>(Charged<View>{
      View(Kokkos::view_alloc(Kokkos::WithoutInitializing, label), bytes == 0 ? 1 : bytes),
      MemoryCharge(part, bytes, device)});
  *data = v->view.data();
  return v;
}

void require_host(const Tensor& t, const char* what) {
  if (t.space() != MemorySpace::host)
    throw InvalidArgument(std::string("Tensor::") + what + " needs a host tensor");
}

}  // namespace

const char* memory_space_name(MemorySpace s) noexcept {
  return s == MemorySpace::host ? "host" : "device";
}

Tensor Tensor::empty(const Shape& shape, DType dtype, MemorySpace space, const std::string& label,
                     MemoryPart part) {
  checked_nbytes(shape, dtype, [&] { return "Tensor::empty(" + label + ")"; });
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.space_ = space;
  const std::size_t bytes = t.nbytes();
  t.owner_ = space == MemorySpace::host ? allocate<HostBytes>(bytes, label, part, false, &t.data_)
                                        : allocate<DeviceBytes>(bytes, label, part, true, &t.data_);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, MemorySpace space, const std::string& label,
                     MemoryPart part) {
  Tensor t = empty(shape, dtype, space, label, part);
  if (space == MemorySpace::host) {
    std::memset(t.data_, 0, t.nbytes());
  } else {
    Kokkos::View<std::byte*, Kokkos::DefaultExecutionSpace::memory_space,
                 Kokkos::MemoryTraits<Kokkos::Unmanaged>>
        v(static_cast<std::byte*>(t.data_), t.nbytes());
    Kokkos::deep_copy(v, std::byte{0});
  }
  return t;
}

Tensor Tensor::wrap(void* data, const Shape& shape, DType dtype, MemorySpace space) {
  return from_owner(nullptr, data, shape, dtype, space);
}

Tensor Tensor::from_owner(std::shared_ptr<void> owner, void* data, const Shape& shape, DType dtype,
                          MemorySpace space) {
  Tensor t;
  t.owner_ = std::move(owner);
  t.data_ = data;
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.space_ = space;
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  if (fullshard::numel(shape) != numel())
    throw InvalidArgument("Tensor::reshape: " + shape_string(shape_) + " cannot become " +
                          shape_string(shape));
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::flat_view(std::int64_t offset, const Shape& shape) const {
  if (offset < 0 || offset + fullshard::numel(shape) > numel())
    throw InvalidArgument("Tensor::flat_view: elements [" + std::to_string(offset) + ", " +
                          std::to_string(offset + fullshard::numel(shape)) + ") are outside " +
                          shape_string(shape_));
  Tensor t = *this;
  t.data_ = static_cast<std::byte*>(data_) + static_cast<std::size_t>(offset) * dtype_size(dtype_);
  t.shape_ = shape;
  return t;
}

double Tensor::at(std::int64_t i) const {
  require_host(*this, "at");
  return load_as_double(data_, dtype_, static_cast<std::size_t>(i));
}

void Tensor::set(std::int64_t i, double v) {
  require_host(*this, "set");
  store_from_double(data_, dtype_, static_cast<std::size_t>(i), v);
}

void Tensor::fill(double v) {
  require_host(*this, "fill");
  for (std::int64_t i = 0; i < numel(); ++i)
    set(i, v);
}

void copy_bytes(const Tensor& dst, const Tensor& src) {
  if (dst.nbytes() != src.nbytes() || dst.dtype() != src.dtype())
    throw InvalidArgument("copy_bytes: " + shape_string(src.shape()) + " " +
                          dtype_name(src.dtype()) + " into " + shape_string(dst.shape()) + " " +
                          dtype_name(dst.dtype()));
  if (src.nbytes() == 0) return;
  using Unmanaged = Kokkos::MemoryTraits<Kokkos::Unmanaged>;
  if (dst.space() == MemorySpace::host && src.space() == MemorySpace::host) {
    std::memcpy(dst.data(), src.data(), src.nbytes());
    return;
  }
  using DevSpace = Kokkos::DefaultExecutionSpace::memory_space;
  auto* d = static_cast<std::byte*>(dst.data());
  auto* s = static_cast<std::byte*>(src.data());
  const std::size_t n = src.nbytes();
  if (dst.space() == MemorySpace::host) {
    Kokkos::deep_copy(Kokkos::View<std::byte*, Kokkos::HostSpace, Unmanaged>(d, n),
                      Kokkos::View<std::byte*, DevSpace, Unmanaged>(s, n));
  } else if (src.space() == MemorySpace::host) {
    Kokkos::deep_copy(Kokkos::View<std::byte*, DevSpace, Unmanaged>(d, n),
                      Kokkos::View<std::byte*, Kokkos::HostSpace, Unmanaged>(s, n));
  } else {
    Kokkos::deep_copy(Kokkos::View<std::byte*, DevSpace, Unmanaged>(d, n),
                      Kokkos::View<std::byte*, DevSpace, Unmanaged>(s, n));
  }
}

}  // namespace fullshard
