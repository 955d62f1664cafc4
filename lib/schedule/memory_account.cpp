// The memory account a plan predicts (docs/memory.md): the persistent parts from the groups'
// sizes, the pool and the shared-memory gradient windows by replaying the plan's buffer events
// with the rules of BufferPool and of the shared-memory transport's window sharing.
#include "fullshard/schedule/memory_account.hpp"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "fullshard/transport/fusions.hpp"

namespace fullshard::schedule {
namespace {

// BufferPool: a block is f32 words covering the bytes asked for, reused only by a request of
// the same byte size; blocks stay cached. Per pool (root group) and size: blocks in use now and
// blocks made.
class PoolReplay {
 public:
  void on(const Plan& plan, const BufferEvent& e) {
    const int pool = plan.groups[static_cast<std::size_t>(e.group)].root_group;
    Count& c = sizes_[{pool, e.bytes}];
    if (e.action == BufferAction::alloc) {
      ++c.in_use;
      c.made = std::max(c.made, c.in_use);
    } else if (c.in_use > 0) {
      --c.in_use;
    }
  }
  std::size_t resident() const {
    std::size_t sum = 0;
    for (const auto& [key, c] : sizes_)
      sum += (key.second + 3) / 4 * 4 * c.made;
    return sum;
  }

 private:
  struct Count {
    std::size_t in_use = 0, made = 0;
  };
  std::map<std::pair<int, std::size_t>, Count> sizes_;
};

// The gradient windows of one node's shared memory, shared by every group (GradWindows in
// lib/transport/shm_transport.cpp): a group takes one at its first gradient write and gives
// it back when its reduce-scatter is issued; the free window of sufficient size given back
// first is taken, and a new one is made while fewer than two such are free.
class GradWindowReplay {
 public:
  void take(int group, std::size_t bytes) {
    if (held_.count(group)) return;  // gradients kept since the last reduction
    Window* first = nullptr;
    int fitting = 0;
    for (Window& w : windows_) {
      if (w.busy || w.bytes < bytes) continue;
      ++fitting;
      if (!first || w.released < first->released) first = &w;
    }
    if (fitting < 2) {
      windows_.push_back(Window{bytes});
      first = &windows_.back();
    }
    first->busy = true;
    held_[group] = first;
  }
  void give_back(int group) {
    const auto it = held_.find(group);
    if (it == held_.end()) return;
    it->second->busy = false;
    it->second->released = ++clock_;
    held_.erase(it);
  }
  std::size_t bytes() const {
    std::size_t sum = 0;
    for (const Window& w : windows_)
      sum += w.bytes;
    return sum;
  }
  std::size_t count() const noexcept { return windows_.size(); }

