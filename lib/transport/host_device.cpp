// The host device: MPI and shared-memory transports, host memory, Kokkos host kernels. Each
// channel is the group mesh's channel stream (a worker thread or the caller); the compute
// channel is the host itself, so its operations run inline and waits for it are host waits.
#include <exception>

#include "fullshard/tensor/buffer_pool.hpp"
#include "lib/transport/devices.hpp"

namespace fullshard::transport::detail {
namespace {

class HostDevice final : public Device {
 public:
  // `mesh`: the first group's (the engine's stream waits use its channel streams).
  explicit HostDevice(const DeviceMesh& mesh) : mesh_(mesh) {}

  comm::Stream& stream(comm::StreamKind c, const DeviceMesh& mesh) const override {
    return mesh.stream(c);
  }

  comm::Work run(comm::StreamKind c, comm::Stream& s, const comm::LazyLabel& label,
                 std::function<void()> kernel) override {
    if (c == comm::StreamKind::compute) {
      kernel();
      return comm::Work();
    }
    comm::Work before = last(c);
    if (s.runs_inline()) {
      before.test();
      kernel();
      return comm::Work();
    }
    return s.submit(label, [before, k = std::move(kernel)] {
      before.test();
      k();
    });
  }

  void before_collective(comm::StreamKind c) override { exec(c).fence(); }

  Tensor acquire(comm::StreamKind, std::int64_t numel, DType dtype, const char* what,
                 const std::string& group) override {
    return pool_.acquire({numel}, dtype, what, group);
  }
  Tensor reserve(std::int64_t numel, DType dtype, const char*, const std::string&) override {
    return pool_.reserve({numel}, dtype);
  }
  void used(Held& h, comm::StreamKind, const comm::Work& w) override { h.used = w; }
  // The bytes go back to the pool with the last view, once the operation using them ran
  // (worker streams run it later).
  void release(Held& h, std::size_t) override { h.used.wait(); }
  std::size_t bytes_in_use() const override { return pool_.bytes_in_use(); }
  std::size_t peak_bytes_in_use() const override { return pool_.peak_bytes_in_use(); }
  void reset_peak() override { pool_.reset_peak(); }

  void wait(comm::StreamKind waiter, const comm::Work& done) override {
    if (waiter == comm::StreamKind::compute) return;  // the engine waits on the host (host_wait)
    comm::Stream& s = mesh_.stream(waiter);
    if (s.runs_inline())
      done.test();  // finished already (caller streams run at submit): its error, if any
    else
      s.wait(done.event());
  }
  // Operations of one stream finish in order: the last one's completion is the stream's.
  comm::Work record(comm::StreamKind c) override { return last(c); }

  void host_wait(const std::vector<comm::Work>& done) override {
    for (const auto& e : exec_)
      e.fence();
    std::exception_ptr first;
    for (const comm::Work& w : done) {
      try {
        w.wait();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }
  void host_wait(const comm::Work& done) override {
    done.wait();
    exec(comm::StreamKind::all_gather).fence();
  }
  void host_reads(comm::StreamKind c) override { exec(c).fence(); }
  comm::Work computed(const char*, const std::string&) override { return comm::Work(); }

 private:
  DeviceMesh mesh_;
  BufferPool pool_{MemorySpace::host, "fsdp"};
};

}  // namespace

std::unique_ptr<Device> make_host_device(const DeviceMesh& mesh) {
  return std::make_unique<HostDevice>(mesh);
}

}  // namespace fullshard::transport::detail
