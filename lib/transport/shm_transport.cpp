#include "lib/transport/shm_transport.hpp"

#include <algorithm>
#include <cstring>

#include "fullshard/kernels/multi_source.hpp"
#include "lib/transport/comm_transport.hpp"

namespace fullshard::transport::detail {
namespace {

// Counters of both windows: [0] rounds published by the rank, [1] rounds the rank finished
// reading from its peers.
constexpr int kPublished = 0;
constexpr int kRead = 1;

class ShmTransport final : public CommTransport {
 public:
  ShmTransport(GroupSpec spec, const comm::ShmComm& shm)
      : CommTransport(Kind::shm, std::move(spec)), shm_(shm) {}

  // The cast shard goes to this rank's segment, where peers read it.
  comm::Work gather_copy_in(Device& dev, Channel c, Held&) override {
    ensure_gather();
    return cast_shard(dev, c, ag_.local());
  }

  // Publishes this rank's shard (the copy-out reads every peer's directly). Without a cast
  // the shard is published where it is stored; a storage adopted since (checkpoint load) is
  // copied to the segment first.
  comm::Work all_gather(Device& dev, Channel c, Held&, bool in_place) override {
    dev.before_collective(c);
    ensure_gather();
    const Geometry& I = geo();
    const comm::ShmWindow win = ag_;
    const std::uint64_t round = ++ag_round_;
    count(&comm::Traffic::all_gather, I.param_dtype);
    const void* stored = in_place ? nullptr : store().shards().data();
    const bool copy = stored && stored != win.local();
    const DType t = I.param_dtype;
    const std::int64_t n = I.shard_numel;
    const Tensor keep = copy ? store().shards() : Tensor();
    const kernels::ExecStream& on = dev.exec(c);
    return dev.submit(c, stream(dev, c), ag_label_, [=, &on] {
      if (copy) kernels::cast_copy(on, keep.data(), t, win.local(), t, n);
      on.fence();
      win.publish(kPublished, round);
    });
  }

  // The all-gather and its copy-out in one pass: every peer's slot straight into the arena.
  comm::Work gather_copy_out(Device& dev, Channel c, const Held* src, bool from_slices, Held& arena,
                             Held* keep, int k) override {
    if (from_slices) return CommTransport::gather_copy_out(dev, c, src, true, arena, keep, k);
    const Geometry& I = geo();
    const comm::ShmWindow& win = ag_;
    const std::uint64_t round = ag_round_;
    win.wait_all(kPublished, round, "all_gather", ag_detail_);
    const kernels::ExecStream& on = dev.exec(c);
    for (int q = 0; q < I.world; ++q)
      kernels::run_copies(copy_out_from_[static_cast<std::size_t>(q)], win.segment(q),
                          I.param_dtype, arena.tensor.data(), I.param_dtype, on);
    if (keep) {
      // reshard_after_forward=k: the W/k slots this rank serves in its k-rank group.
      const int per = I.world / k;
      const std::size_t slot = static_cast<std::size_t>(I.shard_numel) * dtype_size(I.param_dtype);
      for (int j = 0; j < per; ++j)
        std::memcpy(
            static_cast<std::byte*>(keep->tensor.data()) + static_cast<std::size_t>(j) * slot,
            win.segment((I.rank % k) * per + j), slot);
    }
    on.fence();
    ag_read_ = round;
    win.publish(kRead, round);
    return comm::Work();
  }

  // Nothing to copy: peers read their chunks from the gradient window.
  comm::Work reduce_copy_in(Device& dev, Channel c, Held&, Held&) override {
    return dev.run(c, stream(dev, c), label("copy_in of group "), [] {});
  }

