#include "lib/tensor/stream_pool.hpp"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/tensor/buffer_pool.hpp"
#include "lib/base/abort.hpp"
#include "lib/base/message_of.hpp"
#include "lib/tensor/pool_label.hpp"

namespace fullshard {
namespace {

struct Block {
  Tensor storage;
  std::size_t bytes = 0;
  std::vector<comm::Stream> users;  // while handed out: streams it is used on
  // While cached: one event per stream it was used on, recorded at release.
  std::vector<std::pair<std::uint64_t, comm::StreamEvent>> released;
};

}  // namespace

struct StreamOrderedPool::State {
  MemorySpace space;
  std::string name;
  mutable std::mutex m;
  std::map<std::size_t, std::vector<std::shared_ptr<Block>>> free;  // by byte size
  std::unordered_map<const void*, std::shared_ptr<Block>> live;     // by base address
  Stats stats;
  // A release that could not record its events (a CUDA error in the tensor's deleter, which
  // must not throw): the first such failure, re-thrown by the next acquire(), and how many
  // there were. The blocks they released are never reused (another stream may still use
  // them): kept in `quarantined` until the pool's state goes.
  std::string release_error;
  std::uint64_t release_errors = 0;
  std::vector<std::shared_ptr<Block>> quarantined;

  ~State() {
    if (release_error.empty()) return;
    // Never re-thrown (no acquire followed): reported, so it is not lost.
    const int rank = detail::world_rank_or_minus_one();
    std::fprintf(stderr, "fullshard[rank %s]: %s (not re-thrown: no acquire followed)\n",
                 rank < 0 ? "-" : std::to_string(rank).c_str(), release_error.c_str());
  }

  // The tensor deleter: never throws (a throwing deleter is std::terminate).
  void release(const std::shared_ptr<Block>& b) noexcept {
    try {
      std::vector<comm::Stream> users;
      {
        std::lock_guard<std::mutex> lock(m);
        users.swap(b->users);
      }
      // Record outside the lock: a worker stream's record() enqueues a task.
      std::vector<std::pair<std::uint64_t, comm::StreamEvent>> events;
      events.reserve(users.size());
      std::string failure;
      for (auto& s : users) {
        try {
          events.emplace_back(s.id(), s.record());
        } catch (const std::exception& e) {
          if (failure.empty())
            failure = "pool '" + name + "': releasing a block of " + std::to_string(b->bytes) +
                      " bytes could not record its release event on stream '" + s.name() +
                      "' (the block is not reused): " + detail::message_of(e);
        }
      }
      std::lock_guard<std::mutex> lock(m);
      live.erase(b->storage.data());
      stats.bytes_in_use -= b->bytes;
      if (!failure.empty()) {
        if (release_error.empty()) release_error = std::move(failure);
        ++release_errors;
        quarantined.push_back(b);
        return;
      }
      b->released = std::move(events);
      stats.bytes_cached += b->bytes;
      free[b->bytes].push_back(b);
    } catch (...) {  // out of host memory: the block is dropped, the failure reported here
      std::fputs("fullshard: StreamOrderedPool: a block could not be returned to its pool\n",
                 stderr);
    }
  }

