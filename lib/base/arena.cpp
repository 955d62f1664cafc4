#include "lib/base/arena.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>

namespace fullshard {

namespace {

constexpr std::size_t kHuge = std::size_t(2) << 20;  // a transparent huge page
// Smaller blocks come from the heap, which keeps them for the next arena (glibc raises its
// mmap threshold up to 32 MiB to the sizes freed); larger ones are mapped, as huge pages.
constexpr std::size_t kMapMin = std::size_t(32) << 20;

std::size_t round_up(std::size_t x, std::size_t to) {
  if (x > static_cast<std::size_t>(-1) - to) throw std::bad_alloc();
  return (x + to - 1) / to * to;
}

// `bytes` (a multiple of kHuge) of zero-filled memory at a kHuge boundary: huge pages need the
// alignment, which mmap does not promise, so map one more and unmap the ends.
void* map_aligned(std::size_t bytes) {
  const std::size_t span = bytes + kHuge;
  void* p = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t b = (a + kHuge - 1) / kHuge * kHuge;
  if (b > a) (void)::munmap(p, b - a);
  if (a + span > b + bytes)
    (void)::munmap(reinterpret_cast<void*>(b + bytes), a + span - b - bytes);
#ifdef MADV_HUGEPAGE
  // Advice only: where transparent huge pages are off, the block works with small pages.
  (void)::madvise(reinterpret_cast<void*>(b), bytes, MADV_HUGEPAGE);
#endif
  return reinterpret_cast<void*>(b);
}

}  // namespace

Arena::Arena(std::size_t expected_bytes)
    : next_bytes_(std::max<std::size_t>(expected_bytes, 4096)) {}

namespace {

void release(const void* base, std::size_t bytes, bool mapped) noexcept {
  if (mapped)
    (void)::munmap(const_cast<void*>(base), bytes);
  else
    ::operator delete(const_cast<void*>(base));
}

}  // namespace

Arena::~Arena() {
  for (const Block& b : blocks_)
    release(b.base, b.bytes, b.mapped);
}

std::size_t Arena::reusable_bytes() const noexcept {
  std::size_t most = 0;
  for (const Block& b : blocks_)
    most = std::max(most, b.bytes);
  return most;
}

void Arena::reset() noexcept {
  if (blocks_.empty()) return;
  std::size_t keep = 0;
  for (std::size_t i = 1; i < blocks_.size(); ++i)
    if (blocks_[i].bytes > blocks_[keep].bytes) keep = i;
  for (std::size_t i = 0; i < blocks_.size(); ++i)
    if (i != keep) {
      release(blocks_[i].base, blocks_[i].bytes, blocks_[i].mapped);
      reserved_ -= blocks_[i].bytes;
    }
  blocks_[0] = blocks_[keep];
  blocks_.resize(1);
  cur_ = static_cast<std::byte*>(blocks_[0].base);
  end_ = cur_ + blocks_[0].bytes;
}

void Arena::add_block(std::size_t min_bytes) {
  std::size_t bytes = std::max(next_bytes_, min_bytes);
  const bool mapped = bytes >= kMapMin;
  if (mapped) bytes = round_up(bytes, kHuge);
  blocks_.reserve(blocks_.size() + 1);  // so that the push below cannot throw
  void* base = mapped ? map_aligned(bytes) : ::operator new(bytes);
  blocks_.push_back({base, bytes, mapped});
  reserved_ += bytes;
  cur_ = static_cast<std::byte*>(base);
  end_ = cur_ + bytes;
  next_bytes_ = bytes > static_cast<std::size_t>(-1) / 2 ? bytes : 2 * bytes;
}

void* Arena::allocate(std::size_t bytes, std::size_t align) {
  auto fits = [&] {
    const auto c = reinterpret_cast<std::uintptr_t>(cur_);
    const std::uintptr_t a = (c + align - 1) & ~(std::uintptr_t(align) - 1);
    return cur_ && a >= c && a - c <= static_cast<std::size_t>(end_ - cur_) &&
           bytes <= static_cast<std::size_t>(end_ - cur_) - (a - c);
  };
  if (!fits()) {
    add_block(round_up(bytes, 4096) + align);
  }
  const auto c = reinterpret_cast<std::uintptr_t>(cur_);
  const std::uintptr_t a = (c + align - 1) & ~(std::uintptr_t(align) - 1);
  std::byte* p = cur_ + (a - c);
  cur_ = p + bytes;
  return p;
}

void* arena_allocate(Arena& arena, std::size_t bytes, std::size_t align) {
  return arena.allocate(bytes, align);
}

}  // namespace fullshard
