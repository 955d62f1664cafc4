// The streams, kernels and memory one FSDP root's operations run on: the host (MPI and
// shared-memory transports) or a CUDA device (NCCL). The engine's streams are the mesh's
// channels (comm::StreamKind::compute is the compute stream). A transport issues its copy kernels
// and collectives through the root's Device, so that nothing outside the two devices asks which one
// it is on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/comm/stream.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/tensor/tensor.hpp"

namespace fullshard::transport {

/// A buffer the engine holds, and the last operation that reads or writes it (its memory is
/// released only once that operation ran).
struct Held {
  Tensor tensor;
  comm::Work used;
};

class Device {
 public:
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  /// The stream channel `c`'s operations of a group on `mesh` run on (host: that mesh's
  /// channel stream; CUDA: the root's CUDA stream of the channel).
  virtual comm::Stream& stream(comm::StreamKind c, const DeviceMesh& mesh) const = 0;
  /// The execution-space instance channel `c`'s kernels are enqueued on (no fence there: it is
  /// fenced where its results are consumed).
  const kernels::ExecStream& exec(comm::StreamKind c) const { return exec_[index(c)]; }
  /// The completion of channel `c`'s last operation.
  const comm::Work& last(comm::StreamKind c) const { return last_[index(c)]; }
  void set_last(comm::StreamKind c, comm::Work w) { last_[index(c)] = std::move(w); }

  /// Runs `kernel` (copy kernels on exec(c)) as the next operation of `c` on `s`, after c's
  /// previous operation succeeded (its error is re-raised instead of copying what it did not
  /// write). Host: inline on the compute channel and on caller streams, else submitted to the
  /// worker (the kernel then owns what it reads). CUDA: enqueued on the stream now.
  virtual comm::Work run(comm::StreamKind c, comm::Stream& s, const comm::LazyLabel& label,
                         std::function<void()> kernel) = 0;
  /// A host function (a shared-memory collective) submitted under `label` as the next
  /// operation of `c` on `s`, after c's previous operation succeeded.
  comm::Work submit(comm::StreamKind c, comm::Stream& s, const std::string& label,
                    std::function<void()> op);
  /// Before a collective is issued on `c`: host: c's kernels have finished; CUDA: an
  /// iteration's first all-gather-stream operation waits for the compute stream.
  virtual void before_collective(comm::StreamKind c) = 0;

  /// A buffer for the engine, first written by channel `first_user`'s operations, counted in
  /// bytes_in_use(): host memory from the root's BufferPool, or device memory from its
  /// stream-ordered pool.
  virtual Tensor acquire(comm::StreamKind first_user, std::int64_t numel, DType dtype,
                         const char* what, const std::string& group) = 0;
  /// The bytes of a buffer counted in bytes_in_use() as acquire() counts them, where a
  /// transport provides the memory (GroupTransport::provides_grads): no memory (the tensor has
  /// no data; dropping it ends the count). Host: BufferPool::reserve; others acquire().
  virtual Tensor reserve(std::int64_t numel, DType dtype, const char* what,
                         const std::string& group);
  /// Scratch device memory for channel `c` (not counted; released with the tensor). Only a
  /// CUDA device has it.
  virtual Tensor scratch(comm::StreamKind c, std::int64_t numel, DType dtype, const char* what,
                         const std::string& group);
  /// Operation `w` of channel `c` reads or writes `h`.
  virtual void used(Held& h, comm::StreamKind c, const comm::Work& w) = 0;
  /// Gives `h` (`bytes` of it counted) back, once its last use ran (host) or on the pool's
  /// release events (CUDA: no host wait).
  virtual void release(Held& h, std::size_t bytes) = 0;
  virtual std::size_t bytes_in_use() const = 0;
  virtual std::size_t peak_bytes_in_use() const = 0;
  virtual void reset_peak() = 0;

  /// The stream `waiter` waits for `done` (CUDA: cudaStreamWaitEvent; host: the worker stream
  /// waits, the compute channel is the host itself and waits in host_wait).
  virtual void wait(comm::StreamKind waiter, const comm::Work& done) = 0;
  /// The completion of everything issued on channel `c` so far.
  virtual comm::Work record(comm::StreamKind c) = 0;
  /// The host waits for `done` before the compute stream uses what it made (the copy-out of
  /// an all-gather, the sharded gradients after the reductions); every error is raised, the
  /// first one rethrown. CUDA: the compute stream waits instead, the host only re-raises errors
  /// already known (and blocks under hold_host_for_shards).
  virtual void host_wait(const std::vector<comm::Work>& done) = 0;
  virtual void host_wait(const comm::Work& done) = 0;
  /// The host reads what channel c's kernels wrote (parameters, gradients).
  virtual void host_reads(comm::StreamKind c) = 0;
  /// After a user callback ran on the compute channel: its completion.
  virtual comm::Work computed(const char* phase, const std::string& module) = 0;
  /// CPUOffloadPolicy on a CUDA mesh: the end of backward also blocks the host until the
  /// reduced gradient shards are in host memory and the all-gather stream has passed its last
  /// read of the host shards (FSDP2's finalize_backward), before the host optimizer uses them.
  virtual void hold_host_for_shards() {}

  static int index(comm::StreamKind c) noexcept { return static_cast<int>(c); }

 protected:
  Device() = default;
  kernels::ExecStream exec_[comm::kNumStreams] = {
      kernels::ExecStream::host(), kernels::ExecStream::host(), kernels::ExecStream::host(),
      kernels::ExecStream::host()};
  comm::Work last_[comm::kNumStreams];
};

/// The device of `mesh` for one FSDP root (`group`, the first group attached, names its pool).
std::unique_ptr<Device> make_device(const DeviceMesh& mesh, const std::string& group);

}  // namespace fullshard::transport
