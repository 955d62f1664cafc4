#include "lib/session/torch_host_bytes.hpp"

#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <atomic>
#include <cstddef>

namespace fullshard::session {
namespace {

// Wraps the allocator current at installation. Each allocation takes kHeader more bytes from
// it and keeps, in front of the data, the byte count and the inner allocation's deleter; the
// data pointer is its own context, as LibTorch's raw_allocate requires. A tensor allocated
// before installation is released by its own deleter.
class CountingCpuAllocator final : public c10::Allocator, public TorchHostBytes {
 public:
  explicit CountingCpuAllocator(c10::Allocator* inner) : inner_(inner) {}

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  c10::DataPtr allocate(std::size_t n) override {
    return counted(n);
  }
  void copy_data(void* dest, const void* src, std::size_t n) const override {
    default_copy_data(dest, src, n);
  }
#else
  c10::DataPtr allocate(std::size_t n) const override {
    return counted(n);
  }
#endif
  c10::DeleterFnPtr raw_deleter() const override {
    return &release;
  }

  std::int64_t now() const noexcept override {
    return now_.load(std::memory_order_relaxed);
  }
  std::int64_t peak() const noexcept override {
    return peak_.load(std::memory_order_relaxed);
  }
  void reset_peak() noexcept override {
    peak_.store(now(), std::memory_order_relaxed);
  }

 private:
  struct Header {
    void* inner_context;
    c10::DeleterFnPtr inner_deleter;
    std::int64_t bytes;
    const CountingCpuAllocator* owner;
  };
  // Keeps the data at the inner allocator's alignment (c10's is 64 bytes).
  static constexpr std::size_t kHeader = 64;
  static_assert(sizeof(Header) <= kHeader, "the header fits in front of the data");

  static void release(void* data) {
    auto* h = reinterpret_cast<Header*>(static_cast<std::byte*>(data) - kHeader);
    const Header copy = *h;
    copy.owner->now_.fetch_sub(copy.bytes, std::memory_order_relaxed);
    if (copy.inner_deleter) copy.inner_deleter(copy.inner_context);
  }

  c10::DataPtr counted(std::size_t n) const {
    c10::DataPtr inner;
    try {
      inner = inner_->allocate(n + kHeader);
    } catch (const c10::Error&) {
      // The inner allocator's own error, naming the bytes the caller asked for.
      inner = inner_->allocate(n);
      throw;  // n bytes fit where n + kHeader did not: the first error stands
    }
    const c10::Device device = inner.device();
    auto* base = static_cast<std::byte*>(inner.get());
    void* data = base + kHeader;
    auto* h = reinterpret_cast<Header*>(base);
    h->bytes = static_cast<std::int64_t>(n);
    h->owner = this;
    h->inner_deleter = inner.get_deleter();
    h->inner_context = inner.release_context();
    const std::int64_t v = now_.fetch_add(h->bytes, std::memory_order_relaxed) + h->bytes;
    std::int64_t p = peak_.load(std::memory_order_relaxed);
    while (v > p && !peak_.compare_exchange_weak(p, v, std::memory_order_relaxed)) {
    }
    return c10::DataPtr(data, data, &CountingCpuAllocator::release, device);
  }

  c10::Allocator* inner_;
  mutable std::atomic<std::int64_t> now_{0}, peak_{0};
};

}  // namespace

TorchHostBytes* TorchHostBytes::get() {
  // Lives to the end of the process: tensors it allocated may outlive every session. Once
  // installed it stays the counter: an allocator installed later over it passes its
  // allocations on (and one that replaces it leaves the count unchanged: nothing measured).
  static CountingCpuAllocator* const counter = [] {
    auto* c = new CountingCpuAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(c, /*priority=*/0);
    if (c10::GetCPUAllocator() == c) return c;
    delete c;  // not taken: an allocator of a higher priority is installed
    return static_cast<CountingCpuAllocator*>(nullptr);
  }();
  return counter;
}

}  // namespace fullshard::session
