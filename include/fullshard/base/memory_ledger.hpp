// The bytes fullshard allocates, by what they hold: the process-wide count behind the memory
// account (docs/memory.md). Every allocation of the library's own state is charged to one part
// when it is made and given back when it is freed, so each count is exact (the bytes asked
// for, before the allocator's rounding): the plan's predicted parts are compared with these.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace fullshard {

/// What a block of the library's memory holds.
enum class MemoryPart : std::uint8_t {
  /// Sharded parameters (the parameters' dtype: f32 masters under mixed precision), also
  /// where they live in a shared-memory all-gather window.
  shards,
  /// Sharded gradients (and an optimizer inside backward's reduced-gradient scratch).
  gradients,
  /// Optimizer state (SGD's momentum, AdamW's two moments), f32.
  optimizer_state,
  /// Buffer pool blocks: unsharded parameters and gradients, communication buffers, in use or
  /// cached for reuse.
  pool,
  /// This rank's segments of shared-memory windows other than shards: gradient windows, the
  /// all-gather windows of a cast.
  windows,
  /// Everything else the library allocates (state dicts, checkpoint staging, scratch).
  other,
};
inline constexpr int kNumMemoryParts = 6;

/// "shards", "gradients", "optimizer state", "pool", "windows", "other".
const char* memory_part_name(MemoryPart p) noexcept;

/// Bytes per part: now, and the largest since the start (or reset_peaks).
struct MemoryCounts {
  std::array<std::uint64_t, kNumMemoryParts> now{};
  std::array<std::uint64_t, kNumMemoryParts> peak{};
  /// The largest sum of all parts at one time (not the sum of the parts' peaks).
  std::uint64_t total_peak = 0;

  std::uint64_t now_of(MemoryPart p) const noexcept { return now[static_cast<int>(p)]; }
  std::uint64_t peak_of(MemoryPart p) const noexcept { return peak[static_cast<int>(p)]; }
  std::uint64_t total_now() const noexcept;
};

namespace memory_ledger {

/// Host memory (`device` false) or device memory (true): counted apart.
void charge(MemoryPart p, std::size_t bytes, bool device = false) noexcept;
void release(MemoryPart p, std::size_t bytes, bool device = false) noexcept;
/// The counts of host (or device) memory.
MemoryCounts counts(bool device = false) noexcept;
/// Peaks start again from the bytes in use now.
void reset_peaks() noexcept;

}  // namespace memory_ledger

/// RAII: `bytes` of part `p` charged for the object's life (movable, not copyable).
class MemoryCharge {
 public:
  MemoryCharge() noexcept = default;
  MemoryCharge(MemoryPart p, std::size_t bytes, bool device = false) noexcept;
  ~MemoryCharge();
  MemoryCharge(MemoryCharge&& o) noexcept;
  MemoryCharge& operator=(MemoryCharge&& o) noexcept;
  MemoryCharge(const MemoryCharge&) = delete;
  MemoryCharge& operator=(const MemoryCharge&) = delete;

  std::size_t bytes() const noexcept { return bytes_; }

 private:
  MemoryPart part_ = MemoryPart::other;
  std::size_t bytes_ = 0;
  bool device_ = false;
};

}  // namespace fullshard
