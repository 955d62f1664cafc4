// The running backend of the FSDP engine: the communicators, streams, memory and Kokkos copy
// kernels of the mesh's device, and the user's callbacks. Private to lib/fsdp.
//
// On a CPU mesh: MPI (or node-local shared memory) collectives on the mesh's host channel
// streams, one host buffer pool per FSDP root, kernels on the host.
// On a CUDA mesh: NCCL collectives on the mesh's CUDA channel streams, copy kernels as Kokkos
// kernels on the stream of their operation, user compute on the mesh's compute stream, every
// buffer from the root's stream-ordered device pool. Cross-stream order is kept with CUDA
// events only (the engine's waits become cudaStreamWaitEvent); the host never blocks on a
// collective or a kernel (no fence, no cudaDeviceSynchronize): its waits only re-raise errors
// already known and order the compute stream.
// CPUOffloadPolicy on a CUDA mesh: the shards and sharded gradients are host memory; their
// host-to-device and device-to-host copies are part of the copy-in / copy-out operations (on
// the all-gather and reduce-scatter streams), and the end of backward waits on the host for
// the reduced gradient shards (FSDP2's finalize_backward), so the optimizer steps on the host.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fullshard/fsdp/engine.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/tensor/buffer_pool.hpp"
#include "fullshard/tensor/stream_pool.hpp"

namespace fullshard::fsdp::detail {

class ParamGroup;

/// The buffers of one FSDP root: a host BufferPool on a CPU mesh, a stream-ordered device pool
/// on the mesh's CUDA streams on a CUDA mesh, with the engine's accounting (what FSDPModule's
/// memory statistics and the plan's peak refer to).
class EnginePool {
 public:
  BufferPool host{MemorySpace::host, "fsdp"};
  StreamOrderedPool* device = nullptr;
  std::size_t device_in_use = 0;
  std::size_t device_peak = 0;

  std::size_t bytes_in_use() const { return device ? device_in_use : host.bytes_in_use(); }
  std::size_t peak_bytes_in_use() const { return device ? device_peak : host.peak_bytes_in_use(); }
  void reset_peak() {
    host.reset_peak();
    device_peak = device_in_use;
  }
};

class RunningBackend final : public engine::Backend {
 public:
  RunningBackend();

  /// The groups by engine id (attach order).
  std::vector<ParamGroup*> groups;
  EnginePool pool;
  ComputeRecorder compute_recorder;
  /// When set, every operation's description is appended (plan-versus-run comparisons).
  std::vector<engine::OpDesc>* op_log = nullptr;

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
  // The group's shared-memory gradient window, once every rank has read its last round
  // (allocated on first use): where this rank's unsharded gradients are written next.
  void* writable_grads_window(ParamGroup& p);
  // reduce_copy_in of external gradients (the parameters' grad(), grads not held).
  engine::Event external_copy_in(const engine::OpDesc& d, engine::Group& g, engine::Buf& input);
  engine::Event reduce_scatter(const engine::OpDesc& d, engine::Group& g, engine::Buf& input,
                               engine::Buf& output) override;
  engine::Event all_reduce(const engine::OpDesc& d, engine::Group& g, engine::Buf& data) override;
  engine::Event accumulate(const engine::OpDesc& d, engine::Group& g, engine::Buf& src,
                           engine::Buf& dst, bool accumulate) override;
  engine::Event reduce_copy_out(const engine::OpDesc& d, engine::Group& g, const engine::Buf& src,
                                double divisor, bool accumulate) override;
  engine::Event reshard(const engine::OpDesc& d, engine::Group& g) override;
  engine::Event compute(const engine::OpDesc& d, graph::Module& m, engine::Phase phase) override;
  void host_wait(const engine::OpDesc& d, const std::vector<engine::Event>& done) override;
  void host_wait(const engine::Event& e) override;
  void drop_sharded_grads(engine::Group& g) override;

  void keep_external_grads(engine::Group& g, bool keep) override;
  void show_sharded(engine::Group& g) override;
  void show_unsharded(engine::Group& g) override;
  void show_unsharded_grads(engine::Group& g) override;
  void show_sharded_grads(engine::Group& g) override;

  /// Takes the device of `g`'s mesh (the first group attached decides; every group of one
  /// root must be on the same device type: InvalidArgument naming both groups otherwise). On a
  /// CUDA mesh the root's operations run on that mesh's streams.
  void bind(const ParamGroup& g);
  bool on_device() const noexcept { return device_mesh_.has_value(); }

