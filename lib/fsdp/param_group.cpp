#include "lib/fsdp/param_group.hpp"

#include <cstring>
#include <exception>

#include "fullshard/base/error.hpp"

namespace fullshard::fsdp::detail {

using kernels::ExecTarget;

CommContext::CommContext() : pool(MemorySpace::host, "fsdp") {}

CommContext::~CommContext() {
  try {
    wait_reduces(0);
  } catch (...) {  // errors were the iteration's to report; a destructor only cleans up
  }
}

void CommContext::wait_reduces(std::size_t keep) {
  std::exception_ptr first;
  while (pending_reduces.size() > keep) {
    try {
      pending_reduces.front().done.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
    pending_reduces.pop_front();
  }
  if (first) std::rethrow_exception(first);
}

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

}  // namespace

ParamGroup::ParamGroup(std::string name, std::vector<graph::Module*> modules,
                       std::vector<graph::Parameter*> params, std::vector<ShardLayout> layouts,
                       const DeviceMesh& mesh, const FullyShardOptions& options)
    : name_(std::move(name)),
      modules_(std::move(modules)),
      params_(std::move(params)),
      mesh_(mesh) {
  const std::string shard_dim = mesh.names().back();
  W_ = mesh.size(shard_dim);
  rank_ = mesh.coordinate(shard_dim);
  ag_comm_ = &mesh.comm(shard_dim, Channel::all_gather);
  rs_comm_ = &mesh.comm(shard_dim, Channel::reduce_scatter);
  if (mesh.ndim() == 2) {
    ar_comm_ = &mesh.comm(mesh.names()[0], Channel::all_reduce);
    replicate_size_ = mesh.shape()[0];
  }

  if (!params_.empty()) orig_dtype_ = params_[0]->dtype();
  for (auto* p : params_)
    if (p->dtype() != orig_dtype_)
      throw InvalidArgument("fully_shard(" + name_ + "): parameters '" + params_[0]->fqn() + "' (" +
                            dtype_name(orig_dtype_) + ") and '" + p->fqn() + "' (" +
                            dtype_name(p->dtype()) +
                            ") have different dtypes; one communication group holds one dtype, "
                            "so give them separate fully_shard calls");
  param_dtype_ = options.mp_policy.param_dtype.value_or(orig_dtype_);
  reduce_dtype_ = options.mp_policy.reduce_dtype.value_or(param_dtype_);
  offload_ = options.offload_policy;  // sharded state below is host memory either way

  layout_ = kernels::make_group_layout(layouts);
  copy_out_ = kernels::CopyPlan(ExecTarget::host, kernels::all_gather_copy_out_runs(layout_));
  copy_in_ = kernels::CopyPlan(ExecTarget::host, kernels::reduce_scatter_copy_in_runs(layout_));

  // Sharded storage in slot layout, padding zero; initial values from the full tensors the
  // user registered (then released: only the shard stays).
  sharded_ =
      Tensor::zeros({layout_.shard_numel}, orig_dtype_, MemorySpace::host, "fsdp.sharded:" + name_);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto* p = params_[i];
    const auto& m = layout_.members[i];
    const Tensor& full = p->data();
    if (full.data() && full.numel() > 0) {
      if (full.shape() != p->shape() || full.dtype() != p->dtype() ||
          full.space() != MemorySpace::host)
        throw InvalidArgument("fully_shard(" + name_ + "): parameter '" + p->fqn() + "' holds a " +
                              dtype_name(full.dtype()) + " tensor of shape " +
                              shape_string(full.shape()) + " but is declared " +
                              dtype_name(p->dtype()) + " " + shape_string(p->shape()));
      copy_shard_in(full, m.layout,
                    static_cast<std::byte*>(sharded_.data()) +
                        static_cast<std::size_t>(m.slot_offset) * dtype_size(orig_dtype_));
    }
  }
  set_reshard_after_forward(options.reshard_after_forward);
  register_sharded();
}

ParamGroup::~ParamGroup() {
  if (gather_in_flight_) {
    try {
      gather_work_.wait();  // the collective writes into gather_buffer_
    } catch (...) {         // a destructor only cleans up
    }
  }
}

