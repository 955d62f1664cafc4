#include "lib/fsdp/running_backend.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>

#include "fullshard/base/error.hpp"
#include "fullshard/kernels/multi_source.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/tensor/staging.hpp"
#include "lib/fsdp/param_group.hpp"

namespace fullshard::fsdp::detail {

using engine::Buf;
using engine::Event;
using engine::OpDesc;
using engine::StreamKind;

namespace {

Channel channel_of(StreamKind s) {
  switch (s) {
    case StreamKind::all_gather:
      return Channel::all_gather;
    case StreamKind::reduce_scatter:
      return Channel::reduce_scatter;
    case StreamKind::all_reduce:
      return Channel::all_reduce;
    case StreamKind::compute:
      break;
  }
  return Channel::main;
}

std::byte* bytes(const Tensor& t) {
  return static_cast<std::byte*>(t.data());
}

// The stream whose operation first writes a buffer of this kind (where it is acquired).
StreamKind first_user(engine::BufKind k) {
  switch (k) {
    case engine::BufKind::ag_buffer:
      return StreamKind::all_gather;
    case engine::BufKind::unsharded:
    case engine::BufKind::post_forward:
    case engine::BufKind::grads:
      return StreamKind::compute;
    case engine::BufKind::rs_input:
    case engine::BufKind::rs_output:
    case engine::BufKind::partial_reduce:
      break;
  }
  return StreamKind::reduce_scatter;
}

// "<op kind> of group <name>": an operation's label, built only when a message needs it.
std::string op_label(const char* kind, const void* name, std::uint64_t, std::uint64_t) {
  return std::string(kind) + " of group " + *static_cast<const std::string*>(name);
}

comm::LazyLabel op_label(const OpDesc& d, const ParamGroup& p) {
  return comm::LazyLabel(&op_label, engine::op_kind_name(d.kind), p.shared_name());
}

// "record on <stream>": static text, so recording builds no string.
const char* record_label(StreamKind s) noexcept {
  switch (s) {
    case StreamKind::compute:
      return "record on compute";
    case StreamKind::all_gather:
      return "record on all_gather";
    case StreamKind::reduce_scatter:
      return "record on reduce_scatter";
    case StreamKind::all_reduce:
      return "record on all_reduce";
  }
  return "record";
}

}  // namespace

RunningBackend::RunningBackend() = default;

RootContext::~RootContext() {
  try {
    engine::wait_reductions(root, 0);
  } catch (...) {  // errors were the iteration's to report; a destructor only cleans up
  }
}

ParamGroup& RunningBackend::pg(const engine::Group& g) const {
  return *groups[static_cast<std::size_t>(g.id)];
}

comm::Stream& RunningBackend::stream(const engine::Group& g, StreamKind s) const {
  if (device_mesh_) return dstream(s);
  return pg(g).mesh().stream(channel_of(s));
}

comm::Stream& RunningBackend::dstream(StreamKind s) const {
  if (s == StreamKind::compute) return device_mesh_->compute_stream();
  return device_mesh_->device_stream(channel_of(s));
}

void RunningBackend::bind(const ParamGroup& g) {
  const DeviceMesh& m = g.mesh();
  if (g.offloaded()) offloaded_ = true;
  if (bound_) {
    if (m.device_type() != device_type_)
      throw InvalidArgument("fully_shard: groups " + bound_group_ + " (a " +
                            device_type_name(device_type_) + " mesh) and " + g.name() + " (a " +
                            device_type_name(m.device_type()) + " mesh, " + m.describe() +
                            ") are under one FSDP root; every group of a root must be on the "
                            "same device type");
    return;
  }
  bound_ = true;
  device_type_ = m.device_type();
  bound_group_ = g.name();
  if (device_type_ != DeviceType::cuda) return;
  device_mesh_.emplace(m);
  device_pool_ = std::make_unique<StreamOrderedPool>(MemorySpace::device, "fsdp:" + g.name());
  pool.device = device_pool_.get();
  for (int s = 0; s < engine::kNumStreams; ++s)
    exec_[s] = kernels::ExecStream::device(dstream(static_cast<StreamKind>(s)).native_handle());
}

Event RunningBackend::device_op(const OpDesc& d, const engine::Group& g,
                                const std::function<void()>& enqueue) {
  // The previous operation of the stream must not have failed (known errors only: no wait).
  last_[static_cast<int>(d.stream)].test();
  return done(d, dstream(d.stream).submit(op_label(d, pg(g)), enqueue));
}

void RunningBackend::gather_stream_after_compute() {
  if (!gather_after_compute_) return;
  gather_after_compute_ = false;
  dstream(StreamKind::all_gather).wait(dstream(StreamKind::compute).record());
}

void RunningBackend::use(const Buf& b, StreamKind s) {
  const Tensor& t = mem(b).tensor;
  if (pool.device && t.nbytes() > 0) pool.device->used_on(t, dstream(s));
}

Tensor RunningBackend::offload_staging(const ParamGroup& p, StreamKind s) {
  if (!p.offloaded() || p.offload_pinned()) return Tensor();
  return device_pool_->acquire({p.layout().shard_numel}, p.orig_dtype(), dstream(s),
                               "offload_staging", p.name());
}

void RunningBackend::offload_copy(const ParamGroup& p, void* dst, const void* src, StreamKind s,
                                  const char* what) {
  ::fullshard::detail::copy_async(
      dst, src, static_cast<std::size_t>(p.layout().shard_numel) * dtype_size(p.orig_dtype()),
      dstream(s).native_handle(), [&] {
        return std::string("CPUOffloadPolicy of group ") + p.name() + ": " + what + " on the " +
               engine::stream_name(s) + " stream";
      });
}

Event RunningBackend::done(const OpDesc& d, comm::Work w) {
  if (op_log) op_log->push_back(d);
  last_[static_cast<int>(d.stream)] = w;
  Event e;
  e.op = d.id;
  e.work = std::move(w);
  return e;
}

Event RunningBackend::on_stream(const OpDesc& d, const engine::Group& g,
                                std::function<void()> kernel) {
  if (d.stream == StreamKind::compute) {
    kernel();
    return done(d, comm::Work());
  }
  comm::Stream& s = stream(g, d.stream);
  // The previous operation of the stream (a collective) must have succeeded: re-raise its
  // error instead of copying what it did not write.
  comm::Work before = last_[static_cast<int>(d.stream)];
  if (s.runs_inline()) {
    before.test();
    kernel();
    return done(d, comm::Work());
  }
  return done(d, s.submit(op_label(d, pg(g)), [before, k = std::move(kernel)] {
    before.test();
    k();
  }));
}

Event RunningBackend::collective(const OpDesc& d, const engine::Group& g, const std::string& label,
                                 std::function<void()> op) {
  comm::Stream& s = stream(g, d.stream);
  comm::Work before = last_[static_cast<int>(d.stream)];
  return done(d, s.submit(label, [before, o = std::move(op)] {
    before.test();
    o();
  }));
}

void RunningBackend::stream_wait(StreamKind waiter, const Event& e) {
  if (device_mesh_) {  // cudaStreamWaitEvent: the host does not block
    dstream(waiter).wait(e.work.event());
    return;
  }
  if (waiter == StreamKind::compute || groups.empty()) return;  // the engine waits on the host
  comm::Stream& s = groups.front()->mesh().stream(channel_of(waiter));
  if (s.runs_inline())
    e.work.test();  // finished already (caller streams run at submit): its error, if any
  else
    s.wait(e.work.event());
}

void RunningBackend::stream_record(StreamKind s, Event& e) {
  if (device_mesh_) {
    // An event after everything enqueued on the CUDA stream so far (operations that enqueue
    // nothing, such as a reshard, have no event of their own).
    e.work = dstream(s).submit(comm::LazyLabel(record_label(s)), [] {});
    return;
  }
  // Operations of one stream finish in order: the last one's completion is the stream's.
  e.work = last_[static_cast<int>(s)];
}

// ---- memory -------------------------------------------------------------------------------

void* RunningBackend::writable_grads_window(ParamGroup& p) {
  // Every rank (this one's reduction too, on a worker stream) must have read the last round
  // before the window is written again.
  p.ensure_shm_grads();
  ShmGroupState& st = p.shm_state();
  st.grads.wait_all(ShmGroupState::kRead, st.rs_round, "reduce_scatter (peers still reading)",
                    st.rs_detail, true);
  return st.grads.local();
}

Buf RunningBackend::acquire(const engine::Group& g, engine::BufKind kind, std::int64_t numel,
                            DType dtype) {
  Buf b;
  b.kind = kind;
  b.held = true;
  b.bytes = static_cast<std::size_t>(numel) * dtype_size(dtype);
  if (free_slots_.empty()) {
    free_slots_.push_back(static_cast<int>(memory_.size()));
    memory_.emplace_back();
  }
  b.slot = free_slots_.back();
  free_slots_.pop_back();
  if (pool.device) {
    // Stream-ordered: a block last used on other streams is handed out after their release
    // events (on the device, cudaStreamWaitEvent).
    mem(b).tensor = pool.device->acquire({numel}, dtype, dstream(first_user(kind)),
                                         engine::buf_kind_name(kind), pg(g).name());
    pool.device_in_use += b.bytes;
    pool.device_peak = std::max(pool.device_peak, pool.device_in_use);
    return b;
  }
  mem(b).tensor = pool.host.acquire({numel}, dtype, engine::buf_kind_name(kind), pg(g).name());
  ParamGroup& p = pg(g);
  if (kind == engine::BufKind::grads && p.shm() && g.info.world > 1) {
    // Shared memory: the unsharded gradients live in the group's window, where peers read
    // their chunks; the pool buffer only keeps the pool's accounting.
    writable_grads_window(p);
    ShmGroupState& st = p.shm_state();
    st.grads_pool = std::move(mem(b).tensor);
    mem(b).tensor =
        Tensor::from_owner(st.grads.owner(), st.grads.local(), {numel}, dtype, MemorySpace::host);
  }
  return b;
}

void RunningBackend::release(const engine::Group& g, Buf& b) {
  if (b.kind == engine::BufKind::grads && b.held && pg(g).shm() && g.info.world > 1) {
    // The window stays; its next user waits for the readers (acquire).
    pg(g).shm_state().grads_pool = Tensor();
    b = Buf();
    return;
  }
  // The bytes go back to the pool with the last view, once the operation using them ran
  // (worker streams run it later): at the point the engine says, on every kind of stream.
  // On the device the pool records an event on every stream the block was used on instead:
  // no host wait.
  Memory& m = mem(b);
  if (pool.device)
    pool.device_in_use -= std::min(pool.device_in_use, b.bytes);
  else
    m.used.wait();
  m = Memory();
  free_slots_.push_back(b.slot);
  b = Buf();
}

RunningBackend::Memory& RunningBackend::mem(const Buf& b) {
  if (!b.held || b.slot < 0 || static_cast<std::size_t>(b.slot) >= memory_.size())
    throw InvalidArgument("fsdp engine: a " + std::string(engine::buf_kind_name(b.kind)) +
                          " buffer without memory (internal)");
  return memory_[static_cast<std::size_t>(b.slot)];
}

// ---- operations ---------------------------------------------------------------------------

Event RunningBackend::gather_copy_in(const OpDesc& d, engine::Group& g, Buf& dst) {
  ParamGroup& p = pg(g);
  const auto& I = g.info;
  void* to =
      bytes(mem(dst).tensor) +
      (I.world > 1 ? static_cast<std::size_t>(I.rank * I.shard_numel) * dtype_size(I.param_dtype)
                   : 0);
  if (p.shm() && I.world > 1) {
    // Shared memory: the cast shard goes to this rank's segment, where peers read it.
    p.ensure_shm_gather();
    to = p.shm_state().ag.local();
  }
  const void* from = p.sharded().data();
  const kernels::ExecStream& on = exec(d.stream);
  if (device_mesh_) {
    gather_stream_after_compute();
    // CPUOffloadPolicy: the cast kernel reads pinned host shards in place (the H2D is fused
    // into the copy-in); pageable ones are copied into a device staging buffer first.
    const Tensor staged = offload_staging(p, d.stream);
    Event e = device_op(d, g, [&] {
      if (staged.data()) {
        offload_copy(p, staged.data(), from, d.stream, "host-to-device copy of the shard");
        from = staged.data();
      }
      kernels::cast_copy(on, from, I.orig_dtype, to, I.param_dtype, I.shard_numel);
    });
    use(dst, d.stream);
    return e;
  }
  Event e = on_stream(d, g, [=, &on] {
    kernels::cast_copy(on, from, I.orig_dtype, to, I.param_dtype, I.shard_numel);
  });
  mem(dst).used = e.work;
  return e;
}

Event RunningBackend::all_gather(const OpDesc& d, engine::Group& g, Buf& dst, bool in_place,
                                 Buf* slices) {
  ParamGroup& p = pg(g);
  const auto& I = g.info;
  comm::Stream& s = stream(g, d.stream);
  // The copy-in before it: on the device the same CUDA stream orders it.
  if (!device_mesh_) exec(d.stream).fence();
  const std::size_t gsn = static_cast<std::size_t>(I.shard_numel);
  if (device_mesh_) {
    gather_stream_after_compute();
    use(dst, d.stream);
    if (slices) use(*slices, d.stream);
  }
  if (slices) {
    const std::size_t block = static_cast<std::size_t>(I.world / d.k) * gsn;
    return done(d,
                p.post_forward_comm().all_gather(mem(*slices).tensor.data(), mem(dst).tensor.data(),
                                                 block, I.param_dtype, s));
  }
  if (p.shm()) {
    // Shared memory: publish this rank's shard (the copy-out reads every peer's directly).
    p.ensure_shm_gather();
    ShmGroupState& st = p.shm_state();
    const comm::ShmWindow win = st.ag;
    const std::uint64_t round = ++st.ag_round;
    st.gather_pending = true;
    comm::Traffic traffic;
    traffic.all_gather = static_cast<std::uint64_t>(I.world) * gsn * dtype_size(I.param_dtype);
    p.shm()->count(traffic);
    // Without a cast the shard is published where it is stored; a storage adopted since
    // (checkpoint load) is copied to the segment first.
    const void* stored = in_place ? nullptr : p.sharded().data();
    const bool copy = stored && stored != win.local();
    const DType t = I.param_dtype;
    const std::int64_t n = I.shard_numel;
    Tensor keep = copy ? p.sharded() : Tensor();
    const kernels::ExecStream& on = exec(d.stream);
    return collective(d, g, st.ag_label, [=, &on] {
      if (copy) kernels::cast_copy(on, keep.data(), t, win.local(), t, n);
      on.fence();
      win.publish(ShmGroupState::kPublished, round);
    });
  }
  void* own =
      bytes(mem(dst).tensor) + static_cast<std::size_t>(I.rank) * gsn * dtype_size(I.param_dtype);
  const void* send = in_place ? own : p.sharded().data();
  if (device_mesh_ && !in_place && p.offloaded()) {
    // CPUOffloadPolicy without a cast: NCCL sends device memory, so the host shard is copied
    // (cudaMemcpyAsync, DMA from pinned memory) into this rank's slot of the all-gather
    // buffer on the all-gather stream, and the all-gather runs in place after it.
    offload_copy(p, own, send, d.stream, "host-to-device copy of the shard");
    send = own;
  }
  return done(d, p.ag_comm().all_gather(send, mem(dst).tensor.data(), gsn, I.param_dtype, s));
}

Event RunningBackend::gather_copy_out(const OpDesc& d, engine::Group& g, const Buf* src, Buf& arena,
                                      Buf* keep) {
  ParamGroup& p = pg(g);
  const auto& I = g.info;
  if (p.shm() && p.shm_state().gather_pending) {
    // The all-gather and its copy-out in one pass: every peer's slot straight into the arena.
    ShmGroupState& st = p.shm_state();
    st.gather_pending = false;
    const comm::ShmWindow& win = st.ag;
    const std::uint64_t round = st.ag_round;
    win.wait_all(ShmGroupState::kPublished, round, "all_gather", st.ag_detail);
    const kernels::ExecStream& on = exec(d.stream);
    for (int q = 0; q < I.world; ++q)
      kernels::run_copies(st.copy_out_from[static_cast<std::size_t>(q)], win.segment(q),
                          I.param_dtype, mem(arena).tensor.data(), I.param_dtype, on);
    if (keep) {
      // reshard_after_forward=k: the W/k slots this rank serves in its k-rank group.
      const int k = g.reshard_after_forward;
      const int per = I.world / k;
      const std::size_t slot = static_cast<std::size_t>(I.shard_numel) * dtype_size(I.param_dtype);
      for (int j = 0; j < per; ++j)
        std::memcpy(
            static_cast<std::byte*>(mem(*keep).tensor.data()) + static_cast<std::size_t>(j) * slot,
            win.segment((I.rank % k) * per + j), slot);
    }
    on.fence();
    st.ag_read = round;
    win.publish(ShmGroupState::kRead, round);
    return done(d, comm::Work());
  }
  const void* from = src ? mem(*src).tensor.data() : p.sharded().data();
  if (device_mesh_) {
    // Copy-out (and the kept slice) as kernels on the operation's stream. Without a gather
    // buffer (one rank, no cast) the kernel reads the shards themselves: pinned host shards
    // (CPUOffloadPolicy) in place, pageable ones after a copy into a device staging buffer.
    void* to = mem(arena).tensor.data();
    void* kept = keep ? mem(*keep).tensor.data() : nullptr;
    const std::size_t block = keep ? keep->bytes : 0;
    const int k = g.reshard_after_forward;
    const kernels::ExecStream& on = exec(d.stream);
    const Tensor staged = src ? Tensor() : offload_staging(p, d.stream);
    Event e = device_op(d, g, [&] {
      if (staged.data()) {
        offload_copy(p, staged.data(), from, d.stream, "host-to-device copy of the shard");
        from = staged.data();
      }
      kernels::run_copies(p.copy_out_plan(), from, I.param_dtype, to, I.param_dtype, on);
      if (kept)
        kernels::cast_copy(
            on, static_cast<const std::byte*>(from) + static_cast<std::size_t>(I.rank % k) * block,
            I.param_dtype, kept, I.param_dtype,
            static_cast<std::int64_t>(block / dtype_size(I.param_dtype)));
    });
    use(arena, d.stream);
    if (src) use(*src, d.stream);
    if (keep) use(*keep, d.stream);
    return e;
  }
  kernels::run_copies(p.copy_out_plan(), from, I.param_dtype, mem(arena).tensor.data(),
                      I.param_dtype, exec(d.stream));
  if (keep) {
    // reshard_after_forward=k: keep the W/k slots this rank serves in its k-rank group.
    const int k = g.reshard_after_forward;
    const std::size_t block = keep->bytes;
    exec(d.stream).fence();  // the slice is copied by the host
    std::memcpy(mem(*keep).tensor.data(),
                static_cast<const std::byte*>(from) + static_cast<std::size_t>(I.rank % k) * block,
                block);
  }
  return done(d, comm::Work());
}

Event RunningBackend::grad_init(const OpDesc& d, engine::Group& g, Buf& grads) {
  if (device_mesh_) {
    // A kernel on the compute stream writing zeros: runs of padding only (nothing read), in
    // blocks of 64 Ki elements (the device kernel gives each run one team), built once per
    // group.
    const DType t = g.info.param_dtype;
    const auto n = static_cast<std::int64_t>(grads.bytes / dtype_size(t));
    const auto id = static_cast<std::size_t>(g.id);
    if (zero_plans_.size() <= id) zero_plans_.resize(id + 1);
    if (zero_plans_[id].elements_written() != n) {
      constexpr std::int64_t kBlock = std::int64_t{1} << 16;
      std::vector<kernels::CopyRun> runs;
      for (std::int64_t at = 0; at < n; at += kBlock) {
        kernels::CopyRun zeros;
        zeros.dst_offset = at;
        zeros.pad = std::min(kBlock, n - at);
        runs.push_back(zeros);
      }
      zero_plans_[id] = kernels::CopyPlan(kernels::ExecTarget::device, runs);
    }
    void* ptr = mem(grads).tensor.data();
    const kernels::ExecStream& on = exec(d.stream);
    Event e = device_op(d, g, [&] {
      if (n > 0) kernels::run_copies(zero_plans_[id], ptr, t, ptr, t, on);
    });
    use(grads, d.stream);
    return e;
  }
  if (grads.bytes) std::memset(mem(grads).tensor.data(), 0, grads.bytes);
  return done(d, comm::Work());
}

Event RunningBackend::reduce_copy_in(const OpDesc& d, engine::Group& g, Buf& grads, Buf& input) {
  if (!grads.held) return external_copy_in(d, g, input);
  ParamGroup& p = pg(g);
  const auto& I = g.info;
  const void* from = mem(grads).tensor.data();
  void* to = mem(input).tensor.data();
  const kernels::CopyPlan* plan = &p.copy_in_plan();
  if (p.shm() && I.world > 1) {
    // Shared memory: nothing to copy, peers read their chunks from the gradient window.
    return on_stream(d, g, [] {});
  }
  if (device_mesh_) {
    const kernels::ExecStream& on = exec(d.stream);
    Event e = device_op(
        d, g, [&] { kernels::run_copies(*plan, from, I.param_dtype, to, I.reduce_dtype, on); });
    use(grads, d.stream);
    use(input, d.stream);
    return e;
  }
  // The kernel holds the buffers until it ran (worker streams run it later).
  Tensor keep_from = mem(grads).tensor;
  Tensor keep_to = mem(input).tensor;
  const kernels::ExecStream& on = exec(d.stream);
  Event e = on_stream(d, g, [=, &on] {
    (void)keep_from;
    (void)keep_to;
    kernels::run_copies(*plan, from, I.param_dtype, to, I.reduce_dtype, on);
  });
  mem(grads).used = mem(input).used = e.work;
  return e;
}

// External gradients (a front end's autograd allocated them): each parameter's grad() is
// read where it is, the one copy of the reduction's input. With shared memory they go into
// the group's gradient window (where peers read their chunks), else straight into the
// rank-major input; a parameter without a gradient contributes zeros.
Event RunningBackend::external_copy_in(const OpDesc& d, engine::Group& g, Buf& input) {
  ParamGroup& p = pg(g);
  const auto& I = g.info;
  std::vector<Tensor> grads;  // held until the copies ran (worker streams run them later)
  grads.reserve(p.params().size());
  for (const graph::Parameter* param : p.params()) {
    const Tensor& t = param->grad();
    if (t.data() && (t.dtype() != I.param_dtype || t.numel() != param->numel()))
      throw InvalidArgument("fsdp group " + p.name() + ": the gradient of '" + param->fqn() +
                            "' is a " + dtype_name(t.dtype()) + " tensor of shape " +
                            shape_string(t.shape()) + ", expected " + dtype_name(I.param_dtype) +
                            " " + shape_string(param->shape()) + " (the unsharded parameter)");
    grads.push_back(t.data() ? t : Tensor());
  }
  if (p.shm() && I.world > 1) {
    auto* window = static_cast<std::byte*>(writable_grads_window(p));
    const std::size_t es = dtype_size(I.param_dtype);
    // The layout lives with the group, as the copy plans below do.
    const std::vector<kernels::GroupMember>* members = &p.layout().members;
    return on_stream(d, g, [grads = std::move(grads), window, es, members] {
      for (std::size_t i = 0; i < grads.size(); ++i) {
        const kernels::GroupMember& m = (*members)[i];
        std::byte* to = window + static_cast<std::size_t>(m.arena_offset) * es;
        const std::size_t bytes = static_cast<std::size_t>(numel(m.layout.global_shape)) * es;
        if (grads[i].data())
          std::memcpy(to, grads[i].data(), bytes);
        else
          std::memset(to, 0, bytes);
      }
    });
  }
  void* to = mem(input).tensor.data();
  std::vector<const kernels::CopyPlan*> plans;
  plans.reserve(grads.size());
  for (std::size_t i = 0; i < grads.size(); ++i)
    plans.push_back(&p.member_copy_in_plan(i, !grads[i].data()));
  const kernels::ExecStream& on = exec(d.stream);
  const DType from_t = I.param_dtype, to_t = I.reduce_dtype;
  auto run = [grads = std::move(grads), plans = std::move(plans), to, from_t, to_t, &on] {
    for (std::size_t i = 0; i < grads.size(); ++i)
      kernels::run_copies(*plans[i], grads[i].data() ? grads[i].data() : to, from_t, to, to_t, on);
  };
  if (device_mesh_) {
    Event e = device_op(d, g, run);
    use(input, d.stream);
    return e;
  }
  Tensor keep_to = mem(input).tensor;
  Event e = on_stream(d, g, [run = std::move(run), keep_to] {
    (void)keep_to;
    run();
  });
  mem(input).used = e.work;
  return e;
}

Event RunningBackend::reduce_scatter(const OpDesc& d, engine::Group& g, Buf& input, Buf& output) {
  const auto& I = g.info;
  ParamGroup& p = pg(g);
  if (p.shm()) {
    // Shared memory: sum this rank's chunk of every peer's input. Without HSDP the divide,
    // the cast and the accumulation into the sharded gradients are fused in (reduce_copy_out
    // then has nothing left to do); with HSDP the sum goes to `output` for the all-reduce.
    ShmGroupState& st = p.shm_state();
    const comm::ShmWindow win = st.grads;
    const std::uint64_t round = ++st.rs_round;
    const bool fused = I.replicate == 1;
    comm::Traffic traffic;
    traffic.reduce_scatter = static_cast<std::uint64_t>(I.world) *
                             static_cast<std::uint64_t>(I.shard_numel) * dtype_size(I.reduce_dtype);
    p.shm()->count(traffic);
    DType out_t = I.reduce_dtype;
    double divisor = 1.0;
    bool acc = false;
    Tensor keep_out = mem(output).tensor;
    if (fused) {
      p.ensure_sharded_grads();
      keep_out = p.sharded_grads();
      out_t = I.orig_dtype;
      // What the engine's reduce_copy_out asks for (checked there).
      divisor = g.divide_factor > 0 ? g.divide_factor : static_cast<double>(I.world) * I.replicate;
      acc = g.has_sharded_grads;
      st.rs_fused = true;
      st.rs_divisor = divisor;
      st.rs_accumulate = acc;
    }
    const std::vector<kernels::CopyRun>* runs = &st.rs_runs;
    const std::string* about = &st.rs_detail;
    Event e = collective(d, g, st.rs_label, [=] {
      // The backward compute has written the gradients (the engine ordered this stream after
      // the compute stream); peers may read them from here on.
      win.publish(ShmGroupState::kPublished, round);
      win.wait_all(ShmGroupState::kPublished, round, "reduce_scatter", *about);
      const std::size_t in_size = dtype_size(I.param_dtype);
      const std::size_t out_size = dtype_size(out_t);
      std::vector<const void*> sources(static_cast<std::size_t>(I.world));
      auto* out = static_cast<std::byte*>(keep_out.data());
      for (const kernels::CopyRun& r : *runs) {
        for (int q = 0; q < I.world; ++q)
          sources[static_cast<std::size_t>(q)] =
              win.segment(q) + static_cast<std::size_t>(r.src_offset) * in_size;
        std::byte* to = out + static_cast<std::size_t>(r.dst_offset) * out_size;
        kernels::reduce_sources(sources.data(), I.world, I.param_dtype, I.reduce_dtype, to, out_t,
                                r.len, divisor, acc);
        if (r.pad > 0 && !acc)  // padding stays zero (+0 is all zero bits in every dtype)
          std::memset(to + static_cast<std::size_t>(r.len) * out_size, 0,
                      static_cast<std::size_t>(r.pad) * out_size);
      }
      win.publish(ShmGroupState::kRead, round);
    });
    mem(input).used = mem(output).used = e.work;
    return e;
  }
  if (device_mesh_) {
    // NCCL's pre-multiplied sum: each rank's input is scaled by 1/divisor inside the
    // reduction (FSDP2's gradient divide factor), so the copy-out only casts and accumulates.
    // The divisor is the one the engine's copy-out asks for (checked there). 16-bit reductions
    // sum here and divide in the copy-out: NCCL would round 1/divisor to the reduce dtype
    // (1/3 -> 0.3340 in bf16) before the sum, where the host path divides in f32. Ordered
    // after the copy-in by the stream.
    const bool premul = I.reduce_dtype == DType::f32 || I.reduce_dtype == DType::f64;
    const double divisor =
        g.divide_factor > 0 ? g.divide_factor : static_cast<double>(I.world) * I.replicate;
    if (prescaled_.size() <= static_cast<std::size_t>(g.id))
      prescaled_.resize(static_cast<std::size_t>(g.id) + 1, 0.0);
    prescaled_[static_cast<std::size_t>(g.id)] = premul ? divisor : 0.0;
    use(input, d.stream);
    use(output, d.stream);
    void* in = mem(input).tensor.data();
    void* out = mem(output).tensor.data();
    const auto n = static_cast<std::size_t>(I.shard_numel);
    return done(d, premul ? p.rs_comm().reduce_scatter_divided(in, out, n, I.reduce_dtype, divisor,
                                                               stream(g, d.stream))
                          : p.rs_comm().reduce_scatter(in, out, n, I.reduce_dtype,
                                                       comm::ReduceOp::sum, stream(g, d.stream)));
  }
  exec(d.stream).fence();  // the copy-in before it
  return done(
      d, pg(g).rs_comm().reduce_scatter(mem(input).tensor.data(), mem(output).tensor.data(),
                                        static_cast<std::size_t>(I.shard_numel), I.reduce_dtype,
                                        comm::ReduceOp::sum, stream(g, d.stream)));
}

Event RunningBackend::all_reduce(const OpDesc& d, engine::Group& g, Buf& data) {
  const auto& I = g.info;
  // What the reduce-scatter stream wrote into it (on the device: the engine's event wait).
  if (device_mesh_)
    use(data, d.stream);
  else
    exec(StreamKind::reduce_scatter).fence();
  return done(d, pg(g).ar_comm().all_reduce(mem(data).tensor.data(), mem(data).tensor.data(),
                                            static_cast<std::size_t>(I.shard_numel), I.reduce_dtype,
                                            comm::ReduceOp::sum, stream(g, d.stream)));
}

Event RunningBackend::accumulate(const OpDesc& d, engine::Group& g, Buf& src, Buf& dst, bool acc) {
  const auto& I = g.info;
  Tensor from = mem(src).tensor;
  Tensor to = mem(dst).tensor;
  const kernels::ExecStream& on = exec(d.stream);
  if (device_mesh_) {
    Event e = device_op(d, g, [&] {
      kernels::reduce_copy_out(on, from.data(), I.reduce_dtype, to.data(), I.reduce_dtype,
                               I.shard_numel, 1.0, acc);
    });
    use(src, d.stream);
    use(dst, d.stream);
    return e;
  }
  Event e = on_stream(d, g, [=, &on] {
    kernels::reduce_copy_out(on, from.data(), I.reduce_dtype, to.data(), I.reduce_dtype,
                             I.shard_numel, 1.0, acc);
  });
  mem(src).used = mem(dst).used = e.work;
  return e;
}

Event RunningBackend::reduce_copy_out(const OpDesc& d, engine::Group& g, const Buf& src,
                                      double divisor, bool acc) {
  ParamGroup& p = pg(g);
  const auto& I = g.info;
  if (p.shm() && p.shm_state().rs_fused) {
    ShmGroupState& st = p.shm_state();
    st.rs_fused = false;
    if (divisor != st.rs_divisor || acc != st.rs_accumulate)
      throw Error("group " + p.name() + ": the shared-memory reduce-scatter divided by " +
                  std::to_string(st.rs_divisor) + (st.rs_accumulate ? " accumulating" : "") +
                  " but the copy-out asks for " + std::to_string(divisor) +
                  (acc ? " accumulating" : "") + " (internal: engine and backend disagree)");
    // Done by the reduce-scatter: this operation completes with it.
    return done(d, last_[static_cast<int>(d.stream)]);
  }
  p.ensure_sharded_grads();
  Tensor from = mem(src).tensor;
  Tensor to = p.sharded_grads();
  const kernels::ExecStream& on = exec(d.stream);
  if (device_mesh_) {
    // What the reduce-scatter's pre-multiplied sum divided by is not divided again.
    double rest = divisor;
    if (static_cast<std::size_t>(g.id) < prescaled_.size()) {
      double& pre = prescaled_[static_cast<std::size_t>(g.id)];
      if (pre > 0) rest = divisor / pre;
      pre = 0.0;
    }
    // CPUOffloadPolicy: the kernel writes (and accumulates into) pinned host gradients in
    // place (the D2H is fused into the copy-out); pageable ones go through a device staging
    // buffer: the old gradients in (when accumulating), the kernel, the result out (a copy
    // into pageable memory returns once done: the host blocks here, as FSDP2's).
    const Tensor staged = offload_staging(p, d.stream);
    void* out = staged.data() ? staged.data() : to.data();
    Event e = device_op(d, g, [&] {
      if (staged.data() && acc)
        offload_copy(p, out, to.data(), d.stream, "host-to-device copy of the sharded gradients");
      kernels::reduce_copy_out(on, from.data(), I.reduce_dtype, out, I.orig_dtype, I.shard_numel,
                               rest, acc);
      if (staged.data())
        offload_copy(p, to.data(), out, d.stream,
                     "device-to-host copy of the reduced gradient shard");
    });
    use(src, d.stream);
    return e;
  }
  return on_stream(d, g, [=, &on] {
    kernels::reduce_copy_out(on, from.data(), I.reduce_dtype, to.data(), I.orig_dtype,
                             I.shard_numel, divisor, acc);
  });
}

Event RunningBackend::reshard(const OpDesc& d, engine::Group&) {
  return done(d, comm::Work());
}

Event RunningBackend::compute(const OpDesc& d, graph::Module& m, engine::Phase phase) {
  const auto& cb = phase == engine::Phase::forward ? m.forward_callback() : m.backward_callback();
  if (cb && device_mesh_) {
    // The callback enqueues its kernels on the compute stream (after the copy-outs there); the
    // event recorded after them orders the reduce-scatter stream. No host synchronisation. It
    // runs here, not inside the stream's submit, so that its exception leaves forward() /
    // backward() at once, as on the host (a submit keeps it in the Work until a later test).
    const auto t0 = std::chrono::steady_clock::now();
    const std::string name = m.fqn().empty() ? "<root>" : m.fqn();
    const std::string what = (phase == engine::Phase::forward ? "fwd(" : "bwd(") + name + ")";
    cb(m);
    Event e = done(d, dstream(StreamKind::compute).submit(what, [] {}));
    if (compute_recorder) compute_recorder(what, t0, std::chrono::steady_clock::now());
    return e;
  }
  if (cb) {
    exec(StreamKind::compute).fence();  // the copy-outs the callback reads
    const auto t0 = std::chrono::steady_clock::now();
    cb(m);
    if (compute_recorder) {
      const std::string name = m.fqn().empty() ? "<root>" : m.fqn();
      compute_recorder((phase == engine::Phase::forward ? "fwd(" : "bwd(") + name + ")", t0,
                       std::chrono::steady_clock::now());
    }
  }
  return done(d, comm::Work());
}

void RunningBackend::host_wait(const OpDesc& d, const std::vector<Event>& events) {
  if (op_log) op_log->push_back(d);
  if (device_mesh_) {
    // FSDP2's wait for the reductions on the device: the compute stream waits for their
    // events (cudaStreamWaitEvent), the host only re-raises errors already known.
    // CPUOffloadPolicy (FSDP2's finalize_backward synchronising its grad offload events): the
    // host also blocks until the reduced gradient shards are in host memory, before anything
    // on the host reads them (clip_grad_norm, the optimizer step on the host shards), and
    // until the all-gather stream has passed its last read of the host shards (a prefetch
    // that backward did not use), before the host optimizer writes them.
    std::exception_ptr first;
    for (const Event& e : events) {
      try {
        if (offloaded_)
          e.work.wait();
        else
          e.work.test();
        dstream(StreamKind::compute).wait(e.work.event());
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (offloaded_) {
      try {
        dstream(StreamKind::all_gather).record().synchronize();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    gather_after_compute_ = true;  // the next iteration's first all-gather
    if (first) std::rethrow_exception(first);
    return;
  }
  for (const auto& e : exec_)
    e.fence();
  std::exception_ptr first;
  for (const Event& e : events) {
    try {
      e.work.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

void RunningBackend::host_wait(const Event& e) {
  if (device_mesh_) {
    // On the device the compute stream waits instead of the host (cudaStreamWaitEvent): for
    // an all-gather before its copy-out, for a reduction before the sharded gradients are
    // used. Errors already known are re-raised here.
    e.work.test();
    dstream(StreamKind::compute).wait(e.work.event());
    return;
  }
  e.work.wait();
  exec(StreamKind::all_gather).fence();
}

void RunningBackend::drop_sharded_grads(engine::Group& g) {
  pg(g).drop_sharded_grads();
}

void RunningBackend::keep_external_grads(engine::Group& g, bool keep) {
  pg(g).keep_external_grads(keep);
}

// ---- registration -------------------------------------------------------------------------

void RunningBackend::show_sharded(engine::Group& g) {
  ParamGroup& p = pg(g);
  if (p.shm() && p.shm_state().ag.valid()) {
    // The shards may change from here on (optimizer, checkpoint load): every peer must have
    // read this rank's last published shard. A gather this rank dropped unread (reshard with
    // the gather in flight) counts as read.
    ShmGroupState& st = p.shm_state();
    st.gather_pending = false;
    if (st.ag_read < st.ag_round) {
      st.ag_read = st.ag_round;
      st.ag.publish(ShmGroupState::kRead, st.ag_round);
    }
    st.ag.wait_all(ShmGroupState::kRead, st.ag_round, "all_gather (peers still reading)",
                   st.ag_detail);
  }
  p.show_sharded();
}
// The host sees the parameters and gradients from here on: the kernels that made them are
// finished first.
void RunningBackend::show_unsharded(engine::Group& g) {
  if (!device_mesh_) exec(StreamKind::compute).fence();
  pg(g).show_unsharded(mem(g.arena).tensor);
}
void RunningBackend::show_unsharded_grads(engine::Group& g) {
  if (g.external_grads) {
    pg(g).show_external_grads(g.external_grads_kept);
    return;
  }
  if (!device_mesh_) exec(StreamKind::compute).fence();
  pg(g).show_unsharded_grads(mem(g.grads).tensor);
}
void RunningBackend::show_sharded_grads(engine::Group& g) {
  pg(g).show_sharded_grads();
}

}  // namespace fullshard::fsdp::detail
