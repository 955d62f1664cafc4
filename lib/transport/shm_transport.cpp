#include "lib/transport/shm_transport.hpp"

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>

#include "lib/kernels/multi_source.hpp"
#include "lib/transport/comm_transport.hpp"

namespace fullshard::transport::detail {
namespace {

// Counters of both windows: [0] rounds published by the rank, [1] rounds the rank finished
// reading from its peers.
constexpr int kPublished = 0;
constexpr int kRead = 1;

// Windows of one node communicator shared by its groups, one pool per use:
// - gradients: a group holds one from its first gradient write (its grads buffer, or the
//   copy-in of a front end's gradients) to its reduce-scatter's issue;
// - all-gathers that need a window of their own (a cast, or two levels: the other nodes'
//   shards): a group holds one from its gather's copy-in to its copy-out;
// so the node holds the collectives in flight, not one window per group for the group's life.
// A group takes a free window at least its size that was given back before another free one
// (the readers of its last round have had the longest), and a new window (collective) while
// fewer than two such are free: a writer then rarely waits for the peers still reading the
// window's last round, which it must (ShmTransport::writable_grads_window, take_gather). Every
// rank takes and gives back in the same order (the engine's), so every rank allocates the same
// windows at the same point.
class SharedWindows {
 public:
  struct Entry {
    comm::ShmWindow win;
    std::uint64_t round = 0;     // reduce-scatters published on it (any group's)
    std::uint64_t released = 0;  // when it was last given back (GradWindows' clock)
    bool busy = false;
  };

  enum class Use { gradients, all_gather };

  SharedWindows(const comm::ShmComm& shm, Use use) : shm_(shm), use_(use) {}

  Entry& take(std::size_t bytes) {
    Entry* first = nullptr;
    int fitting = 0;
    for (Entry& e : entries_) {
      if (e.busy || e.win.bytes() < bytes) continue;
      ++fitting;
      if (!first || e.released < first->released) first = &e;
    }
    if (fitting < 2) {
      entries_.push_back(Entry{});
      first = &entries_.back();
      first->win = shm_.allocate(
          bytes, std::string(use_ == Use::gradients ? "fsdp.grads." : "fsdp.all_gather.") +
                     std::to_string(entries_.size()));
    }
    first->busy = true;
    return *first;
  }
  void give_back(Entry& e) {
    e.busy = false;
    e.released = ++clock_;
  }

  // The windows of `shm` for `use`, shared by every group's transport over it (made by the
  // first).
  static std::shared_ptr<SharedWindows> of(const comm::ShmComm& shm, Use use) {
    static std::mutex m;
    static std::map<std::pair<const comm::ShmComm*, Use>, std::weak_ptr<SharedWindows>> all;
    const std::lock_guard<std::mutex> lock(m);
    std::shared_ptr<SharedWindows> w = all[{&shm, use}].lock();
    if (!w) {
      w = std::make_shared<SharedWindows>(shm, use);
      all[{&shm, use}] = w;
    }
    return w;
  }

 private:
  const comm::ShmComm& shm_;
  Use use_;
  std::deque<Entry> entries_;  // references stay valid as it grows
  std::uint64_t clock_ = 0;
};

// Two levels (a shard dim spanning nodes, NodeSplit): each rank's segment of the all-gather
// window holds one slot per node, the shards of the ranks with its place on every node; the
// all-gather across nodes (MPI, in place) fills them and the copy-out reads all W slots where
// they lie in the node's segments. The reduce-scatter first sums, for each node, the chunk of
// the rank with this rank's place there over the node's gradients (read in place), into the
// rank-major input; an all-to-all across the nodes brings each rank the nodes' sums of its
// chunk, summed as on one node (divided, cast and accumulated into the sharded gradients).
class ShmTransport final : public CommTransport {
 public:
  ShmTransport(GroupSpec spec, const comm::ShmComm& shm, const NodeSplit* split)
      : CommTransport(split ? Kind::two_level : Kind::shm, std::move(spec)),
        shm_(shm),
        split_(split),
        windows_(SharedWindows::of(shm, SharedWindows::Use::gradients)) {
    if (split_ || geo().cast())
      gather_windows_ = SharedWindows::of(shm, SharedWindows::Use::all_gather);
    // Where each rank of the shard dim has its slot: (segment, slot in it).
    const int W = geo().world;
    where_.resize(static_cast<std::size_t>(W));
    for (int q = 0; q < W; ++q)
      where_[static_cast<std::size_t>(q)] = {q, 0};
    if (split_)
      for (int n = 0; n < split_->nodes(); ++n)
        for (int l = 0; l < split_->ranks_per_node(); ++l)
          where_.at(static_cast<std::size_t>(split_->dim_rank(n, l))) = {l, n};
  }

