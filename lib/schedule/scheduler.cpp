// Scheduler::plan: replays fsdp::forward(root) and fsdp::backward(root) over the graph with
// the engine's rules (lib/fsdp/hooks.cpp, lib/fsdp/param_group.cpp) on a model of each
// group's state, emitting ops in program order and the pool acquisitions/releases in the
// order the engine makes them; then list-schedules the ops on their streams.
#include <algorithm>
#include <deque>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "fullshard/base/error.hpp"
#include "fullshard/schedule/plan.hpp"

namespace fullshard::schedule {

namespace {

enum class State { sharded, sharded_post_forward, unsharded };

// The engine state of one ParamGroup that decides its buffers.
struct GroupState {
  State state = State::sharded;
  bool gather_in_flight = false;
  int gather_op = -1;            // last op of the in-flight all-gather (-1: none)
  bool gather_pooled = false;    // the gather buffer came from the pool
  bool arena = false;            // unsharded parameters held
  bool post_forward = false;     // reshard_after_forward=k slice held
  bool grad_arena = false;       // ParamGroup::grad_arena_ set
  bool grads_on_params = false;  // the parameters' grad() still view the grad arena
  bool partial = false;          // HSDP partial_reduce_ held
  int ready_op = -1;             // the copy-out that made the unsharded parameters
  int forward_calls = 0, forward_done = 0, backward_calls = 0, backward_done = 0;
  std::vector<std::size_t> post_forward_indices;
};

// A reduce-scatter in flight (CommContext::PendingReduce) with its buffers.
struct Pending {
  int last_op = -1;
  std::string input;
  std::size_t input_bytes = 0;
  std::string output;  // "" when the output is the input (one rank)
  std::size_t output_bytes = 0;
};

// One CommContext: per FSDP root.
struct Context {
  int pool = 0;
  std::vector<int> post_forward_order;
  bool in_backward = false;
  std::deque<Pending> pending;
  int last_copy_out = -1;
  std::vector<int> subtree_groups;  // pre-order of their modules (FSDPModule::subtree_states)
};

std::string display(const graph::Module& m) {
  return m.fqn().empty() ? "<root>" : m.fqn();
}

class Simulator {
 public:
  Simulator(const graph::Module& root, Plan& plan)
      : root_(root), p_(plan), cost_(*plan.options.cost) {}

  void run() {
    // About 12 ops and 8 buffer events per group and iteration: reserve once.
    const std::size_t n = p_.groups.size() + 1;
    p_.ops.reserve(16 * n);
    p_.events.reserve(12 * n);
    dur_.reserve(16 * n);
    group_at_.reserve(2 * n);
    for (std::size_t g = 0; g < p_.groups.size(); ++g)
      for (const graph::Module* gm : p_.groups[g].modules)
        group_at_[gm] = static_cast<int>(g);
    index_modules(root_, -1);
    const auto& G = p_.groups;
    st_.assign(G.size(), GroupState{});
    unshard_in_backward_.assign(G.size(), true);
    for (std::size_t g = 0; g < G.size(); ++g)
      if (p_.options.no_unshard_in_backward.count(G[g].name)) unshard_in_backward_[g] = false;
    // One context (pool) per root group, in group order.
    std::map<int, int> ctx_of_root;
    for (std::size_t g = 0; g < G.size(); ++g)
      if (G[g].is_root) {
        ctx_of_root[static_cast<int>(g)] = static_cast<int>(ctx_.size());
        Context c;
        c.pool = static_cast<int>(ctx_.size());
        ctx_.push_back(c);
        p_.pool_roots.push_back(static_cast<int>(g));
      }
    ctx_of_.resize(G.size());
    for (std::size_t g = 0; g < G.size(); ++g)
      ctx_of_[g] = ctx_of_root.at(G[g].root_group);
    for (int g : p_.forward_order)  // forward order is the modules' pre-order
      ctx_[static_cast<std::size_t>(ctx_of_[static_cast<std::size_t>(g)])].subtree_groups.push_back(
          g);
    pool_in_use_.assign(ctx_.size(), 0);
    p_.pool_peak_bytes.assign(ctx_.size(), 0);

    phase_ = Phase::forward;
    forward(root_);
    last_forward_compute_ = last_compute_;
    phase_ = Phase::backward;
    backward(root_);
    schedule();
  }