  // acquire(): a release failure is the caller's error now (once).
  void rethrow_release_error_locked() {
    if (release_error.empty()) return;
    std::string m = std::move(release_error);
    release_error.clear();
    if (release_errors > 1)
      m += " (and " + std::to_string(release_errors - 1) + " more release failures)";
    release_errors = 0;
    throw CommError(m);
  }
};

StreamOrderedPool::StreamOrderedPool(MemorySpace space, std::string name)
    : s_(std::make_shared<State>()) {
  s_->space = space;
  s_->name = std::move(name);
}

StreamOrderedPool::~StreamOrderedPool() = default;  // blocks in use keep the state alive

Tensor StreamOrderedPool::acquire(const Shape& shape, DType dtype, comm::Stream& stream,
                                  std::string_view label, std::string_view owner) {
  const std::int64_t n = numel(shape);
  if (n < 0)
    throw InvalidArgument("pool '" + s_->name + "': negative shape " + shape_string(shape));
  const std::size_t bytes = static_cast<std::size_t>(n) * dtype_size(dtype);
  if (bytes == 0) return Tensor::empty(shape, dtype, s_->space);  // nothing to pool
  const std::uint64_t sid = stream.id();
  std::shared_ptr<Block> block;
  std::vector<comm::StreamEvent> waits;
  {
    std::lock_guard<std::mutex> lock(s_->m);
    s_->rethrow_release_error_locked();
    auto it = s_->free.find(bytes);
    if (it != s_->free.end() && !it->second.empty()) {
      auto& list = it->second;
      // Prefer a block that needs no wait: last used on this stream only, or whose other
      // streams are past their release events.
      auto needs_wait = [&](const std::shared_ptr<Block>& b) {
        for (const auto& [id, e] : b->released)
          if (id != sid && !e.query()) return true;
        return false;
      };
      auto pick = std::find_if(list.rbegin(), list.rend(),
                               [&](const std::shared_ptr<Block>& b) { return !needs_wait(b); });
      const auto idx = pick != list.rend()
                           ? static_cast<std::size_t>(std::distance(pick, list.rend()) - 1)
                           : list.size() - 1;
      block = list[idx];
      list.erase(list.begin() + static_cast<std::ptrdiff_t>(idx));
      for (const auto& [id, e] : block->released)
        if (id != sid && !e.query()) waits.push_back(e);
      block->released.clear();
      s_->stats.bytes_cached -= bytes;
      ++s_->stats.reuses;
    }
  }
  const bool fresh = !block;
  if (fresh) {  // a new block: f32 words covering `bytes`
    block = std::make_shared<Block>();
    block->bytes = bytes;
    block->storage =
        Tensor::empty({static_cast<std::int64_t>((bytes + 3) / 4)}, DType::f32, s_->space,
                      detail::pool_block_label(s_->name, label, owner), MemoryPart::pool);
  }
  // Order this stream after the block's previous users on other streams.
  for (const auto& e : waits)
    stream.wait(e);
  {
    std::lock_guard<std::mutex> lock(s_->m);
    s_->stats.stream_waits += waits.size();
    if (fresh) ++s_->stats.allocations;
    block->users.assign(1, stream);
    s_->live[block->storage.data()] = block;
    s_->stats.bytes_in_use += bytes;
    s_->stats.peak_bytes_in_use = std::max(s_->stats.peak_bytes_in_use, s_->stats.bytes_in_use);
  }
  auto state = s_;
  auto handle = std::shared_ptr<void>(block->storage.data(),
                                      [state, block](void*) { state->release(block); });
  return Tensor::from_owner(std::move(handle), block->storage.data(), shape, dtype, s_->space);
}

void StreamOrderedPool::used_on(const Tensor& t, comm::Stream& stream) {
  std::lock_guard<std::mutex> lock(s_->m);
  auto it = s_->live.find(t.owner().get());
  if (it == s_->live.end())
    throw InvalidArgument("pool '" + s_->name + "': used_on(stream '" + stream.name() +
                          "') for a tensor that is not in use from this pool");
  auto& users = it->second->users;
  for (const auto& s : users)
    if (s.id() == stream.id()) return;
  users.push_back(stream);
}

StreamOrderedPool::Stats StreamOrderedPool::stats() const {
  std::lock_guard<std::mutex> lock(s_->m);
  Stats st = s_->stats;
  st.bytes_reserved = st.bytes_in_use + st.bytes_cached;
  return st;
}

void StreamOrderedPool::reset_peak() {
  std::lock_guard<std::mutex> lock(s_->m);
  s_->stats.peak_bytes_in_use = s_->stats.bytes_in_use;
}

void StreamOrderedPool::trim() {
  std::map<std::size_t, std::vector<std::shared_ptr<Block>>> drop;
  {
    std::lock_guard<std::mutex> lock(s_->m);
    drop.swap(s_->free);
    s_->stats.bytes_cached = 0;
  }
  for (auto& [bytes, list] : drop)
    for (auto& b : list)
      for (auto& [id, e] : b->released)
        e.synchronize();
}

MemorySpace StreamOrderedPool::space() const noexcept {
  return s_->space;
}

const std::string& StreamOrderedPool::name() const noexcept {
  return s_->name;
}

}  // namespace fullshard
