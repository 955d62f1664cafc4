#include "lib/fsdp/running_backend.hpp"

#include <cstring>
#include <exception>

#include "fullshard/base/error.hpp"
#include "fullshard/kernels/shard_copy.hpp"
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

}  // namespace

RunningBackend::RunningBackend() : pool(MemorySpace::host, "fsdp") {}

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
  return pg(g).mesh().stream(channel_of(s));
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
  return done(d, s.submit(engine::op_kind_name(d.kind) + std::string(" of group ") + pg(g).name(),
                          [before, k = std::move(kernel)] {
                            before.test();
                            k();
                          }));
}

void RunningBackend::stream_wait(StreamKind waiter, const Event& e) {
  if (waiter == StreamKind::compute || groups.empty()) return;  // the engine waits on the host
  comm::Stream& s = groups.front()->mesh().stream(channel_of(waiter));
  if (s.runs_inline())
    e.work.test();  // finished already (caller streams run at submit): its error, if any
  else
    s.wait(e.work.event());
}

void RunningBackend::stream_record(StreamKind s, Event& e) {
  // Operations of one stream finish in order: the last one's completion is the stream's.
  e.work = last_[static_cast<int>(s)];
}

// ---- memory -------------------------------------------------------------------------------

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
  mem(b).tensor =
      pool.acquire({numel}, dtype, std::string(engine::buf_kind_name(kind)) + ":" + pg(g).name());
  return b;
}

void RunningBackend::release(const engine::Group&, Buf& b) {
  // The bytes go back to the pool with the last view, once the operation using them ran
  // (worker streams run it later): at the point the engine says, on every kind of stream.
  Memory& m = mem(b);
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
  const void* from = p.sharded().data();
  const kernels::ExecStream& on = exec(d.stream);
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
  exec(d.stream).fence();  // the copy-in before it (an event on the same stream)
  const std::size_t gsn = static_cast<std::size_t>(I.shard_numel);
  if (slices) {
    const std::size_t block = static_cast<std::size_t>(I.world / d.k) * gsn;
    return done(d,
                p.post_forward_comm().all_gather(mem(*slices).tensor.data(), mem(dst).tensor.data(),
                                                 block, I.param_dtype, s));
  }
  const void* send = in_place ? bytes(mem(dst).tensor) + static_cast<std::size_t>(I.rank) * gsn *
                                                             dtype_size(I.param_dtype)
                              : p.sharded().data();
  return done(d, p.ag_comm().all_gather(send, mem(dst).tensor.data(), gsn, I.param_dtype, s));
}

Event RunningBackend::gather_copy_out(const OpDesc& d, engine::Group& g, const Buf* src, Buf& arena,
                                      Buf* keep) {
  ParamGroup& p = pg(g);
  const auto& I = g.info;
  const void* from = src ? mem(*src).tensor.data() : p.sharded().data();
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

Event RunningBackend::grad_init(const OpDesc& d, engine::Group&, Buf& grads) {
  if (grads.bytes) std::memset(mem(grads).tensor.data(), 0, grads.bytes);
  return done(d, comm::Work());
}

Event RunningBackend::reduce_copy_in(const OpDesc& d, engine::Group& g, Buf& grads, Buf& input) {
  ParamGroup& p = pg(g);
  const auto& I = g.info;
  const void* from = mem(grads).tensor.data();
  void* to = mem(input).tensor.data();
  const kernels::CopyPlan* plan = &p.copy_in_plan();
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

Event RunningBackend::reduce_scatter(const OpDesc& d, engine::Group& g, Buf& input, Buf& output) {
  const auto& I = g.info;
  exec(d.stream).fence();  // the copy-in before it
  return done(
      d, pg(g).rs_comm().reduce_scatter(mem(input).tensor.data(), mem(output).tensor.data(),
                                        static_cast<std::size_t>(I.shard_numel), I.reduce_dtype,
                                        comm::ReduceOp::sum, stream(g, d.stream)));
}

Event RunningBackend::all_reduce(const OpDesc& d, engine::Group& g, Buf& data) {
  const auto& I = g.info;
  exec(StreamKind::reduce_scatter).fence();  // what the reduce-scatter stream wrote into it
  return done(d, pg(g).ar_comm().all_reduce(mem(data).tensor.data(), mem(data).tensor.data(),
                                            static_cast<std::size_t>(I.shard_numel), I.reduce_dtype,
                                            comm::ReduceOp::sum, stream(g, d.stream)));
}

Event RunningBackend::accumulate(const OpDesc& d, engine::Group& g, Buf& src, Buf& dst, bool acc) {
  const auto& I = g.info;
  Tensor from = mem(src).tensor;
  Tensor to = mem(dst).tensor;
  const kernels::ExecStream& on = exec(d.stream);
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
  if (!p.sharded_grads().data())
    p.sharded_grads() =
        Tensor::empty({I.shard_numel}, I.orig_dtype, MemorySpace::host, "fsdp.grads:" + p.name());
  Tensor from = mem(src).tensor;
  Tensor to = p.sharded_grads();
  const kernels::ExecStream& on = exec(d.stream);
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
  e.work.wait();
  exec(StreamKind::all_gather).fence();
}

void RunningBackend::drop_sharded_grads(engine::Group& g) {
  pg(g).sharded_grads() = Tensor();
}

// ---- registration -------------------------------------------------------------------------

void RunningBackend::show_sharded(engine::Group& g) {
  pg(g).show_sharded();
}
// The host sees the parameters and gradients from here on: the kernels that made them are
// finished first.
void RunningBackend::show_unsharded(engine::Group& g) {
  exec(StreamKind::compute).fence();
  pg(g).show_unsharded(mem(g.arena).tensor);
}
void RunningBackend::show_unsharded_grads(engine::Group& g) {
  exec(StreamKind::compute).fence();
  pg(g).show_unsharded_grads(mem(g.grads).tensor);
}
void RunningBackend::show_sharded_grads(engine::Group& g) {
  pg(g).show_sharded_grads();
}

}  // namespace fullshard::fsdp::detail