 private:
  // ---- graph indexing --------------------------------------------------------------------

  // owner_: the group holding a module's own parameters (nearest grouped ancestor-or-self).
  void index_modules(const graph::Module& m, int owner) {
    if (const int g = group_at(m); g >= 0) owner = g;
    owner_[&m] = owner;
    for (std::size_t i = 0; i < m.num_children(); ++i)
      index_modules(m.child(i), owner);
  }

  int group_at(const graph::Module& m) const {
    auto it = group_at_.find(&m);
    return it == group_at_.end() ? -1 : it->second;
  }

  GroupState& st(int g) { return st_[static_cast<std::size_t>(g)]; }
  bool unshard_in_backward(int g) const {
    return unshard_in_backward_[static_cast<std::size_t>(g)];
  }
  const PlannedGroup& grp(int g) const { return p_.groups[static_cast<std::size_t>(g)]; }
  Context& ctx(int g) {
    return ctx_[static_cast<std::size_t>(ctx_of_[static_cast<std::size_t>(g)])];
  }

  // ---- emission --------------------------------------------------------------------------

  int emit(StreamKind s, OpKind k, int g, const std::string& module, std::size_t bytes,
           double dur_ms, std::vector<int> deps, std::string label) {
    Op op;
    op.id = static_cast<int>(p_.ops.size());
    op.stream = s;
    op.kind = k;
    op.group = g;
    op.module = module;
    op.bytes = bytes;
    std::sort(deps.begin(), deps.end());
    deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
    deps.erase(std::remove(deps.begin(), deps.end(), -1), deps.end());
    op.deps = std::move(deps);
    op.phase = phase_;
    op.label = std::move(label);
    p_.ops.push_back(std::move(op));
    dur_.push_back(dur_ms);
    if (s == StreamKind::compute) last_compute_ = p_.ops.back().id;
    return p_.ops.back().id;
  }

  void buffer(int op, int g, const std::string& kind, std::size_t bytes, BufferAction a) {
    if (bytes == 0) return;  // no pool block (an empty group)
    const int pool = ctx_of_[static_cast<std::size_t>(g)];
    auto& pin = pool_in_use_[static_cast<std::size_t>(pool)];
    if (a == BufferAction::alloc) {
      pin += bytes;
      in_use_ += bytes;
      auto& pp = p_.pool_peak_bytes[static_cast<std::size_t>(pool)];
      pp = std::max(pp, pin);
    } else {
      pin -= bytes;
      in_use_ -= bytes;
    }
    BufferEvent e;
    e.op = op;
    e.buffer = kind + "[" + grp(g).name + "]";
    e.bytes = bytes;
    e.action = a;
    e.pool = pool;
    e.in_use = in_use_;
    p_.events.push_back(std::move(e));
  }
  void alloc(int op, int g, const std::string& kind, std::size_t bytes) {
    buffer(op, g, kind, bytes, BufferAction::alloc);
  }
  void release(int op, int g, const std::string& kind, std::size_t bytes) {
    buffer(op, g, kind, bytes, BufferAction::free);
  }

  std::size_t gsn(int g) const { return static_cast<std::size_t>(grp(g).layout.shard_numel); }
  std::size_t pbytes(int g) const { return dtype_size(grp(g).param_dtype); }
  std::size_t rbytes(int g) const { return dtype_size(grp(g).reduce_dtype); }
  std::size_t obytes(int g) const { return dtype_size(grp(g).orig_dtype); }
  std::size_t W(int g) const { return static_cast<std::size_t>(grp(g).shard_size()); }
  const std::string& gname(int g) const { return grp(g).name; }

  // ---- ParamGroup ------------------------------------------------------------------------

