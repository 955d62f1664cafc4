#include "lib/fsdp/param_group.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstring>

#include "fullshard/base/error.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "lib/base/message_of.hpp"
#include "lib/fsdp/group_rules.hpp"
#include "lib/fsdp/running_backend.hpp"
#include "lib/tensor/staging.hpp"

namespace fullshard::fsdp {

using namespace detail;  // the root context and the running backend

namespace {

// Copies this rank's shard of a full host tensor into its slot (padding stays zero).
void copy_shard_in(const Tensor& full, const ShardLayout& l, void* slot) {
  const std::size_t es = dtype_size(full.dtype());
  const std::int64_t D = l.global_shape[static_cast<std::size_t>(l.placement.dim())];
  const auto* src = static_cast<const std::byte*>(full.data());
  auto* dst = static_cast<std::byte*>(slot);
  const std::int64_t run = l.local_rows * l.inner;
  for (std::int64_t o = 0; o < l.outer; ++o) {
    const std::int64_t from = (o * D + l.global_offset[l.placement.dim()]) * l.inner;
    std::memcpy(dst + static_cast<std::size_t>(o * l.chunk * l.inner) * es,
                src + static_cast<std::size_t>(from) * es, static_cast<std::size_t>(run) * es);
  }
}

// Fills this rank's shard of a parameter declared with init_sharded into its slot of `shards`
// (elements from `first`; padding stays zero): element (o, row, k) of the shard is the
// initialiser's value at its index in the full tensor, so no full tensor is made.
void fill_shard_in(const std::function<double(std::int64_t)>& fn, const ShardLayout& l,
                   Tensor& shards, std::int64_t first) {
  const std::int64_t D = l.global_shape[static_cast<std::size_t>(l.placement.dim())];
  const std::int64_t row0 = l.global_offset[l.placement.dim()];
  for (std::int64_t o = 0; o < l.outer; ++o)
    for (std::int64_t r = 0; r < l.local_rows; ++r) {
      const std::int64_t from = (o * D + row0 + r) * l.inner;
      const std::int64_t to = first + (o * l.chunk + r) * l.inner;
      for (std::int64_t k = 0; k < l.inner; ++k)
        shards.set(to + k, fn(from + k));
    }
}

}  // namespace

ParamGroup::ParamGroup(std::string name, std::vector<graph::Module*> modules,
                       std::vector<graph::Parameter*> params, std::vector<ShardLayout> layouts,
                       const DeviceMesh& mesh, const FullyShardOptions& options)
    : name_(std::make_shared<const std::string>(std::move(name))),
      modules_(std::move(modules)),
      params_(std::move(params)),
      mesh_(mesh) {
  engine::GroupInfo& I = engine_.info;
  I.name = *name_;
  I.module = modules_.front();
  I.num_modules = static_cast<int>(modules_.size());
  const std::string shard_dim = mesh.names().back();
  I.world = mesh.size(shard_dim);
  I.rank = mesh.coordinate(shard_dim);
  if (mesh.ndim() == 2) I.replicate = mesh.shape()[0];
  const bool on_device = mesh.device_type() == DeviceType::cuda;
  const MemorySpace space = on_device ? MemorySpace::device : MemorySpace::host;
  space_ = space;
  // CPUOffloadPolicy: the sharded parameters and gradients stay in host memory (on a CPU
  // mesh they are host memory anyway: the policy changes nothing there).
  shard_space_ = options.offload_policy ? MemorySpace::host : space;
  engine_.shards_offloaded = options.offload_policy.has_value();

  if (!params_.empty()) I.orig_dtype = params_[0]->dtype();
  for (auto* p : params_)
    check_group_dtype(*name_, *params_[0], *p);
  I.param_dtype = options.mp_policy.param_dtype.value_or(I.orig_dtype);
  I.reduce_dtype = options.mp_policy.reduce_dtype.value_or(I.param_dtype);
  I.wire = ::fullshard::fsdp::compression_wire(options.compression, *name_);
  offload_ = options.offload_policy;

  layout_ = kernels::make_group_layout(layouts);
  layout_.world = I.world;  // also for a group without parameters (as the planner's)
  I.shard_numel = layout_.shard_numel;
  I.arena_numel = layout_.arena_numel;

  // Sharded storage in slot layout, padding zero, in the mesh's memory; initial values from
  // the full tensors the user registered (then released: only the shard stays), or, for a
  // parameter declared with init_sharded, made for this rank's rows only. Initial values
  // may be host memory on any mesh (Parameter::init; copied to the device once, as FSDP2
  // moves CPU states to the mesh's device) or the mesh's own memory; device memory on a CPU
  // mesh is an error.
  // Under CPUOffloadPolicy the shards are host memory (pinned with pin_memory on a CUDA mesh)
  // and take the initial values directly.
  if (shard_space_ == MemorySpace::host) {
    sharded_ = new_shard_tensor("fsdp.sharded:" + *name_, MemoryPart::shards);
    std::memset(sharded_.data(), 0, sharded_.nbytes());
  } else {
    sharded_ = Tensor::zeros({layout_.shard_numel}, I.orig_dtype, space, "fsdp.sharded:" + *name_,
                             MemoryPart::shards);
  }
  const bool stage = sharded_.space() != MemorySpace::host;
  Tensor staging = stage ? Tensor::zeros({layout_.shard_numel}, I.orig_dtype, MemorySpace::host,
                                         "fsdp.staging:" + *name_)
                         : sharded_;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto* p = params_[i];
    const auto& m = layout_.members[i];
    const Tensor& full = p->data();
    if (p->initializer() && !full.data()) {  // sharded creation (Parameter::init_sharded)
      fill_shard_in(p->initializer(), m.layout, staging, m.slot_offset);
      p->clear_initializer();
      continue;
    }
    if (full.data() && full.numel() > 0) {
      if (full.shape() != p->shape() || full.dtype() != p->dtype())
        throw InvalidArgument("fully_shard(" + *name_ + "): parameter '" + p->fqn() + "' holds a " +
                              dtype_name(full.dtype()) + " tensor of shape " +
                              shape_string(full.shape()) + " but is declared " +
                              dtype_name(p->dtype()) + " " + shape_string(p->shape()));
      if (full.space() != MemorySpace::host && full.space() != space)
        throw InvalidArgument("fully_shard(" + *name_ + "): parameter '" + p->fqn() + "' is in " +
                              memory_space_name(full.space()) + " memory (cuda) but the mesh " +
                              mesh.describe() + " is a " + device_type_name(mesh.device_type()) +
                              " mesh (" + memory_space_name(space) +
                              " memory); give it host memory or make the mesh with "
                              "DeviceType::cuda");
      Tensor src = full;
      if (full.space() != MemorySpace::host) {
        src = Tensor::empty(full.shape(), full.dtype(), MemorySpace::host, "fsdp.staging");
        copy_bytes(src, full);
      }
      copy_shard_in(src, m.layout,
                    static_cast<std::byte*>(staging.data()) +
                        static_cast<std::size_t>(m.slot_offset) * dtype_size(I.orig_dtype));
    }
  }
  if (stage) copy_bytes(sharded_, staging);
  // The group's collectives: NCCL on a CUDA mesh; shared memory when the shard dim lies inside
  // a node, else MPI, on a CPU mesh.
  transport::GroupSpec spec;
  spec.name = name_;
  spec.geometry = &I;
  spec.layout = &layout_;
  spec.mesh = &mesh_;
  spec.store = this;
  spec.offloaded = offloaded();
  spec.pinned = offload_pinned();
  transport_ = transport::make_group_transport(std::move(spec));
  set_reshard_after_forward(options.reshard_after_forward);
  show_sharded();
}

