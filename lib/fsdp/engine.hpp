// The FSDP engine: the one state machine behind fully_shard (running) and Scheduler::plan
// (planning). It decides, group by group, when to all-gather, copy out, reshard, prepare and
// reduce gradients, prefetch and wait, exactly as FSDP2 does; every side effect goes through
// a Backend:
//   - the running backend (lib/fsdp) owns the sharded storage, communicators, streams, the
//     buffer pool and the copy kernels of the mesh's device, and calls the user's callbacks;
//   - the planning backend (lib/schedule) costs each operation, simulates the streams and
//     records the Plan.
// The engine also numbers every operation and derives its dependencies from the events it
// records and waits for, so a plan and a recorded run can be compared operation by operation.
// The state machine itself is detail::StateMachine<B> (lib/fsdp/state_machine.hpp); the
// functions below run it on the abstract Backend.
//
// Private to the library: applications use fully_shard.hpp / hooks.hpp, and read a plan's
// operations through fullshard/fsdp/operations.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/comm/stream.hpp"
#include "fullshard/fsdp/operations.hpp"
#include "fullshard/fsdp/options.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/tensor/tensor.hpp"
#include "fullshard/transport/fusions.hpp"

namespace fullshard::fsdp::engine {

/// A buffer from the backend's pool: its kind and size. The running backend keeps the memory
/// (and the last operation using it) in its own slot, so the engine's state stays small: a
/// plan holds every group's state at once.
struct Buf {
  BufKind kind = BufKind::ag_buffer;
  bool held = false;
  int slot = -1;  // the backend's handle of the memory (-1: none)
  std::size_t bytes = 0;
};

/// A point in a stream's order: the engine's number of the last operation before it (-1:
/// none) and, on the running backend, the work to wait for.
struct Event {
  int op = -1;
  comm::Work work;
};

/// Sizes and dtypes of one communication group (identical on every rank but `rank`): its
/// transport's Geometry and what the engine adds.
struct GroupInfo : transport::Geometry {
  const graph::Module* module = nullptr;  // its first module
  int num_modules = 1;
  std::string_view name;  // "layers.0", "<root>", "a+b" (owned by the group's maker)

  std::size_t unsharded_bytes() const noexcept;  // arena_numel * param dtype
};

enum class ShardedState { sharded, sharded_post_forward, unsharded };

class Root;

/// The engine state of one communication group.
class Group {
 public:
  // What the end of backward checks of every group comes first, in one cache line (a plan
  // holds 100,000 groups, and that pass is the only one that reads all of them at once).
  ShardedState state = ShardedState::sharded;
  bool gather_in_flight = false;
  bool reshard_after_backward = true;
  int forward_calls = 0, forward_done = 0, backward_calls = 0, backward_done = 0;
  DepList post_forward_indices;  // positions in the root's post-forward order
  int id = 0;  // index among the groups of its backend (plan group index when planning)
  Root* root = nullptr;
  // The rest of the state (written by the hooks), then what they only read.
  bool has_sharded_grads = false;
  // External gradients (policy below): pre-backward ran, so post-backward reduces what the
  // parameters' grad() shows; a no_sync backward kept them registered on the parameters.
  bool external_grads_pending = false;
  bool external_grads_kept = false;
  // grads_are_sharded: this backward (or no_sync run of backwards) adds into the sharded
  // gradients, which stand for the unsharded ones until its reduction.
  bool sharded_grads_live = false;
  Event gather_done;
  Buf gather, arena, post_forward, grads, partial;

  GroupInfo info;