  // `own`: issued by the group's own hook (wait_unshard), not prefetched.
  void issue_unshard(int g, bool own = false) {
    GroupState& s = st(g);
    if (s.state == State::unsharded || s.gather_in_flight) return;
    const PlannedGroup& G = grp(g);
    const bool cast = G.param_dtype != G.orig_dtype;
    // FSDP2's all_gather_state: an all-gather waits for the last copy-out (at most one
    // gathered buffer awaits its copy-out). Forward: the CPU runs ahead of the streams, so
    // nothing else holds it back. Backward starts when forward's compute ended, and a
    // group's own pre-backward runs when autograd reaches the module, i.e. once the compute
    // issued before it is done: only a prefetch starts earlier.
    std::vector<int> deps{ctx(g).last_copy_out};
    if (phase_ == Phase::backward) deps.push_back(own ? last_compute_ : last_forward_compute_);
    const std::size_t shard = gsn(g) * pbytes(g);
    if (W(g) == 1) {
      if (cast) {
        const int op =
            emit(StreamKind::all_gather, OpKind::copy_in, g, display(*G.modules[0]), shard,
                 cost_.copy_ms(static_cast<double>(shard)), deps, "AG.copy_in(" + gname(g) + ")");
        alloc(op, g, "ag_buffer", G.gather_bytes());
        s.gather_op = op;
        s.gather_pooled = true;
      } else {
        s.gather_op = -1;  // copy-out reads the shards themselves
        s.gather_pooled = false;
      }
      s.gather_in_flight = true;
      return;
    }
    int first = -1;
    int ag = -1;
    const std::string mod = display(*G.modules[0]);
    if (s.state == State::sharded_post_forward) {
      // Gather inside the k-rank group from the kept slices: (W/k)*gsn per rank.
      const std::size_t k = static_cast<std::size_t>(G.reshard_after_forward);
      const std::size_t block = (W(g) / k) * shard;
      const double eff =
          static_cast<double>(block) * static_cast<double>(k - 1) / static_cast<double>(W(g) - 1);
      ag = first = emit(StreamKind::all_gather, OpKind::all_gather, g, mod, block,
                        cost_.time_ms(CollectiveKind::all_gather, MeshDim::shard, eff), deps,
                        "AG(" + gname(g) + ")/" + std::to_string(k));
    } else if (!cast) {
      ag = first = emit(
          StreamKind::all_gather, OpKind::all_gather, g, mod, shard,
          cost_.time_ms(CollectiveKind::all_gather, MeshDim::shard, static_cast<double>(shard)),
          deps, "AG(" + gname(g) + ")");
    } else {
      first = emit(StreamKind::all_gather, OpKind::copy_in, g, mod, shard,
                   cost_.copy_ms(static_cast<double>(shard)), deps, "AG.copy_in(" + gname(g) + ")");
      ag = emit(
          StreamKind::all_gather, OpKind::all_gather, g, mod, shard,
          cost_.time_ms(CollectiveKind::all_gather, MeshDim::shard, static_cast<double>(shard)),
          {first}, "AG(" + gname(g) + ")");
    }
    alloc(first, g, "ag_buffer", G.gather_bytes());
    s.gather_op = ag;
    s.gather_pooled = true;
    s.gather_in_flight = true;
  }

  void wait_unshard(int g) {
    GroupState& s = st(g);
    if (s.state == State::unsharded) return;
    issue_unshard(g, true);
    const PlannedGroup& G = grp(g);
    const std::size_t arena = G.unsharded_bytes();
    const int op = emit(StreamKind::compute, OpKind::copy_out, g, display(*G.modules[0]), arena,
                        cost_.copy_ms(static_cast<double>(arena)), {s.gather_op},
                        "AG.copy_out(" + gname(g) + ")");
    alloc(op, g, "unsharded", arena);
    s.arena = true;
    const int k = G.reshard_after_forward;
    if (!ctx(g).in_backward && k > 1 && k < G.shard_size() && s.state == State::sharded) {
      alloc(op, g, "post_forward", (W(g) / static_cast<std::size_t>(k)) * gsn(g) * pbytes(g));
      s.post_forward = true;
    }
    if (s.gather_pooled) release(op, g, "ag_buffer", G.gather_bytes());
    s.gather_pooled = false;
    s.gather_in_flight = false;
    s.gather_op = -1;
    s.state = State::unsharded;
    s.ready_op = op;
    ctx(g).last_copy_out = op;
  }

