// The FSDP state machine (FSDP2's FSDPParamGroup and its hooks), written once for every
// backend: StateMachine<B> calls backend B's methods directly. engine.cpp instantiates it with
// the abstract Backend (virtual calls: the running backend); the planner with its final
// planning backend, so that planning a 100,000-module graph makes no virtual call per
// operation and inlines the costing and recording. Buffers are acquired and released at fixed
// points, so the planning backend's pool accounting is the running backend's, byte for byte.
//
// For engine.cpp and the planner only: everything else calls the functions of engine.hpp.
#pragma once

#include <algorithm>
#include <exception>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "lib/fsdp/engine.hpp"

namespace fullshard::fsdp::engine::detail {

#if defined(__GNUC__) || defined(__clang__)
#define FULLSHARD_ENGINE_INLINE [[gnu::always_inline]] inline
#else
#define FULLSHARD_ENGINE_INLINE inline
#endif

template <class B>
struct StateMachine {
  // The traversal asks the cache for the module this many children ahead (a large graph's
  // modules are not in cache when the walk reaches them).
  static constexpr std::size_t kPrefetchAhead = 2;

  // ---- groups ------------------------------------------------------------------------------

  static B& be(const Group& g) { return static_cast<B&>(*g.root->backend); }
  static B& be(const Root& r) { return static_cast<B&>(*r.backend); }

  // Starts an operation in the backend's record (Backend::op_record). Always inlined: about
  // thirty call sites, each a few stores on the planner's path, where GCC's unit-growth limit
  // would otherwise decide by the size of the whole file.
  FULLSHARD_ENGINE_INLINE static OpDesc& begin(B& b, StreamKind s, OpKind k, int group,
                                               const graph::Module* source, std::size_t bytes) {
    return b.begin(b.op_record(), s, k, group, source, bytes);
  }
  // Starts an operation of group g.
  FULLSHARD_ENGINE_INLINE static OpDesc& begin(StreamKind s, OpKind k, const Group& g,
                                               std::size_t bytes) {
    return begin(be(g), s, k, g.id, g.info.module, bytes);
  }
  // The event after the last operation issued on `s`.
  static Event record(B& b, StreamKind s) {
    Event e;
    e.op = b.last_op(s);
    b.stream_record(s, e);
    return e;
  }
  // Operations issued on `waiter` from now on run after `e`.
  static void wait(B& b, StreamKind waiter, const Event& e) {
    if (e.op >= 0) b.add_wait(waiter, e.op);
    b.stream_wait(waiter, e);
  }

  static void release(Group& g, Buf& b) {
    if (b.held) be(g).release(g, b);
    b = Buf();
  }

  // A rank's slot of the all-gather: its shard in the parameter dtype, or its packed codes.
  static std::size_t shard_bytes_param(const Group& g) { return g.info.gather_slot_bytes(); }

  // The hook counters and post-forward positions of one iteration.
  static void clear_counters(Group& g) noexcept {
    // Read before writing: the end of backward clears every group, most of them clean.
    if (g.forward_calls | g.forward_done | g.backward_calls | g.backward_done)
      g.forward_calls = g.forward_done = g.backward_calls = g.backward_done = 0;
    if (!g.post_forward_indices.empty()) g.post_forward_indices.clear();
  }

  // The W/k all-gather slots a rank keeps after forward (reshard_after_forward=k).
  static std::size_t slice_numel(const Group& g) {
    return static_cast<std::size_t>(g.info.world / g.reshard_after_forward.value()) *
           static_cast<std::size_t>(g.info.gather_slot_numel());
  }