  // A group destroyed while it holds a window gives it back (every rank destroys its groups in
  // the same order); its next taker still waits for the last round's readers.
  ~ShmTransport() override {
    if (held_) windows_->give_back(*held_);
    release_gather();
  }

  // The cast shard goes to this rank's slot, where peers read it (in a window taken for this
  // gather: a window held still is a gather dropped unread).
  comm::Work gather_copy_in(Device& dev, comm::StreamKind c, Held&) override {
    ensure_gather();
    if (gather_windows_) {
      release_gather();
      take_gather(dev, c);
    }
    return cast_shard(dev, c, slot(geo().rank));
  }

  // Publishes this rank's shard (the copy-out reads every peer's directly); two levels: after
  // the all-gather across nodes into this rank's segment. Without a cast the shard is
  // published where it is stored; a storage adopted since (checkpoint load) is copied to the
  // slot first.
  comm::Work all_gather(Device& dev, comm::StreamKind c, Held&, bool in_place) override {
    dev.before_collective(c);
    ensure_gather();
    if (gather_windows_) {  // the copy-in's window (a cast), or one taken now
      if (ag_gathered_) release_gather();
      if (!ag_held_) take_gather(dev, c);
      ag_gathered_ = true;
    }
    const Geometry& I = geo();
    const comm::ShmWindow win = gather_window();
    const std::uint64_t round = gather_windows_ ? ag_round_ : ++ag_round_;
    count(&comm::Traffic::all_gather, I.param_dtype);
    std::byte* own = slot(I.rank);
    const void* stored = in_place ? nullptr : store().shards().data();
    const bool copy = stored && stored != own;
    const DType t = I.param_dtype;
    const std::int64_t n = I.shard_numel;
    const Tensor keep = copy ? store().shards() : Tensor();
    const kernels::ExecStream& on = dev.exec(c);
    const bool across = split_ != nullptr;
    // The window's last readers were waited for when it was taken (take_gather).
    comm::Work w = dev.submit(c, stream(dev, c), ag_label_, [=, &on] {
      if (copy) kernels::cast_copy(on, keep.data(), t, own, t, n);
      on.fence();
      if (!across) win.publish(kPublished, round);
    });
    if (!across) return w;
    const comm::Work gathered = split_->across(c).all_gather(
        own, win.local(), static_cast<std::size_t>(n), t, stream(dev, c));
    // Published only when both parts succeeded (their errors instead: peers would read slots
    // the gather did not fill).
    return dev.submit(c, stream(dev, c), ag_publish_label_, [=] {
      w.wait();  // both ran before (stream order): their errors instead of publishing
      gathered.wait();
      win.publish(kPublished, round);
    });
  }

  // The all-gather and its copy-out in one pass: every peer's slot straight into the arena.
  comm::Work gather_copy_out(Device& dev, comm::StreamKind c, const Held* src, bool from_slices,
                             Held& arena, Held* keep, int k) override {
    if (from_slices) {
      release_gather();
      return CommTransport::gather_copy_out(dev, c, src, true, arena, keep, k);
    }
    const Geometry& I = geo();
    const comm::ShmWindow win = gather_window();
    const std::uint64_t round = ag_round_;
    win.wait_all(kPublished, round, "all_gather", ag_detail_);
    const kernels::ExecStream& on = dev.exec(c);
    for (int q = 0; q < I.world; ++q)
      kernels::run_copies(copy_out_from_[static_cast<std::size_t>(q)], slot(q), I.param_dtype,
                          arena.tensor.data(), I.param_dtype, on);
    if (keep) {
      // reshard_after_forward=k: the W/k slots this rank serves in its k-rank group.
      const int per = I.world / k;
      const std::size_t bytes = static_cast<std::size_t>(I.shard_numel) * dtype_size(I.param_dtype);
      for (int j = 0; j < per; ++j)
        std::memcpy(
            static_cast<std::byte*>(keep->tensor.data()) + static_cast<std::size_t>(j) * bytes,
            slot((I.rank % k) * per + j), bytes);
    }
    on.fence();
    ag_read_ = round;
    win.publish(kRead, round);
    release_gather();  // read: the window goes back (its next taker waits for the peers)
    return comm::Work();
  }

