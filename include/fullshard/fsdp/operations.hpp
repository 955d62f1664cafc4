// The operations of FSDP's pipeline as the engine issues them (lib/fsdp/engine.hpp) and as a
// Plan records them: their kinds, streams and phases, what pool buffers hold, and one
// operation's description with the operations it waits for. Both the running engine and the
// planner describe every operation this way, so a plan and a recorded run can be compared
// operation by operation (fullshard/schedule/plan.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <vector>

#include "fullshard/comm/stream.hpp"
#include "fullshard/graph/module.hpp"

namespace fullshard::fsdp::engine {

/// The logical streams of one FSDP root: comm::StreamKind.
using comm::kNumStreams;
using comm::stream_name;
using comm::StreamKind;

enum class OpKind : std::uint8_t {
  all_gather,       // the all-gather collective (all_gather stream)
  copy_in,          // all-gather cast copy-in (all_gather stream) / reduce-scatter chunk-cat
                    // copy-in (reduce_scatter stream)
  copy_out,         // all-gather copy-out into the unsharded arena (compute stream)
  forward,          // a module's own forward work (compute)
  backward,         // a module's own backward work (compute)
  reduce_scatter,   // the reduce-scatter collective (reduce_scatter stream)
  all_reduce,       // HSDP replicate all-reduce (all_reduce stream)
  reduce_copy_out,  // divide/cast/accumulate into the sharded gradients, or HSDP's deferred
                    // accumulation and its add-back (stream of the last collective)
  reshard,          // frees unsharded parameters after forward / backward (compute, 0 ms)
  grad_init,        // zeroes the unsharded gradient arena at pre-backward (compute; not with
                    // external gradients), or the sharded gradients that stand for it
                    // (Group::grads_are_sharded); with Group::fresh_grads it only marks the
                    // gradients fresh (0 bytes)
  wait,             // the host waits for pending reductions (compute)
  update,           // the optimizer's update of the shards from the reduced gradients, inside
                    // backward (Group::update_state_arrays; after the copy-out, on its stream)
};
const char* op_kind_name(OpKind k) noexcept;

enum class Phase : std::uint8_t { forward, backward };

/// What a pool buffer holds.
enum class BufKind : std::uint8_t {
  ag_buffer,
  unsharded,
  post_forward,
  grads,
  rs_input,
  rs_output,
  partial_reduce
};
const char* buf_kind_name(BufKind k) noexcept;

/// The operations an operation waits for (sorted, unique): up to three inline, no allocation
/// for the common case (planning a 100,000-module graph makes a million of them), 16 bytes.
class DepList {
 public:
  DepList() noexcept = default;
  DepList(std::initializer_list<int> v) {
    for (int x : v)
      push_back(x);
  }
  DepList(const DepList& o) {
    if (o.n_ <= kInline)
      copy_words(o);
    else
      assign(o.begin(), o.end());
  }
  DepList(DepList&& o) noexcept {
    copy_words(o);
    o.n_ = 0;
  }
  DepList& operator=(const DepList& o) {
    if (this == &o) return *this;
    if (o.n_ <= kInline) {
      release();
      copy_words(o);
    } else {
      DepList t(o);
      swap(t);
    }
    return *this;
  }
  DepList& operator=(DepList&& o) noexcept {
    if (this != &o) {
      release();
      copy_words(o);
      o.n_ = 0;
    }
    return *this;
  }
  ~DepList() { release(); }

