#include "lib/session/torch_host_bytes.hpp"

#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <utility>

#include <fcntl.h>
#include <unistd.h>

namespace fullshard::session {
namespace {

// Wraps the allocator current at installation (the inner one). An allocation is the inner
// one's, its data pointer its own context (as LibTorch's raw_allocate requires); a side table
// keeps, per data pointer, the inner allocation and its bytes. A pointer the table does not
// know (a buffer oneDNN took through raw_allocate before the installation) goes to the inner
// allocator's raw deleter. A tensor allocated before installation is released by its own
// deleter. Zero bytes are the inner allocator's, uncounted.
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
    next_sample_.store(now(), std::memory_order_relaxed);
    anonymous_peak_.store(anonymous_bytes(), std::memory_order_relaxed);
  }

  std::int64_t anonymous_peak() const noexcept override {
    return anonymous_peak_.load(std::memory_order_relaxed);
  }
  void sample() override {
    const std::int64_t a = anonymous_bytes();
    std::int64_t m = anonymous_peak_.load(std::memory_order_relaxed);
    while (a > m && !anonymous_peak_.compare_exchange_weak(m, a, std::memory_order_relaxed)) {
    }
  }

  // The one counter of the process (release is a plain function pointer).
  static CountingCpuAllocator* instance;

 private:
  struct Held {
    c10::DataPtr inner;
    std::int64_t bytes;
  };

  static void release(void* data) {
    if (!data) return;
    CountingCpuAllocator& self = *instance;
    self.sample_pending();
    Held held;
    bool known = false;
    {
      const std::lock_guard<std::mutex> lock(self.mutex_);
      const auto it = self.held_.find(data);
      if (it != self.held_.end()) {
        held = std::move(it->second);
        self.held_.erase(it);
        known = true;
      }
    }
    if (!known) {  // not ours: the inner allocator's
      if (c10::DeleterFnPtr d = self.inner_->raw_deleter()) d(data);
      return;
    }
    self.now_.fetch_sub(held.bytes, std::memory_order_relaxed);
    // held.inner frees the inner allocation here (outside the lock).
  }

  // The sample a new peak asked for (before the call's own allocation or release).
  void sample_pending() const {
    if (pending_.load(std::memory_order_relaxed) &&
        pending_.exchange(false, std::memory_order_relaxed))
      const_cast<CountingCpuAllocator*>(this)->sample();
  }

  c10::DataPtr counted(std::size_t n) const {
    sample_pending();
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (n == 0 || !data) return inner;
    const c10::Device device = inner.device();
    const auto bytes = static_cast<std::int64_t>(n);
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      held_.emplace(data, Held{std::move(inner), bytes});
    }
    const std::int64_t v = now_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    std::int64_t p = peak_.load(std::memory_order_relaxed);
    while (v > p && !peak_.compare_exchange_weak(p, v, std::memory_order_relaxed)) {
    }
    // A new peak well above the last sample: the process's anonymous memory is sampled at the
    // next allocation or release, once the new tensor's pages are written.
    std::int64_t next = next_sample_.load(std::memory_order_relaxed);
    if (v > p && v >= next &&
        next_sample_.compare_exchange_strong(next, v + std::max<std::int64_t>(1 << 20, v / 64),
                                             std::memory_order_relaxed))
      pending_.store(true, std::memory_order_relaxed);
    return c10::DataPtr(data, data, &CountingCpuAllocator::release, device);
  }

  // RssAnon: /proc/self/statm's resident less its shared (file and shared-memory) pages, read
  // with pread on a descriptor kept open (no allocation in the allocator's path); 0 where
  // /proc cannot be read.
  static std::int64_t anonymous_bytes() {
    static const int fd = ::open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
    static const std::int64_t page = ::sysconf(_SC_PAGESIZE);
    char text[128];
    const ssize_t n = fd < 0 ? -1 : ::pread(fd, text, sizeof text - 1, 0);
    if (n <= 0) return 0;
    text[n] = '\0';
    char* end = text;
    std::strtoll(end, &end, 10);  // size
    const long long resident = std::strtoll(end, &end, 10);
    const long long shared = std::strtoll(end, &end, 10);
    return static_cast<std::int64_t>(resident - shared) * page;
  }

  c10::Allocator* inner_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, Held> held_;
  mutable std::atomic<std::int64_t> now_{0}, peak_{0}, next_sample_{0}, anonymous_peak_{0};
  mutable std::atomic<bool> pending_{false};
};

CountingCpuAllocator* CountingCpuAllocator::instance = nullptr;

}  // namespace

TorchHostBytes* TorchHostBytes::get() {
  // Lives to the end of the process: tensors it allocated may outlive every session. Once
  // installed it stays the counter: an allocator installed later over it passes its
  // allocations on (and one that replaces it leaves the count unchanged: nothing measured).
  static CountingCpuAllocator* const counter = [] {
    auto* c = new CountingCpuAllocator(c10::GetCPUAllocator());
    CountingCpuAllocator::instance = c;  // before any allocation can reach it
    c10::SetCPUAllocator(c, /*priority=*/0);
    if (c10::GetCPUAllocator() == c) return c;
    CountingCpuAllocator::instance = nullptr;
    delete c;  // not taken: an allocator of a higher priority is installed
    return static_cast<CountingCpuAllocator*>(nullptr);
  }();
  return counter;
}

}  // namespace fullshard::session
