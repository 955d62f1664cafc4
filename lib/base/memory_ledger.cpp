#include "fullshard/base/memory_ledger.hpp"

#include <algorithm>
#include <mutex>
#include <utility>

namespace fullshard {
namespace {

struct Ledger {
  std::mutex m;
  MemoryCounts space[2];
};

Ledger& ledger() noexcept {
  static Ledger l;  // constructed on first use; never destroyed before static tensors are
  return l;
}

}  // namespace

const char* memory_part_name(MemoryPart p) noexcept {
  switch (p) {
    case MemoryPart::shards:
      return "shards";
    case MemoryPart::gradients:
      return "gradients";
    case MemoryPart::optimizer_state:
      return "optimizer state";
    case MemoryPart::pool:
      return "pool";
    case MemoryPart::windows:
      return "windows";
    case MemoryPart::other:
      break;
  }
  return "other";
}

std::uint64_t MemoryCounts::total_now() const noexcept {
  std::uint64_t t = 0;
  for (std::uint64_t b : now)
    t += b;
  return t;
}

namespace memory_ledger {

void charge(MemoryPart p, std::size_t bytes, bool device) noexcept {
  if (bytes == 0) return;
  Ledger& l = ledger();
  const std::lock_guard<std::mutex> lock(l.m);
  MemoryCounts& c = l.space[device ? 1 : 0];
  const auto i = static_cast<std::size_t>(p);
  c.now[i] += bytes;
  c.peak[i] = std::max(c.peak[i], c.now[i]);
  c.total_peak = std::max(c.total_peak, c.total_now());
}

void release(MemoryPart p, std::size_t bytes, bool device) noexcept {
  if (bytes == 0) return;
  Ledger& l = ledger();
  const std::lock_guard<std::mutex> lock(l.m);
  std::uint64_t& now = l.space[device ? 1 : 0].now[static_cast<std::size_t>(p)];
  now -= std::min<std::uint64_t>(now, bytes);
}

MemoryCounts counts(bool device) noexcept {
  Ledger& l = ledger();
  const std::lock_guard<std::mutex> lock(l.m);
  return l.space[device ? 1 : 0];
}

void reset_peaks() noexcept {
  Ledger& l = ledger();
  const std::lock_guard<std::mutex> lock(l.m);
  for (MemoryCounts& c : l.space) {
    c.peak = c.now;
    c.total_peak = c.total_now();
  }
}

}  // namespace memory_ledger

MemoryCharge::MemoryCharge(MemoryPart p, std::size_t bytes, bool device) noexcept
    : part_(p), bytes_(bytes), device_(device) {
  memory_ledger::charge(part_, bytes_, device_);
}

MemoryCharge::~MemoryCharge() {
  memory_ledger::release(part_, bytes_, device_);
}

MemoryCharge::MemoryCharge(MemoryCharge&& o) noexcept
    : part_(o.part_), bytes_(std::exchange(o.bytes_, 0)), device_(o.device_) {}

MemoryCharge& MemoryCharge::operator=(MemoryCharge&& o) noexcept {
  if (this != &o) {
    memory_ledger::release(part_, bytes_, device_);
    part_ = o.part_;
    bytes_ = std::exchange(o.bytes_, 0);
    device_ = o.device_;
  }
  return *this;
}

}  // namespace fullshard
