// The plan of one training iteration: which collectives and copies run on which stream in
// which order, which pool buffers the engine acquires and releases when, and what that
// costs (predicted step time, peak memory per rank). Computed from the module graph alone:
// deterministic, no communication, identical on every rank. Formats: docs/plan-format.md.
//
// The plan is the FSDP engine (fullshard/fsdp/engine.hpp) run on a planning backend: the
// buffer events are the engine's pool acquisitions and releases, so the executor's measured
// BufferPool peak equals peak_bytes, and its operations are those of a recorded run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "fullshard/base/arena_allocator.hpp"
#include "fullshard/fsdp/operations.hpp"
#include "fullshard/fsdp/options.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/schedule/cost_model.hpp"
#include "fullshard/schedule/groups.hpp"

namespace fullshard::schedule {

/// Backward prefetch policy.
enum class BackwardPrefetch {
  /// FSDP2's default: at a group's pre-backward, issue the all-gather of the group that ran
  /// forward just before it (reverse post-forward order).
  reverse_post_forward,
  /// No backward prefetch (set_modules_to_backward_prefetch({}) on every module).
  none,
};

struct PlanOptions {
  /// Options of every fully_shard call; a request object overrides them key by key.
  fsdp::FullyShardOptions defaults;
  /// 0: implicit prefetch only (a group's all-gather is issued by its own pre-forward, as
  /// FSDP2); d >= 1: the pre-forward of group i also issues groups i+1..i+d (in forward
  /// order), i.e. set_modules_to_forward_prefetch with those d modules.
  int forward_prefetch_depth = 0;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::reverse_post_forward;
  /// set_reduce_scatter_max_input_buffers (>= 1).
  int reduce_scatter_max_input_buffers = 1;
  /// HSDP: false defers the replicate all-reduce (set_requires_all_reduce(false)).
  bool requires_all_reduce = true;
  /// set_reshard_after_backward on every FSDP module: false keeps each group's unsharded
  /// parameters after its post-backward (they are still in the pool at the end).
  bool reshard_after_backward = true;
  /// set_requires_gradient_sync on the roots (recursively): false is a micro-batch of
  /// gradient accumulation (no_sync): no reduce-scatter or all-reduce; each group's unsharded
  /// gradients stay in the pool at the end.
  bool requires_gradient_sync = true;
  /// Groups (names as in Plan::groups: module FQN, "<root>", "a+b" for a list; the plan
  /// resolves them once, Plan::no_unshard_in_backward) on whose module
  /// set_unshard_in_backward(false) is called: no backward all-gather for them (a
  /// group resharded after forward runs its backward without parameters) and they are never
  /// prefetched in backward. An unknown name is an InvalidArgument.
  std::set<std::string> no_unshard_in_backward;
  /// Explicit backward prefetch (set_modules_to_backward_prefetch): group name -> the groups
  /// its pre-backward prefetches, replacing the implicit rule for that group. A target whose
  /// backward already ran is gathered and resharded, unused, at the end of backward. Unknown
  /// names are an InvalidArgument.
  std::map<std::string, std::vector<std::string>> backward_prefetch_targets;
  /// set_is_last_backward on the roots: false skips the root's final wait for the pending
  /// reduce-scatters (more micro-batches follow): their buffers are in use at the end.
  bool is_last_backward = true;
  /// The gradients come from a front end's autograd (fsdp::use_external_gradients, as
  /// fullshard::torch does): no unsharded gradient buffer and no zeroing at pre-backward.
  bool external_gradients = false;
  /// An optimizer inside backward (optim::Optimizer::run_in_backward) with this many state
  /// arrays per parameter (SGD 0 or 1, AdamW 2): each reduction ends with its update of the
  /// group's shards (OpKind::update); -1: the optimizer steps after backward (not planned).
  int optimizer_in_backward_states = -1;
  /// FSDPModule::set_fresh_gradients on the roots (recursively): the backward callbacks
  /// assign each parameter's first gradient (graph::Parameter::grad_fresh), so grad_init
  /// writes nothing (0 bytes). Host meshes.
  bool fresh_gradients = false;
  /// The cost model; unset: CostModel::defaults(mesh).
  std::optional<CostModel> cost;
};

/// The plan speaks the engine's vocabulary (fullshard/fsdp/engine.hpp): the same streams,
/// operation kinds and phases as a recorded run.
using StreamKind = fsdp::engine::StreamKind;
using OpKind = fsdp::engine::OpKind;
using Phase = fsdp::engine::Phase;
using fsdp::engine::op_kind_name;
using fsdp::engine::stream_name;

/// One operation: the engine's description of it (id, the index into Plan::groups or -1 for
/// compute of a module outside every group, stream, kind, phase, variant, k, bytes, the
/// module it belongs to as `source` — in the graph the plan was made from: keep it alive —
/// and the ops it waits for besides the previous op of its stream), and when it runs.
struct Op : fsdp::engine::OpDesc {
  double start_ms = 0.0;
  double end_ms = 0.0;

  /// FQN of the module the op belongs to, "<root>" for the root module.
  std::string_view module() const noexcept {
    return !source || source->fqn().empty() ? std::string_view("<root>")
                                            : std::string_view(source->fqn());
  }
};

/// Bytes read and written in one rank's memory (docs/plan-format.md, "The byte account").
struct ByteCount {
  double read = 0.0;
  double written = 0.0;
  double total() const noexcept { return read + written; }
};

/// What a step must move per rank at least (docs/plan-format.md, "The byte floor"): the
/// backward's gradient writes (F), the optimizer's passes over the sharded parameters and
/// its state, and on more than one rank the all-gathers' writes of the unsharded parameters
/// and the reduce-scatter's reads of the gradients.
struct ByteFloor {
  double gradients = 0.0;
  double optimizer = 0.0;
  double all_gather = 0.0;
  double reduce_scatter = 0.0;
  double total() const noexcept { return gradients + optimizer + all_gather + reduce_scatter; }
};

enum class BufferAction : std::uint8_t { alloc, free };

/// One acquisition from / release to the buffer pool, in the engine's order (the bytes in use
/// after each are the running sum of these; the pool is that of the group's root group).
struct BufferEvent {
  /// The op at which the engine does it (the op being issued or just issued).
  int op = 0;
  /// Index into Plan::groups.
  int group = 0;
  fsdp::engine::BufKind kind = fsdp::engine::BufKind::ag_buffer;
  BufferAction action = BufferAction::alloc;
  std::size_t bytes = 0;