ParamGroup::~ParamGroup() {
  if (engine_.gather_in_flight) {
    try {
      engine_.gather_done.work.wait();  // the collective writes into the gather buffer
    } catch (...) {                     // a destructor only cleans up
    }
  }
}

Tensor ParamGroup::new_shard_tensor(const std::string& label, MemoryPart part) const {
  const Shape shape{layout_.shard_numel};
  const DType t = engine_.info.orig_dtype;
  if (!offload_pinned()) return Tensor::empty(shape, t, shard_space_, label, part);
  try {
    return ::fullshard::detail::pinned_host_tensor(shape, t, label);
  } catch (const std::exception& e) {
    const std::size_t bytes = static_cast<std::size_t>(layout_.shard_numel) * dtype_size(t);
    throw ConfigError("fully_shard(" + name() +
                      "): CPUOffloadPolicy(pin_memory=true) could not allocate " +
                      std::to_string(bytes) + " bytes of page-locked host memory for '" + label +
                      "' (" + ::fullshard::detail::message_of(e) +
                      "); give the offload policy pin_memory=false (pageable memory, copies "
                      "that block the host) or raise the locked-memory limit");
  }
}

void ParamGroup::set_reshard_after_forward(ReshardAfterForward v) {
  const ReshardAfterForward r = v.for_shard_group(engine_.info.world, name());
  const int k = r.value();
  if (k > 1 && post_forward_k_ != k) {
    if (engine_.state == engine::ShardedState::sharded_post_forward)
      throw InvalidArgument("group " + name() +
                            ": reshard_after_forward cannot change between forward and "
                            "backward; call reshard() first");
    // The split is a collective on the all-gather communicator: nothing may be in flight on
    // its stream (every rank makes this call at the same point of the program).
    if (engine_.gather_in_flight) engine::reshard(engine_);
    mesh_.device_stream(comm::StreamKind::all_gather).synchronize();
    // Consecutive groups of k ranks (e.g. the ranks of a node); collective over the shard
    // group, made here while every rank makes the same call.
    transport_->split_post_forward(k);
    post_forward_k_ = k;
  }
  if (r.is_automatic() && ctx_) return;  // keep the value resolved at attach
  engine_.reshard_after_forward = r;
}