  static void issue_unshard(Group& g, bool own = false) {
    if (g.state == ShardedState::unsharded || g.gather_in_flight) return;
    if (!g.root)
      throw InvalidArgument("group " + std::string(g.info.name) + ": not initialised (internal)");
    B& b = be(g);
    Root& r = *g.root;
    const GroupInfo& I = g.info;
    const std::size_t shard = shard_bytes_param(g);
    g.gather_in_flight = true;
    if (I.world > 1 || I.cast()) {
      // FSDP2's all_gather_state: an all-gather waits for the last copy-out. In backward a
      // group's own all-gather is issued when autograd reaches it (after the compute before
      // it); a prefetch only after forward's compute.
      wait(b, StreamKind::all_gather, r.last_copy_out);
      if (b.phase == Phase::backward)
        wait(b, StreamKind::all_gather, own ? record(b, StreamKind::compute) : b.forward_end);
    }
    if (I.world == 1) {
      if (I.cast()) {
        OpDesc& d = begin(StreamKind::all_gather, OpKind::copy_in, g, shard);
        g.gather = b.acquire(g, BufKind::ag_buffer, I.shard_numel, I.param_dtype);
        g.gather_done = b.gather_copy_in(d, g, g.gather);
        g.gather_done.op = d.id;
      } else {
        g.gather_done = Event();  // the copy-out reads the shards themselves
      }
      return;
    }
    // W slots: the shards in the parameter dtype, or (compressed) their packed codes.
    const std::int64_t total = static_cast<std::int64_t>(I.world) * I.gather_slot_numel();
    const DType gather_t = I.gather_dtype();
    if (g.state == ShardedState::sharded_post_forward) {
      // Gather inside the k-rank group from the kept slices: W/k slots per rank.
      OpDesc& d = begin(StreamKind::all_gather, OpKind::all_gather, g,
                        slice_numel(g) * dtype_size(gather_t));
      d.k = g.reshard_after_forward.value();
      g.gather = b.acquire(g, BufKind::ag_buffer, total, gather_t);
      g.gather_done = b.all_gather(d, g, g.gather, false, &g.post_forward);
      g.gather_done.op = d.id;
      return;
    }
    bool in_place = false;
    if (I.cast() || I.compressed_gather()) {  // the copy-in casts or encodes into its slot
      OpDesc& d = begin(StreamKind::all_gather, OpKind::copy_in, g, shard);
      g.gather = b.acquire(g, BufKind::ag_buffer, total, gather_t);
      b.gather_copy_in(d, g, g.gather);
      in_place = true;
    }
    OpDesc& d = begin(StreamKind::all_gather, OpKind::all_gather, g, shard);
    if (!in_place) g.gather = b.acquire(g, BufKind::ag_buffer, total, gather_t);
    g.gather_done = b.all_gather(d, g, g.gather, in_place, nullptr);
    g.gather_done.op = d.id;
  }

  // Waits for the all-gather in flight; on error drops its buffer and rethrows.
  static void await_gather(Group& g) {
    try {
      be(g).host_wait(g.gather_done);
    } catch (...) {
      release(g, g.gather);
      g.gather_in_flight = false;
      g.gather_done = Event();
      throw;
    }
  }

  static void wait_unshard(Group& g) {
    if (g.state == ShardedState::unsharded) return;
    issue_unshard(g, true);
    B& b = be(g);
    await_gather(g);
    const GroupInfo& I = g.info;
    if (g.shards_are_params()) {  // the shards are shown as the unsharded parameters
      g.gather_in_flight = false;
      g.gather_done = Event();
      g.state = ShardedState::unsharded;
      b.show_unsharded(g);
      return;
    }
    wait(b, StreamKind::compute, g.gather_done);
    OpDesc& d = begin(StreamKind::compute, OpKind::copy_out, g, I.unsharded_bytes());
    g.arena = b.acquire(g, BufKind::unsharded, I.arena_numel, I.param_dtype);
    const bool keep =
        !g.root->in_backward && g.post_forward_slicing() && g.state == ShardedState::sharded;
    if (keep)
      g.post_forward = b.acquire(g, BufKind::post_forward,
                                 static_cast<std::int64_t>(slice_numel(g)), I.gather_dtype());
    const Buf* src = g.gather.held ? &g.gather : nullptr;
    b.gather_copy_out(d, g, src, g.arena, keep ? &g.post_forward : nullptr);
    release(g, g.gather);
    g.gather_in_flight = false;
    g.gather_done = Event();
    g.state = ShardedState::unsharded;
    g.root->last_copy_out = record(b, StreamKind::compute);
    b.show_unsharded(g);
  }