  // Nothing to copy: peers read their chunks from the gradient window.
  comm::Work reduce_copy_in(Device& dev, comm::StreamKind c, Held&, Held&) override {
    return dev.run(c, stream(dev, c), label("copy_in of group "), [] {});
  }

  // External gradients go into the gradient window, where peers read their chunks; a
  // parameter without a gradient contributes zeros.
  comm::Work external_copy_in(Device& dev, comm::StreamKind c, std::vector<Tensor> grads,
                              Held&) override {
    auto* window = static_cast<std::byte*>(writable_grads_window());
    const std::size_t es = dtype_size(geo().param_dtype);
    // The layout lives with the group, as the copy plans do.
    const std::vector<kernels::GroupMember>* members = &layout().members;
    return dev.run(c, stream(dev, c), label("copy_in of group "),
                   [grads = std::move(grads), window, es, members] {
                     for (std::size_t i = 0; i < grads.size(); ++i) {
                       const kernels::GroupMember& m = (*members)[i];
                       std::byte* to = window + static_cast<std::size_t>(m.arena_offset) * es;
                       const std::size_t bytes =
                           static_cast<std::size_t>(numel(m.layout.global_shape)) * es;
                       if (grads[i].data())
                         std::memcpy(to, grads[i].data(), bytes);
                       else
                         std::memset(to, 0, bytes);
                     }
                   });
  }

