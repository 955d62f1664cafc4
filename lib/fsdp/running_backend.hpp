// The running backend of the FSDP engine: the mesh's communicators and channel streams, one
// buffer pool per FSDP root, the Kokkos copy kernels, the user's callbacks. Private to
// lib/fsdp.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/fsdp/engine.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/tensor/buffer_pool.hpp"

namespace fullshard::fsdp::detail {

class ParamGroup;

class RunningBackend final : public engine::Backend {
 public:
  RunningBackend();

  /// The groups by engine id (attach order).
  std::vector<ParamGroup*> groups;
  BufferPool pool;
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

  void show_sharded(engine::Group& g) override;
  void show_unsharded(engine::Group& g) override;
  void show_unsharded_grads(engine::Group& g) override;
  void show_sharded_grads(engine::Group& g) override;

 protected:
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
};

/// One FSDP root: its backend and the engine state shared by its groups.
struct RootContext {
  RunningBackend backend;
  engine::Root root{backend};
  ~RootContext();
};

}  // namespace fullshard::fsdp::detail
