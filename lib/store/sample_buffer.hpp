// A consumer's sample buffer and its policies, without MPI: a bounded set of slots, each one
// sample's bytes (every field packed) and where it came from, filled by ingest() (or by the
// caller into the slot admit() gives) and read by draw() (the policy's draw) or drain()
// (without replacement, once the stream ended).
//
//   fifo       a bounded queue: draws pop the oldest; a full buffer pushes its oldest out
//   reservoir  Vitter's algorithm R: the i-th sample (from 0) replaces slot j, j uniform in
//              [0, i], when j < capacity; draws uniform with replacement
//   window     the last N samples (a ring); draws uniform with replacement
//
// Random choices come from std::mt19937_64 with an explicit seed and uniform_below (not
// std::uniform_int_distribution, whose results differ between standard libraries), so a
// seed gives the same choices everywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "fullshard/store/sample_store.hpp"

namespace fullshard::store {

/// A uniform integer in [0, n), n >= 1: the generator's values below 2^64 mod n are rejected
/// (so that every residue is equally likely), the first other one is taken modulo n.
std::uint64_t uniform_below(std::mt19937_64& rng, std::uint64_t n);

/// A 64-bit mix of a seed and a stream number (splitmix64): the seed of one consumer.
std::uint64_t stream_seed(std::uint64_t seed, std::uint64_t stream) noexcept;

/// What a buffer is.
struct BufferOptions {
  Policy policy = Policy::reservoir;
  std::int64_t capacity = 1024;  ///< samples held at most (fifo, reservoir), >= 1
  std::int64_t window = 0;       ///< Policy::window: the last N (0: capacity; <= capacity)
  std::size_t sample_bytes = 0;  ///< bytes of one sample, >= 1
  std::uint64_t seed = 0;
};

/// What happened in a buffer.
struct BufferCounts {
  std::int64_t ingested = 0;  ///< ingest() calls
  std::int64_t evicted = 0;   ///< samples replaced (reservoir) or pushed out (fifo, window)
  std::int64_t rejected = 0;  ///< reservoir: samples not kept
  std::int64_t drawn = 0;     ///< samples given by draw() and drain()
  std::int64_t reused = 0;    ///< of those, samples given before
  /// Sum over drawn samples of newest_step - the sample's step.
  double staleness_sum = 0;
  /// The largest step ingested (0 before any).
  std::int64_t newest_step = 0;
};

class SampleBuffer {
 public:
  /// Called with each sample a draw gives: its bytes (sample_bytes) and where it came from.
  /// The bytes are valid during the call only.
  using Sink = std::function<void(const std::byte* sample, const SampleMeta& meta)>;

  /// InvalidArgument on a capacity < 1, a window outside [0, capacity] or no sample bytes.
  explicit SampleBuffer(const BufferOptions& options);

  /// Takes one sample (sample_bytes bytes at `sample`), as the policy says. Not after drain().
  /// admit() and a copy.
  void ingest(const void* sample, const SampleMeta& meta);

  /// Takes one sample as the policy says and returns the slot its sample_bytes bytes go to,
  /// which the caller fills before any other call; nullptr when the policy does not keep it
  /// (reservoir: algorithm R rejected it). For a caller that fills the slot in a pass of its
  /// own (the store copies and measures a sample at once). Not after drain().
  std::byte* admit(const SampleMeta& meta);

  /// The policy's draw of `n` samples: fifo pops min(n, size()) in order; reservoir and window
  /// pick n uniformly with replacement (none when empty). Returns the count given to `sink`.
  std::int64_t draw(std::int64_t n, const Sink& sink);

  /// Once no sample will come any more: gives min(n, size()) samples without replacement and
  /// removes them (fifo: in order; reservoir and window: uniformly). Returns the count. After
  /// the first drain() the buffer takes no more samples.
  std::int64_t drain(std::int64_t n, const Sink& sink);

  /// Samples held now.
  std::int64_t size() const noexcept;
  /// Samples it can hold: capacity, or the window.
  std::int64_t bound() const noexcept { return bound_; }
  bool draining() const noexcept { return draining_; }
  /// Bytes of the slots allocated so far (they grow with the samples held, up to
  /// bound() x sample_bytes; never above it).
  std::size_t bytes() const noexcept;
  const BufferCounts& counts() const noexcept { return counts_; }
  /// staleness_sum / drawn (0 before any draw).
  double mean_staleness() const noexcept;
  const BufferOptions& options() const noexcept { return options_; }

  /// Every sample held (slot order), for checks and tests.
  void visit(const Sink& sink) const;

 private:
  struct Slot {
    SampleMeta meta;
    std::int64_t draws = 0;  // times given by a draw
  };

  std::byte* slot_bytes(std::int64_t slot) noexcept;
  void ensure_slot(std::int64_t slot);
  std::byte* claim(std::int64_t slot, const SampleMeta& meta);
  void give(std::int64_t slot, const Sink& sink);
  void start_drain();

  BufferOptions options_;
  std::int64_t bound_;
  std::mt19937_64 rng_;
  std::unique_ptr<std::byte[]> data_;
  std::int64_t allocated_ = 0;  // slots in data_
  std::vector<Slot> slots_;     // allocated_ entries
  std::int64_t head_ = 0;       // fifo, window: the oldest sample's slot (a ring of bound_)
  std::int64_t held_ = 0;
  bool draining_ = false;
  std::vector<std::int64_t> remaining_;  // while draining: the slots left (fifo: in order)
  std::size_t remaining_front_ = 0;      // fifo drain: the next of remaining_
  BufferCounts counts_;
};

}  // namespace fullshard::store