  // ParamGroup::reshard: frees (in this order) a gather still in flight, the post-forward
  // slice, the unsharded parameters (released when the parameters' views go), then the
  // gradient arena if the parameters' grad() still viewed it and the group no longer holds
  // it (it does without gradient sync).
  void reshard(int g) {
    GroupState& s = st(g);
    const int op = emit(StreamKind::compute, OpKind::reshard, g, display(*grp(g).modules[0]), 0,
                        0.0, {s.gather_in_flight ? s.gather_op : -1}, "reshard(" + gname(g) + ")");
    if (s.gather_in_flight && s.gather_pooled) release(op, g, "ag_buffer", grp(g).gather_bytes());
    s.gather_in_flight = false;
    s.gather_pooled = false;
    s.gather_op = -1;
    if (s.post_forward)
      release(op, g, "post_forward",
              (W(g) / static_cast<std::size_t>(grp(g).reshard_after_forward)) * gsn(g) * pbytes(g));
    s.post_forward = false;
    if (s.arena) release(op, g, "unsharded", grp(g).unsharded_bytes());
    s.arena = false;
    // Without gradient sync ParamGroup::grad_arena_ still holds the arena: it stays.
    if (s.grads_on_params && !s.grad_arena) release(op, g, "grads", grp(g).unsharded_bytes());
    s.grads_on_params = false;
    s.state = State::sharded;
    s.ready_op = -1;  // compute from here on runs without the unsharded parameters
  }

  void post_forward_reshard(int g) {
    GroupState& s = st(g);
    const int k = grp(g).reshard_after_forward;
    if (k == 1) return;  // kept for backward
    if (k > 1 && k < grp(g).shard_size() && s.post_forward) {
      const int op = emit(StreamKind::compute, OpKind::reshard, g, display(*grp(g).modules[0]), 0,
                          0.0, {}, "reshard(" + gname(g) + ")/" + std::to_string(k));
      if (s.arena) release(op, g, "unsharded", grp(g).unsharded_bytes());
      s.arena = false;
      s.state = State::sharded_post_forward;
      s.ready_op = -1;
      return;
    }
    reshard(g);
  }

  void prepare_gradients(int g) {
    GroupState& s = st(g);
    if (s.grad_arena) return;
    const std::size_t bytes = grp(g).unsharded_bytes();
    const int op =
        emit(StreamKind::compute, OpKind::grad_init, g, display(*grp(g).modules[0]), bytes,
             cost_.copy_ms(static_cast<double>(bytes)), {}, "grad_init(" + gname(g) + ")");
    alloc(op, g, "grads", bytes);
    s.grad_arena = true;
    s.grads_on_params = true;
  }

  // CommContext::wait_reduces(keep): the oldest pending reduce-scatters, dropped in order
  // (each entry releases its output, then its input).
  std::vector<Pending> take_pending(Context& c, std::size_t keep) {
    std::vector<Pending> out;
    while (c.pending.size() > keep) {
      out.push_back(c.pending.front());
      c.pending.pop_front();
    }
    return out;
  }
  void release_pending(int op, const std::vector<Pending>& done) {
    for (const Pending& d : done) {
      const int pg = pending_group_.at(d.last_op);
      if (!d.output.empty()) release(op, pg, d.output, d.output_bytes);
      release(op, pg, d.input, d.input_bytes);
    }
  }

