#include "lib/store/sample_buffer.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "fullshard/base/error.hpp"

namespace fullshard::store {

std::uint64_t uniform_below(std::mt19937_64& rng, std::uint64_t n) {
  // 2^64 mod n: the values below it are the ones that would make the low residues likelier.
  const std::uint64_t threshold = (std::uint64_t(0) - n) % n;
  for (;;) {
    const std::uint64_t x = rng();
    if (x >= threshold) return x % n;
  }
}

std::uint64_t stream_seed(std::uint64_t seed, std::uint64_t stream) noexcept {
  std::uint64_t z = seed + (stream + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

SampleBuffer::SampleBuffer(const BufferOptions& options)
    : options_(options), bound_(options.capacity), rng_(options.seed) {
  if (options.capacity < 1)
    throw InvalidArgument("sample buffer: capacity " + std::to_string(options.capacity) +
                          ": expected at least 1 sample");
  if (options.policy != Policy::fifo && options.policy != Policy::reservoir &&
      options.policy != Policy::window)
    throw InvalidArgument("sample buffer: unknown policy " +
                          std::to_string(static_cast<int>(options.policy)));
  if (options.window < 0 || options.window > options.capacity)
    throw InvalidArgument("sample buffer: window " + std::to_string(options.window) +
                          ": expected 0 (the capacity) to the capacity " +
                          std::to_string(options.capacity));
  if (options.sample_bytes == 0) throw InvalidArgument("sample buffer: a sample of 0 bytes");
  if (options.policy == Policy::window && options.window > 0) bound_ = options.window;
}

std::byte* SampleBuffer::slot_bytes(std::int64_t slot) noexcept {
  return data_.get() + static_cast<std::size_t>(slot) * options_.sample_bytes;
}

void SampleBuffer::ensure_slot(std::int64_t slot) {
  if (slot < allocated_) return;
  // Doubling, from 16 slots, up to the bound: the memory follows the samples held.
  const std::int64_t grown =
      std::min(bound_, std::max({slot + 1, 2 * allocated_, std::int64_t(16)}));
  // Not value-initialised: pages are touched only when samples are written into them.
  std::unique_ptr<std::byte[]> data(
      new std::byte[static_cast<std::size_t>(grown) * options_.sample_bytes]);
  if (allocated_ > 0)
    std::memcpy(data.get(), data_.get(),
                static_cast<std::size_t>(allocated_) * options_.sample_bytes);
  data_ = std::move(data);
  slots_.resize(static_cast<std::size_t>(grown));
  allocated_ = grown;
}

std::byte* SampleBuffer::claim(std::int64_t slot, const SampleMeta& meta) {
  ensure_slot(slot);
  slots_[static_cast<std::size_t>(slot)] = Slot{meta, 0};
  return slot_bytes(slot);
}

void SampleBuffer::ingest(const void* sample, const SampleMeta& meta) {
  if (std::byte* slot = admit(meta)) std::memcpy(slot, sample, options_.sample_bytes);
}

std::byte* SampleBuffer::admit(const SampleMeta& meta) {
  if (draining_)
    throw Error("sample buffer: a sample ingested after the drain began (internal error)");
  const std::int64_t i = counts_.ingested++;
  counts_.newest_step = i == 0 ? meta.step : std::max(counts_.newest_step, meta.step);
  if (options_.policy == Policy::reservoir) {
    if (i < bound_) {
      std::byte* slot = claim(i, meta);  // first: it may allocate (and throw)
      ++held_;
      return slot;
    }
    const std::uint64_t j = uniform_below(rng_, static_cast<std::uint64_t>(i) + 1);
    if (j < static_cast<std::uint64_t>(bound_)) {
      ++counts_.evicted;
      return claim(static_cast<std::int64_t>(j), meta);
    }
    ++counts_.rejected;
    return nullptr;
  }
  // fifo and window: a ring of bound_ slots from head_.
  if (held_ < bound_) {
    std::byte* slot = claim((head_ + held_) % bound_, meta);
    ++held_;
    return slot;
  }
  const std::int64_t slot = head_;
  head_ = (head_ + 1) % bound_;
  ++counts_.evicted;
  return claim(slot, meta);
}

void SampleBuffer::give(std::int64_t slot, const Sink& sink) {
  Slot& s = slots_[static_cast<std::size_t>(slot)];
  if (s.draws > 0) ++counts_.reused;
  ++s.draws;
  ++counts_.drawn;
  counts_.staleness_sum += static_cast<double>(counts_.newest_step - s.meta.step);
  sink(slot_bytes(slot), s.meta);
}

std::int64_t SampleBuffer::draw(std::int64_t n, const Sink& sink) {
  if (draining_) return drain(n, sink);
  if (n <= 0 || held_ == 0) return 0;
  if (options_.policy == Policy::fifo) {
    const std::int64_t k = std::min(n, held_);
    for (std::int64_t d = 0; d < k; ++d) {
      give(head_, sink);
      head_ = (head_ + 1) % bound_;
      --held_;
    }
    return k;
  }
  // reservoir: slots [0, held_); window: the ring from head_ (all of it once full).
  for (std::int64_t d = 0; d < n; ++d) {
    const auto r =
        static_cast<std::int64_t>(uniform_below(rng_, static_cast<std::uint64_t>(held_)));
    give(options_.policy == Policy::reservoir ? r : (head_ + r) % bound_, sink);
  }
  return n;
}

void SampleBuffer::start_drain() {
  draining_ = true;
  remaining_.clear();
  remaining_front_ = 0;
  for (std::int64_t i = 0; i < held_; ++i)
    remaining_.push_back(options_.policy == Policy::reservoir ? i : (head_ + i) % bound_);
}

std::int64_t SampleBuffer::drain(std::int64_t n, const Sink& sink) {
  if (!draining_) start_drain();
  const std::int64_t k = std::min(std::max<std::int64_t>(n, 0), held_);
  for (std::int64_t d = 0; d < k; ++d) {
    if (options_.policy == Policy::fifo) {
      give(remaining_[remaining_front_++], sink);
    } else {
      const std::size_t j = static_cast<std::size_t>(
          uniform_below(rng_, static_cast<std::uint64_t>(remaining_.size())));
      const std::int64_t slot = remaining_[j];
      remaining_[j] = remaining_.back();
      remaining_.pop_back();
      give(slot, sink);
    }
    --held_;
  }
  return k;
}

std::int64_t SampleBuffer::size() const noexcept {
  return held_;
}

std::size_t SampleBuffer::bytes() const noexcept {
  return static_cast<std::size_t>(allocated_) * options_.sample_bytes;
}

double SampleBuffer::mean_staleness() const noexcept {
  return counts_.drawn > 0 ? counts_.staleness_sum / static_cast<double>(counts_.drawn) : 0.0;
}

void SampleBuffer::visit(const Sink& sink) const {
  auto at = [&](std::int64_t slot) {
    sink(data_.get() + static_cast<std::size_t>(slot) * options_.sample_bytes,
         slots_[static_cast<std::size_t>(slot)].meta);
  };
  if (draining_) {
    const std::size_t first = options_.policy == Policy::fifo ? remaining_front_ : 0;
    for (std::size_t i = first; i < remaining_.size(); ++i)
      at(remaining_[i]);
    return;
  }
  for (std::int64_t i = 0; i < held_; ++i)
    at(options_.policy == Policy::reservoir ? i : (head_ + i) % bound_);
}

}  // namespace fullshard::store