  // External gradients go into the gradient window, where peers read their chunks; a
  // parameter without a gradient contributes zeros.
  comm::Work external_copy_in(Device& dev, Channel c, std::vector<Tensor> grads, Held&) override {
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
  // all-reduce.
  comm::Work reduce_scatter(Device& dev, Channel c, Held&, Held& output,
                            const ReduceSpec& spec) override {
    const Geometry I = geo();
    const comm::ShmWindow win = grads_;
    const std::uint64_t round = ++rs_round_;
    count(&comm::Traffic::reduce_scatter, I.reduce_dtype);
    DType out_t = I.reduce_dtype;
    double divisor = 1.0;
    bool acc = false;
    Tensor out = output.tensor;
    if (fusions().copy_out_in_reduce) {
      out = store().gradients_for_write();
      out_t = I.orig_dtype;
      divisor = spec.divisor;
      acc = spec.accumulate;
    }
    const std::vector<kernels::CopyRun>* runs = &rs_runs_;
    const std::string* about = &rs_detail_;
    return dev.submit(c, stream(dev, c), rs_label_, [=] {
      // The backward compute has written the gradients (the engine ordered this stream after
      // the compute stream); peers may read them from here on.
      win.publish(kPublished, round);
      win.wait_all(kPublished, round, "reduce_scatter", *about);
      const std::size_t in_size = dtype_size(I.param_dtype);
      const std::size_t out_size = dtype_size(out_t);
      std::vector<const void*> sources(static_cast<std::size_t>(I.world));
      auto* to_base = static_cast<std::byte*>(out.data());
      for (const kernels::CopyRun& r : *runs) {
        for (int q = 0; q < I.world; ++q)
          sources[static_cast<std::size_t>(q)] =
              win.segment(q) + static_cast<std::size_t>(r.src_offset) * in_size;
        std::byte* to = to_base + static_cast<std::size_t>(r.dst_offset) * out_size;
        kernels::reduce_sources(sources.data(), I.world, I.param_dtype, I.reduce_dtype, to, out_t,
                                r.len, divisor, acc);
        if (r.pad > 0 && !acc)  // padding stays zero (+0 is all zero bits in every dtype)
          std::memset(to + static_cast<std::size_t>(r.len) * out_size, 0,
                      static_cast<std::size_t>(r.pad) * out_size);
      }
      win.publish(kRead, round);
    });
  }

  comm::Work reduce_copy_out(Device& dev, Channel c, Held& src, const ReduceSpec& spec) override {
    // Done by the reduce-scatter: this operation completes with it.
    if (fusions().copy_out_in_reduce) return dev.last(c);
    return CommTransport::reduce_copy_out(dev, c, src, spec);
  }

  // The unsharded gradients live in the group's window, where peers read their chunks; the
  // pool buffer only keeps the pool's accounting.
  void take_grads_buffer(Held& grads) override {
    void* window = writable_grads_window();
    grads_pool_ = std::move(grads.tensor);
    grads.tensor = Tensor::from_owner(grads_.owner(), window, grads_pool_.shape(),
                                      grads_pool_.dtype(), MemorySpace::host);
  }
  // The window stays; its next writer waits for the readers (writable_grads_window).
  void return_grads_buffer(Held& grads) override {
    grads_pool_ = Tensor();
    grads.used = comm::Work();
  }

  // Every peer must have read this rank's last published shard. A gather this rank dropped
  // unread (reshard with the gather in flight) counts as read.
  void before_shards_change() override {
    if (!ag_.valid()) return;
    if (ag_read_ < ag_round_) {
      ag_read_ = ag_round_;
      ag_.publish(kRead, ag_round_);
    }
    ag_.wait_all(kRead, ag_round_, "all_gather (peers still reading)", ag_detail_);
  }

 private:
  const comm::ShmComm& shm_;
  comm::ShmWindow ag_;     // per rank: the group shard in param dtype (the storage without a cast)
  comm::ShmWindow grads_;  // per rank: the unsharded gradients (arena layout, param dtype)
  Tensor grads_pool_;      // the pool buffer standing for grads_ while the engine holds it
  std::uint64_t ag_round_ = 0;  // all-gathers published
  std::uint64_t ag_read_ = 0;   // all-gathers whose peers' shards this rank has read
  std::uint64_t rs_round_ = 0;  // reduce-scatters published
  std::vector<kernels::CopyPlan> copy_out_from_;  // per rank: the copy-out runs of its slot
  std::vector<kernels::CopyRun> rs_runs_;         // this rank's chunks: arena -> shard offset
  std::string ag_detail_, rs_detail_;             // "<gsn> x <dtype>, group <name>"
  std::string ag_label_, rs_label_;  // "all_gather on shared memory of '<comm>' (<detail>)"

  // Counts one collective (the whole buffer: W shards of dtype t) in the shared memory's traffic.
  void count(std::uint64_t comm::Traffic::*kind, DType t) const {
    comm::Traffic traffic;
    traffic.*kind = static_cast<std::uint64_t>(geo().world) *
                    static_cast<std::uint64_t>(geo().shard_numel) * dtype_size(t);
    shm_.count(traffic);
  }

  // The group's shared-memory gradient window, once every rank has read its last round
  // (allocated on first use): where this rank's unsharded gradients are written next.
  void* writable_grads_window() {
    ensure_grads();
    grads_.wait_all(kRead, rs_round_, "reduce_scatter (peers still reading)", rs_detail_, true);
    return grads_.local();
  }

  // Allocates the all-gather window on first use (collective over the shard group, at the
  // group's first all-gather: the same point on every rank) and, without a cast, moves the
  // sharded storage into it (peers read the shards where they are stored).
  void ensure_gather();
  // Allocates the gradient window on first use (collective, the first pre-backward).
  void ensure_grads();
};

void ShmTransport::ensure_gather() {
  if (ag_.valid()) return;
  const Geometry& I = geo();
  const auto gsn = static_cast<std::size_t>(I.shard_numel);
  ag_ = shm_.allocate(gsn * dtype_size(I.param_dtype), "fsdp.all_gather:" + name());
  ag_detail_ = std::to_string(gsn) + " x " + dtype_name(I.param_dtype) + ", group " + name();
  ag_label_ = "all_gather on shared memory of '" + shm_.name() + "' (" + ag_detail_ + ")";
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
  if (!I.cast()) {
    // The shards move into the window once; the parameters show them there from the next
    // reshard on (until then they show the same values in the old storage).
    Tensor& shards = store().shards();
    std::memcpy(ag_.local(), shards.data(), gsn * dtype_size(I.orig_dtype));
    shards = Tensor::from_owner(ag_.owner(), ag_.local(), {I.shard_numel}, I.orig_dtype,
                                MemorySpace::host);
  }
}

void ShmTransport::ensure_grads() {
  if (grads_.valid()) return;
  const Geometry& I = geo();
  grads_ = shm_.allocate(static_cast<std::size_t>(I.arena_numel) * dtype_size(I.param_dtype),
                         "fsdp.grads:" + name());
  rs_detail_ =
      std::to_string(I.shard_numel) + " x " + dtype_name(I.reduce_dtype) + ", group " + name();
  rs_label_ = "reduce_scatter on shared memory of '" + shm_.name() + "' (" + rs_detail_ + ")";
  // This rank's block of every member and outer index (the copy-in runs of its slot): where
  // it lies in the arena, where in the shard, its valid and padded elements.
  rs_runs_.clear();
  for (const kernels::GroupMember& m : layout().members) {
    const ShardLayout& l = m.layout;
    const std::int64_t D = l.global_shape[static_cast<std::size_t>(l.placement.dim())];
    for (std::int64_t o = 0; o < l.outer; ++o) {
      kernels::CopyRun r;
      r.src_offset = m.arena_offset + (o * D + std::min(I.rank * l.chunk, D)) * l.inner;
      r.dst_offset = m.slot_offset + o * l.chunk * l.inner;
      r.len = l.rows_of(I.rank) * l.inner;
      r.pad = l.chunk * l.inner - r.len;
      if (r.len == 0 && r.pad == 0) continue;
      if (!rs_runs_.empty()) {
        kernels::CopyRun& last = rs_runs_.back();
        if (last.pad == 0 && last.dst_offset + last.len == r.dst_offset &&
            last.src_offset + last.len == r.src_offset) {
          last.len += r.len;
          last.pad = r.pad;
          continue;
        }
      }
      rs_runs_.push_back(r);
    }
  }
}

}  // namespace

std::unique_ptr<GroupTransport> make_shm_transport(GroupSpec spec, const comm::ShmComm& shm) {
  return std::make_unique<ShmTransport>(std::move(spec), shm);
}

}  // namespace fullshard::transport::detail