  void reduce_gradients(int g) {
    GroupState& s = st(g);
    if (!s.grad_arena) return;
    // no_sync: no communication; the unsharded gradients keep accumulating in the arena.
    if (!p_.options.requires_gradient_sync) return;
    const PlannedGroup& G = grp(g);
    Context& c = ctx(g);
    const std::string mod = display(*G.modules[0]);
    const auto keep =
        static_cast<std::size_t>(std::max(p_.options.reduce_scatter_max_input_buffers, 1) - 1);
    std::vector<Pending> waited = take_pending(c, keep);
    std::vector<int> deps{last_compute_};
    for (const Pending& d : waited)
      deps.push_back(d.last_op);
    const std::size_t in_bytes = W(g) * gsn(g) * rbytes(g);
    const int in =
        emit(StreamKind::reduce_scatter, OpKind::copy_in, g, mod, in_bytes,
             cost_.copy_ms(static_cast<double>(in_bytes)), deps, "RS.copy_in(" + gname(g) + ")");
    release_pending(in, waited);
    alloc(in, g, "rs_input", in_bytes);
    s.grad_arena = false;  // the parameters' grad() views keep it until replaced

    Pending pend;
    pend.input = "rs_input";
    pend.input_bytes = in_bytes;
    int last = in;
    StreamKind last_stream = StreamKind::reduce_scatter;
    const std::size_t out_bytes = gsn(g) * rbytes(g);
    if (W(g) > 1) {
      last = emit(StreamKind::reduce_scatter, OpKind::reduce_scatter, g, mod, out_bytes,
                  cost_.time_ms(CollectiveKind::reduce_scatter, MeshDim::shard,
                                static_cast<double>(out_bytes)),
                  {in}, "RS(" + gname(g) + ")");
      alloc(last, g, "rs_output", out_bytes);
      pend.output = "rs_output";
      pend.output_bytes = out_bytes;
    }
    if (p_.mesh.replicate > 1) {
      if (!p_.options.requires_all_reduce) {
        const int acc = emit(StreamKind::reduce_scatter, OpKind::reduce_copy_out, g, mod, out_bytes,
                             cost_.copy_ms(static_cast<double>(out_bytes)), {last},
                             "accumulate(" + gname(g) + ")");
        if (!s.partial) alloc(acc, g, "partial_reduce", out_bytes);
        s.partial = true;
        pend.last_op = acc;
        pending_group_[acc] = g;
        c.pending.push_back(pend);
        return;  // the gradients stay unsharded on the parameters until reshard
      }
      last = emit(StreamKind::all_reduce, OpKind::all_reduce, g, mod, out_bytes,
                  cost_.time_ms(CollectiveKind::all_reduce, MeshDim::replicate,
                                static_cast<double>(out_bytes)),
                  {last}, "AR(" + gname(g) + ")");
      last_stream = StreamKind::all_reduce;
    }
    const std::size_t grad_bytes = gsn(g) * obytes(g);
    const int out = emit(last_stream, OpKind::reduce_copy_out, g, mod, grad_bytes,
                         cost_.copy_ms(static_cast<double>(grad_bytes)), {last},
                         "RS.copy_out(" + gname(g) + ")");
    pend.last_op = out;
    pending_group_[out] = g;
    c.pending.push_back(pend);
    // The parameters' grad() now views the sharded gradients: the arena goes back.
    if (s.grads_on_params) release(out, g, "grads", G.unsharded_bytes());
    s.grads_on_params = false;
  }

  void clear_iteration(Context& c) {
    c.post_forward_order.clear();
    c.in_backward = false;
    for (int g : c.subtree_groups) {
      GroupState& s = st(g);
      s.forward_calls = s.forward_done = s.backward_calls = s.backward_done = 0;
      s.post_forward_indices.clear();
    }
  }

  // ---- hooks -----------------------------------------------------------------------------

  void pre_forward(const graph::Module& m) {
    const int g = group_at(m);
    if (g < 0) return;
    GroupState& s = st(g);
    Context& c = ctx(g);
    if (c.in_backward) {
      wait_unshard(g);
      return;
    }
    if (grp(g).is_root && s.forward_calls == 0) clear_iteration(c);
    if (s.forward_calls++ == 0) wait_unshard(g);
    for (int t : p_.forward_prefetch[static_cast<std::size_t>(g)])
      issue_unshard(t);
  }