  static void reshard(Group& g) {
    B& b = be(g);
    if (g.gather_in_flight) wait(b, StreamKind::compute, g.gather_done);
    OpDesc& d = begin(StreamKind::compute, OpKind::reshard, g, 0);
    if (g.gather_in_flight) {
      try {
        await_gather(g);
      } catch (...) {
        g.state = ShardedState::sharded;
        throw;
      }
      release(g, g.gather);
      g.gather_in_flight = false;
      g.gather_done = Event();
    }
    b.reshard(d, g);
    g.state = ShardedState::sharded;
    b.show_sharded(g);
    release(g, g.post_forward);
    release(g, g.arena);
  }

  static void post_forward_reshard(Group& g) {
    const int k = g.reshard_after_forward.value();
    if (k == 1) return;  // keep the unsharded parameters for backward
    if (g.post_forward_slicing() && g.post_forward.held) {
      B& b = be(g);
      OpDesc& d = begin(StreamKind::compute, OpKind::reshard, g, 0);
      d.k = k;
      b.reshard(d, g);
      g.state = ShardedState::sharded_post_forward;
      b.show_sharded(g);
      release(g, g.arena);
      return;
    }
    reshard(g);
  }

  // grad_init writes the gradients' bytes, or nothing when they start fresh.
  static std::size_t grad_init_bytes(const Group& g) {
    return g.fresh_grads ? 0 : g.info.unsharded_bytes();
  }

  // An optimizer inside backward updates the shards before the next forward: the end of
  // backward must wait for the updates, and no unsharded copy of the old values may stay.
  static void check_update_policies(const Group& g) {
    if (g.reduce_grads && !g.root->is_last_backward)
      throw InvalidArgument("group " + std::string(g.info.name) +
                            ": an optimizer inside backward needs set_is_last_backward(true) on "
                            "a backward that reduces (its updates are waited for at the end of "
                            "backward); micro-batches without gradient sync may set it false");
    if (!g.reshard_after_backward && !g.shards_are_params())
      throw InvalidArgument("group " + std::string(g.info.name) +
                            ": an optimizer inside backward needs set_reshard_after_backward(true) "
                            "(the unsharded parameters kept after backward would be the values "
                            "before its update)");
  }

  static void prepare_gradients(Group& g) {
    if (g.external_grads) {  // the front end's autograd allocates them
      g.external_grads_pending = true;
      be(g).show_unsharded_grads(g);
      return;
    }
    if (!g.sharded_grads_live && !g.grads.held && !g.has_sharded_grads && g.grads_are_sharded()) {
      // Backward adds into the sharded gradients (zeroed here): the reduction is a no-op.
      B& b = be(g);
      OpDesc& d = begin(StreamKind::compute, OpKind::grad_init, g, grad_init_bytes(g));
      Buf none;
      b.grad_init(d, g, none);
      g.sharded_grads_live = true;
    }
    if (!g.grads.held && !g.sharded_grads_live) {
      B& b = be(g);
      OpDesc& d = begin(StreamKind::compute, OpKind::grad_init, g, grad_init_bytes(g));
      g.grads = b.acquire(g, BufKind::grads, g.info.arena_numel, g.info.param_dtype);
      b.grad_init(d, g, g.grads);
    }
    be(g).show_unsharded_grads(g);
  }

