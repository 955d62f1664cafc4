#include "lib/transport/comm_transport.hpp"

#include "fullshard/kernels/quantize.hpp"

namespace fullshard::transport::detail {
namespace {

std::byte* bytes(const Tensor& t) {
  return static_cast<std::byte*>(t.data());
}

// The shard a kernel on channel c reads: pageable offloaded shards are first copied into
// `staged` (a device buffer), pinned and device shards are read where they are.
const void* shard_source(const OffloadedShards* off, Device& dev, comm::StreamKind c,
                         const Tensor& staged, const void* from) {
  if (!staged.data()) return from;
  off->copy(dev, c, staged.data(), from, "host-to-device copy of the shard");
  return staged.data();
}

}  // namespace

CommTransport::CommTransport(Kind kind, GroupSpec spec)
    : GroupTransport(kind, std::move(spec),
                     kind == Kind::nccl ? kernels::ExecTarget::device : kernels::ExecTarget::host) {
  if (spec_.offloaded) offload_.emplace(spec_);
}

// CPUOffloadPolicy: the end of backward blocks the host until the reduced gradient shards
// are in host memory (the host optimizer steps on them).
void CommTransport::attach(Device& dev) {
  if (offload_) dev.hold_host_for_shards();
}

// CPUOffloadPolicy: the cast kernel reads pinned host shards in place (the host-to-device copy
// is fused into the copy-in); pageable ones are copied into a device staging buffer first.
// A compressed all-gather encodes the shard into its packed slot instead of casting it.
comm::Work CommTransport::cast_shard(Device& dev, comm::StreamKind c, void* to) {
  const Geometry I = geo();
  const void* from = store().shards().data();
  const Tensor staged = offload_ ? offload_->staging(dev, c) : Tensor();
  const OffloadedShards* off = offload_ ? &*offload_ : nullptr;
  Device* d = &dev;
  const kernels::ExecStream& on = dev.exec(c);
  return dev.run(c, stream(dev, c), label("copy_in of group "), [=, &on] {
    const void* src = shard_source(off, *d, c, staged, from);
    if (I.compressed_gather())
      kernels::quantize_packed(on, src, I.orig_dtype, I.shard_numel, I.quant_block(),
                               I.gather_code(), to);
    else
      kernels::cast_copy(on, src, I.orig_dtype, to, I.param_dtype, I.shard_numel);
  });
}

comm::Work CommTransport::gather_copy_in(Device& dev, comm::StreamKind c, Held& dst) {
  const Geometry& I = geo();
  const std::size_t slot =
      I.world > 1 ? static_cast<std::size_t>(I.rank) * I.gather_slot_bytes() : 0;
  return cast_shard(dev, c, bytes(dst.tensor) + slot);
}

comm::Work CommTransport::all_gather(Device& dev, comm::StreamKind c, Held& dst, bool in_place) {
  dev.before_collective(c);  // the copy-in before it (a device orders it by the stream)
  const Geometry& I = geo();
  const auto count = static_cast<std::size_t>(I.gather_slot_numel());  // compressed: packed
  void* own = bytes(dst.tensor) + static_cast<std::size_t>(I.rank) * I.gather_slot_bytes();
  const void* send = in_place ? own : store().shards().data();
  if (offload_ && !in_place) {
    // CPUOffloadPolicy without a cast: NCCL sends device memory, so the host shard is copied
    // (DMA from pinned memory) into this rank's slot of the all-gather buffer on the
    // all-gather stream, and the all-gather runs in place after it.
    offload_->copy(dev, c, own, send, "host-to-device copy of the shard");
    send = own;
  }
  return ag_comm_->all_gather(send, dst.tensor.data(), count, I.gather_dtype(), stream(dev, c));
}

// Copy-out (and the kept slice). Without a gather buffer (one rank, no cast) the kernel reads
// the shards themselves: pinned host shards (CPUOffloadPolicy) in place, pageable ones after a
// copy into a device staging buffer.
comm::Work CommTransport::gather_copy_out(Device& dev, comm::StreamKind c, const Held* src, bool,
                                          Held& arena, Held* keep, int k) {
  const Geometry I = geo();
  const void* from = src ? src->tensor.data() : store().shards().data();
  const Tensor staged = !src && offload_ ? offload_->staging(dev, c) : Tensor();
  const OffloadedShards* off = offload_ ? &*offload_ : nullptr;
  Device* d = &dev;
  void* to = arena.tensor.data();
  // reshard_after_forward=k: the W/k slots this rank serves in its k-rank group.
  void* kept = keep ? keep->tensor.data() : nullptr;
  const std::size_t block = keep ? keep->tensor.nbytes() : 0;
  const kernels::CopyPlan* plan = &copy_out_;
  const kernels::ExecStream& on = dev.exec(c);
  return dev.run(c, stream(dev, c), label("copy_out of group "), [=, &on] {
    const void* f = shard_source(off, *d, c, staged, from);
    if (I.compressed_gather() && src)  // decode fused into the copy-out
      kernels::run_dequantize_copies(*plan, f, I.shard_numel, I.quant_block(), I.gather_code(), to,
                                     I.param_dtype, on);
    else
      kernels::run_copies(*plan, f, I.param_dtype, to, I.param_dtype, on);
    if (kept)  // W/k slots, as gathered (compressed: packed codes)
      kernels::cast_copy(
          on, static_cast<const std::byte*>(f) + static_cast<std::size_t>(I.rank % k) * block,
          I.gather_dtype(), kept, I.gather_dtype(),
          static_cast<std::int64_t>(block / dtype_size(I.gather_dtype())));
  });
}

comm::Work CommTransport::reduce_copy_in(Device& dev, comm::StreamKind c, Held& grads,
                                         Held& input) {
  const Tensor from = grads.tensor;  // held by the kernel until it ran
  const Tensor to = input.tensor;
  const DType from_t = geo().param_dtype, to_t = geo().reduce_dtype;
  const kernels::CopyPlan* plan = &copy_in_;
  const kernels::ExecStream& on = dev.exec(c);
  return dev.run(c, stream(dev, c), label("copy_in of group "), [=, &on] {
    kernels::run_copies(*plan, from.data(), from_t, to.data(), to_t, on);
  });
}

// External gradients (a front end's autograd allocated them): each parameter's grad() is read
// where it is, the one copy of the reduction's input, straight into the rank-major input.
comm::Work CommTransport::external_copy_in(Device& dev, comm::StreamKind c,
                                           std::vector<Tensor> grads, Held& input) {
  return external_copy(dev, c, std::move(grads), input.tensor.data());
}

comm::Work CommTransport::reduce_scatter(Device& dev, comm::StreamKind c, Held& input, Held& output,
                                         const ReduceSpec& spec) {
  if (geo().compressed_reduce()) return compressed_reduce_scatter(dev, c, input, output, spec);
  dev.before_collective(c);  // the copy-in before it (a device orders it by the stream)
  const Geometry& I = geo();
  void* in = input.tensor.data();
  void* out = output.tensor.data();
  const auto n = static_cast<std::size_t>(I.shard_numel);
  // NCCL's pre-multiplied sum: each rank's input is scaled by 1/divisor inside the reduction
  // (FSDP2's gradient divide factor), so the copy-out only casts and accumulates.
  if (fusions().divide_in_reduce)
    return rs_comm_->reduce_scatter_divided(in, out, n, I.reduce_dtype, spec.divisor,
                                            stream(dev, c));
  return rs_comm_->reduce_scatter(in, out, n, I.reduce_dtype, comm::ReduceOp::sum, stream(dev, c));
}

// The int8 reduce-scatter (ZeRO++'s qgZ): every chunk of the rank-major input encoded into a
// packed slot, an all-to-all of the slots, and the slots this rank received decoded and summed
// in f32 in rank order (kernels::reduce_dequantize). Without HSDP that pass also divides, casts
// and accumulates into the sharded gradients (the copy-out is fused); with HSDP it writes the
// sum at the start of `output` for the replicate all-reduce. `output`:
// Geometry::compressed_reduce_bytes.
comm::Work CommTransport::compressed_reduce_scatter(Device& dev, comm::StreamKind c, Held& input,
                                                    Held& output, const ReduceSpec& spec) {
  const Geometry I = geo();
  const int W = I.world;
  const std::int64_t slot = I.packed_slot_bytes();
  const std::size_t rsz = dtype_size(I.reduce_dtype);
  const std::byte* in = bytes(input.tensor);
  std::byte* sent = bytes(output.tensor) + I.reduce_sum_bytes();
  std::byte* received = sent + static_cast<std::size_t>(W) * static_cast<std::size_t>(slot);
  const kernels::ExecStream& on = dev.exec(c);
  comm::Stream& s = stream(dev, c);
  const comm::Work encoded = dev.run(c, s, label("reduce_scatter encode of group "), [=, &on] {
    for (int q = 0; q < W; ++q)
      kernels::quantize_packed(
          on, in + static_cast<std::size_t>(q) * static_cast<std::size_t>(I.shard_numel) * rsz,
          I.reduce_dtype, I.shard_numel, I.quant_block(), kernels::QuantCode::int8,
          sent + static_cast<std::size_t>(q) * static_cast<std::size_t>(slot));
  });
  dev.before_collective(c);
  comm::Work sent_work =
      rs_comm_->all_to_all(sent, received, static_cast<std::size_t>(slot / 4), DType::f32, s);
  const bool fused = fusions().copy_out_in_reduce;
  if (fused && spec.update != nullptr)  // update_in_copy_out: the decode writes gradients
    throw InvalidArgument("group " + name() +
                          ": the int8 reduce-scatter cannot run the update (internal)");
  void* to = fused ? store().gradients_for_write().data() : bytes(output.tensor);
  const DType to_t = fused ? I.orig_dtype : I.reduce_dtype;
  const double divisor = fused ? spec.divisor : 1.0;
  const bool acc = fused && spec.accumulate;
  return dev.run(c, s, label("reduce_scatter decode of group "), [=, &on] {
    encoded.test();  // host: both ran before (stream order); their errors instead of decoding
    sent_work.test();
    kernels::reduce_dequantize(on, received, W, I.shard_numel, I.quant_block(),
                               kernels::QuantCode::int8, divisor, to, to_t, acc);
  });
}

// Divide (what the reduction did not), cast and accumulate into the sharded gradients.
// CPUOffloadPolicy: the kernel writes (and accumulates into) pinned host gradients in place
// (the device-to-host copy is fused into the copy-out); pageable ones go through a device
// staging buffer: the old gradients in (when accumulating), the kernel, the result out.
comm::Work CommTransport::reduce_copy_out(Device& dev, comm::StreamKind c, Held& src,
                                          const ReduceSpec& spec) {
  if (fusions().copy_out_in_reduce) return dev.last(c);  // done by the reduce-scatter
  const Geometry I = geo();
  const double divisor = fusions().divide_in_reduce ? 1.0 : spec.divisor;
  const bool acc = spec.accumulate;
  const Tensor from = src.tensor;
  const kernels::ExecStream& on = dev.exec(c);
  if (spec.update != nullptr) {  // the optimizer inside backward: no gradient is stored
    if (acc || offload_)
      throw InvalidArgument("group " + name() +
                            ": an update fused into the copy-out cannot accumulate or offload "
                            "(internal)");
    const kernels::ElementUpdate u = *spec.update;
    return dev.run(c, stream(dev, c), label("reduce_copy_out and update of group "), [=, &on] {
      kernels::reduce_update(on, from.data(), I.reduce_dtype, I.shard_numel, divisor, u);
    });
  }
  const Tensor to = store().gradients_for_write();
  const Tensor staged = offload_ ? offload_->staging(dev, c) : Tensor();
  const OffloadedShards* off = offload_ ? &*offload_ : nullptr;
  Device* d = &dev;
  void* out = staged.data() ? staged.data() : to.data();
  return dev.run(c, stream(dev, c), label("reduce_copy_out of group "), [=, &on] {
    if (staged.data() && acc)
      off->copy(*d, c, out, to.data(), "host-to-device copy of the sharded gradients");
    kernels::reduce_copy_out(on, from.data(), I.reduce_dtype, out, I.orig_dtype, I.shard_numel,
                             divisor, acc);
    if (staged.data())
      off->copy(*d, c, to.data(), out, "device-to-host copy of the reduced gradient shard");
  });
}

}  // namespace fullshard::transport::detail
