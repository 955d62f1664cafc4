// An allocator for the planner's large, short-lived arrays (a 100,000-module plan holds
// over a million operations): blocks of 4 MiB and more are mapped directly and advised as
// transparent huge pages, so filling them takes a few hundred page faults instead of tens of
// thousands. Smaller blocks come from std::allocator. Stateless: any two compare equal.
#pragma once

#include <cstddef>
#include <memory>

namespace fullshard {

namespace detail {
/// `bytes` (>= kBulkMin) of zero-filled, page-aligned memory; std::bad_alloc when the system
/// has none.
void* bulk_map(std::size_t bytes);
void bulk_unmap(void* p, std::size_t bytes) noexcept;
constexpr std::size_t kBulkMin = std::size_t(4) << 20;
}  // namespace detail

template <class T>
class BulkAllocator {
 public:
  using value_type = T;
  BulkAllocator() noexcept = default;
  template <class U>
  BulkAllocator(const BulkAllocator<U>&) noexcept {}  // NOLINT: rebinding is implicit

  T* allocate(std::size_t n) {
    if (n > static_cast<std::size_t>(-1) / sizeof(T)) throw std::bad_alloc();
    const std::size_t bytes = n * sizeof(T);
    if (bytes < detail::kBulkMin) return std::allocator<T>().allocate(n);
    return static_cast<T*>(detail::bulk_map(bytes));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    const std::size_t bytes = n * sizeof(T);
    if (bytes < detail::kBulkMin)
      std::allocator<T>().deallocate(p, n);
    else
      detail::bulk_unmap(p, bytes);
  }
  template <class U>
  bool operator==(const BulkAllocator<U>&) const noexcept {
    return true;
  }
  template <class U>
  bool operator!=(const BulkAllocator<U>&) const noexcept {
    return false;
  }
};

}  // namespace fullshard
