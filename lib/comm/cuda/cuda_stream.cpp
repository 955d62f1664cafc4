// CUDA streams and events behind Stream/StreamEvent (built with FULLSHARD_ENABLE_CUDA).
// Compiled here, run only where a GPU is (scripts/gpu-check runs test/gpu/test_gpu_streams).
#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <utility>

#include "fullshard/base/error.hpp"
#include "lib/comm/cuda/cuda_check.hpp"
#include "lib/comm/device_stream.hpp"

namespace fullshard::comm {
namespace {

using Name = std::shared_ptr<const std::string>;

// Context strings are built only on failure: recording an event is on every device
// operation's path.
class CudaEvent final : public DeviceEvent {
 public:
  CudaEvent(cudaStream_t stream, Name stream_name) : name_(std::move(stream_name)) {
    if (const cudaError_t e = cudaEventCreateWithFlags(&event_, cudaEventDisableTiming);
        e != cudaSuccess)
      cuda_check(e, "cudaEventCreate", "recording an event on stream '" + *name_ + "'");
    if (const cudaError_t e = cudaEventRecord(event_, stream); e != cudaSuccess) {
      cudaEventDestroy(event_);
      cuda_check(e, "cudaEventRecord", "recording an event on stream '" + *name_ + "'");
    }
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }  // fine while pending
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  bool ready() override {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    if (e != cudaSuccess) cuda_check(e, "cudaEventQuery", "an event of stream '" + *name_ + "'");
    return true;
  }
  void synchronize() override {
    if (const cudaError_t e = cudaEventSynchronize(event_); e != cudaSuccess)
      cuda_check(e, "cudaEventSynchronize", "an event of stream '" + *name_ + "'");
  }
  void enqueue_wait(void* native) override {
    if (const cudaError_t e = cudaStreamWaitEvent(static_cast<cudaStream_t>(native), event_, 0);
        e != cudaSuccess)
      cuda_check(e, "cudaStreamWaitEvent", "waiting on an event of stream '" + *name_ + "'");
  }

 private:
  cudaEvent_t event_ = nullptr;
  Name name_;
};

class CudaStream final : public DeviceStreamBackend {
 public:
  CudaStream(cudaStream_t s, const std::string& name, bool owned)
      : stream_(s), name_(std::make_shared<const std::string>(name)), owned_(owned) {}
  ~CudaStream() override {
    if (owned_) cudaStreamDestroy(stream_);  // pending work still completes
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  void* native() const noexcept override { return stream_; }
  std::shared_ptr<DeviceEvent> record() override {
    return std::make_shared<CudaEvent>(stream_, name_);
  }
  void synchronize() override {
    if (const cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess)
      cuda_check(e, "cudaStreamSynchronize", "synchronising stream '" + *name_ + "'");
  }

 private:
  cudaStream_t stream_ = nullptr;
  Name name_;
  bool owned_ = false;
};

}  // namespace

std::unique_ptr<DeviceStreamBackend> make_cuda_stream_backend(const std::string& name,
                                                              int priority) {
  const std::string context = "creating device stream '" + name + "'";
  int devices = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0) {
    cudaGetLastError();  // clear the sticky "no device" state for later calls
    throw CommError(context + ": no usable CUDA device (cudaGetDeviceCount: " +
                    (e == cudaSuccess ? std::string("0 devices") : cudaGetErrorString(e)) + ")");
  }
  cudaStream_t s = nullptr;
  cuda_check(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority),
             "cudaStreamCreateWithPriority", context);
  return std::make_unique<CudaStream>(s, name, true);
}

std::unique_ptr<DeviceStreamBackend> wrap_cuda_stream_backend(void* native,
                                                              const std::string& name) {
  return std::make_unique<CudaStream>(static_cast<cudaStream_t>(native), name, false);
}

}  // namespace fullshard::comm