  // Sums this rank's chunk of every peer's gradients. Without HSDP the divide, the cast and
  // the accumulation into the sharded gradients are fused in (fusions().copy_out_in_reduce:
  // reduce_copy_out has nothing left to do); with HSDP the sum goes to `output` for the
  // all-reduce. Two levels: the node's sums of the chunks of this rank's place on every node
  // go to `input`; an all-to-all across the nodes brings each rank the N sums of its own chunk
  // (each crosses the network once, to its owner; MPI's reduce-scatter of 2 ranks sends the
  // whole buffer to one of them), which it sums in node order with the same fusions.
  comm::Work reduce_scatter(Device& dev, comm::StreamKind c, Held& input, Held& output,
                            const ReduceSpec& spec) override {
    const Geometry I = geo();
    if (!held_)
      throw InvalidArgument("reduce_scatter of group " + name() +
                            " on shared memory: no gradients were written (internal)");
    const comm::ShmWindow win = held_->win;
    const std::uint64_t round = ++held_->round;
    // The gradients are written: the window goes back (its next writer waits for this round's
    // readers).
    windows_->give_back(*held_);
    held_ = nullptr;
    count(&comm::Traffic::reduce_scatter, I.reduce_dtype);
    // Where the final sum goes: the sharded gradients, divided, cast and accumulated
    // (fusions().copy_out_in_reduce), or `output` for HSDP's all-reduce.
    DType out_t = I.reduce_dtype;
    double divisor = 1.0;
    bool acc = false;
    Tensor out = output.tensor;
    // The optimizer inside backward (spec.update): the final sum updates the shards instead.
    const bool update = fusions().copy_out_in_reduce && spec.update != nullptr;
    const kernels::ElementUpdate u = update ? *spec.update : kernels::ElementUpdate();
    const kernels::ExecStream* on = &dev.exec(c);  // the host's (shared memory)
    const bool update_here = update && !split_;    // one node: its sum is the last pass
    if (fusions().copy_out_in_reduce) {
      out = update ? Tensor() : store().gradients_for_write();
      out_t = I.orig_dtype;
      divisor = spec.divisor;
      acc = spec.accumulate;
    }
    // Two levels: the node's sums go to `input` first, in the reduce dtype.
    const Tensor node_out = split_ ? input.tensor : out;
    const DType node_t = split_ ? I.reduce_dtype : out_t;
    const double node_divisor = split_ ? 1.0 : divisor;
    const bool node_acc = split_ ? false : acc;
    const std::vector<std::vector<kernels::CopyRun>>* runs = &rs_runs_;
    const std::string* about = &rs_detail_;
    const int peers = shm_.size();
    comm::Work w = dev.submit(c, stream(dev, c), rs_label_, [=] {
      // The backward compute has written the gradients (the engine ordered this stream after
      // the compute stream); peers may read them from here on.
      win.publish(kPublished, round);
      win.wait_all(kPublished, round, "reduce_scatter", *about);
      const std::size_t in_size = dtype_size(I.param_dtype);
      const std::size_t out_size = dtype_size(node_t);
      std::vector<const void*> sources(static_cast<std::size_t>(peers));
      const std::size_t per_target = static_cast<std::size_t>(I.shard_numel) * out_size;
      for (std::size_t n = 0; n < runs->size(); ++n) {  // one target per node
        auto* to_base = static_cast<std::byte*>(node_out.data()) + n * per_target;
        for (const kernels::CopyRun& r : (*runs)[n]) {
          for (int q = 0; q < peers; ++q)
            sources[static_cast<std::size_t>(q)] =
                win.segment(q) + static_cast<std::size_t>(r.src_offset) * in_size;
          if (update_here) {  // the padding's update sees zero gradients, as unfused
            kernels::reduce_sources_update(sources.data(), peers, I.param_dtype, I.reduce_dtype,
                                           r.len, node_divisor, u.at(r.dst_offset));
            if (r.pad > 0) kernels::apply_update(*on, u.at(r.dst_offset + r.len), nullptr, r.pad);
            continue;
          }
          std::byte* to = to_base + static_cast<std::size_t>(r.dst_offset) * out_size;
          kernels::reduce_sources(sources.data(), peers, I.param_dtype, I.reduce_dtype, to, node_t,
                                  r.len, node_divisor, node_acc);
          if (r.pad > 0 && !node_acc)  // padding stays zero (+0 is all zero bits in every dtype)
            std::memset(to + static_cast<std::size_t>(r.len) * out_size, 0,
                        static_cast<std::size_t>(r.pad) * out_size);
        }
      }
      win.publish(kRead, round);
    });
    if (!split_) return w;
    // The N sums received into the second half of `input` (W = N L chunks, L >= 2).
    const int nodes = split_->nodes();
    const auto gsn = static_cast<std::size_t>(I.shard_numel);
    std::byte* sent = static_cast<std::byte*>(input.tensor.data());
    std::byte* received = sent + static_cast<std::size_t>(nodes) * gsn * dtype_size(I.reduce_dtype);
    const comm::Work exchanged =
        split_->across(c).all_to_all(sent, received, gsn, I.reduce_dtype, stream(dev, c));
    // The reduction completes with every part (the node's sum's error is not lost).
    return dev.submit(c, stream(dev, c), rs_done_label_, [=] {
      w.wait();  // both ran before (stream order): their errors instead of summing
      exchanged.wait();
      std::vector<const void*> sums(static_cast<std::size_t>(nodes));
      for (int n = 0; n < nodes; ++n)
        sums[static_cast<std::size_t>(n)] =
            received + static_cast<std::size_t>(n) * gsn * dtype_size(I.reduce_dtype);
      if (update)
        kernels::reduce_sources_update(sums.data(), nodes, I.reduce_dtype, I.reduce_dtype,
                                       I.shard_numel, divisor, u);
      else
        kernels::reduce_sources(sums.data(), nodes, I.reduce_dtype, I.reduce_dtype, out.data(),
                                out_t, I.shard_numel, divisor, acc);
    });
  }

