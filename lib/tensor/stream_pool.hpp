// A stream-ordered caching pool for device (and host) buffers: unsharded parameters and
// communication buffers of the GPU path.
//
// Every block remembers the streams it was used on. When its last reference goes, the pool
// records an event on each of them and caches the block at once (nothing is deferred: the
// block's bytes leave bytes_in_use() at that moment). A later acquire() of the same byte size
// on stream S reuses it; before handing it out, S waits for the release events of the other
// streams that have not completed yet (Stream::wait: cudaStreamWaitEvent on a device stream,
// so the host does not block). Reuse on the stream that used the block last needs no wait
// (stream order). So no block is ever overwritten while another stream may still read it, and
// the pool never allocates while a cached block of the requested size exists: the peak is a
// function of the acquire/release order alone (what the plan predicts), not of device timing
// (record_stream-style deferred frees would make it depend on when events complete).
//
// The release runs in the tensor's deleter, which never throws: when an event cannot be
// recorded there (a CUDA error), the block is kept out of reuse (another stream may still
// use it) and the error is re-thrown, as a CommError naming the pool and the stream, by the
// next acquire() (printed to stderr with the rank if no acquire follows).
//
// The events are comm::StreamEvent of the streams given, so host tests drive the pool with worker
// streams or fake device streams (test/unit/test_stream_pool.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "fullshard/comm/stream.hpp"
#include "fullshard/tensor/tensor.hpp"

namespace fullshard {

class StreamOrderedPool {
 public:
  struct Stats {
    std::size_t bytes_in_use = 0;       ///< handed out and not yet released
    std::size_t peak_bytes_in_use = 0;  ///< since construction or reset_peak()
    std::size_t bytes_cached = 0;       ///< released, kept for reuse
    std::size_t bytes_reserved = 0;     ///< in use + cached (what the pool holds)
    std::uint64_t allocations = 0;      ///< new blocks
    std::uint64_t reuses = 0;           ///< acquires served from the cache
    std::uint64_t stream_waits = 0;     ///< Stream::wait calls made to order a reuse
  };

  /// Blocks in `space` (MemorySpace::device: the default Kokkos execution space's memory).
  explicit StreamOrderedPool(MemorySpace space = MemorySpace::device,
                             std::string name = "stream_pool");
  ~StreamOrderedPool();
  StreamOrderedPool(const StreamOrderedPool&) = delete;
  StreamOrderedPool& operator=(const StreamOrderedPool&) = delete;

  /// A tensor for use on `stream` (contents unspecified); see the file comment for reuse.
  /// The bytes return to the pool when the last copy or view of the tensor is destroyed.
  /// Labels as BufferPool::acquire's. CommError (once) when an earlier release could not
  /// record its event.
  Tensor acquire(const Shape& shape, DType dtype, comm::Stream& stream, std::string_view label = {},
                 std::string_view owner = {});
  /// Declares that `t` (or a view of it) from this pool is also used on `stream`: its
  /// release then records an event there too. InvalidArgument for a tensor of another pool
  /// or one already released.
  void used_on(const Tensor& t, comm::Stream& stream);

  Stats stats() const;
  std::size_t bytes_in_use() const { return stats().bytes_in_use; }
  std::size_t peak_bytes_in_use() const { return stats().peak_bytes_in_use; }
  void reset_peak();
  /// Frees every cached block, after synchronising with its pending release events.
  void trim();
  MemorySpace space() const noexcept;
  const std::string& name() const noexcept;

 private:
  struct State;
  std::shared_ptr<State> s_;
};

}  // namespace fullshard