  /// The pool bytes in use after this event, `before` it.
  std::size_t in_use_after(std::size_t before) const noexcept {
    return action == BufferAction::alloc ? before + bytes : before - bytes;
  }
};

/// A plan refers to the graph it was made from (groups[i].modules): keep the graph alive.
/// Scheduler::plan puts its groups, operations and events in one arena (ArenaAllocator);
/// a copy of a plan lives on the heap.
class Plan {
 public:
  MeshShape mesh;
  PlanOptions options;  // options.cost is set (resolved)
  PlannedGroups groups;
  /// Per group: the groups its pre-forward prefetches (the forward_prefetch_depth targets).
  std::vector<std::vector<int>> forward_prefetch;
  /// options.no_unshard_in_backward resolved: the indices of the groups whose modules get
  /// set_unshard_in_backward(false), ascending.
  std::vector<int> no_unshard_in_backward;
  /// options.backward_prefetch_targets resolved: per named group (ascending index), the
  /// groups its pre-backward prefetches (set_modules_to_backward_prefetch).
  std::vector<std::pair<int, std::vector<int>>> backward_prefetch_targets;
  /// Group indices in forward order (order of their first pre-forward).
  std::vector<int> forward_order;
  /// Every op in issue (program) order; ids are indices.
  std::vector<Op, ArenaAllocator<Op>> ops;
  std::vector<BufferEvent, ArenaAllocator<BufferEvent>> events;

  /// Predicted time of the iteration: the latest op end.
  double step_ms = 0.0;
  /// Peak bytes in use of the buffer pool(s) per rank, over the iteration and per phase.
  std::size_t peak_bytes = 0;
  std::size_t forward_peak_bytes = 0;
  std::size_t backward_peak_bytes = 0;
  /// Per pool (index: the root group's position among roots, see pool_roots).
  std::vector<std::size_t> pool_peak_bytes;
  std::vector<int> pool_roots;
  /// Bytes in use when the iteration ends: HSDP's deferred partial reductions, and what
  /// reshard_after_backward / requires_gradient_sync / is_last_backward = false keep.
  std::size_t end_bytes = 0;
  /// Persistent, outside the pool: sharded parameters and sharded gradients per rank.
  std::size_t sharded_bytes = 0;
  std::size_t grad_bytes = 0;

  /// The bytes `op` reads and writes in this rank's memory: its copies, the buffers of its
  /// collective on this rank (received bytes as written; the shared-memory transport's
  /// reads of its peers' buffers as read), the optimizer's update; compute counts 0 (its
  /// traffic is in its time).
  ByteCount bytes_moved(const Op& op) const;
  /// The same summed over the step.
  ByteCount bytes_moved() const;
  /// The step's floor with an optimizer of `optimizer_passes` passes over the sharded
  /// parameters (SGD 3, with momentum 5, AdamW 7; the plan's own optimizer inside backward
  /// when < 0, else 0).
  ByteFloor byte_floor(int optimizer_passes = -1) const;

  /// The ops of one stream, in order.
  std::vector<const Op*> stream_ops(StreamKind s) const;
  /// The ops of one kind (optionally of one group), in issue order.
  std::vector<const Op*> find(OpKind k, int group = -2) const;
  /// Index of the group named `name` (module FQN or "<root>"), or -1.
  int group_index(const std::string& name) const noexcept;
  /// "AG(layers.0)", "AG(m2)/2", "fwd(layers.0)", "RS(<root>)", "accumulate(m2)", ...
  std::string label(const Op& op) const;
  /// "ag_buffer[m2]", "unsharded[m2]", "post_forward[m2]", "grads[m2]", "rs_input[m2]",
  /// "rs_output[m2]", "partial_reduce[m2]".
  std::string buffer_name(const BufferEvent& e) const;

  /// Groups, then the schedule per stream, the buffer events, step time and peak memory.
  std::string to_text() const;
  /// Chrome / Perfetto trace-event JSON: one thread per stream, "X" events (ts, dur in us)
  /// with args bytes/group/module/op/deps, "C" counter events of the pool bytes in use; the
  /// JSON text, on one line.
  std::string to_chrome_trace() const;
  /// 64-bit FNV-1a over to_text(), for a cross-rank equality check.
  std::uint64_t fingerprint() const;
};

class Scheduler {
 public:
  /// Plans one training iteration (forward then backward over the whole graph) of `root`
  /// on `mesh`. InvalidArgument for a bad mesh or option, plus the errors of plan_groups.
  static Plan plan(const graph::Module& root, MeshShape mesh, const PlanOptions& options = {});
  /// plan() into `out`, reusing the memory of the plan `out` held when nothing else shares it
  /// (its pages are resident: a search that plans many candidates pays the kernel's page
  /// zeroing once). On an error `out` is left empty.
  static void replan(Plan& out, const graph::Module& root, MeshShape mesh,
                     const PlanOptions& options = {});
};

/// 64-bit FNV-1a.
std::uint64_t fnv1a64(const std::string& s) noexcept;

}  // namespace fullshard::schedule