 private:
  struct Window {
    std::size_t bytes = 0;
    bool busy = false;
    std::uint64_t released = 0;
  };
  std::deque<Window> windows_;
  std::map<int, Window*> held_;
  std::uint64_t clock_ = 0;
};

std::string line(const char* name, std::size_t bytes) {
  return std::string(name) + " " + format_bytes(bytes) + "\n";
}

}  // namespace

MemoryAccount plan_memory(const Plan& plan, const MemoryInputs& in) {
  MemoryAccount a;
  a.baseline = in.baseline;
  a.activations = in.activations;
  a.shards = plan.sharded_bytes;
  a.gradients = plan.grad_bytes;
  // Inside backward the optimizer keeps each group's state in its padded slot layout; after
  // backward, per parameter over the rank's rows (torch.chunk on dim 0).
  const auto states = static_cast<std::size_t>(std::max(0, in.optimizer_states));
  const bool grouped = plan.options.optimizer_in_backward_states >= 0;
  for (const PlannedGroup& g : plan.groups) {
    if (grouped) {
      a.optimizer_state += states * static_cast<std::size_t>(g.layout.shard_numel) * sizeof(float);
      continue;
    }
    const std::int64_t W = g.shard_size(), r = std::min<std::int64_t>(in.rank, W - 1);
    for (const graph::Parameter* p : g.params) {
      const Shape& s = p->shape();
      const std::int64_t d0 = s.empty() ? 1 : s[0], row = d0 > 0 ? numel(s) / d0 : 0;
      const std::int64_t chunk = (d0 + W - 1) / W;
      const std::int64_t rows =
          std::max<std::int64_t>(0, std::min(d0, (r + 1) * chunk) - r * chunk);
      a.optimizer_state += states * static_cast<std::size_t>(rows * row) * sizeof(float);
    }
  }

  // The pool over one iteration (from the sharded state, as the plan's events are). On
  // shared memory (a group whose transport is not MPI: compressed groups are) the unsharded
  // gradients are the transport's windows (below); the engine buffers its transport never
  // touches (transport::Fusions, as the running backend reads them) are only counted in the
  // pool (Device::reserve).
  const bool shm = in.shared_memory && plan.mesh.shard_size > 1;
  const std::size_t nodes = static_cast<std::size_t>(std::max(1, in.nodes));
  const transport::Kind mesh_kind = nodes > 1 ? transport::Kind::two_level : transport::Kind::shm;
  std::vector<char> on_shm(plan.groups.size(), 0);
  std::vector<transport::Fusions> fused(plan.groups.size());
  for (std::size_t i = 0; i < plan.groups.size() && shm; ++i) {
    const PlannedGroup& g = plan.groups[i];
    const transport::Geometry geo = g.geometry(plan.mesh.replicate_size);
    const transport::Kind k = transport::group_kind(mesh_kind, geo);
    on_shm[i] = g.shard_size() > 1 && k != transport::Kind::mpi;
    fused[i] = transport::fusions(k, geo);
  }
  const auto counted_only = [&](const BufferEvent& e) {
    using fsdp::engine::BufKind;
    const auto gi = static_cast<std::size_t>(e.group);
    const transport::Fusions& f = fused[gi];
    switch (e.kind) {
      case BufKind::grads:
        return on_shm[gi] != 0;
      case BufKind::ag_buffer:  // a gather from the post-forward slices reads the buffer
        return f.gather_buffer_unused && plan.ops[static_cast<std::size_t>(e.op)].k <= 1;
      case BufKind::rs_input:
        return f.reduce_input_unused;
      case BufKind::rs_output:
        return f.reduce_output_unused;
      default:
        return false;
    }
  };
  PoolReplay pool;
  // An alloc's decision holds for its release (per group and kind: one buffer of a kind in
  // flight per group at a time).
  std::map<std::pair<int, int>, int> skipped;
  for (const BufferEvent& e : plan.events) {
    int& n = skipped[{e.group, static_cast<int>(e.kind)}];
    if (e.action == BufferAction::alloc) {
      if (counted_only(e)) {
        ++n;
        continue;
      }
    } else if (n > 0) {
      --n;
      continue;
    }
    pool.on(plan, e);
  }
  a.pool = pool.resident();

  if (shm) {
    // All-gather windows: on one node without a cast a group's window is its shards (counted
    // above); with a cast or on two levels one is taken per gather, at its copy-in or
    // all-gather, and given back at its copy-out (the node's windows shared by the groups).
    std::vector<char> pooled(plan.groups.size(), 0);
    for (std::size_t gi = 0; gi < plan.groups.size(); ++gi) {
      const PlannedGroup& g = plan.groups[gi];
      pooled[gi] = on_shm[gi] && (nodes > 1 || g.param_dtype != g.orig_dtype);
    }
    const auto gather_bytes = [&](const PlannedGroup& g) {
      return nodes * static_cast<std::size_t>(g.layout.shard_numel) * dtype_size(g.param_dtype);
    };
    const auto grad_bytes = [](const PlannedGroup& g) {
      return static_cast<std::size_t>(g.layout.arena_numel) * dtype_size(g.param_dtype);
    };
    // Gradient windows: taken where the engine acquires a group's unsharded gradients (a
    // front end's own gradients, external_gradients: copied in just before the reduce-scatter),
    // given back at its reduce-scatter; iterations replayed until no window is added.
    std::vector<std::vector<const BufferEvent*>> at(plan.ops.size());
    for (const BufferEvent& e : plan.events)
      if (e.kind == fsdp::engine::BufKind::grads && e.action == BufferAction::alloc &&
          on_shm[static_cast<std::size_t>(e.group)])
        at[static_cast<std::size_t>(e.op)].push_back(&e);
    GradWindowReplay grads, gathers;
    std::size_t before = static_cast<std::size_t>(-1);
    for (int round = 0; round < 8 && grads.count() + gathers.count() != before; ++round) {
      before = grads.count() + gathers.count();
      for (std::size_t i = 0; i < plan.ops.size(); ++i) {
        const Op& o = plan.ops[i];
        const auto og = static_cast<std::size_t>(o.group);
        if (o.group >= 0 && og < pooled.size() && pooled[og]) {
          const bool gather_copy_in =
              o.kind == OpKind::copy_in && o.stream == StreamKind::all_gather;
          // (A post-forward gather from the kept slices, k > 1, takes none.)
          if (gather_copy_in || (o.kind == OpKind::all_gather && o.k <= 1))
            gathers.take(o.group, gather_bytes(plan.groups[og]));
          else if (o.kind == OpKind::copy_out)
            gathers.give_back(o.group);
        }
        for (const BufferEvent* e : at[i])
          grads.take(e->group, grad_bytes(plan.groups[static_cast<std::size_t>(e->group)]));
        if (o.kind != OpKind::reduce_scatter) continue;
        if (plan.options.external_gradients && on_shm[og])
          grads.take(o.group, grad_bytes(plan.groups[og]));
        grads.give_back(o.group);
      }
    }
    a.windows += grads.bytes() + gathers.bytes();
  }
  return a;
}

MemoryAccount measured_memory(const MemoryCounts& c, Counted which) {
  const auto of = [&](MemoryPart p) {
    return static_cast<std::size_t>(which == Counted::peak ? c.peak_of(p) : c.now_of(p));
  };
  MemoryAccount a;
  a.shards = of(MemoryPart::shards);
  a.gradients = of(MemoryPart::gradients);
  a.optimizer_state = of(MemoryPart::optimizer_state);
  a.pool = of(MemoryPart::pool);
  a.windows = of(MemoryPart::windows);
  return a;
}

std::string MemoryAccount::to_text() const {
  return line("baseline", baseline) + line("shards", shards) + line("gradients", gradients) +
         line("optimizer state", optimizer_state) + line("pool", pool) + line("windows", windows) +
         line("activations", activations) + line("untracked", untracked) +
         line("process peak", process_peak());
}

}  // namespace fullshard::schedule
