#include "lib/fsdp/running_backend.hpp"

#include <cstring>
#include <exception>

#include "fullshard/base/error.hpp"
#include "lib/fsdp/param_group.hpp"

namespace fullshard::fsdp::detail {

using engine::Buf;
using engine::Event;
using engine::OpDesc;
using engine::StreamKind;

namespace {

// The stream whose operation first writes a buffer of this kind (where it is acquired).
comm::StreamKind first_user(engine::BufKind k) {
  switch (k) {
    case engine::BufKind::ag_buffer:
      return comm::StreamKind::all_gather;
    case engine::BufKind::unsharded:
    case engine::BufKind::post_forward:
    case engine::BufKind::grads:
      return comm::StreamKind::compute;
    case engine::BufKind::rs_input:
    case engine::BufKind::rs_output:
    case engine::BufKind::partial_reduce:
      break;
  }
  return comm::StreamKind::reduce_scatter;
}

}  // namespace

RunningBackend::RunningBackend() = default;
RunningBackend::~RunningBackend() = default;

RootContext::~RootContext() {
  try {
    engine::wait_reductions(root, 0);
  } catch (...) {  // errors were the iteration's to report; a destructor only cleans up
  }
}

// A reduction ends on the all-reduce stream under HSDP, else on the reduce-scatter stream
// (where a shared-memory or compressed reduce-scatter writes the gradients itself).
Tensor RunningBackend::reduced_scratch(const ParamGroup& g) {
  const auto ends_on = [this](const ParamGroup& x) {
    return &device_->stream(x.engine().info.replicate > 1 ? comm::StreamKind::all_reduce
                                                          : comm::StreamKind::reduce_scatter,
                            x.mesh());
  };
  const comm::Stream* s = ends_on(g);
  const std::int64_t gsn = g.layout().shard_numel;
  Tensor& scratch = reduced_scratch_[s];
  if (scratch.numel() < gsn) {
    std::int64_t most = gsn;  // sized once for every group whose reductions end there
    for (const ParamGroup* o : groups)
      if (o->engine().updates_in_backward() && !o->engine().grads_are_sharded() &&
          !transport::update_in_copy_out(o->engine().info) && ends_on(*o) == s)
        most = std::max(most, o->layout().shard_numel);
    scratch =
        Tensor::empty({most}, g.orig_dtype(), g.shard_space(),
                      "fsdp.reduced_gradients (optimizer inside backward)", MemoryPart::gradients);
  }
  return scratch.flat_view(0, {gsn});
}

ParamGroup& RunningBackend::pg(const engine::Group& g) const {
  return *groups[static_cast<std::size_t>(g.id)];
}

transport::GroupTransport& RunningBackend::transport(const engine::Group& g) const {
  return pg(g).transport();
}

void RunningBackend::bind(ParamGroup& g) {
  const DeviceMesh& m = g.mesh();
  if (!device_) {
    device_type_ = m.device_type();
    bound_group_ = g.name();
    device_ = transport::make_device(m, g.name());
  } else if (m.device_type() != device_type_) {
    throw InvalidArgument("fully_shard: groups " + bound_group_ + " (a " +
                          device_type_name(device_type_) + " mesh) and " + g.name() + " (a " +
                          device_type_name(m.device_type()) + " mesh, " + m.describe() +
                          ") are under one FSDP root; every group of a root must be on the "
                          "same device type");
  }
  g.transport().attach(*device_);
}

Event RunningBackend::done(const OpDesc& d, comm::Work w) {
  if (op_log) op_log->push_back(d);
  device_->set_last(d.stream, w);
  Event e;
  e.op = d.id;
  e.work = std::move(w);
  return e;
}

void RunningBackend::used(const OpDesc& d, const Buf& b, const comm::Work& w) {
  device_->used(mem(b), d.stream, w);
}

void RunningBackend::stream_wait(StreamKind waiter, const Event& e) {
  if (device_) device_->wait(waiter, e.work);
}

void RunningBackend::stream_record(StreamKind s, Event& e) {
  e.work = device_ ? device_->record(s) : comm::Work();
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
  transport::Held& m = mem(b);
  // Buffers the transport keeps in its own memory (shared-memory windows) or never uses are
  // only counted (the plan's pool peak has them; schedule::plan_memory leaves them out).
  m.tensor = counted_only(g, kind)
                 ? device_->reserve(numel, dtype, engine::buf_kind_name(kind), pg(g).name())
                 : device_->acquire(first_user(kind), numel, dtype, engine::buf_kind_name(kind),
                                    pg(g).name());
  if (kind == engine::BufKind::grads) transport(g).take_grads_buffer(m);
  return b;
}

bool RunningBackend::counted_only(const engine::Group& g, engine::BufKind kind) const {
  const transport::GroupTransport& t = transport(g);
  const transport::Fusions f = t.fusions();
  switch (kind) {
    case engine::BufKind::grads:
      return t.provides_grads();
    case engine::BufKind::ag_buffer:  // a gather from the post-forward slices reads the buffer
      return f.gather_buffer_unused && g.state != engine::ShardedState::sharded_post_forward;
    case engine::BufKind::rs_input:
      return f.reduce_input_unused;
    case engine::BufKind::rs_output:
      return f.reduce_output_unused;
    default:
      return false;
  }
}

// The memory goes back once the operations using it ran, at the point the engine says.
void RunningBackend::release(const engine::Group& g, Buf& b) {
  transport::Held& m = mem(b);
  if (b.kind == engine::BufKind::grads) transport(g).return_grads_buffer(m);
  device_->release(m, b.bytes);
  m = transport::Held();
  free_slots_.push_back(b.slot);
  b = Buf();
}

transport::Held& RunningBackend::mem(const Buf& b) {
  if (!b.held || b.slot < 0 || static_cast<std::size_t>(b.slot) >= memory_.size())
    throw InvalidArgument("fsdp engine: a " + std::string(engine::buf_kind_name(b.kind)) +
                          " buffer without memory (internal)");
  return memory_[static_cast<std::size_t>(b.slot)];
}

// ---- operations: each one transport call ----------------------------------------------------

Event RunningBackend::gather_copy_in(const OpDesc& d, engine::Group& g, Buf& dst) {
  comm::Work w = transport(g).gather_copy_in(*device_, d.stream, mem(dst));
  used(d, dst, w);
  return done(d, std::move(w));
}

Event RunningBackend::all_gather(const OpDesc& d, engine::Group& g, Buf& dst, bool in_place,
                                 Buf* slices) {
  transport::GroupTransport& t = transport(g);
  const comm::StreamKind c = d.stream;
  comm::Work w = slices ? t.all_gather_slices(*device_, c, mem(dst), mem(*slices), d.k)
                        : t.all_gather(*device_, c, mem(dst), in_place);
  used(d, dst, w);
  if (slices) used(d, *slices, w);
  return done(d, std::move(w));
}

Event RunningBackend::gather_copy_out(const OpDesc& d, engine::Group& g, const Buf* src, Buf& arena,
                                      Buf* keep) {
  // A group resharded after forward to k ranks gathers from its kept slices.
  const bool from_slices = g.state == engine::ShardedState::sharded_post_forward;
  comm::Work w = transport(g).gather_copy_out(*device_, d.stream, src ? &mem(*src) : nullptr,
                                              from_slices, mem(arena), keep ? &mem(*keep) : nullptr,
                                              g.reshard_after_forward.value());
  used(d, arena, w);
  if (src) used(d, *src, w);
  if (keep) used(d, *keep, w);
  return done(d, std::move(w));
}

Event RunningBackend::grad_init(const OpDesc& d, engine::Group& g, Buf& grads) {
  if (g.fresh_grads) {  // nothing written: the callbacks assign the first gradients
    if (!grads.held) pg(g).ensure_sharded_grads();
    for (graph::Parameter* p : pg(g).params())
      p->set_grad_fresh(true);
    return done(d, comm::Work());
  }
  if (!grads.held) {  // the sharded gradients stand for the unsharded ones
    pg(g).ensure_sharded_grads();
    transport::Held sharded;
    sharded.tensor = pg(g).sharded_grads();
    return done(d, transport(g).zero_grads(*device_, d.stream, sharded));
  }
  comm::Work w = transport(g).zero_grads(*device_, d.stream, mem(grads));
  used(d, grads, w);
  return done(d, std::move(w));
}

std::vector<Tensor> RunningBackend::external_grads(const ParamGroup& p) const {
  const auto& I = p.engine().info;
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
  return grads;
}

// Without held gradients the parameters' grad() are a front end's (autograd allocated them).
Event RunningBackend::reduce_copy_in(const OpDesc& d, engine::Group& g, Buf& grads, Buf& input) {
  const comm::StreamKind c = d.stream;
  comm::Work w =
      grads.held ? transport(g).reduce_copy_in(*device_, c, mem(grads), mem(input))
                 : transport(g).external_copy_in(*device_, c, external_grads(pg(g)), mem(input));
  if (grads.held) used(d, grads, w);
  used(d, input, w);
  return done(d, std::move(w));
}

Event RunningBackend::reduce_scatter(const OpDesc& d, engine::Group& g, Buf& input, Buf& output,
                                     const transport::ReduceSpec& spec) {
  comm::Work w = transport(g).reduce_scatter(*device_, d.stream, mem(input), mem(output), spec);
  used(d, input, w);
  used(d, output, w);
  return done(d, std::move(w));
}

Event RunningBackend::all_reduce(const OpDesc& d, engine::Group& g, Buf& data) {
  comm::Work w = transport(g).all_reduce(*device_, d.stream, mem(data));
  used(d, data, w);
  return done(d, std::move(w));
}

Event RunningBackend::accumulate(const OpDesc& d, engine::Group& g, Buf& src, Buf& dst, bool acc) {
  comm::Work w = transport(g).accumulate(*device_, d.stream, mem(src), mem(dst), acc);
  used(d, src, w);
  used(d, dst, w);
  return done(d, std::move(w));
}

Event RunningBackend::reduce_copy_out(const OpDesc& d, engine::Group& g, const Buf& src,
                                      const transport::ReduceSpec& spec) {
  comm::Work w = transport(g).reduce_copy_out(*device_, d.stream, mem(src), spec);
  used(d, src, w);
  return done(d, std::move(w));
}

// The update the reduction's last pass runs (ReduceSpec::update), prepared by the group's
// ShardUpdate for the stream it runs on.
const kernels::ElementUpdate* RunningBackend::prepare_update(engine::Group& g, StreamKind s) {
  ParamGroup& p = pg(g);
  ShardUpdate* update = p.shard_update();
  if (update == nullptr)
    throw InvalidArgument("fsdp group " + p.name() + ": no update to prepare (internal)");
  comm::Stream& st = device_->stream(s, p.mesh());
  prepared_update_ =
      update->prepare({p.name(), p.params(), p.layout(), p.sharded(),
                       p.space() == MemorySpace::device ? st.native_handle() : nullptr});
  return &prepared_update_;
}

// The update reads the sharded gradients the reduction wrote (stream order) and writes the
// shards and the optimizer's state; the next all-gather follows the end of backward's wait.
// Fused (variant 1): the reduction's last pass ran it; it completes with that pass.
Event RunningBackend::update_shards(const OpDesc& d, engine::Group& g) {
  const comm::StreamKind c = d.stream;
  if (d.variant == 1) return done(d, device_->last(c));
  ParamGroup& p = pg(g);
  if (!p.sharded_grads().data())
    throw InvalidArgument("fsdp group " + p.name() + ": no reduced gradients (internal)");
  const kernels::ElementUpdate u = *prepare_update(g, d.stream);
  const Tensor grads = p.sharded_grads();  // held until the update ran (a scratch may grow)
  const std::int64_t n = p.layout().shard_numel;
  const kernels::ExecStream& on = device_->exec(c);
  return done(d, device_->run(c, device_->stream(c, p.mesh()),
                              comm::LazyLabel("optimizer update of group ", p.shared_name()),
                              [u, grads, n, &on] {
                                kernels::apply_update(on, u, grads.data_as<const float>(), n);
                              }));
}

Event RunningBackend::reshard(const OpDesc& d, engine::Group&) {
  return done(d, comm::Work());
}

// The callback reads the copy-outs (the host's kernels finished; a device orders its compute
// stream after them) and enqueues its own work on the compute stream. It runs here, not
// inside a stream's submit, so that its exception leaves forward() / backward() at once.
Event RunningBackend::compute(const OpDesc& d, graph::Module& m, engine::Phase phase) {
  const auto& cb = phase == engine::Phase::forward ? m.forward_callback() : m.backward_callback();
  if (!cb) return done(d, comm::Work());
  device_->host_reads(comm::StreamKind::compute);
  const auto t0 = std::chrono::steady_clock::now();
  {
    // Its parameters' gradients hold values once the backward callback returns (or threw:
    // that iteration is discarded, and no stale mark may outlive it).
    struct Written {
      graph::Module& m;
      bool backward;
      ~Written() {
        if (backward)
          for (std::size_t i = 0; i < m.num_params(); ++i)
            m.param(i).set_grad_fresh(false);
      }
    } written{m, phase == engine::Phase::backward};
    cb(m);
  }
  const char* what = phase == engine::Phase::forward ? "fwd" : "bwd";
  static const std::string root = "<root>";
  const std::string& name = m.fqn().empty() ? root : m.fqn();
  Event e = done(d, device_->computed(what, name));
  if (compute_recorder)
    compute_recorder(std::string(what) + "(" + name + ")", t0, std::chrono::steady_clock::now());
  return e;
}

void RunningBackend::host_wait(const OpDesc& d, const std::vector<Event>& events) {
  if (op_log) op_log->push_back(d);
  std::vector<comm::Work> works;
  works.reserve(events.size());
  for (const Event& e : events)
    works.push_back(e.work);
  device_->host_wait(works);
}

void RunningBackend::host_wait(const Event& e) {
  device_->host_wait(e.work);
}

// What grad() shows is the group's gradient buffer (or the sharded gradients standing for
// it); a parameter still fresh had no callback write it.
void RunningBackend::settle_fresh_grads(engine::Group& g) {
  for (graph::Parameter* p : pg(g).params()) {
    if (!p->grad_fresh()) continue;
    p->set_grad_fresh(false);
    Tensor t = p->grad();
    if (t.data() && t.numel() > 0) std::memset(t.data(), 0, t.nbytes());
  }
}

void RunningBackend::drop_sharded_grads(engine::Group& g) {
  pg(g).drop_sharded_grads();
}

void RunningBackend::keep_external_grads(engine::Group& g, bool keep) {
  pg(g).keep_external_grads(keep);
}

// ---- registration -------------------------------------------------------------------------

// The shards may change from here on (optimizer, checkpoint load).
void RunningBackend::show_sharded(engine::Group& g) {
  transport(g).before_shards_change();
  pg(g).show_sharded();
}
// The host sees the parameters and gradients from here on: the kernels that made them are
// finished first.
void RunningBackend::show_unsharded(engine::Group& g) {
  device_->host_reads(comm::StreamKind::compute);
  pg(g).show_unsharded(g.arena.held ? mem(g.arena).tensor : pg(g).sharded());
}
void RunningBackend::show_unsharded_grads(engine::Group& g) {
  if (g.external_grads) {
    pg(g).show_external_grads(g.external_grads_kept);
    return;
  }
  device_->host_reads(comm::StreamKind::compute);
  pg(g).show_unsharded_grads(g.sharded_grads_live ? pg(g).sharded_grads() : mem(g.grads).tensor);
}
void RunningBackend::show_sharded_grads(engine::Group& g) {
  pg(g).show_sharded_grads();
}

}  // namespace fullshard::fsdp::detail