  comm::Work reduce_copy_out(Device& dev, comm::StreamKind c, Held& src,
                             const ReduceSpec& spec) override {
    // Done by the reduce-scatter: this operation completes with it.
    if (fusions().copy_out_in_reduce) return dev.last(c);
    return CommTransport::reduce_copy_out(dev, c, src, spec);
  }

  // The unsharded gradients live in a gradient window, where peers read their chunks; the
  // pool only counts their bytes (Device::reserve).
  bool provides_grads() const noexcept override { return true; }
  void take_grads_buffer(Held& grads) override {
    void* window = writable_grads_window();
    grads_pool_ = std::move(grads.tensor);
    grads.tensor = Tensor::from_owner(held_->win.owner(), window, grads_pool_.shape(),
                                      grads_pool_.dtype(), MemorySpace::host);
  }
  // The window stays this group's until its reduce-scatter is issued (gradients kept across
  // micro-batches without a reduction stay in it).
  void return_grads_buffer(Held& grads) override {
    grads_pool_ = Tensor();
    grads.used = comm::Work();
  }

  // Every peer must have read this rank's last published shard. A gather this rank dropped
  // unread (reshard with the gather in flight) counts as read. In a window taken per gather
  // the slot holds a copy, so the shards may change; a gather still holding one was dropped
  // (every rank reshards in the same order): its window goes back.
  void before_shards_change() override {
    release_gather();
    if (!ag_.valid()) return;
    if (ag_read_ < ag_round_) {
      ag_read_ = ag_round_;
      ag_.publish(kRead, ag_round_);
    }
    ag_.wait_all(kRead, ag_round_, "all_gather (peers still reading)", ag_detail_);
  }

 private:
  const comm::ShmComm& shm_;                // the node's ranks of the shard dim
  const NodeSplit* split_;                  // two levels: the shard dim's ranks by node; else null
  std::vector<std::pair<int, int>> where_;  // per rank of the dim: (segment, slot)
  // One node without a cast: per rank a slot, the group's shard storage itself.
  comm::ShmWindow ag_;
  // A cast or two levels: the node communicator's all-gather windows (per rank a slot per
  // node, the group shard in param dtype), one held per gather in flight: from its copy-in
  // (or all-gather) to its copy-out. Null otherwise.
  std::shared_ptr<SharedWindows> gather_windows_;
  SharedWindows::Entry* ag_held_ = nullptr;  // this group's gather's
  bool ag_gathered_ = false;                 // its all-gather was issued
  std::shared_ptr<SharedWindows> windows_;   // the node communicator's gradient windows
  SharedWindows::Entry* held_ = nullptr;     // the one this group's gradients are written to
  Tensor grads_pool_;           // the pool's count of the window while the engine holds it
  std::uint64_t ag_round_ = 0;  // all-gathers published (a taken window: its round)
  std::uint64_t ag_read_ = 0;   // all-gathers whose peers' shards this rank has read
  bool rs_ready_ = false;       // labels and chunk runs made (prepare_reduce)
  std::vector<kernels::CopyPlan> copy_out_from_;  // per rank: the copy-out runs of its slot
  // Per node: the chunks of the rank with this rank's place there (one node: this rank's),
  // arena -> shard offset.
  std::vector<std::vector<kernels::CopyRun>> rs_runs_;
  std::string ag_detail_, rs_detail_;  // "<gsn> x <dtype>, group <name>"
  std::string ag_label_, rs_label_;    // "all_gather on shared memory of '<comm>' (<detail>)"
  std::string ag_publish_label_;       // two levels: after the gather across nodes
  std::string ag_take_label_;          // a window taken per gather: its last readers
  std::string rs_done_label_;          // two levels: the sum of the nodes' sums

  // The all-gather window of this gather.
  const comm::ShmWindow& gather_window() const { return ag_held_ ? ag_held_->win : ag_; }