void ParamGroup::attach(std::shared_ptr<RootContext> ctx) {
  ctx->backend.bind(*this);
  ctx_ = std::move(ctx);
  engine_.id = static_cast<int>(ctx_->backend.groups.size());
  ctx_->backend.groups.push_back(this);
}

Tensor ParamGroup::gather_full() {
  const std::int64_t gsn = layout_.shard_numel;
  const int W = engine_.info.world;
  const DType od = engine_.info.orig_dtype;
  const MemorySpace space = space_;
  Tensor arena = Tensor::empty({layout_.arena_numel}, od, space, "fsdp.full:" + name());
  Tensor gathered = sharded_;
  // Device shards: the optimizer (or any user kernel) may still be writing them on the
  // compute stream; this cold path (state dicts, checkpoints) waits for the whole device.
  if (space != MemorySpace::host) Kokkos::fence();
  if (offloaded()) {
    // Host shards (CPUOffloadPolicy): the collective and the copy-out run on the device.
    gathered = Tensor::empty({gsn}, od, space, "fsdp.full_shard:" + name());
    copy_bytes(gathered, sharded_);
  }
  const Tensor shard = gathered;
  if (W > 1) {
    gathered = Tensor::empty({W * gsn}, od, space, "fsdp.full_gather");
    comm::Stream& s = mesh_.device_stream(comm::StreamKind::all_gather);
    transport_->gather_comm()
        .all_gather(shard.data(), gathered.data(), static_cast<std::size_t>(gsn), od, s)
        .wait();
  }
  kernels::run_copies(transport_->copy_out_plan(), gathered.data(), od, arena.data(), od);
  if (space == MemorySpace::host) return arena;
  // The callers (full state dicts, checkpoints) read the full values on the host.
  Tensor host = Tensor::empty({layout_.arena_numel}, od, MemorySpace::host, "fsdp.full:" + name());
  copy_bytes(host, arena);
  return host;
}

void ParamGroup::zero_grad() {
  if (ctx_) {
    engine::zero_grad(engine_);
    return;
  }
  drop_sharded_grads();
  engine_.has_sharded_grads = false;
  show_sharded_grads();
}

void ParamGroup::drop_sharded_grads() noexcept {
  // A group updated inside backward writes a shared scratch (RunningBackend::reduced_scratch):
  // nothing of its own to keep.
  if (engine_.updates_in_backward() && !engine_.grads_are_sharded())
    spare_grads_ = Tensor();
  else
    spare_grads_ = std::move(sharded_grads_);
  sharded_grads_ = Tensor();
}

