// The device side of Stream/StreamEvent/Work (private to lib/comm and its tests).
//
// A device stream is a DeviceStreamBackend; in CUDA builds lib/comm/cuda/cuda_stream.cpp
// implements it with cudaStream_t/cudaEvent_t. The interfaces carry no CUDA types, so the
// logic of stream.cpp (polling, timeouts, error hooks, cross-stream waits) is tested on any
// machine with fake backends (test/unit/test_device_stream.cpp).
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/comm/stream.hpp"
#include "fullshard/config.hpp"

namespace fullshard::comm {

/// A point recorded on a device stream.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  /// Non-blocking: true once the device passed the record point. Throws CommError on a
  /// device error.
  virtual bool ready() = 0;
  /// Blocks the calling thread until ready() (no timeout). Throws CommError on a device error.
  virtual void synchronize() = 0;
  /// Makes the device stream `native` wait for this event, without blocking the host.
  virtual void enqueue_wait(void* native) = 0;
};

/// One device stream.
class DeviceStreamBackend {
 public:
  virtual ~DeviceStreamBackend() = default;
  /// The cudaStream_t as void*.
  virtual void* native() const noexcept = 0;
  /// Records an event after everything enqueued so far.
  virtual std::shared_ptr<DeviceEvent> record() = 0;
  /// Blocks until this stream is idle (not the whole device).
  virtual void synchronize() = 0;
};

/// Hooks of one device operation, called by Work::wait while it polls the event.
struct DeviceWatch {
  /// Throws CommError when the producer reports an asynchronous error (an NCCL
  /// communicator's ncclCommGetAsyncError); it aborts its communicator first.
  std::function<void()> check;
  /// Called once when the operation ran past its timeout, with the message that will be
  /// thrown (the NCCL backend aborts its communicator).
  std::function<void(const std::string& why)> on_timeout;
};

/// An operation submitted inside a group (ncclGroupStart/End): its event can only be recorded
/// after the group ended, by finish_deferred().
struct DeferredDevice {
  std::shared_ptr<Completion> completion;
  Stream stream;
};

struct StreamAccess {
  /// A device stream over `backend`.
  static Stream make_device(std::string name, std::unique_ptr<DeviceStreamBackend> backend);
  /// Submits a device operation: runs `enqueue` (which puts device work on the stream), then
  /// records its event, unless `deferred` is given: then the event is recorded later by
  /// finish_deferred() and the operation is appended to *deferred. An exception from
  /// `enqueue` is stored in the Work (re-thrown by wait).
  static Work submit_device(Stream& stream, std::string label, const std::function<void()>& enqueue,
                            double timeout_s, DeviceWatch watch,
                            std::vector<DeferredDevice>* deferred = nullptr);
  /// The same with a label built only when needed (an error, a timeout, Work::label()).
  static Work submit_device(Stream& stream, const LazyLabel& label,
                            const std::function<void()>& enqueue, double timeout_s,
                            DeviceWatch watch, std::vector<DeferredDevice>* deferred = nullptr);
  /// Records the event of a deferred operation (after ncclGroupEnd), or stores `error` in it.
  static void finish_deferred(DeferredDevice& d, std::exception_ptr error = nullptr);
};

#if FULLSHARD_HAS_CUDA
/// The CUDA backends (lib/comm/cuda/cuda_stream.cpp).
std::unique_ptr<DeviceStreamBackend> make_cuda_stream_backend(const std::string& name,
                                                              int priority);
std::unique_ptr<DeviceStreamBackend> wrap_cuda_stream_backend(void* native,
                                                              const std::string& name);
#endif

}  // namespace fullshard::comm