  // A window taken for this gather (a cast or two levels), its round the window's next; the
  // stream waits for every peer to have read the window's last round (whichever group's)
  // before this rank writes its slot.
  void take_gather(Device& dev, comm::StreamKind c) {
    const Geometry& I = geo();
    const std::size_t nodes = split_ ? static_cast<std::size_t>(split_->nodes()) : 1;
    ag_held_ = &gather_windows_->take(nodes * static_cast<std::size_t>(I.shard_numel) *
                                      dtype_size(I.param_dtype));
    ag_gathered_ = false;
    ag_round_ = ++ag_held_->round;
    ag_read_ = ag_round_ - 1;
    const comm::ShmWindow win = ag_held_->win;
    const std::uint64_t round = ag_round_;
    const std::string* about = &ag_detail_;
    dev.submit(c, stream(dev, c), ag_take_label_,
               [=] { win.wait_all(kRead, round - 1, "all_gather (peers still reading)", *about); });
  }

  // The gather's window goes back, its round read by this rank (a gather dropped unread
  // counts as read); its next taker waits for every peer's read.
  void release_gather() noexcept {
    if (!ag_held_) return;
    if (ag_read_ < ag_round_) {
      ag_read_ = ag_round_;
      ag_held_->win.publish(kRead, ag_round_);
    }
    gather_windows_->give_back(*ag_held_);
    ag_held_ = nullptr;
    ag_gathered_ = false;
  }

  // Rank q's slot of the all-gather window.
  std::byte* slot(int q) const {
    const auto& [segment, index] = where_[static_cast<std::size_t>(q)];
    return gather_window().segment(segment) + static_cast<std::size_t>(index) *
                                                  static_cast<std::size_t>(geo().shard_numel) *
                                                  dtype_size(geo().param_dtype);
  }

  // Counts one collective (the whole buffer: W shards of dtype t) in the shared memory's
  // traffic; two levels: the W - N shards that do not cross nodes (the communicator across
  // nodes counts its N), so that the sum is what MPI's collective would count.
  void count(std::uint64_t comm::Traffic::*kind, DType t) const {
    comm::Traffic traffic;
    const int nodes = split_ ? split_->nodes() : 0;
    traffic.*kind = static_cast<std::uint64_t>(geo().world - nodes) *
                    static_cast<std::uint64_t>(geo().shard_numel) * dtype_size(t);
    shm_.count(traffic);
  }

  // The gradient window this group writes its unsharded gradients to (taken from the
  // communicator's windows at the first write since its last reduce-scatter), once every
  // rank has read the window's last round, whichever group's it was.
  void* writable_grads_window() {
    prepare_reduce();
    if (!held_) {
      held_ = &windows_->take(static_cast<std::size_t>(geo().arena_numel) *
                              dtype_size(geo().param_dtype));
      held_->win.wait_all(kRead, held_->round, "reduce_scatter (peers still reading)", rs_detail_,
                          true);
    }
    return held_->win.local();
  }