Tensor& ParamGroup::gradients_for_write() {
  if (engine_.updates_in_backward() && ctx_ && !sharded_grads_.data()) {
    sharded_grads_ = ctx_->backend.reduced_scratch(*this);
    return sharded_grads_;
  }
  ensure_sharded_grads();
  return sharded_grads_;
}

void ParamGroup::ensure_sharded_grads() {
  if (sharded_grads_.data()) return;
  // Reused only while no one else refers to it: a gradient the user kept (or a view of it)
  // keeps its values.
  if (spare_grads_.data() && spare_grads_.owner().use_count() == 1) {
    sharded_grads_ = std::move(spare_grads_);
    spare_grads_ = Tensor();
    return;
  }
  spare_grads_ = Tensor();
  sharded_grads_ = new_shard_tensor("fsdp.grads:" + name(), MemoryPart::gradients);
}

std::string ParamGroup::adopt_problem(const Tensor& storage) const {
  if (!sharded_idle())
    return "group " + name() + " is unsharded or being gathered; call reshard() first";
  if (storage.shape() != sharded_.shape() || storage.dtype() != sharded_.dtype() ||
      storage.space() != sharded_.space())
    return "group " + name() + ": new storage " + shape_string(storage.shape()) + " " +
           dtype_name(storage.dtype()) + " does not match " + shape_string(sharded_.shape()) + " " +
           dtype_name(sharded_.dtype());
  return {};
}

void ParamGroup::adopt_sharded_storage(Tensor storage) {
  if (offload_pinned() && storage.data() != sharded_.data() &&
      !::fullshard::detail::is_pinned_host(storage.data())) {
    // Pageable memory (a checkpoint load's) under pin_memory: the values go into the pinned
    // storage, once the device has finished reading it (a forward's copy-ins on the
    // all-gather stream, copy-outs on the compute stream). A cold path: these two streams are
    // synchronised, not the device.
    mesh_.device_stream(comm::StreamKind::all_gather).synchronize();
    mesh_.compute_stream().synchronize();
    std::memcpy(sharded_.data(), storage.data(), sharded_.nbytes());
  } else {
    sharded_ = std::move(storage);
  }
  show_sharded();
}

// Each show tells a parameter's binding (a front end's tensor) right after the change.
void ParamGroup::show_sharded() {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& m = layout_.members[i];
    params_[i]->set_data(sharded_.flat_view(m.slot_offset, m.layout.local_shape));
    if (auto* b = params_[i]->binding()) b->data_shown(*params_[i], true);
  }
  show_sharded_grads();
}

void ParamGroup::show_sharded_grads() {
  // Gradients that micro-batches without sync are still summing into (one rank) are not
  // shown until their reduction, as the unsharded ones of a larger group are not.
  const bool shown = sharded_grads_.data() && !engine_.sharded_grads_live;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& m = layout_.members[i];
    params_[i]->set_grad(shown ? sharded_grads_.flat_view(m.slot_offset, m.layout.local_shape)
                               : Tensor());
    if (auto* b = params_[i]->binding()) b->grad_shown(*params_[i], true);
  }
}

void ParamGroup::show_unsharded(const Tensor& arena) {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    params_[i]->set_data(arena.flat_view(layout_.members[i].arena_offset, params_[i]->shape()));
    if (auto* b = params_[i]->binding()) b->data_shown(*params_[i], false);
  }
}

void ParamGroup::show_unsharded_grads(const Tensor& grads) {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    params_[i]->set_grad(grads.flat_view(layout_.members[i].arena_offset, params_[i]->shape()));
    if (auto* b = params_[i]->binding()) b->grad_shown(*params_[i], false);
  }
}

void ParamGroup::show_external_grads(bool kept) {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    params_[i]->set_grad(kept && i < kept_grads_.size() ? kept_grads_[i] : Tensor());
    if (auto* b = params_[i]->binding()) b->grad_shown(*params_[i], false);
  }
}

void ParamGroup::keep_external_grads(bool keep) {
  kept_grads_.clear();
  if (!keep) return;
  kept_grads_.reserve(params_.size());
  for (const graph::Parameter* p : params_)
    kept_grads_.push_back(p->grad());
}

}  // namespace fullshard::fsdp