void ParamGroup::set_reshard_after_forward(ReshardAfterForward v) {
  const int k = v.value();
  if (k >= 1) {
    if (W_ % k != 0)
      throw InvalidArgument("fully_shard(" + name_ +
                            "): reshard_after_forward=" + std::to_string(k) +
                            " must divide the shard group size " + std::to_string(W_));
    if (k > 1 && k < W_ && post_forward_k_ != k) {
      if (state_ == ShardedState::sharded_post_forward)
        throw InvalidArgument("group " + name_ +
                              ": reshard_after_forward cannot change between forward and "
                              "backward; call reshard() first");
      // The split is a collective on the all-gather communicator: nothing may be in flight on
      // its stream (every rank makes this call at the same point of the program).
      if (gather_in_flight_) reshard();
      mesh_.stream(Channel::all_gather).synchronize();
      // Consecutive groups of k ranks (e.g. the ranks of a node); collective over the shard
      // group, made here while every rank makes the same call.
      post_forward_comm_ = ag_comm_->split(rank_ / k, rank_ % k,
                                           ag_comm_->name() + ".post_forward" + std::to_string(k));
      post_forward_k_ = k;
    }
  } else if (k < -1) {
    throw InvalidArgument("fully_shard(" + name_ + "): bad reshard_after_forward");
  }
  if (k == 0 && ctx_) return;  // keep the value resolved at attach
  reshard_after_forward_ = (k >= 1 && k == W_) ? -1 : k;
}

void ParamGroup::attach(std::shared_ptr<CommContext> ctx, bool is_root_group) {
  ctx_ = std::move(ctx);
  if (reshard_after_forward_ == 0) reshard_after_forward_ = is_root_group ? 1 : -1;
}

std::string ParamGroup::label(const char* op) const {
  return std::string(op) + " of group " + name_;
}

void ParamGroup::issue_unshard() {
  if (state_ == ShardedState::unsharded || gather_in_flight_) return;
  if (!ctx_) throw InvalidArgument("group " + name_ + ": not initialised (internal)");
  const std::int64_t gsn = layout_.shard_numel;
  const std::size_t es = dtype_size(param_dtype_);
  if (W_ == 1) {
    // No collective: copy-out reads the shard itself, or its cast.
    if (param_dtype_ == orig_dtype_) {
      gather_buffer_ = sharded_;
    } else {
      gather_buffer_ = ctx_->pool.acquire({gsn}, param_dtype_, "all_gather");
      kernels::cast_copy(ExecTarget::host, sharded_.data(), orig_dtype_, gather_buffer_.data(),
                         param_dtype_, gsn);
    }
    gather_work_ = comm::Work();
    gather_in_flight_ = true;
    return;
  }
  gather_buffer_ = ctx_->pool.acquire({W_ * gsn}, param_dtype_, "all_gather");
  auto* out = static_cast<std::byte*>(gather_buffer_.data());
  if (state_ == ShardedState::sharded_post_forward) {
    const std::int64_t block = (W_ / post_forward_k_) * gsn;
    gather_work_ = post_forward_comm_->all_gather(post_forward_shard_.data(), out, block,
                                                  param_dtype_, mesh_.stream(Channel::all_gather));
  } else if (param_dtype_ == orig_dtype_) {
    // No copy-in: the shard storage is the send buffer.
    gather_work_ = ag_comm_->all_gather(sharded_.data(), out, gsn, param_dtype_,
                                        mesh_.stream(Channel::all_gather));
  } else {
    // Copy-in: cast the group shard into this rank's slot, then gather in place.
    void* slot = out + static_cast<std::size_t>(rank_ * gsn) * es;
    kernels::cast_copy(ExecTarget::host, sharded_.data(), orig_dtype_, slot, param_dtype_, gsn);
    gather_work_ =
        ag_comm_->all_gather(slot, out, gsn, param_dtype_, mesh_.stream(Channel::all_gather));
  }
  gather_in_flight_ = true;
}

void ParamGroup::await_gather() {
  try {
    gather_work_.wait();
  } catch (...) {
    gather_buffer_ = Tensor();
    gather_in_flight_ = false;
    throw;
  }
}

void ParamGroup::wait_unshard() {
  if (state_ == ShardedState::unsharded) return;
  issue_unshard();
  await_gather();
  const std::int64_t gsn = layout_.shard_numel;
  arena_ = ctx_->pool.acquire({layout_.arena_numel}, param_dtype_, "unsharded");
  kernels::run_copies(copy_out_, gather_buffer_.data(), param_dtype_, arena_.data(), param_dtype_);
  const int k = reshard_after_forward_;
  if (!ctx_->in_backward && k > 1 && k < W_ && state_ == ShardedState::sharded) {
    // reshard_after_forward=k: keep the W/k slots this rank serves in its k-rank group.
    const std::int64_t block = (W_ / k) * gsn;
    post_forward_shard_ = ctx_->pool.acquire({block}, param_dtype_, "post_forward");
    std::memcpy(post_forward_shard_.data(),
                static_cast<const std::byte*>(gather_buffer_.data()) +
                    static_cast<std::size_t>((rank_ % k) * block) * dtype_size(param_dtype_),
                static_cast<std::size_t>(block) * dtype_size(param_dtype_));
  }
  gather_buffer_ = Tensor();
  gather_in_flight_ = false;
  state_ = ShardedState::unsharded;
  register_unsharded();
}