  // Policies (FSDPModule setters / plan options).
  /// Checked for the shard group (ReshardAfterForward::for_shard_group); automatic until
  /// attach resolves it.
  ReshardAfterForward reshard_after_forward = ReshardAfterForward::automatic();
  bool reduce_grads = true;
  bool all_reduce_grads = true;
  bool unshard_in_backward = true;
  bool explicit_backward_prefetch = false;
  /// A front end's autograd allocates the unsharded gradients and registers them on the
  /// parameters (Parameter::set_grad) before post-backward: no gradient buffer, no zeroing;
  /// the reduce-scatter copy-in reads them where they are (an undefined grad() reads as zeros).
  bool external_grads = false;
  double divide_factor = 0.0;  // 0: the data-parallel size
  /// CPUOffloadPolicy (on a device mesh the shards are in host memory, the unsharded
  /// parameters in the device's; set on any mesh, so that a plan, which knows no device,
  /// takes the same path as the run).
  bool shards_offloaded = false;
  /// FSDPModule::set_fresh_gradients: the gradients the engine owns are not zeroed before
  /// backward (grad_init writes nothing); the callbacks assign the first gradient of each
  /// parameter (Parameter::grad_fresh) and the reduction zeroes those none wrote.
  bool fresh_grads = false;
  /// An optimizer updates the shards inside backward (fsdp/shard_update.hpp), reading this
  /// many state arrays per element (SGD 0 or 1, AdamW 2); -1: none. Each reduction then ends
  /// with the update, and the sharded gradients go.
  std::int8_t update_state_arrays = -1;
  std::vector<Group*> forward_prefetch;
  std::vector<Group*> backward_prefetch;

  bool updates_in_backward() const noexcept { return update_state_arrays >= 0; }
  /// Its backward has begun and holds gradients (a buffer, sharded gradients standing for
  /// it, or a front end's): the gradient policies (external, fresh, an update) stay as set.
  bool backward_begun() const noexcept {
    return grads.held || sharded_grads_live || external_grads_pending;
  }
  /// The update's bytes read and written: parameters read and written, gradients read, each
  /// state array read and written (f32).
  std::size_t update_bytes() const noexcept {
    return static_cast<std::size_t>(info.shard_numel) * 4 *
           static_cast<std::size_t>(3 + 2 * std::max<int>(update_state_arrays, 0));
  }
  bool post_forward_slicing() const noexcept {
    return reshard_after_forward.value() > 1 && reshard_after_forward.value() < info.world;
  }
  /// A shard group of one rank without a cast, its shards where the compute reads: the
  /// sharded storage (one slot, the arena's layout) is the unsharded parameters; no
  /// unsharded buffer, no copy-out.
  bool shards_are_params() const noexcept {
    return info.world == 1 && !info.cast() && info.shard_numel == info.arena_numel &&
           !shards_offloaded;
  }
  /// ... and its reduction would only copy (no replicate all-reduce, no reduce-dtype cast,
  /// a divisor of 1, gradients the engine owns): backward adds into the sharded gradients
  /// themselves; no gradient buffer, copy-in, reduce-scatter or copy-out. Taken when the
  /// sharded gradients start from zero (after zero_grad), so that a failed backward never
  /// touches gradients accumulated before it.
  bool grads_are_sharded() const noexcept {
    return shards_are_params() && !external_grads && info.replicate == 1 &&
           info.reduce_dtype == info.orig_dtype && (divide_factor <= 0 || divide_factor == 1);
  }
};

class Backend;

/// State shared by the groups under one FSDP root (FSDP2's FSDPState of the root): the
/// backend, the post-forward order, the reductions in flight.
class Root {
 public:
  explicit Root(Backend& backend, int pool = 0) : backend(&backend), pool(pool) {}
  Backend* backend;
  int pool;                    // the pool the groups' buffers count against
  std::vector<Group*> groups;  // every group of the subtree, pre-order (root group first)
  std::vector<Group*> post_forward_order;
  bool in_backward = false;
  int max_reduce_buffers = 1;
  bool is_last_backward = true;
  /// Some group's hook counters or post-forward indices may be set (a clean root's groups
  /// need no pass to clear them).
  bool groups_touched = false;
  Event last_copy_out;  // FSDP2's all_gather_state: the next all-gather waits for it

  struct Pending {
    Group* group;
    Event done;
    Buf input, output;
  };
  std::deque<Pending> pending;
};

/// Every side effect of the engine. The engine calls begin() for each operation, then the
/// operation's method; backends execute (running) or cost and record (planning) it.
class Backend {
 public:
  virtual ~Backend() = default;

