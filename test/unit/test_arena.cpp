// Arena and ArenaAllocator (fullshard/base/arena.hpp): alignment, growth past the first
// block, huge-page blocks on 2 MiB boundaries, reset keeping the largest block, and where
// containers' copies and moves live.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "lib/base/arena.hpp"

using fullshard::Arena;
using fullshard::ArenaAllocator;

namespace {

std::uintptr_t addr(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p);
}

}  // namespace

TEST_CASE("Arena: aligned, non-overlapping allocations, more blocks as needed") {
  Arena a(4096);
  std::vector<std::pair<unsigned char*, std::size_t>> got;
  for (std::size_t i = 0; i < 200; ++i) {
    const std::size_t align = std::size_t(1) << (i % 7);  // 1 .. 64
    const std::size_t bytes = 1 + (i * 37) % 300;
    auto* p = static_cast<unsigned char*>(a.allocate(bytes, align));
    REQUIRE(p != nullptr);
    CHECK(addr(p) % align == 0);
    std::memset(p, static_cast<int>(i), bytes);
    got.emplace_back(p, bytes);
  }
  // 200 allocations of ~150 bytes do not fit the 4 KiB first block: later blocks double.
  CHECK(a.reserved_bytes() > 4096);
  for (std::size_t i = 0; i < got.size(); ++i)  // nothing overwrote anything
    for (std::size_t j = 0; j < got[i].second; ++j)
      REQUIRE(got[i].first[j] == static_cast<unsigned char>(i));
  // One allocation larger than any block gets a block of its own.
  void* big = a.allocate(std::size_t(1) << 20, 64);
  CHECK(addr(big) % 64 == 0);
  std::memset(big, 0xab, std::size_t(1) << 20);
  CHECK(a.reserved_bytes() >= (std::size_t(1) << 20) + 4096);
}

TEST_CASE("Arena: blocks of 32 MiB and more are mapped on 2 MiB boundaries; reset keeps one") {
  const std::size_t big = std::size_t(40) << 20;
  Arena a(big);
  void* p = a.allocate(100, 8);
  CHECK(addr(p) % (std::size_t(2) << 20) == 0);  // the block's start, huge-page aligned
  CHECK(a.reserved_bytes() == std::size_t(40) << 20);
  a.allocate(big, 8);  // does not fit the rest: a second block
  const std::size_t two = a.reserved_bytes();
  CHECK(two >= std::size_t(80) << 20);
  const std::size_t largest = a.reusable_bytes();
  CHECK(largest >= big);
  a.reset();
  CHECK(a.reserved_bytes() == largest);  // the other block went back to the system
  CHECK(a.reserved_bytes() < two);
  CHECK(a.reusable_bytes() == largest);
  void* again = a.allocate(100, 8);
  CHECK(addr(again) % 8 == 0);
  std::memset(again, 1, 100);
}

TEST_CASE("ArenaAllocator: containers keep their arena; copies live on the heap") {
  auto arena = std::make_shared<Arena>(1 << 16);
  std::vector<int, ArenaAllocator<int>> v{ArenaAllocator<int>(arena)};
  v.resize(1000);
  std::iota(v.begin(), v.end(), 0);
  CHECK((v.get_allocator().arena() == arena));
  CHECK(arena.use_count() == 2);

  const auto copy = v;  // select_on_container_copy_construction: the heap
  CHECK(!copy.get_allocator().arena());
  CHECK(copy == v);

  auto moved = std::move(v);  // a move takes the arena along
  CHECK((moved.get_allocator().arena() == arena));
  std::vector<int, ArenaAllocator<int>> assigned;
  assigned = std::move(moved);  // propagate_on_container_move_assignment
  CHECK((assigned.get_allocator().arena() == arena));

  arena.reset();  // the container alone keeps the memory alive
  CHECK(assigned.get_allocator().arena().use_count() >= 1);
  for (int i = 0; i < 1000; ++i)
    REQUIRE(assigned[static_cast<std::size_t>(i)] == i);
  assigned.push_back(7);  // growth inside the arena
  CHECK(assigned.back() == 7);
  CHECK(assigned[999] == 999);
}
