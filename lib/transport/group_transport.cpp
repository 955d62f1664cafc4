#include "lib/transport/group_transport.hpp"

#include <algorithm>
#include <cstring>

#include "fullshard/base/error.hpp"
#include "lib/transport/comm_transport.hpp"
#include "lib/transport/shm_transport.hpp"

namespace fullshard::transport {

GroupTransport::GroupTransport(Kind kind, GroupSpec spec, kernels::ExecTarget target)
    : kind_(kind), spec_(std::move(spec)), target_(target) {
  const DeviceMesh& m = mesh();
  const std::string shard_dim = m.names().back();
  // The communicators of the mesh's device: NCCL on a CUDA mesh, MPI on a CPU mesh.
  ag_comm_ = &m.device_comm(shard_dim, comm::StreamKind::all_gather);
  rs_comm_ = &m.device_comm(shard_dim, comm::StreamKind::reduce_scatter);
  if (m.ndim() == 2) ar_comm_ = &m.device_comm(m.names()[0], comm::StreamKind::all_reduce);
  // The copy kernels run where the mesh's memory is.
  copy_out_ = kernels::CopyPlan(target, kernels::all_gather_copy_out_runs(layout()));
  copy_in_ = kernels::CopyPlan(target, kernels::reduce_scatter_copy_in_runs(layout()));
}

GroupTransport::~GroupTransport() = default;

comm::LazyLabel GroupTransport::label(const char* op) const {
  return comm::LazyLabel(op, spec_.name);
}

void GroupTransport::split_post_forward(int k) {
  const int rank = geo().rank;
  post_forward_comm_ =
      ag_comm_->split(rank / k, rank % k, ag_comm_->name() + ".post_forward" + std::to_string(k));
}

comm::Work GroupTransport::all_gather_slices(Device& dev, comm::StreamKind c, Held& dst,
                                             Held& slices, int k) {
  dev.before_collective(c);
  const Geometry& I = geo();
  const std::size_t block =
      static_cast<std::size_t>(I.world / k) * static_cast<std::size_t>(I.gather_slot_numel());
  return post_forward_comm_->all_gather(slices.tensor.data(), dst.tensor.data(), block,
                                        I.gather_dtype(), stream(dev, c));
}

comm::Work GroupTransport::zero_grads(Device& dev, comm::StreamKind c, Held& grads) {
  void* ptr = grads.tensor.data();
  const DType t = grads.tensor.dtype();
  const std::int64_t n = grads.tensor.numel();
  if (target_ == kernels::ExecTarget::host) {
    if (n > 0) std::memset(ptr, 0, grads.tensor.nbytes());
    return comm::Work();
  }
  // A kernel writing zeros: runs of padding only (nothing read), in blocks of 64 Ki elements
  // (the device kernel gives each run one team), built once.
  if (zeros_.elements_written() != n) {
    constexpr std::int64_t kBlock = std::int64_t{1} << 16;
    std::vector<kernels::CopyRun> runs;
    for (std::int64_t at = 0; at < n; at += kBlock) {
      kernels::CopyRun z;
      z.dst_offset = at;
      z.pad = std::min(kBlock, n - at);
      runs.push_back(z);
    }
    zeros_ = kernels::CopyPlan(target_, runs);
  }
  const kernels::ExecStream& on = dev.exec(c);
  const kernels::CopyPlan* plan = &zeros_;
  return dev.run(c, stream(dev, c), label("grad_init of group "), [=, &on] {
    if (n > 0) kernels::run_copies(*plan, ptr, t, ptr, t, on);
  });
}

comm::Work GroupTransport::all_reduce(Device& dev, comm::StreamKind c, Held& data) {
  // What the reduce-scatter stream's kernels wrote into it (a device orders by events).
  dev.before_collective(comm::StreamKind::reduce_scatter);
  const Geometry& I = geo();
  return ar_comm_->all_reduce(data.tensor.data(), data.tensor.data(),
                              static_cast<std::size_t>(I.shard_numel), I.reduce_dtype,
                              comm::ReduceOp::sum, stream(dev, c));
}

comm::Work GroupTransport::accumulate(Device& dev, comm::StreamKind c, Held& src, Held& dst,
                                      bool acc) {
  const Tensor from = src.tensor;
  const Tensor to = dst.tensor;
  const DType t = geo().reduce_dtype;
  const std::int64_t n = geo().shard_numel;
  const kernels::ExecStream& on = dev.exec(c);
  return dev.run(c, stream(dev, c), label("reduce_copy_out of group "), [=, &on] {
    kernels::reduce_copy_out(on, from.data(), t, to.data(), t, n, 1.0, acc);
  });
}

const kernels::CopyPlan& GroupTransport::member_copy_in_plan(std::size_t member, bool zeros) {
  if (member_copy_in_.empty()) {
    member_copy_in_.reserve(2 * layout().members.size());
    for (std::size_t i = 0; i < layout().members.size(); ++i)
      for (bool z : {false, true})
        member_copy_in_.emplace_back(target_,
                                     kernels::reduce_scatter_copy_in_member_runs(layout(), i, z));
  }
  return member_copy_in_.at(2 * member + (zeros ? 1 : 0));
}

comm::Work GroupTransport::external_copy(Device& dev, comm::StreamKind c, std::vector<Tensor> grads,
                                         void* to) {
  std::vector<const kernels::CopyPlan*> plans;
  plans.reserve(grads.size());
  for (std::size_t i = 0; i < grads.size(); ++i)
    plans.push_back(&member_copy_in_plan(i, !grads[i].data()));
  const kernels::ExecStream& on = dev.exec(c);
  const DType from_t = geo().param_dtype, to_t = geo().reduce_dtype;
  // The gradients are held until the copies ran (worker streams run them later).
  return dev.run(c, stream(dev, c), label("copy_in of group "),
                 [grads = std::move(grads), plans = std::move(plans), to, from_t, to_t, &on] {
                   for (std::size_t i = 0; i < grads.size(); ++i)
                     kernels::run_copies(*plans[i], grads[i].data() ? grads[i].data() : to, from_t,
                                         to, to_t, on);
                 });
}

void GroupTransport::attach(Device&) {}
void GroupTransport::take_grads_buffer(Held&) {}
void GroupTransport::return_grads_buffer(Held&) {}
void GroupTransport::before_shards_change() {}

std::unique_ptr<GroupTransport> make_group_transport(GroupSpec spec) {
  const DeviceMesh& m = *spec.mesh;
  if (m.device_type() == DeviceType::cuda) {
    if (spec.offloaded && !spec.pinned && spec.geometry->compressed_reduce())
      throw ConfigError(
          "fully_shard(" + *spec.name +
          "): an int8 reduce-scatter writes the sharded gradients from its decode "
          "kernel, which cannot reach pageable host memory; give the "
          "CPUOffloadPolicy pin_memory=true or drop the reduce-scatter's compression");
    return std::make_unique<detail::CommTransport>(Kind::nccl, std::move(spec));
  }
  const std::string shard_dim = m.names().back();
  const comm::ShmComm* shm = m.shm(shard_dim);
  const int world = spec.geometry->world;
  const Geometry& geo = *spec.geometry;
  const bool compressed = geo.compressed_gather() || geo.compressed_reduce();
  if (compressed && m.host_collectives() == HostCollectives::shm)
    throw ConfigError("fully_shard(" + *spec.name +
                      "): FULLSHARD_HOST_COLLECTIVES=shm, but the group's collectives are "
                      "compressed, and compressed collectives run on MPI (our shared-memory "
                      "transport reads each peer's shard where it lies: there is no message to "
                      "make smaller); use FULLSHARD_HOST_COLLECTIVES=auto or mpi, or drop the "
                      "compression");
  const NodeSplit* split = m.node_split(shard_dim);
  if (!shm && !split && world > 1 && m.host_collectives() == HostCollectives::shm)
    throw ConfigError("fully_shard(" + *spec.name +
                      "): FULLSHARD_HOST_COLLECTIVES=shm, but the shard dim '" + shard_dim +
                      "' of mesh " + m.describe() +
                      " spans nodes that do not each hold the same number (two or more) of its "
                      "ranks, so they cannot share memory inside each node; use "
                      "FULLSHARD_HOST_COLLECTIVES=auto (MPI across nodes) or mpi, launch the "
                      "same number of ranks on every node, or use an HSDP mesh whose shard dim "
                      "lies inside a node");
  if (shm && world > 1 && group_kind(Kind::shm, geo) == Kind::shm)
    return detail::make_shm_transport(std::move(spec), *shm);
  if (split && world > 1 && group_kind(Kind::two_level, geo) == Kind::two_level)
    return detail::make_shm_transport(std::move(spec), split->local(), split);
  return std::make_unique<detail::CommTransport>(Kind::mpi, std::move(spec));
}

}  // namespace fullshard::transport