  // Allocates the all-gather window on first use (collective over the shard group, at the
  // group's first all-gather: the same point on every rank) and, without a cast, moves the
  // sharded storage into it (peers read the shards where they are stored).
  void ensure_gather();
  // The reduce-scatter's labels and this rank's chunk runs, on first use.
  void prepare_reduce();
  // Rank t's chunks of the unsharded gradients: arena -> shard offset, valid and padded.
  std::vector<kernels::CopyRun> runs_of(int t) const;
};

void ShmTransport::ensure_gather() {
  if (ag_.valid() || !copy_out_from_.empty()) return;
  const Geometry& I = geo();
  const auto gsn = static_cast<std::size_t>(I.shard_numel);
  // One node without a cast: this rank's shards move into its slot (below); else the windows
  // are taken per gather (take_gather).
  if (!gather_windows_)
    ag_ = shm_.allocate(gsn * dtype_size(I.param_dtype), "fsdp.all_gather:" + name(),
                        gsn * dtype_size(I.orig_dtype));
  ag_detail_ = std::to_string(gsn) + " x " + dtype_name(I.param_dtype) + ", group " + name();
  ag_label_ = "all_gather on shared memory of '" + shm_.name() + "' (" + ag_detail_ + ")";
  ag_publish_label_ = "publish of " + ag_label_;
  ag_take_label_ = "window of " + ag_label_;
  // The copy-out runs by the slot they read, rebased to it (a run that crosses a slot
  // boundary is split there).
  std::vector<std::vector<kernels::CopyRun>> by_slot(static_cast<std::size_t>(I.world));
  const auto g = static_cast<std::int64_t>(gsn);
  for (kernels::CopyRun r : kernels::all_gather_copy_out_runs(layout())) {
    while (g > 0 && r.len > 0) {
      const std::int64_t q = r.src_offset / g;
      const std::int64_t room = (q + 1) * g - r.src_offset;
      kernels::CopyRun piece = r;
      piece.src_offset -= q * g;
      if (r.len > room) {
        piece.len = room;
        piece.pad = 0;
      }
      by_slot[static_cast<std::size_t>(q)].push_back(piece);
      if (r.len <= room) {
        r.len = r.pad = 0;
        break;
      }
      r.src_offset += room;
      r.dst_offset += room;
      r.len -= room;
    }
    if (r.pad > 0) {  // zeros only (not made by the copy-out runs today)
      kernels::CopyRun z = r;
      z.src_offset = 0;
      z.len = 0;
      by_slot[0].push_back(z);
    }
  }
  copy_out_from_.clear();
  for (const auto& runs : by_slot)
    copy_out_from_.emplace_back(kernels::ExecTarget::host, runs);
  if (!gather_windows_) {
    // The shards move into the window once; the parameters show them there from the next
    // reshard on (until then they show the same values in the old storage).
    Tensor& shards = store().shards();
    std::memcpy(slot(I.rank), shards.data(), gsn * dtype_size(I.orig_dtype));
    shards = Tensor::from_owner(ag_.owner(), slot(I.rank), {I.shard_numel}, I.orig_dtype,
                                MemorySpace::host);
  }
}

void ShmTransport::prepare_reduce() {
  if (rs_ready_) return;
  rs_ready_ = true;
  const Geometry& I = geo();
  rs_detail_ =
      std::to_string(I.shard_numel) + " x " + dtype_name(I.reduce_dtype) + ", group " + name();
  rs_label_ = "reduce_scatter on shared memory of '" + shm_.name() + "' (" + rs_detail_ + ")";
  rs_done_label_ = "end of " + rs_label_;
  // The block of rank t (this rank; two levels: the rank of its place on each node) of every
  // member and outer index (the copy-in runs of t's slot): where it lies in the arena, where
  // in the shard, its valid and padded elements.
  rs_runs_.clear();
  const int nodes = split_ ? split_->nodes() : 1;
  for (int n = 0; n < nodes; ++n)
    rs_runs_.push_back(runs_of(split_ ? split_->dim_rank(n, shm_.rank()) : I.rank));
}

std::vector<kernels::CopyRun> ShmTransport::runs_of(int t) const {
  std::vector<kernels::CopyRun> runs;
  for (const kernels::GroupMember& m : layout().members) {
    const ShardLayout& l = m.layout;
    const std::int64_t D = l.global_shape[static_cast<std::size_t>(l.placement.dim())];
    for (std::int64_t o = 0; o < l.outer; ++o) {
      kernels::CopyRun r;
      r.src_offset = m.arena_offset + (o * D + std::min(t * l.chunk, D)) * l.inner;
      r.dst_offset = m.slot_offset + o * l.chunk * l.inner;
      r.len = l.rows_of(t) * l.inner;
      r.pad = l.chunk * l.inner - r.len;
      if (r.len == 0 && r.pad == 0) continue;
      if (!runs.empty()) {
        kernels::CopyRun& last = runs.back();
        if (last.pad == 0 && last.dst_offset + last.len == r.dst_offset &&
            last.src_offset + last.len == r.src_offset) {
          last.len += r.len;
          last.pad = r.pad;
          continue;
        }
      }
      runs.push_back(r);
    }
  }
  return runs;
}

}  // namespace

std::unique_ptr<GroupTransport> make_shm_transport(GroupSpec spec, const comm::ShmComm& shm,
                                                   const NodeSplit* split) {
  return std::make_unique<ShmTransport>(std::move(spec), shm, split);
}

}  // namespace fullshard::transport::detail
