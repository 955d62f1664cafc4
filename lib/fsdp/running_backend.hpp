// The running backend of the FSDP engine: each engine operation goes to the group's transport
// (lib/transport: MPI or shared memory on a CPU mesh, NCCL on a CUDA mesh), issued on the
// root's transport::Device (host, or the CUDA streams of the mesh) that also holds the
// buffers; the user's callbacks run here. This file keeps the engine's records: the memory of
// each held buffer, the operation log, the completion of each operation. Private to lib/fsdp.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/fsdp/hooks.hpp"
#include "lib/fsdp/engine.hpp"
#include "lib/transport/device.hpp"
#include "lib/transport/group_transport.hpp"

namespace fullshard::fsdp {
class ParamGroup;
}

namespace fullshard::fsdp::detail {

class RunningBackend final : public engine::Backend {
 public:
  RunningBackend();
  ~RunningBackend() override;

  /// The groups by engine id (attach order).
  std::vector<ParamGroup*> groups;
  ComputeRecorder compute_recorder;
  /// When set, every operation's description is appended (plan-versus-run comparisons).
  std::vector<engine::OpDesc>* op_log = nullptr;

  /// The root's buffers (what FSDPModule's memory statistics and the plan's peak refer to).
  std::size_t bytes_in_use() const { return device_ ? device_->bytes_in_use() : 0; }
  std::size_t peak_bytes_in_use() const { return device_ ? device_->peak_bytes_in_use() : 0; }
  void reset_peak() {
    if (device_) device_->reset_peak();
  }
  /// The reduced gradients of group `g`, updated inside backward by a separate pass (not
  /// transport::update_in_copy_out, or gradients to add to): a view of the scratch of the
  /// stream its reductions end on (one per stream, as large as the largest shard of the
  /// groups ending there that need one: each reduction writes it and its update reads it in
  /// that stream's order). Made larger when too small (an update in flight holds the old one).
  Tensor reduced_scratch(const ParamGroup& g);

  engine::Buf acquire(const engine::Group& g, engine::BufKind kind, std::int64_t numel,
                      DType dtype) override;
  void release(const engine::Group& g, engine::Buf& b) override;

  engine::Event gather_copy_in(const engine::OpDesc& d, engine::Group& g,
                               engine::Buf& dst) override;
  engine::Event all_gather(const engine::OpDesc& d, engine::Group& g, engine::Buf& dst,
                           bool in_place, engine::Buf* slices) override;
  engine::Event gather_copy_out(const engine::OpDesc& d, engine::Group& g, const engine::Buf* src,
                                engine::Buf& arena, engine::Buf* keep) override;
  engine::Event grad_init(const engine::OpDesc& d, engine::Group& g, engine::Buf& grads) override;
  engine::Event reduce_copy_in(const engine::OpDesc& d, engine::Group& g, engine::Buf& grads,
                               engine::Buf& input) override;
  engine::Event reduce_scatter(const engine::OpDesc& d, engine::Group& g, engine::Buf& input,
                               engine::Buf& output, const transport::ReduceSpec& spec) override;
  engine::Event all_reduce(const engine::OpDesc& d, engine::Group& g, engine::Buf& data) override;
  engine::Event accumulate(const engine::OpDesc& d, engine::Group& g, engine::Buf& src,
                           engine::Buf& dst, bool accumulate) override;
  engine::Event reduce_copy_out(const engine::OpDesc& d, engine::Group& g, const engine::Buf& src,
                                const transport::ReduceSpec& spec) override;
  engine::Event update_shards(const engine::OpDesc& d, engine::Group& g) override;
  const kernels::ElementUpdate* prepare_update(engine::Group& g, engine::StreamKind s) override;
  engine::Event reshard(const engine::OpDesc& d, engine::Group& g) override;
  engine::Event compute(const engine::OpDesc& d, graph::Module& m, engine::Phase phase) override;
  void host_wait(const engine::OpDesc& d, const std::vector<engine::Event>& done) override;
  void host_wait(const engine::Event& e) override;
  void drop_sharded_grads(engine::Group& g) override;
  void settle_fresh_grads(engine::Group& g) override;

  void keep_external_grads(engine::Group& g, bool keep) override;
  void show_sharded(engine::Group& g) override;
  void show_unsharded(engine::Group& g) override;
  void show_unsharded_grads(engine::Group& g) override;
  void show_sharded_grads(engine::Group& g) override;

  /// Takes the device of `g`'s mesh (the first group attached decides; every group of one
  /// root must be on the same device type: InvalidArgument naming both groups otherwise).
  void bind(ParamGroup& g);

 protected:
  engine::OpDesc& op_record() override { return op_; }
  void stream_wait(engine::StreamKind waiter, const engine::Event& e) override;
  void stream_record(engine::StreamKind s, engine::Event& e) override;

 private:
  std::map<const comm::Stream*, Tensor> reduced_scratch_;
  kernels::ElementUpdate prepared_update_;  // prepare_update's, for the reduction being issued
  engine::OpDesc op_;                       // the operation being issued
  std::deque<transport::Held> memory_;      // by Buf::slot (references stay valid as it grows)
  std::vector<int> free_slots_;
  std::unique_ptr<transport::Device> device_;
  DeviceType device_type_ = DeviceType::cpu;
  std::string bound_group_;  // the group that decided the device (messages)

  transport::Held& mem(const engine::Buf& b);
  ParamGroup& pg(const engine::Group& g) const;
  transport::GroupTransport& transport(const engine::Group& g) const;
  /// A buffer of `kind` the group's transport keeps in its own memory or never uses: only
  /// its bytes are counted (Device::reserve).
  bool counted_only(const engine::Group& g, engine::BufKind kind) const;
  // The operation's completion (and its channel's last operation).
  engine::Event done(const engine::OpDesc& d, comm::Work w);
  // Operation `d` (completing with `w`) reads or writes `b`.
  void used(const engine::OpDesc& d, const engine::Buf& b, const comm::Work& w);
  // Each parameter's grad() (a front end's), checked against the group's unsharded parameters.
  std::vector<Tensor> external_grads(const ParamGroup& p) const;
};

/// One FSDP root: its backend and the engine state shared by its groups.
struct RootContext {
  RunningBackend backend;
  engine::Root root{backend};
  ~RootContext();
};

}  // namespace fullshard::fsdp::detail