  void post_forward(const graph::Module& m) {
    const int g = group_at(m);
    if (g < 0) return;
    GroupState& s = st(g);
    Context& c = ctx(g);
    if (c.in_backward) return;
    if (++s.forward_done < static_cast<int>(grp(g).modules.size())) return;
    s.post_forward_indices.push_back(c.post_forward_order.size());
    c.post_forward_order.push_back(g);
    s.forward_calls = s.forward_done = 0;
    post_forward_reshard(g);
  }

  void pre_backward(const graph::Module& m) {
    const int g = group_at(m);
    if (g < 0) return;
    GroupState& s = st(g);
    Context& c = ctx(g);
    c.in_backward = true;
    if (s.backward_calls++ > 0) return;
    if (unshard_in_backward(g)) wait_unshard(g);
    prepare_gradients(g);
    if (p_.options.backward_prefetch == BackwardPrefetch::none) return;
    if (!s.post_forward_indices.empty()) {
      const std::size_t i = s.post_forward_indices.back();
      s.post_forward_indices.pop_back();
      if (i > 0) {
        const int next = c.post_forward_order[i - 1];
        if (unshard_in_backward(next)) issue_unshard(next);
      }
    }
  }

  void post_backward(const graph::Module& m) {
    const int g = group_at(m);
    if (g < 0) return;
    GroupState& s = st(g);
    Context& c = ctx(g);
    if (++s.backward_done >= static_cast<int>(grp(g).modules.size())) {
      s.backward_calls = s.backward_done = 0;
      reduce_gradients(g);
      if (p_.options.reshard_after_backward) reshard(g);
    }
    if (!grp(g).is_root) return;
    for (int other : c.subtree_groups)
      if (other != g && p_.options.reshard_after_backward && st(other).state != State::sharded)
        reshard(other);
    if (p_.options.is_last_backward) {  // wait for every reduce-scatter
      std::vector<Pending> waited = take_pending(c, 0);
      std::vector<int> deps;
      for (const Pending& d : waited)
        deps.push_back(d.last_op);
      const int op = emit(StreamKind::compute, OpKind::wait, g, display(m), 0, 0.0, deps,
                          "wait(" + gname(g) + ")");
      release_pending(op, waited);
    }  // else the pending reduce-scatters keep their buffers (a later K cap or root waits)
    clear_iteration(c);
  }

  // ---- traversal (fsdp::forward / fsdp::backward) ---------------------------------------

  std::vector<int> compute_deps(const graph::Module& m) {
    const int owner = owner_.at(&m);
    return {owner >= 0 ? st(owner).ready_op : -1};
  }

  void forward(const graph::Module& m) {
    pre_forward(m);
    if (m.cost().declared || m.forward_callback())
      emit(StreamKind::compute, OpKind::forward, owner_.at(&m), display(m), 0, m.cost().forward_ms,
           compute_deps(m), "fwd(" + display(m) + ")");
    for (std::size_t i = 0; i < m.num_children(); ++i)
      forward(m.child(i));
    post_forward(m);
  }

  void backward(const graph::Module& m) {
    pre_backward(m);
    for (std::size_t i = m.num_children(); i-- > 0;)
      backward(m.child(i));
    if (m.cost().declared || m.backward_callback())
      emit(StreamKind::compute, OpKind::backward, owner_.at(&m), display(m), 0,
           m.cost().backward_ms, compute_deps(m), "bwd(" + display(m) + ")");
    post_backward(m);
  }

  // ---- list scheduling -------------------------------------------------------------------

  void schedule() {
    double free_at[4] = {0, 0, 0, 0};
    for (Op& op : p_.ops) {
      double start = free_at[static_cast<int>(op.stream)];
      for (int d : op.deps)
        start = std::max(start, p_.ops[static_cast<std::size_t>(d)].end_ms);
      op.start_ms = start;
      op.end_ms = start + dur_[static_cast<std::size_t>(op.id)];
      free_at[static_cast<int>(op.stream)] = op.end_ms;
      p_.step_ms = std::max(p_.step_ms, op.end_ms);
    }
    for (const BufferEvent& e : p_.events) {
      if (e.action != BufferAction::alloc) continue;
      p_.peak_bytes = std::max(p_.peak_bytes, e.in_use);
      if (p_.ops[static_cast<std::size_t>(e.op)].phase == Phase::forward)
        p_.forward_peak_bytes = std::max(p_.forward_peak_bytes, e.in_use);
      else
        p_.backward_peak_bytes = std::max(p_.backward_peak_bytes, e.in_use);
    }
    p_.end_bytes = in_use_;
  }

