// The allocator of a plan's containers (Plan::ops, Plan::events, PlannedGroup's lists):
// Scheduler::plan puts one plan's records in one arena, so a 100,000-module plan fills a few
// large blocks instead of allocating two million records one by one. The arena itself is
// private to the library; a copy of a container lives on the heap.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>

namespace fullshard {

// Opaque: a monotonic arena of blocks, freed together (lib/base/arena.hpp).
class Arena;
/// `bytes` aligned to `align` (a power of two <= 4096) from `arena`, freed with the arena;
/// std::bad_alloc when the system has no memory.
void* arena_allocate(Arena& arena, std::size_t bytes, std::size_t align);

/// A standard allocator over a shared Arena, or over the heap when it has none (the default,
/// and what copies of a container get). Containers keep their arena alive; deallocation in an
/// arena is a no-op (the memory returns when the last container using the arena dies).
template <class T>
class ArenaAllocator {
 public:
  using value_type = T;
  using propagate_on_container_move_assignment = std::true_type;
  using propagate_on_container_swap = std::true_type;
  using propagate_on_container_copy_assignment = std::false_type;

  ArenaAllocator() noexcept = default;
  explicit ArenaAllocator(std::shared_ptr<Arena> arena) noexcept : arena_(std::move(arena)) {}
  template <class U>
  ArenaAllocator(const ArenaAllocator<U>& o) noexcept : arena_(o.arena()) {}  // NOLINT: rebind

  /// A copy of a container lives on the heap: it may outlive the arena's other users.
  ArenaAllocator select_on_container_copy_construction() const noexcept { return {}; }

  T* allocate(std::size_t n) {
    if (n > static_cast<std::size_t>(-1) / sizeof(T)) throw std::bad_alloc();
    if (!arena_) return std::allocator<T>().allocate(n);
    return static_cast<T*>(arena_allocate(*arena_, n * sizeof(T), alignof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (!arena_) std::allocator<T>().deallocate(p, n);
  }

  const std::shared_ptr<Arena>& arena() const noexcept { return arena_; }

  template <class U>
  bool operator==(const ArenaAllocator<U>& o) const noexcept {
    return arena_ == o.arena();
  }
  template <class U>
  bool operator!=(const ArenaAllocator<U>& o) const noexcept {
    return arena_ != o.arena();
  }

 private:
  std::shared_ptr<Arena> arena_;
};

}  // namespace fullshard
