// Streams, events and work handles: ordered asynchronous execution, modelled on CUDA streams
// so that a cudaStream_t sits behind the same interface. On the host a stream is either a
// worker thread running its operations in order, or the calling thread itself ("caller"
// stream: an operation runs when it is enqueued). A device stream (CUDA builds) is a
// cudaStream_t: an operation's host function runs at submit and enqueues device work (a
// kernel, an NCCL collective); its completion is a CUDA event recorded after it.
//
// Cross-stream order on the device is kept with events only (cudaStreamWaitEvent), never with
// device-wide synchronisation: Stream::wait(event) and Work::wait(consumer) on a device stream
// return without blocking the host.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "fullshard/runtime/settings.hpp"

namespace fullshard::comm {

// Opaque: a stream's and a completion's state (lib/comm/stream.cpp), and the library's access to
// them (lib/comm/device_stream.hpp).
struct Completion;
struct StreamImpl;
struct StreamAccess;

class Stream;

/// The four streams of an FSDP root (FSDP2's compute, all-gather, reduce-scatter and HSDP
/// all-reduce streams). A mesh has one stream of each kind and, on every dim, one communicator
/// per kind, used only on that kind's stream (DeviceMesh::comm, DeviceMesh::stream).
enum class StreamKind : std::uint8_t { compute, all_gather, reduce_scatter, all_reduce };
constexpr int kNumStreams = 4;
/// "compute", "all_gather", "reduce_scatter" or "all_reduce".
const char* stream_name(StreamKind s) noexcept;

/// The label of an operation that is built only when its text is needed (an error, a
/// timeout, a stream recorder, Work::label()), so that an operation builds no string when it
/// is submitted.
/// Copying one copies two pointers, two numbers and a shared_ptr (no allocation).
class LazyLabel {
 public:
  /// Builds the text from the parts given to the constructor.
  using Build = std::string (*)(const char* text, const void* context, std::uint64_t a,
                                std::uint64_t b);
  /// `text` (static storage: a literal or op_kind_name()).
  explicit LazyLabel(const char* text = "") noexcept : text_(text) {}
  /// `text` + *name + `suffix` (text and suffix of static storage; the name is shared).
  LazyLabel(const char* text, std::shared_ptr<const std::string> name,
            const char* suffix = "") noexcept
      : text_(text), suffix_(suffix), context_(std::move(name)) {}
  /// build(text, context.get(), a, b), for labels with numbers (a sequence, a count).
  LazyLabel(Build build, const char* text, std::shared_ptr<const void> context, std::uint64_t a = 0,
            std::uint64_t b = 0) noexcept
      : build_(build), text_(text), context_(std::move(context)), a_(a), b_(b) {}
  /// The text.
  std::string str() const;

 private:
  Build build_ = nullptr;
  const char* text_ = "";
  const char* suffix_ = "";
  std::shared_ptr<const void> context_;
  std::uint64_t a_ = 0;
  std::uint64_t b_ = 0;
};

/// What runs a stream's operations.
enum class StreamType {
  caller,  ///< the thread that submits (host)
  worker,  ///< a worker thread of the stream (host)
  device,  ///< a CUDA stream (device work, enqueued by the submitting thread)
};
const char* stream_type_name(StreamType k) noexcept;

/// A point in a stream's order. Default-constructed events are complete.
class StreamEvent {
 public:
  StreamEvent() = default;
  /// True when everything enqueued before the record point has finished. For a device event
  /// a device error also counts as finished (the error surfaces in Work::wait/synchronize).
  bool query() const noexcept;
  /// Blocks the calling thread until query() is true (no timeout: use Work::wait for that).
  void synchronize() const;
  /// True for an event recorded on a device stream (a CUDA event).
  bool is_device() const noexcept;