  // ---- order (the engine's bookkeeping; both backends share it) ----
  /// Where the engine writes the next operation (then numbers it with begin()): the planning
  /// backend's next plan record, the running backend's description of the current operation.
  virtual OpDesc& op_record() = 0;
  /// Numbers `d` on its stream, in the current phase, with the dependencies waited for
  /// (variant and k 0). Valid until the next operation.
  OpDesc& begin(OpDesc& d, StreamKind s, OpKind k, int group, const graph::Module* source,
                std::size_t bytes) {
    const auto si = static_cast<int>(s);
    d.id = next_op_++;
    d.group = group;
    d.stream = s;
    d.kind = k;
    d.phase = phase;
    d.variant = 0;
    d.k = 0;
    d.bytes = bytes;
    d.source = source;
    // The waits recorded for the stream (events of earlier ops), sorted and unique.
    d.deps = std::move(waits_[si]);
    d.deps.sort_unique();
    last_[si] = d.id;
    return d;
  }
  /// The last operation issued on `s` (-1: none).
  int last_op(StreamKind s) const noexcept { return last_[static_cast<int>(s)]; }
  /// The next operation issued on `waiter` waits for operation `op`.
  void add_wait(StreamKind waiter, int op) { waits_[static_cast<int>(waiter)].push_back(op); }
  /// Orders a real stream after an event (worker and device streams).
  virtual void stream_wait(StreamKind /*waiter*/, const Event& /*e*/) {}
  /// Fills in the real completion of the last operation issued on `s`.
  virtual void stream_record(StreamKind /*s*/, Event& /*e*/) {}
  int ops_issued() const noexcept { return next_op_; }
  /// The phase of the operations being issued, and the end of forward's compute (backward
  /// all-gathers start after it).
  Phase phase = Phase::forward;
  Event forward_end;

  // ---- memory ----
  virtual Buf acquire(const Group& g, BufKind kind, std::int64_t numel, DType dtype) = 0;
  /// Returns a buffer to the pool (the engine holds it no longer).
  virtual void release(const Group& g, Buf& b) = 0;

  // ---- operations (each returns its completion) ----
  /// dst (this rank's slot when W > 1) <- cast(sharded storage).
  virtual Event gather_copy_in(const OpDesc& d, Group& g, Buf& dst) = 0;
  /// dst <- all-gather of the shards (from the sharded storage, or in place when the copy-in
  /// filled this rank's slot), or of the post-forward slices over the k-rank group.
  virtual Event all_gather(const OpDesc& d, Group& g, Buf& dst, bool in_place, Buf* slices) = 0;
  /// arena <- unpack `src` (nullptr: the sharded storage itself, W == 1 without a cast);
  /// with `keep`, also keep this rank's k-group slice of `src` for the backward all-gather.
  virtual Event gather_copy_out(const OpDesc& d, Group& g, const Buf* src, Buf& arena,
                                Buf* keep) = 0;
  /// grads <- 0; without a held buffer, the sharded gradients (made when missing) <- 0
  /// (Group::grads_are_sharded).
  virtual Event grad_init(const OpDesc& d, Group& g, Buf& grads) = 0;
  virtual Event reduce_copy_in(const OpDesc& d, Group& g, Buf& grads, Buf& input) = 0;
  /// The reduction's divisor and accumulation (`spec`) are the copy-out's, for a transport
  /// that folds the copy-out into the reduce-scatter (transport::Fusions).
  virtual Event reduce_scatter(const OpDesc& d, Group& g, Buf& input, Buf& output,
                               const transport::ReduceSpec& spec) = 0;
  virtual Event all_reduce(const OpDesc& d, Group& g, Buf& data) = 0;
  /// dst = (accumulate ? dst : 0) + src (HSDP's deferred accumulation and its add-back).
  virtual Event accumulate(const OpDesc& d, Group& g, Buf& src, Buf& dst, bool accumulate) = 0;
  /// sharded grads = (spec.accumulate ? grads : 0) + cast(src / spec.divisor).
  virtual Event reduce_copy_out(const OpDesc& d, Group& g, const Buf& src,
                                const transport::ReduceSpec& spec) = 0;
  /// The optimizer's update of the shards from the sharded gradients the reduction (or, on a
  /// one-rank group, the backward) wrote (Group::update_state_arrays); d.variant 1: the
  /// reduction's last pass ran it (prepare_update), the operation completes with it.
  virtual Event update_shards(const OpDesc& d, Group& g) = 0;
  /// The update a reduction about to be issued runs in the pass that writes the reduced
  /// shard, on stream `s` (transport::ReduceSpec::update; valid while the reduction's
  /// operations are issued). A backend that runs nothing returns nullptr.
  virtual const kernels::ElementUpdate* prepare_update(Group& /*g*/, StreamKind /*s*/) {
    return nullptr;
  }
  virtual Event reshard(const OpDesc& d, Group& g) = 0;
  virtual Event compute(const OpDesc& d, graph::Module& m, Phase phase) = 0;
  /// The host waits for `done` (errors re-thrown after all were waited for).
  virtual void host_wait(const OpDesc& d, const std::vector<Event>& done) = 0;
  /// The host waits for one event (a group's all-gather before its copy-out, with the
  /// running backend's error handling); no operation of its own.
  virtual void host_wait(const Event& e) = 0;
  /// zero_grad: the sharded gradients go.
  virtual void drop_sharded_grads(Group& g) = 0;
  /// Group::fresh_grads, at the end of the group's backward: the gradients no callback wrote
  /// (still fresh) become zeros (host memory, before the reduction reads them).
  virtual void settle_fresh_grads(Group& /*g*/) {}
  /// External gradients: a no_sync backward keeps the ones the parameters show (`keep`) for
  /// the next backward (show_unsharded_grads shows them again), or they go (`!keep`).
  virtual void keep_external_grads(Group& /*g*/, bool /*keep*/) {}