void ParamGroup::reshard() {
  if (gather_in_flight_) {
    await_gather();
    gather_buffer_ = Tensor();
    gather_in_flight_ = false;
  }
  arena_ = Tensor();
  post_forward_shard_ = Tensor();
  state_ = ShardedState::sharded;
  register_sharded();
}

void ParamGroup::post_forward_reshard() {
  const int k = reshard_after_forward_;
  if (k == 1) return;  // keep the unsharded parameters for backward
  if (k > 1 && k < W_ && post_forward_shard_.data()) {
    arena_ = Tensor();
    state_ = ShardedState::sharded_post_forward;
    register_sharded();
    return;
  }
  reshard();
}

void ParamGroup::prepare_gradients() {
  if (!grad_arena_.data()) {
    grad_arena_ = ctx_->pool.acquire({layout_.arena_numel}, param_dtype_, "grads");
    std::memset(grad_arena_.data(), 0, grad_arena_.nbytes());
  }
  for (std::size_t i = 0; i < params_.size(); ++i)
    params_[i]->set_grad(
        grad_arena_.flat_view(layout_.members[i].arena_offset, params_[i]->shape()));
}

void ParamGroup::reduce_gradients() {
  if (!grad_arena_.data()) return;  // this group's backward did not run
  if (!reduce_grads) return;        // no_sync: the unsharded gradients keep accumulating
  const std::int64_t gsn = layout_.shard_numel;
  ctx_->wait_reduces(static_cast<std::size_t>(std::max(ctx_->max_reduce_buffers, 1) - 1));

  // Copy-in: chunk every gradient along its shard dim into the rank-major input.
  Tensor input = ctx_->pool.acquire({W_ * gsn}, reduce_dtype_, "reduce_scatter.in");
  kernels::run_copies(copy_in_, grad_arena_.data(), param_dtype_, input.data(), reduce_dtype_);
  grad_arena_ = Tensor();

  const bool accumulate = sharded_grads_.data() != nullptr;
  if (!accumulate)
    sharded_grads_ = Tensor::zeros({gsn}, orig_dtype_, MemorySpace::host, "fsdp.grads:" + name_);
  Tensor output = input;  // one rank: the input is the reduced shard
  comm::Stream* last = &mesh_.stream(Channel::reduce_scatter);
  // The collectives this reduction depends on: a task after them re-raises their errors
  // (Work::test on a finished operation) instead of using a buffer they did not fill.
  std::vector<comm::Work> collectives;
  const double timeout = rs_comm_->timeout_s();
  auto check = [](const std::vector<comm::Work>& ws) {
    for (const auto& w : ws)
      w.test();
  };
  if (W_ > 1) {
    output = ctx_->pool.acquire({gsn}, reduce_dtype_, "reduce_scatter.out");
    collectives.push_back(rs_comm_->reduce_scatter(input.data(), output.data(), gsn, reduce_dtype_,
                                                   comm::ReduceOp::sum,
                                                   mesh_.stream(Channel::reduce_scatter)));
  }
  if (ar_comm_ && replicate_size_ > 1) {
    const DType rd = reduce_dtype_;
    if (!all_reduce_grads) {
      // Defer the replicate all-reduce: accumulate the reduce-scattered shard.
      if (!partial_reduce_.data()) {
        partial_reduce_ = ctx_->pool.acquire({gsn}, rd, "partial_reduce");
        std::memset(partial_reduce_.data(), 0, partial_reduce_.nbytes());
      }
      Tensor partial = partial_reduce_;
      comm::Work done = mesh_.stream(Channel::reduce_scatter)
                            .submit(
                                label("partial accumulate"),
                                [=] {
                                  check(collectives);
                                  kernels::reduce_copy_out(ExecTarget::host, output.data(), rd,
                                                           partial.data(), rd, gsn, 1.0, true);
                                },
                                timeout);
      ctx_->pending_reduces.push_back({done, input, output});
      return;  // the sharded gradients change only with the all-reduce
    }
    if (partial_reduce_.data()) {
      Tensor partial = partial_reduce_;
      partial_reduce_ = Tensor();
      mesh_.stream(Channel::reduce_scatter).submit(label("partial add"), [=] {
        check(collectives);
        kernels::reduce_copy_out(ExecTarget::host, partial.data(), rd, output.data(), rd, gsn, 1.0,
                                 true);
      });
    }
    mesh_.stream(Channel::all_reduce).wait(mesh_.stream(Channel::reduce_scatter).record());
    collectives.push_back(ar_comm_->all_reduce(output.data(), output.data(), gsn, rd,
                                               comm::ReduceOp::sum,
                                               mesh_.stream(Channel::all_reduce)));
    last = &mesh_.stream(Channel::all_reduce);
  }
  // Copy-out: divide, cast, accumulate into the sharded gradients, after the collectives.
  const double divisor =
      divide_factor > 0 ? divide_factor : static_cast<double>(W_) * replicate_size_;
  Tensor grads = sharded_grads_;
  const DType rd = reduce_dtype_;
  const DType od = orig_dtype_;
  comm::Work done = last->submit(
      label("reduce_scatter copy-out"),
      [=] {
        check(collectives);
        kernels::reduce_copy_out(ExecTarget::host, output.data(), rd, grads.data(), od, gsn,
                                 divisor, accumulate);
      },
      timeout);
  ctx_->pending_reduces.push_back({done, input, output});
  for (std::size_t i = 0; i < params_.size(); ++i)
    params_[i]->set_grad(sharded_grads_.flat_view(layout_.members[i].slot_offset,
                                                  layout_.members[i].layout.local_shape));
}