  const graph::Module& root_;
  Plan& p_;
  CostModel cost_;
  std::unordered_map<const graph::Module*, int> group_at_;
  std::unordered_map<const graph::Module*, int> owner_;
  std::vector<GroupState> st_;
  std::vector<bool> unshard_in_backward_;
  std::vector<Context> ctx_;
  std::vector<int> ctx_of_;
  std::map<int, int> pending_group_;  // last op of a pending reduce -> its group
  std::vector<double> dur_;
  std::vector<std::size_t> pool_in_use_;
  std::size_t in_use_ = 0;
  int last_compute_ = -1;
  int last_forward_compute_ = -1;
  Phase phase_ = Phase::forward;
};

// Groups in the order of their first pre-forward: the pre-order of their modules.
void preorder_groups(const graph::Module& m,
                     const std::unordered_map<const graph::Module*, int>& at,
                     std::vector<int>& out) {
  auto it = at.find(&m);
  if (it != at.end()) out.push_back(it->second);
  for (std::size_t i = 0; i < m.num_children(); ++i)
    preorder_groups(m.child(i), at, out);
}

std::vector<int> forward_order(const graph::Module& root, const std::vector<PlannedGroup>& groups) {
  std::unordered_map<const graph::Module*, int> at;
  for (std::size_t g = 0; g < groups.size(); ++g)
    at[groups[g].modules.front()] = static_cast<int>(g);
  std::vector<int> out;
  preorder_groups(root, at, out);
  return out;
}

}  // namespace

Plan Scheduler::plan(const graph::Module& root, MeshShape mesh, const PlanOptions& options) {
  if (mesh.shard < 1 || mesh.replicate < 1)
    throw InvalidArgument("Scheduler::plan: mesh sizes must be >= 1, got shard " +
                          std::to_string(mesh.shard) + " x replicate " +
                          std::to_string(mesh.replicate));
  if (options.forward_prefetch_depth < 0)
    throw InvalidArgument("Scheduler::plan: forward_prefetch_depth must be >= 0, got " +
                          std::to_string(options.forward_prefetch_depth));
  if (options.reduce_scatter_max_input_buffers < 1)
    throw InvalidArgument("Scheduler::plan: reduce_scatter_max_input_buffers must be >= 1, got " +
                          std::to_string(options.reduce_scatter_max_input_buffers));
  Plan p;
  p.mesh = mesh;
  p.options = options;
  if (!p.options.cost) p.options.cost = CostModel::defaults(mesh);
  p.groups = plan_groups(root, mesh.shard, options.defaults);
  for (const std::string& name : options.no_unshard_in_backward)
    if (p.group_index(name) < 0) {
      std::string names;
      for (const auto& g : p.groups)
        names += (names.empty() ? "" : ", ") + g.name;
      throw InvalidArgument("Scheduler::plan: no_unshard_in_backward: no group named '" + name +
                            "' (groups: " + (names.empty() ? "none" : names) + ")");
    }
  for (const auto& g : p.groups) {
    p.sharded_bytes += g.shard_bytes();
    p.grad_bytes += g.shard_bytes();
  }

  p.forward_order = forward_order(root, p.groups);
  p.forward_prefetch.assign(p.groups.size(), {});
  const auto depth = static_cast<std::size_t>(options.forward_prefetch_depth);
  const auto& order = p.forward_order;
  for (std::size_t i = 0; i < order.size(); ++i)
    for (std::size_t j = i + 1; j < order.size() && j <= i + depth; ++j)
      p.forward_prefetch[static_cast<std::size_t>(order[i])].push_back(order[j]);

  Simulator sim(root, p);
  sim.run();
  return p;
}

}  // namespace fullshard::schedule