  void push_back(int x) {
    if (n_ < kInline) {
      w_[n_++] = x;
      return;
    }
    if (n_ == kInline || n_ == capacity()) grow(n_ == kInline ? 2 * kInline : 2 * n_);
    heap()[n_++] = x;
  }
  void clear() noexcept {
    release();
    n_ = 0;
  }
  std::size_t size() const noexcept { return n_; }
  bool empty() const noexcept { return n_ == 0; }
  const int* begin() const noexcept { return n_ > kInline ? heap() : w_; }
  const int* end() const noexcept { return begin() + n_; }
  int operator[](std::size_t i) const noexcept { return begin()[i]; }
  int back() const noexcept { return begin()[n_ - 1]; }
  void pop_back() noexcept {
    if (n_ == kInline + 1) {  // back to inline
      int* h = heap();
      const std::uint32_t cap = capacity();
      std::copy(h, h + kInline, w_);
      std::allocator<int>().deallocate(h, cap);
    }
    --n_;
  }
  /// Sorts and removes duplicates.
  void sort_unique() {
    if (n_ < 2) return;
    if (n_ == 2) {
      if (w_[0] > w_[1]) std::swap(w_[0], w_[1]);
      if (w_[0] == w_[1]) n_ = 1;
      return;
    }
    int* b = n_ > kInline ? heap() : w_;
    std::sort(b, b + n_);
    const auto n = static_cast<std::uint32_t>(std::unique(b, b + n_) - b);
    if (n_ > kInline && n <= kInline) {  // back to inline
      int t[kInline];
      std::copy(b, b + n, t);
      release();
      std::copy(t, t + n, w_);
    }
    n_ = n;
  }
  std::vector<int> to_vector() const { return {begin(), end()}; }
  bool operator==(const std::vector<int>& v) const {
    return v.size() == n_ && std::equal(v.begin(), v.end(), begin());
  }
  void swap(DepList& o) noexcept {
    DepList t(std::move(o));
    o.copy_words(*this);
    copy_words(t);
    t.n_ = 0;
  }

 private:
  static constexpr std::uint32_t kInline = 3;
  // n_ <= kInline: the values are in w_. Otherwise w_[0..1] hold the heap array's address and
  // w_[2] its capacity.
  int* heap() const noexcept {
    int* p;
    std::memcpy(&p, w_, sizeof p);
    return p;
  }
  std::uint32_t capacity() const noexcept { return static_cast<std::uint32_t>(w_[2]); }
  void set_heap(int* p, std::uint32_t cap) noexcept {
    std::memcpy(w_, &p, sizeof p);
    w_[2] = static_cast<int>(cap);
  }
  void grow(std::uint32_t cap) {
    int* p = std::allocator<int>().allocate(cap);
    std::copy(begin(), end(), p);
    release();
    set_heap(p, cap);
  }
  void release() noexcept {
    if (n_ > kInline) std::allocator<int>().deallocate(heap(), capacity());
  }
  // The representation as is (inline values, or the heap array's address and capacity).
  void copy_words(const DepList& o) noexcept {
    w_[0] = o.w_[0];
    w_[1] = o.w_[1];
    w_[2] = o.w_[2];
    n_ = o.n_;
  }
  void assign(const int* b, const int* e) {
    for (; b != e; ++b)
      push_back(*b);
  }
  static_assert(sizeof(int*) <= 2 * sizeof(int), "DepList keeps a pointer in two ints");
  int w_[3] = {};
  std::uint32_t n_ = 0;
};

/// One operation as the engine issues it: both backends see the same descriptions, so the
/// plan and a recorded run agree by construction on everything but time. The engine writes
/// it where the backend keeps it (Backend::op_record): the planning backend's is the plan's
/// record itself, so nothing is copied.
struct OpDesc {
  int id = 0;
  int group = -1;  // Group::id, -1 for compute outside every group
  StreamKind stream = StreamKind::compute;
  OpKind kind = OpKind::forward;
  Phase phase = Phase::forward;
  // reduce_copy_out: 0 copy-out, 1 deferred accumulate, 2 add-back, 3 copy-out running the
  // optimizer's update; reduce_scatter and update: 1 the update runs in the reduction's pass
  std::uint8_t variant = 0;
  int k = 0;              // post-forward group size of a k-rank all-gather, else 0
  std::size_t bytes = 0;  // per rank for collectives (the shard), written bytes for copies
  const graph::Module* source = nullptr;  // the module the op belongs to
  DepList deps;  // ops that must finish first, besides the stream's previous op
};

}  // namespace fullshard::fsdp::engine