void ParamGroup::discard_iteration_state() {
  if (gather_in_flight_) {
    try {
      gather_work_.wait();
    } catch (...) {  // discarded with the iteration
    }
  }
  gather_in_flight_ = false;
  gather_buffer_ = Tensor();
  arena_ = Tensor();
  grad_arena_ = Tensor();
  post_forward_shard_ = Tensor();
  partial_reduce_ = Tensor();
  forward_calls = forward_done = backward_calls = backward_done = 0;
  post_forward_indices.clear();
  state_ = ShardedState::sharded;
  register_sharded();
}

void ParamGroup::zero_grad() {
  sharded_grads_ = Tensor();
  grad_arena_ = Tensor();
  partial_reduce_ = Tensor();
  for (auto* p : params_)
    p->set_grad(Tensor());
}

Tensor ParamGroup::gather_full() {
  const std::int64_t gsn = layout_.shard_numel;
  Tensor arena =
      Tensor::empty({layout_.arena_numel}, orig_dtype_, MemorySpace::host, "fsdp.full:" + name_);
  Tensor gathered = sharded_;
  if (W_ > 1) {
    gathered = Tensor::empty({W_ * gsn}, orig_dtype_, MemorySpace::host, "fsdp.full_gather");
    comm::Stream& s = mesh_.stream(Channel::all_gather);
    ag_comm_->all_gather(sharded_.data(), gathered.data(), gsn, orig_dtype_, s).wait();
  }
  kernels::run_copies(copy_out_, gathered.data(), orig_dtype_, arena.data(), orig_dtype_);
  return arena;
}

std::string ParamGroup::adopt_problem(const Tensor& storage) const {
  if (state_ != ShardedState::sharded || gather_in_flight_)
    return "group " + name_ + " is unsharded or being gathered; call reshard() first";
  if (storage.shape() != sharded_.shape() || storage.dtype() != sharded_.dtype() ||
      storage.space() != sharded_.space())
    return "group " + name_ + ": new storage " + shape_string(storage.shape()) + " " +
           dtype_name(storage.dtype()) + " does not match " + shape_string(sharded_.shape()) + " " +
           dtype_name(sharded_.dtype());
  return {};
}

void ParamGroup::adopt_sharded_storage(Tensor storage) noexcept {
  sharded_ = std::move(storage);
  register_sharded();
}

void ParamGroup::register_sharded() {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& m = layout_.members[i];
    params_[i]->set_data(sharded_.flat_view(m.slot_offset, m.layout.local_shape));
    params_[i]->set_grad(sharded_grads_.data()
                             ? sharded_grads_.flat_view(m.slot_offset, m.layout.local_shape)
                             : Tensor());
  }
}

void ParamGroup::register_unsharded() {
  for (std::size_t i = 0; i < params_.size(); ++i)
    params_[i]->set_data(arena_.flat_view(layout_.members[i].arena_offset, params_[i]->shape()));
}

}  // namespace fullshard::fsdp::detail
