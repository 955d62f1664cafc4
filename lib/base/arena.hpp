// A monotonic arena for data that is made together and dies together: one plan's groups,
// operations and buffer events (a 100,000-module plan holds over two million records), and
// the planner's scratch. One allocation per block instead of one per array: a plan's arrays
// share huge pages, so filling them takes a few faults instead of one per 4 KiB page, and
// nothing is returned piecemeal. ArenaAllocator (fullshard/base/arena_allocator.hpp) puts a
// standard container in an arena.
#pragma once

#include <cstddef>
#include <vector>

#include "fullshard/base/arena_allocator.hpp"

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

}  // namespace fullshard
