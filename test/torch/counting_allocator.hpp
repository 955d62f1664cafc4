// LibTorch's CPU allocator with a count of the bytes it holds (now and the peak since a reset),
// for tests that count what LibTorch allocates: installed with c10::SetCPUAllocator over the
// allocator it wraps.
#pragma once

#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "fullshard/base/memory_ledger.hpp"

namespace fullshard::test {

/// Counts the bytes its allocations hold; with_shards_peak() adds fullshard's shard storage.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  c10::DataPtr allocate(std::size_t n) override {
    return count(n);
  }
  void copy_data(void* dest, const void* src, std::size_t n) const override {
    default_copy_data(dest, src, n);
  }
#else
  c10::DataPtr allocate(std::size_t n) const override {
    return count(n);
  }
#endif
  std::int64_t now() const {
    return now_.load();
  }
  std::int64_t peak() const {
    return peak_.load();
  }
  void reset_peak() {
    peak_.store(now_.load());
    with_shards_peak_.store(now_.load() + shards());
  }
  /// The peak of LibTorch's bytes plus fullshard's shard storage (the ledger's), read at every
  /// allocation and release of LibTorch's: the two together, as the process holds them.
  std::int64_t with_shards_peak() const {
    return with_shards_peak_.load();
  }

 private:
  struct Held {
    c10::DataPtr inner;
    std::size_t n;
    const CountingAllocator* self;
  };
  static std::int64_t shards() {
    return static_cast<std::int64_t>(
        fullshard::memory_ledger::counts().now_of(fullshard::MemoryPart::shards));
  }
  static void raise(std::atomic<std::int64_t>& peak, std::int64_t v) {
    std::int64_t p = peak.load();
    while (v > p && !peak.compare_exchange_weak(p, v)) {
    }
  }
  static void release(void* ctx) {
    auto* h = static_cast<Held*>(ctx);
    raise(h->self->with_shards_peak_, h->self->now_.load() + shards());
    h->self->now_ -= static_cast<std::int64_t>(h->n);
    delete h;
  }
  c10::DataPtr count(std::size_t n) const {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* held = new Held{std::move(inner), n, this};
    const std::int64_t v = now_ += static_cast<std::int64_t>(n);
    raise(peak_, v);
    raise(with_shards_peak_, v + shards());
    return c10::DataPtr(data, held, &CountingAllocator::release, device);
  }
  c10::Allocator* base_;
  mutable std::atomic<std::int64_t> now_{0}, peak_{0}, with_shards_peak_{0};
};

}  // namespace fullshard::test