  // ---- what the parameters show (running backend only) ----
  /// data() the shards, grad() the sharded gradients (or none).
  virtual void show_sharded(Group& g) = 0;
  /// data() the unsharded parameters (the shards when Group::shards_are_params).
  virtual void show_unsharded(Group& g) = 0;
  /// grad() the unsharded gradients (the sharded ones while Group::sharded_grads_live).
  virtual void show_unsharded_grads(Group& g) = 0;
  /// grad() the sharded gradients (or none).
  virtual void show_sharded_grads(Group& g) = 0;

 private:
  int next_op_ = 0;
  int last_[kNumStreams] = {-1, -1, -1, -1};
  DepList waits_[kNumStreams];
};

// ---- the state machine -------------------------------------------------------------------

/// Attaches `groups` (pre-order, the root's group first) to `root` and resolves the automatic
/// reshard_after_forward (false for the root group, true for the others).
void attach(Root& root, const std::vector<Group*>& groups);

void issue_unshard(Group& g, bool own = false);
void wait_unshard(Group& g);
void reshard(Group& g);
void post_forward_reshard(Group& g);
void prepare_gradients(Group& g);
void reduce_gradients(Group& g);
/// Waits for the oldest reductions until at most `keep` are in flight; first error re-thrown.
void wait_reductions(Root& root, std::size_t keep);
/// reset_iter_state: drops every unsharded buffer and the iteration's bookkeeping.
void discard_iteration(Root& root);
/// zero_grad of one group: its sharded gradients and unsharded buffers go.
void zero_grad(Group& g);

// Hooks of the module(s) of group `g` (called once per module; a list group acts on the
// first pre-hook and the last post-hook).
void pre_forward(Group& g);
void post_forward(Group& g);
void pre_backward(Group& g);
void post_backward(Group& g);

/// What the traversal needs of a graph: the engine group fully_shard formed at a module
/// (nullptr: none), and the backend of compute outside every group.
class GroupLookup {
 public:
  virtual ~GroupLookup() = default;
  virtual Group* group_at(const graph::Module& m) const = 0;
  /// nullptr: such compute runs the module's callback directly, outside the engine.
  virtual Backend* default_backend() const = 0;
};

/// Starts the backward phase of `b` (the end of forward's compute is recorded); the first
/// pre-backward does it when the driver did not.
void begin_backward(Backend& b);

/// fsdp::forward / fsdp::backward: hooks around each module's compute (Backend::compute of
/// the backend of the group owning the module's parameters), children in order (reverse in
/// backward).
void forward(graph::Module& m, const GroupLookup& lookup, Group* owner = nullptr);
void backward(graph::Module& m, const GroupLookup& lookup, Group* owner = nullptr);

}  // namespace fullshard::fsdp::engine
