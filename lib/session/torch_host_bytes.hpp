// LibTorch's host memory, counted: a wrapper around LibTorch's CPU allocator that keeps the
// bytes it holds now and their peak since a reset, so that the training session can measure
// what a LibTorch step allocates (its activations and scratch) and put it in the memory
// account (docs/memory.md); with them the process's anonymous memory at the step's peak (its
// excess over the account's parts is the account's untracked: the heap glibc keeps from freed
// tensors, LibTorch's and the BLAS's own buffers). Installed once per process, at the first
// LibTorch session, at c10's default priority: an allocator the program installed with a
// higher priority stays, and then nothing is counted. Private to lib/session.
#pragma once

#include <cstdint>

namespace fullshard::session {

class TorchHostBytes {
 public:
  /// The process's counter, installed on the first call; nullptr when LibTorch's CPU allocator
  /// was then another's (installed with a higher priority) and could not be wrapped.
  static TorchHostBytes* get();

  /// Bytes LibTorch's CPU allocations hold now (those made since the counter was installed).
  virtual std::int64_t now() const noexcept = 0;
  /// The largest now() since the last reset_peak().
  virtual std::int64_t peak() const noexcept = 0;
  virtual void reset_peak() noexcept = 0;

  /// The largest anonymous resident memory of the process (RssAnon) since reset_peak():
  /// sampled there, at the allocation or release after now() reached a new peak 1/64 (at
  /// least 1 MiB) above the last sample (the new tensor's pages written by then), and at
  /// sample().
  virtual std::int64_t anonymous_peak() const noexcept = 0;
  virtual void sample() = 0;

 protected:
  ~TorchHostBytes() = default;
};

}  // namespace fullshard::session