  static void wait_reductions(Root& r, std::size_t keep) {
    std::exception_ptr first;
    while (r.pending.size() > keep) {
      Root::Pending p = std::move(r.pending.front());
      r.pending.pop_front();
      try {
        be(r).host_wait(p.done);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
      release(*p.group, p.output);
      release(*p.group, p.input);
    }
    if (first) std::rethrow_exception(first);
  }

  // The host waits for the oldest `n` reductions and returns their buffers (first error
  // re-thrown after all of them), as part of the operation being issued.
  static void finish_oldest(Root& r, std::size_t n) {
    std::exception_ptr first;
    for (std::size_t i = 0; i < n; ++i) {
      try {
        be(r).host_wait(r.pending[i].done);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    for (std::size_t i = 0; i < n; ++i) {
      Root::Pending& p = r.pending.front();
      release(*p.group, p.output);
      release(*p.group, p.input);
      r.pending.pop_front();
    }
    if (first) std::rethrow_exception(first);
  }

  // Copy-in: chunk every gradient along its shard dim into the rank-major input, after the
  // backward compute and at most max_reduce_buffers - 1 older reductions.
  static Buf reduce_copy_in(Group& g) {
    B& b = be(g);
    Root& r = *g.root;
    const auto keep = static_cast<std::size_t>(std::max(r.max_reduce_buffers, 1) - 1);
    const std::size_t waited = r.pending.size() > keep ? r.pending.size() - keep : 0;
    wait(b, StreamKind::reduce_scatter, record(b, StreamKind::compute));
    for (std::size_t i = 0; i < waited; ++i)
      wait(b, StreamKind::reduce_scatter, r.pending[i].done);
    const GroupInfo& I = g.info;
    const std::int64_t n = static_cast<std::int64_t>(I.world) * I.shard_numel;
    OpDesc& d = begin(StreamKind::reduce_scatter, OpKind::copy_in, g,
                      static_cast<std::size_t>(n) * dtype_size(I.reduce_dtype));
    finish_oldest(r, waited);
    Buf input = b.acquire(g, BufKind::rs_input, n, I.reduce_dtype);
    b.reduce_copy_in(d, g, g.grads, input);  // external gradients: g.grads is not held
    if (g.external_grads_kept) b.keep_external_grads(g, false);
    g.external_grads_pending = g.external_grads_kept = false;
    // The parameters' grad() no longer views the unsharded gradients: they go back.
    b.show_sharded_grads(g);
    release(g, g.grads);
    return input;
  }

  // Reduce-scatter over the shard group (one rank: the input is the reduced shard).
  // `with_update`: the reduction it begins runs the optimizer's update in the pass that writes
  // the reduced shard (OpDesc::variant 1: the byte account's, where that pass is this one).
  static Event reduce_scatter(Group& g, Buf& input, Buf& output, const transport::ReduceSpec& spec,
                              bool with_update) {
    B& b = be(g);
    const GroupInfo& I = g.info;
    if (I.world == 1) return record(b, StreamKind::reduce_scatter);
    if (I.compressed_reduce()) {
      // The packed chunks sent and received (and, with HSDP, the sum for the all-reduce), as
      // f32 words: Geometry::compressed_reduce_bytes.
      OpDesc& d = begin(StreamKind::reduce_scatter, OpKind::reduce_scatter, g,
                        static_cast<std::size_t>(I.packed_slot_bytes()));
      output = b.acquire(g, BufKind::rs_output,
                         static_cast<std::int64_t>(I.compressed_reduce_bytes() / 4), DType::f32);
      Event e = b.reduce_scatter(d, g, input, output, spec);
      e.op = d.id;
      return e;
    }
    OpDesc& d = begin(StreamKind::reduce_scatter, OpKind::reduce_scatter, g,
                      static_cast<std::size_t>(I.shard_numel) * dtype_size(I.reduce_dtype));
    d.variant = with_update ? 1 : 0;
    output = b.acquire(g, BufKind::rs_output, I.shard_numel, I.reduce_dtype);
    Event e = b.reduce_scatter(d, g, input, output, spec);
    e.op = d.id;
    return e;
  }

  static std::size_t reduced_bytes(const Group& g) {
    return static_cast<std::size_t>(g.info.shard_numel) * dtype_size(g.info.reduce_dtype);
  }

  static void reduce_gradients(Group& g) {
    // Its backward did not run.
    if (!g.grads.held && !g.external_grads_pending && !g.sharded_grads_live) return;
    if (g.fresh_grads && !g.external_grads) be(g).settle_fresh_grads(g);
    if (!g.reduce_grads) {  // no_sync: the unsharded gradients keep accumulating
      if (g.external_grads_pending) {
        g.external_grads_kept = true;
        g.external_grads_pending = false;
        be(g).keep_external_grads(g, true);
      }
      return;
    }
    if (g.sharded_grads_live) {  // backward wrote the reduced shard itself
      g.sharded_grads_live = false;
      g.has_sharded_grads = true;
      if (g.updates_in_backward()) {  // after the backward that wrote them
        B& b = be(g);
        wait(b, StreamKind::reduce_scatter, record(b, StreamKind::compute));
        Event e = update_shards(g, StreamKind::reduce_scatter, false);
        g.root->pending.push_back({&g, std::move(e), Buf(), Buf()});
        return;
      }
      be(g).show_sharded_grads(g);
      return;
    }
    B& b = be(g);
    Root& r = *g.root;
    const GroupInfo& I = g.info;
    // The copy-out's divisor (FSDP2's gradient divide factor, by default the data-parallel
    // size) and whether it adds into the sharded gradients.
    transport::ReduceSpec spec;
    spec.divisor =
        g.divide_factor > 0 ? g.divide_factor : static_cast<double>(I.world) * I.replicate;
    spec.accumulate = g.has_sharded_grads;
    // The optimizer inside backward runs in the pass that writes the reduced shard, which then
    // stores no gradient (transport::update_in_copy_out). Not with a deferred all-reduce (no
    // copy-out now) or gradients to add to (a separate update reads their sum). Prepared once
    // the stream it runs on follows the compute (the state a first update copies in may have
    // been written there), before the reduce-scatter (it may be the pass); if that fails, the
    // reduction is not issued and its input goes back.
    const bool fused_update = g.updates_in_backward() && transport::update_in_copy_out(I) &&
                              !spec.accumulate && (I.replicate == 1 || g.all_reduce_grads);
    Buf input = reduce_copy_in(g);
    if (fused_update && I.replicate == 1) {
      try {
        spec.update = b.prepare_update(g, StreamKind::reduce_scatter);
      } catch (...) {
        release(g, input);
        throw;
      }
    }
    Buf output;
    Event last = reduce_scatter(g, input, output, spec, fused_update);
    Buf& reduced = output.held ? output : input;
    StreamKind last_stream = StreamKind::reduce_scatter;
    if (I.replicate > 1) {
      if (!g.all_reduce_grads) {
        // Defer the replicate all-reduce: accumulate the reduce-scattered shard.
        OpDesc& d = begin(StreamKind::reduce_scatter, OpKind::reduce_copy_out, g, reduced_bytes(g));
        d.variant = 1;
        const bool first = !g.partial.held;
        if (first) g.partial = b.acquire(g, BufKind::partial_reduce, I.shard_numel, I.reduce_dtype);
        Event e = b.accumulate(d, g, reduced, g.partial, !first);
        e.op = d.id;
        r.pending.push_back({&g, e, std::move(input), std::move(output)});
        return;  // the sharded gradients change only with the all-reduce
      }
      if (g.partial.held) {
        OpDesc& d = begin(StreamKind::reduce_scatter, OpKind::reduce_copy_out, g, reduced_bytes(g));
        d.variant = 2;
        b.accumulate(d, g, g.partial, reduced, true);
        release(g, g.partial);
      }
      wait(b, StreamKind::all_reduce, record(b, StreamKind::reduce_scatter));
      OpDesc& d = begin(StreamKind::all_reduce, OpKind::all_reduce, g, reduced_bytes(g));
      last = b.all_reduce(d, g, reduced);
      last.op = d.id;
      last_stream = StreamKind::all_reduce;
      if (fused_update) {  // run by the copy-out on the all-reduce stream
        try {
          spec.update = b.prepare_update(g, StreamKind::all_reduce);
        } catch (...) {  // the reduction in flight is still waited for; its buffers go back
          r.pending.push_back({&g, last, std::move(input), std::move(output)});
          throw;
        }
      }
    }
    // Copy-out: divide, cast, accumulate into the sharded gradients, after the collectives.
    OpDesc& d = begin(last_stream, OpKind::reduce_copy_out, g,
                      static_cast<std::size_t>(I.shard_numel) * dtype_size(I.orig_dtype));
    if (fused_update) d.variant = 3;
    Event e = b.reduce_copy_out(d, g, reduced, spec);
    e.op = d.id;
    g.has_sharded_grads = true;
    // Pending first: if the update cannot be issued, the reduction is still waited for and
    // its buffers go back.
    r.pending.push_back({&g, std::move(e), std::move(input), std::move(output)});
    if (g.updates_in_backward())
      r.pending.back().done = update_shards(g, last_stream, fused_update);
    else
      b.show_sharded_grads(g);
  }

  // The optimizer's update of the shards from the sharded gradients just written, on `s`
  // (after them); the gradients are consumed: none is shown and the next reduction
  // overwrites their storage (also when the update cannot be issued: the iteration fails).
  // `fused`: the reduction's last pass ran it (OpDesc::variant 1: completes with the
  // reduction, reads no gradient). The shared-memory transport's peers read this rank's shard
  // in their backward copy-out, which precedes their gradients' publication and so this
  // reduction: nobody reads it now.
  static Event update_shards(Group& g, StreamKind s, bool fused) {
    B& b = be(g);
    const std::size_t gradient_read = static_cast<std::size_t>(g.info.shard_numel) * 4;
    OpDesc& d = begin(s, OpKind::update, g, g.update_bytes() - (fused ? gradient_read : 0));
    d.variant = fused ? 1 : 0;
    Event e;
    try {
      e = b.update_shards(d, g);
    } catch (...) {
      g.has_sharded_grads = false;
      b.drop_sharded_grads(g);
      b.show_sharded_grads(g);
      throw;
    }
    e.op = d.id;
    g.has_sharded_grads = false;
    b.drop_sharded_grads(g);
    b.show_sharded_grads(g);
    return e;
  }

  static void discard_iteration(Root& r) {
    try {
      wait_reductions(r, 0);
    } catch (...) {  // the failed iteration's reductions are discarded
    }
    r.post_forward_order.clear();
    r.in_backward = false;
    be(r).phase = Phase::forward;
    for (Group* g : r.groups) {
      if (g->gather_in_flight) {
        try {
          be(r).host_wait(g->gather_done);
        } catch (...) {  // discarded with the iteration
        }
      }
      g->gather_in_flight = false;
      g->gather_done = Event();
      g->state = ShardedState::sharded;
      if (g->external_grads_kept) be(r).keep_external_grads(*g, false);
      g->external_grads_pending = g->external_grads_kept = false;
      if (g->sharded_grads_live) {  // partial sums in gradients that started from zero
        g->sharded_grads_live = false;
        g->has_sharded_grads = false;
        be(r).drop_sharded_grads(*g);
      }
      be(r).show_sharded(*g);
      release(*g, g->gather);
      release(*g, g->arena);
      release(*g, g->grads);
      release(*g, g->post_forward);
      release(*g, g->partial);
      clear_counters(*g);
    }
    r.groups_touched = false;
  }

  static void zero_grad(Group& g) {
    g.has_sharded_grads = false;
    g.sharded_grads_live = false;
    if (!g.root) return;
    B& b = be(g);
    if (g.external_grads_kept) b.keep_external_grads(g, false);
    g.external_grads_pending = g.external_grads_kept = false;
    b.drop_sharded_grads(g);
    b.show_sharded_grads(g);
    release(g, g.grads);
    release(g, g.partial);
  }

  // ---- hooks -------------------------------------------------------------------------------

  static void clear_iteration(Root& r) {
    r.post_forward_order.clear();
    r.in_backward = false;
    if (!r.groups_touched) return;
    for (Group* g : r.groups)
      clear_counters(*g);
    r.groups_touched = false;
  }

  static bool is_root_group(const Group& g) {
    return !g.root->groups.empty() && g.root->groups.front() == &g;
  }

  static void pre_forward(Group& g) {
    Root& r = *g.root;
    if (!r.in_backward && be(r).phase == Phase::backward) be(r).phase = Phase::forward;
    if (r.in_backward) {  // recomputation inside backward: only make sure it is unsharded
      wait_unshard(g);
      return;
    }
    if (is_root_group(g) && g.forward_calls == 0) clear_iteration(r);
    r.groups_touched = true;
    if (g.forward_calls++ == 0) wait_unshard(g);
    for (Group* t : g.forward_prefetch)
      issue_unshard(*t);
  }

  static void post_forward(Group& g) {
    Root& r = *g.root;
    if (r.in_backward) return;
    if (++g.forward_done < g.info.num_modules) return;  // a list: wait for the last module
    g.post_forward_indices.push_back(static_cast<int>(r.post_forward_order.size()));
    r.post_forward_order.push_back(&g);
    g.forward_calls = g.forward_done = 0;
    post_forward_reshard(g);
  }

  static void pre_backward(Group& g) {
    if (g.backward_calls == 0 && g.updates_in_backward()) check_update_policies(g);
    Root& r = *g.root;
    B& b = be(r);
    r.in_backward = true;
    r.groups_touched = true;
    begin_backward(b);
    if (g.backward_calls++ > 0) return;
    if (g.unshard_in_backward) wait_unshard(g);
    prepare_gradients(g);
    if (g.explicit_backward_prefetch) {
      for (Group* t : g.backward_prefetch)
        if (t->unshard_in_backward) issue_unshard(*t);
    } else if (!g.post_forward_indices.empty()) {
      // Reverse post-forward order: prefetch the group that ran forward just before this one.
      const auto i = static_cast<std::size_t>(g.post_forward_indices.back());
      g.post_forward_indices.pop_back();
      if (i > 0) {
        Group* next = r.post_forward_order[i - 1];
        if (next->unshard_in_backward) issue_unshard(*next);
      }
    }
  }

  static void post_backward(Group& g) {
    Root& r = *g.root;
    B& b = be(r);
    if (++g.backward_done >= g.info.num_modules) {
      g.backward_calls = g.backward_done = 0;
      reduce_gradients(g);
      if (g.reshard_after_backward) reshard(g);
    }
    if (!is_root_group(g)) return;
    // End of the iteration's backward. Groups prefetched but never used in backward: finish
    // their gather and reshard. The same pass clears the hook counters (clear_iteration's
    // work: one pass over the groups, not two).
    for (Group* other : r.groups) {
      if (other != &g &&
          ((other->reshard_after_backward && other->state != ShardedState::sharded) ||
           other->gather_in_flight))
        reshard(*other);
      clear_counters(*other);
    }
    r.groups_touched = false;
    if (r.is_last_backward) {  // wait for every reduction
      std::vector<Event> events;
      events.reserve(r.pending.size());
      for (const auto& p : r.pending) {
        events.push_back(p.done);
        wait(b, StreamKind::compute, p.done);
      }
      OpDesc& d = begin(StreamKind::compute, OpKind::wait, g, 0);
      try {
        b.host_wait(d, events);
      } catch (...) {
        finish_oldest(r, r.pending.size());  // errors known; the buffers go back
        throw;
      }
      finish_oldest(r, r.pending.size());
    }  // else the pending reductions keep their buffers (a later cap or root waits)
    clear_iteration(r);
  }

  // ---- traversal ---------------------------------------------------------------------------

  static void begin_backward(B& b) {
    if (b.phase == Phase::backward) return;
    b.phase = Phase::backward;
    b.forward_end = record(b, StreamKind::compute);
  }

  template <class L>
  static void compute(graph::Module& m, const L& lookup, Group* owner, Phase ph) {
    const auto callback = [&m, ph] {
      return ph == Phase::forward ? bool(m.forward_callback()) : bool(m.backward_callback());
    };
    // The declared cost first: planning never reads the callbacks.
    if (!m.cost().declared && !callback()) return;
    B* b = static_cast<B*>(owner ? owner->root->backend : lookup.default_backend());
    if (!b) {  // outside every FSDP root: nothing to order it with
      if (callback()) (ph == Phase::forward ? m.forward_callback() : m.backward_callback())(m);
      return;
    }
    const OpDesc& d =
        begin(*b, StreamKind::compute, ph == Phase::forward ? OpKind::forward : OpKind::backward,
              owner ? owner->id : -1, &m, 0);
    b->compute(d, m, ph);
  }

  template <class L>
  static void forward(graph::Module& m, const L& lookup, Group* owner = nullptr) {
    Group* g = lookup.group_at(m);
    if (g) {
      owner = g;
      pre_forward(*g);
    }
    compute(m, lookup, owner, Phase::forward);
    for (std::size_t i = 0; i < m.num_children(); ++i) {
      m.prefetch_child(i + kPrefetchAhead);
      forward(m.child(i), lookup, owner);
    }
    if (g) post_forward(*g);
  }

  template <class L>
  static void backward(graph::Module& m, const L& lookup, Group* owner = nullptr) {
    Group* g = lookup.group_at(m);
    if (g) {
      owner = g;
      pre_backward(*g);
    }
    for (std::size_t i = m.num_children(); i-- > 0;) {
      if (i >= kPrefetchAhead) m.prefetch_child(i - kPrefetchAhead);
      backward(m.child(i), lookup, owner);
    }
    compute(m, lookup, owner, Phase::backward);
    if (g) post_backward(*g);
  }
};

}  // namespace fullshard::fsdp::engine::detail
