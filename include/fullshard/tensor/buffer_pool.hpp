// A caching pool of tensors: a released block is kept and handed out again for the next
// request of the same byte size. Communication and unsharded-parameter buffers come from
// pools because writing into fresh memory was measured 6-17x slower than into reused,
// pre-touched memory, and because the pool's accounting gives the exact memory in use.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "fullshard/tensor/tensor.hpp"

namespace fullshard {

class BufferPool {
 public:
  explicit BufferPool(MemorySpace space = MemorySpace::host, std::string name = "pool");
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  /// A tensor whose bytes come from the pool (contents unspecified). The bytes go back to the
  /// pool when the last copy or view of the tensor is destroyed. A new block is labelled
  /// "<pool>:<label>:<owner>" for Kokkos tools (joined only then: no string per reuse).
  Tensor acquire(const Shape& shape, DType dtype, std::string_view label = {},
                 std::string_view owner = {});

  /// The bytes of a `shape` x `dtype` buffer counted in bytes_in_use() (and the peak) while the
  /// returned tensor (or a copy) lives, without memory: its data() is null. For a buffer whose
  /// memory lies elsewhere but belongs to the pool's account.
  Tensor reserve(const Shape& shape, DType dtype);

  /// Bytes handed out and not yet returned.
  std::size_t bytes_in_use() const;
  /// Largest bytes_in_use() since construction or reset_peak().
  std::size_t peak_bytes_in_use() const;
  void reset_peak();
  /// Bytes held for reuse.
  std::size_t bytes_cached() const;
  /// Frees every cached block.
  void trim();
  MemorySpace space() const noexcept;

 private:
  struct State;
  std::shared_ptr<State> s_;
};

}  // namespace fullshard