 private:
  friend class Stream;
  friend class Work;
  friend struct StreamAccess;
  explicit StreamEvent(std::shared_ptr<Completion> c) : c_(std::move(c)) {}
  std::shared_ptr<Completion> c_;
};

/// Handle of one asynchronous operation. Errors raised by the operation are re-thrown by
/// wait() and test(). Copies refer to the same operation. A default-constructed Work is
/// complete.
class Work {
 public:
  Work() = default;
  /// Blocks until the operation finished; re-throws its error. If the operation carries a
  /// timeout (collectives carry FULLSHARD_TIMEOUT) and does not finish in time:
  /// - host operations: the job is aborted with a message naming rank, communicator,
  ///   operation and sequence number (a blocked MPI collective cannot be cancelled, and the
  ///   alternative is a silent hang);
  /// - device operations: the host polls the operation's event and its communicator's
  ///   asynchronous errors (ncclCommGetAsyncError); an error or the timeout aborts the
  ///   communicator (ncclCommAbort) and throws CommError naming rank, communicator and
  ///   operation.
  void wait() const;
  /// Orders `consumer` after the operation. For a device operation and a device consumer
  /// this is cudaStreamWaitEvent: the host is not blocked (an error already known is
  /// re-thrown, and the producer's asynchronous errors are polled once). Otherwise it is
  /// wait() (the host blocks).
  void wait(Stream& consumer) const;
  /// Non-blocking: true once the operation finished (re-throws its error then).
  bool test() const;
  /// The operation's completion as an event, for Stream::wait on another stream.
  StreamEvent event() const { return StreamEvent(c_); }
  /// "all_gather on 'mesh.shard' (seq 3, 1024 x f32)"-style description.
  std::string label() const;
  /// True for an operation submitted to a device stream.
  bool is_device() const noexcept;

 private:
  friend class Stream;
  friend struct StreamAccess;
  explicit Work(std::shared_ptr<Completion> c) : c_(std::move(c)) {}
  std::shared_ptr<Completion> c_;
};

/// An ordered queue of operations. Copies refer to the same stream; the worker thread (if
/// any) drains the queue and stops when the last copy is destroyed.
class Stream {
 public:
  /// A stream whose operations run on the calling thread at enqueue time.
  static Stream caller(std::string name = "caller");
  /// A stream with its own worker thread.
  static Stream worker(std::string name);
  /// Worker or caller, as `progress` says (the Runtime's Settings::host_progress).
  Stream(std::string name, HostProgress progress);
  /// A new CUDA stream (cudaStreamNonBlocking, `priority` as cudaStreamCreateWithPriority) on
  /// the current device, destroyed with the last copy. CUDA builds only: ConfigError when
  /// fullshard was built without CUDA, CommError when no device can be used.
  static Stream device(std::string name, int priority = 0);
  /// A device stream over an existing cudaStream_t (passed as void*, e.g. the application's
  /// compute stream); not destroyed by fullshard. CUDA builds only.
  static Stream wrap_device(void* cuda_stream, std::string name);

  const std::string& name() const noexcept;
  /// The name, shared (for LazyLabel).
  const std::shared_ptr<const std::string>& shared_name() const noexcept;
  StreamType kind() const noexcept;
  bool is_device() const noexcept { return kind() == StreamType::device; }
  /// The cudaStream_t of a device stream (as void*); nullptr for host streams.
  void* native_handle() const noexcept;
  /// True for caller and device streams (an operation's host function runs inside submit()).
  bool runs_inline() const noexcept;
  /// Unique id of this stream in the process (copies share it).
  std::uint64_t id() const noexcept;

  /// Enqueues `op`. Operations of one stream run one after another in submit order.
  /// `label` names the operation in errors and timeouts; `timeout_s` > 0 arms the timeout
  /// of Work::wait. On a device stream `op` runs now and must only enqueue device work on
  /// native_handle(); the Work completes when that work has run on the device.
  Work submit(std::string label, std::function<void()> op, double timeout_s = 0.0);
  /// The same with a label built only if needed: for an error, a timeout, a recorder or
  /// Work::label() (any stream).
  Work submit(const LazyLabel& label, std::function<void()> op, double timeout_s = 0.0);
  /// An event that completes when everything submitted so far has run.
  StreamEvent record();
  /// Operations submitted after this call start only once `e` completed. A device stream
  /// waiting on a device event: cudaStreamWaitEvent (the host is not blocked); on a host
  /// event: the calling thread blocks until it completed (a CUDA stream cannot wait on a host
  /// thread without one). A worker stream waiting on a device event blocks its worker thread.
  void wait(const StreamEvent& e);
  /// Blocks until everything submitted so far has run (cudaStreamSynchronize on a device
  /// stream: this stream only, never the whole device).
  void synchronize();

  /// Called after every operation with its label and its start and end times (for measured
  /// timelines); empty to stop. Runs on the thread that ran the operation. Device streams do
  /// not call it (their operations finish on the device, after submit returns).
  using Recorder =
      std::function<void(const std::string& label, std::chrono::steady_clock::time_point start,
                         std::chrono::steady_clock::time_point end)>;
  void set_recorder(Recorder recorder);

 private:
  friend struct StreamAccess;
  explicit Stream(std::shared_ptr<StreamImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<StreamImpl> impl_;
};

}  // namespace fullshard::comm
