#include "fullshard/base/bulk_allocator.hpp"

#include <sys/mman.h>

#include <new>

namespace fullshard::detail {

void* bulk_map(std::size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  // Advice only: where transparent huge pages are off, the mapping works with small pages.
  (void)::madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return p;
}

void bulk_unmap(void* p, std::size_t bytes) noexcept {
  if (p) (void)::munmap(p, bytes);
}

}  // namespace fullshard::detail
