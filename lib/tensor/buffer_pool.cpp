#include "fullshard/tensor/buffer_pool.hpp"
#include "lib/tensor/pool_label.hpp"

#include <algorithm>
#include <map>
#include <mutex>
#include <vector>

namespace fullshard {

struct BufferPool::State {
  MemorySpace space;
  std::string name;
  mutable std::mutex m;
  std::map<std::size_t, std::vector<Tensor>> free;  // by byte size
  std::size_t in_use = 0;
  std::size_t peak = 0;
  std::size_t cached = 0;
};

BufferPool::BufferPool(MemorySpace space, std::string name) : s_(std::make_shared<State>()) {
  s_->space = space;
  s_->name = std::move(name);
}

BufferPool::~BufferPool() = default;  // blocks still in use keep the state alive

Tensor BufferPool::acquire(const Shape& shape, DType dtype, std::string_view label,
                           std::string_view owner) {
  const std::size_t bytes = static_cast<std::size_t>(numel(shape)) * dtype_size(dtype);
  Tensor block;
  {
    std::lock_guard<std::mutex> lock(s_->m);
    auto it = s_->free.find(bytes);
    if (it != s_->free.end() && !it->second.empty()) {
      block = std::move(it->second.back());
      it->second.pop_back();
      s_->cached -= bytes;
    }
  }
  if (!block.data())  // a new block: f32 words covering `bytes`
    block = Tensor::empty({static_cast<std::int64_t>((bytes + 3) / 4)}, DType::f32, s_->space,
                          detail::pool_block_label(s_->name, label, owner), MemoryPart::pool);
  {
    std::lock_guard<std::mutex> lock(s_->m);  // counted once the block exists
    s_->in_use += bytes;
    s_->peak = std::max(s_->peak, s_->in_use);
  }
  // The handle returns the block to the pool when the last user lets go of it.
  auto state = s_;
  auto handle = std::shared_ptr<void>(block.data(), [state, block, bytes](void*) {
    std::lock_guard<std::mutex> lock(state->m);
    state->in_use -= bytes;
    state->cached += bytes;
    state->free[bytes].push_back(block);
  });
  return Tensor::from_owner(std::move(handle), block.data(), shape, dtype, s_->space);
}

Tensor BufferPool::reserve(const Shape& shape, DType dtype) {
  const std::size_t bytes = static_cast<std::size_t>(numel(shape)) * dtype_size(dtype);
  {
    std::lock_guard<std::mutex> lock(s_->m);
    s_->in_use += bytes;
    s_->peak = std::max(s_->peak, s_->in_use);
  }
  auto state = s_;
  auto handle = std::shared_ptr<void>(static_cast<void*>(nullptr), [state, bytes](void*) {
    std::lock_guard<std::mutex> lock(state->m);
    state->in_use -= bytes;
  });
  return Tensor::from_owner(std::move(handle), nullptr, shape, dtype, s_->space);
}

std::size_t BufferPool::bytes_in_use() const {
  std::lock_guard<std::mutex> lock(s_->m);
  return s_->in_use;
}

std::size_t BufferPool::peak_bytes_in_use() const {
  std::lock_guard<std::mutex> lock(s_->m);
  return s_->peak;
}

void BufferPool::reset_peak() {
  std::lock_guard<std::mutex> lock(s_->m);
  s_->peak = s_->in_use;
}

std::size_t BufferPool::bytes_cached() const {
  std::lock_guard<std::mutex> lock(s_->m);
  return s_->cached;
}

void BufferPool::trim() {
  std::map<std::size_t, std::vector<Tensor>> drop;
  {
    std::lock_guard<std::mutex> lock(s_->m);
    drop.swap(s_->free);
    s_->cached = 0;
  }
}

MemorySpace BufferPool::space() const noexcept {
  return s_->space;
}

namespace detail {

std::string pool_block_label(const std::string& pool, std::string_view label,
                             std::string_view owner) {
  std::string out = pool;
  for (std::string_view part : {label, owner})
    if (!part.empty()) out.append(":").append(part);
  return out;
}

}  // namespace detail

}  // namespace fullshard