 protected:
  engine::OpDesc& op_record() override { return op_; }
  void stream_wait(engine::StreamKind waiter, const engine::Event& e) override;
  void stream_record(engine::StreamKind s, engine::Event& e) override;

 private:
  // The memory of a held buffer, and the last operation reading or writing it (released only
  // once that operation ran: worker streams run it later).
  struct Memory {
    Tensor tensor;
    comm::Work used;
  };
  Memory& mem(const engine::Buf& b);
  engine::OpDesc op_;          // the operation being issued
  std::deque<Memory> memory_;  // by Buf::slot (references stay valid as it grows)
  std::vector<int> free_slots_;

  ParamGroup& pg(const engine::Group& g) const;
  comm::Stream& stream(const engine::Group& g, engine::StreamKind s) const;
  // Runs a copy kernel as the next operation of stream `s` (inline on caller streams).
  engine::Event on_stream(const engine::OpDesc& d, const engine::Group& g,
                          std::function<void()> kernel);
  engine::Event done(const engine::OpDesc& d, comm::Work w);
  // Runs a shared-memory collective as the next operation of stream `s`, submitted (also on
  // caller streams) under `label` so that stream recorders see it as they see MPI's.
  engine::Event collective(const engine::OpDesc& d, const engine::Group& g,
                           const std::string& label, std::function<void()> op);
  comm::Work last_[engine::kNumStreams];  // the last operation's work per stream
  // The execution-space instance of each stream: kernels are enqueued on it without a fence;
  // it is fenced where its results are consumed (a collective on the stream, the host
  // reading parameters or gradients, the end of a worker-stream operation).
  kernels::ExecStream exec_[engine::kNumStreams] = {
      kernels::ExecStream::host(), kernels::ExecStream::host(), kernels::ExecStream::host(),
      kernels::ExecStream::host()};
  const kernels::ExecStream& exec(engine::StreamKind s) const { return exec_[static_cast<int>(s)]; }

  // ---- the device (CUDA meshes) ----
  std::optional<DeviceMesh> device_mesh_;  // the mesh whose streams the root's operations use
  bool bound_ = false;
  DeviceType device_type_ = DeviceType::cpu;
  std::string bound_group_;  // the group that decided the device (messages)
  // The CUDA stream of an engine stream.
  comm::Stream& dstream(engine::StreamKind s) const;
  // Runs `enqueue` (device work on dstream(d.stream)) as the operation's submit: the event
  // recorded after it is the operation's completion.
  engine::Event device_op(const engine::OpDesc& d, const engine::Group& g,
                          const std::function<void()>& enqueue);
  // Declares that operation stream `s` uses `b` (the pool records a release event there).
  void use(const engine::Buf& b, engine::StreamKind s);
  // ---- CPUOffloadPolicy on a CUDA mesh (host shards, device collectives) ----
  // True when a group of this root is offloaded: the end of backward waits on the host.
  bool offloaded_ = false;
  // Pageable host shards (pin_memory=false): a device buffer of one group shard (orig dtype)
  // from the root's pool for use on stream `s`, released (an event on `s`) with the returned
  // tensor; outside the engine's accounting. Undefined for pinned or device shards, whose
  // kernels read and write them in place.
  Tensor offload_staging(const ParamGroup& p, engine::StreamKind s);
  // One group shard (orig dtype) from `src` to `dst` on stream `s` (cudaMemcpyAsync).
  void offload_copy(const ParamGroup& p, void* dst, const void* src, engine::StreamKind s,
                    const char* what);
  // FSDP2's root pre-forward: the first all-gather-stream operation of an iteration waits for
  // the compute stream (what the user enqueued there since the last backward, e.g. an
  // optimizer step on the shards). Set at the end of backward.
  bool gather_after_compute_ = true;
  void gather_stream_after_compute();
  // Per group: the divisor its last reduce-scatter already applied (NCCL pre-multiplied sum),
  // 0 when none (one rank: no reduce-scatter ran).
  std::vector<double> prescaled_;
  // Per group: the kernel that zeroes its unsharded gradients (grad_init).
  std::vector<kernels::CopyPlan> zero_plans_;
  // The root's buffers on a CUDA mesh (EnginePool::device points here).
  std::unique_ptr<StreamOrderedPool> device_pool_;
};

/// One FSDP root: its backend and the engine state shared by its groups.
struct RootContext {
  RunningBackend backend;
  engine::Root root{backend};
  ~RootContext();
};

}  // namespace fullshard::fsdp::detail
