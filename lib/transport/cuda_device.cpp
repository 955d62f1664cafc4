// The CUDA device: NCCL collectives and Kokkos kernels enqueued on the root mesh's CUDA channel
// streams, user compute on its compute stream, every buffer from the root's stream-ordered
// device pool. Cross-stream order is kept with CUDA events only (a wait is
// cudaStreamWaitEvent); the host never blocks on a collective or a kernel (no fence, no
// cudaDeviceSynchronize): its waits only re-raise errors already known and order the compute
// stream, except at the end of backward under CPUOffloadPolicy (hold_host_for_shards).
#include <algorithm>
#include <exception>

#include "lib/tensor/stream_pool.hpp"
#include "lib/transport/devices.hpp"

namespace fullshard::transport::detail {
namespace {

// "record on <stream>": static text, so recording builds no string.
const char* record_label(comm::StreamKind c) noexcept {
  switch (c) {
    case comm::StreamKind::compute:
      return "record on compute";
    case comm::StreamKind::all_gather:
      return "record on all_gather";
    case comm::StreamKind::reduce_scatter:
      return "record on reduce_scatter";
    case comm::StreamKind::all_reduce:
      return "record on all_reduce";
  }
  return "record";
}

class CudaDevice final : public Device {
 public:
  CudaDevice(const DeviceMesh& mesh, const std::string& group)
      : mesh_(mesh), pool_(MemorySpace::device, "fsdp:" + group) {
    for (int c = 0; c < comm::kNumStreams; ++c)
      exec_[c] =
          kernels::ExecStream::device(cuda(static_cast<comm::StreamKind>(c)).native_handle());
  }

  comm::Stream& stream(comm::StreamKind c, const DeviceMesh&) const override { return cuda(c); }

  comm::Work run(comm::StreamKind c, comm::Stream& s, const comm::LazyLabel& label,
                 std::function<void()> kernel) override {
    if (c == comm::StreamKind::all_gather) gather_after_compute();
    last(c).test();  // the previous operation must not have failed (known errors only)
    return s.submit(label, std::move(kernel));
  }
  void before_collective(comm::StreamKind c) override {
    if (c == comm::StreamKind::all_gather) gather_after_compute();
  }

  Tensor acquire(comm::StreamKind first_user, std::int64_t numel, DType dtype, const char* what,
                 const std::string& group) override {
    // Stream-ordered: a block last used on other streams is handed out after their release
    // events (cudaStreamWaitEvent).
    Tensor t = pool_.acquire({numel}, dtype, cuda(first_user), what, group);
    in_use_ += t.nbytes();
    peak_ = std::max(peak_, in_use_);
    return t;
  }
  Tensor scratch(comm::StreamKind c, std::int64_t numel, DType dtype, const char* what,
                 const std::string& group) override {
    return pool_.acquire({numel}, dtype, cuda(c), what, group);
  }
  // The pool records a release event on every stream the block was used on: no host wait.
  void used(Held& h, comm::StreamKind c, const comm::Work&) override {
    if (h.tensor.nbytes() > 0) pool_.used_on(h.tensor, cuda(c));
  }
  void release(Held&, std::size_t bytes) override { in_use_ -= std::min(in_use_, bytes); }
  std::size_t bytes_in_use() const override { return in_use_; }
  std::size_t peak_bytes_in_use() const override { return peak_; }
  void reset_peak() override { peak_ = in_use_; }

  void wait(comm::StreamKind waiter, const comm::Work& done) override {
    cuda(waiter).wait(done.event());
  }
  // An event after everything enqueued on the stream so far (operations that enqueue nothing,
  // such as a reshard, have no event of their own).
  comm::Work record(comm::StreamKind c) override {
    return cuda(c).submit(comm::LazyLabel(record_label(c)), [] {});
  }

  // FSDP2's wait for the reductions on the device: the compute stream waits for their events,
  // the host only re-raises errors already known. Under CPUOffloadPolicy (FSDP2's
  // finalize_backward) the host also blocks until the reduced gradient shards are in host
  // memory and the all-gather stream has passed its last read of the host shards (a prefetch
  // backward did not use), before anything on the host reads or writes them.
  void host_wait(const std::vector<comm::Work>& done) override {
    std::exception_ptr first;
    for (const comm::Work& w : done) {
      try {
        if (hold_host_)
          w.wait();
        else
          w.test();
        cuda(comm::StreamKind::compute).wait(w.event());
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (hold_host_) {
      try {
        cuda(comm::StreamKind::all_gather).record().synchronize();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    gather_after_compute_ = true;  // the next iteration's first all-gather
    if (first) std::rethrow_exception(first);
  }
  // For an all-gather before its copy-out, a reduction before the sharded gradients are used:
  // the compute stream waits instead of the host.
  void host_wait(const comm::Work& done) override {
    done.test();
    cuda(comm::StreamKind::compute).wait(done.event());
  }
  void host_reads(comm::StreamKind) override {
  }  // stream order: a front end reads on the compute stream
  // The callback enqueued its kernels on the compute stream: the event after them.
  comm::Work computed(const char* phase, const std::string& module) override {
    return cuda(comm::StreamKind::compute).submit(std::string(phase) + "(" + module + ")", [] {});
  }
  void hold_host_for_shards() override { hold_host_ = true; }

 private:
  DeviceMesh mesh_;
  StreamOrderedPool pool_;
  std::size_t in_use_ = 0;
  std::size_t peak_ = 0;
  bool hold_host_ = false;
  // FSDP2's root pre-forward: the first all-gather-stream operation of an iteration waits for
  // the compute stream (what the user enqueued there since the last backward, e.g. an
  // optimizer step on the shards). Set at the end of backward.
  bool gather_after_compute_ = true;

  comm::Stream& cuda(comm::StreamKind c) const {
    return c == comm::StreamKind::compute ? mesh_.compute_stream() : mesh_.device_stream(c);
  }
  void gather_after_compute() {
    if (!gather_after_compute_) return;
    gather_after_compute_ = false;
    cuda(comm::StreamKind::all_gather).wait(cuda(comm::StreamKind::compute).record());
  }
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(const DeviceMesh& mesh, const std::string& group) {
  return std::make_unique<CudaDevice>(mesh, group);
}

}  // namespace fullshard::transport::detail
