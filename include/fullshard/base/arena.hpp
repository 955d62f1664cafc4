// A monotonic arena for data that is made together and dies together: one plan's groups,
// operations and buffer events (a 100,000-module plan holds over two million records), and
// the planner's scratch. One allocation per block instead of one per array: a plan's arrays
// share huge pages, so filling them takes a few faults instead of one per 4 KiB page, and
// nothing is returned piecemeal. ArenaAllocator puts a standard container in an arena.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

namespace fullshard {

class Arena {
 public:
  /// `expected_bytes`: the size of the first block (later blocks double). Blocks under 32 MiB
  /// come from the heap (which reuses them for the next arena of that size); larger ones are
  /// mapped directly, 2 MiB-aligned and advised as transparent huge pages.
  explicit Arena(std::size_t expected_bytes);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  /// `bytes` aligned to `align` (a power of two <= 4096); std::bad_alloc when the system has
  /// no memory. Freed when the arena is destroyed.
  void* allocate(std::size_t bytes, std::size_t align);
  /// Bytes of the blocks taken from the system so far.
  std::size_t reserved_bytes() const noexcept { return reserved_; }
  /// Bytes the arena can hand out before it needs another block, after reset().
  std::size_t reusable_bytes() const noexcept;
  /// Forgets every allocation and keeps the largest block for the next ones (its pages stay
  /// resident: refilling them costs no page faults). Only when nothing uses the memory.
  void reset() noexcept;

 private:
  struct Block {
    void* base;
    std::size_t bytes;
    bool mapped;
  };
  void add_block(std::size_t min_bytes);

  std::vector<Block> blocks_;
  std::byte* cur_ = nullptr;
  std::byte* end_ = nullptr;
  std::size_t next_bytes_;
  std::size_t reserved_ = 0;
};

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
    return static_cast<T*>(arena_->allocate(n * sizeof(T), alignof(T)));
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
