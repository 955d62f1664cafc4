// Streams, events and work handles: ordered asynchronous execution, modelled on CUDA streams
// so that a cudaStream_t can sit behind the same interface. On the host a stream is either a
// worker thread running its operations in order, or the calling thread itself ("caller"
// stream: an operation runs when it is enqueued).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "fullshard/runtime/settings.hpp"

namespace fullshard::comm {

namespace detail {
struct Completion;
struct StreamImpl;
}  // namespace detail

/// A point in a stream's order. Default-constructed events are complete.
class Event {
 public:
  Event() = default;
  /// True when everything enqueued before the record point has finished.
  bool query() const noexcept;
  /// Blocks the calling thread until query() is true (no timeout: use Work::wait for that).
  void synchronize() const;

 private:
  friend class Stream;
  friend class Work;
  explicit Event(std::shared_ptr<detail::Completion> c) : c_(std::move(c)) {}
  std::shared_ptr<detail::Completion> c_;
};

/// Handle of one asynchronous operation. Errors raised by the operation are re-thrown by
/// wait() and test(). Copies refer to the same operation. A default-constructed Work is
/// complete.
class Work {
 public:
  Work() = default;
  /// Blocks until the operation finished; re-throws its error. If the operation carries a
  /// timeout (collectives carry FULLSHARD_TIMEOUT) and does not finish in time, the job is
  /// aborted with a message naming rank, communicator, operation and sequence number: a
  /// blocked collective cannot be cancelled, and the alternative is a silent hang.
  void wait() const;
  /// Non-blocking: true once the operation finished (re-throws its error then).
  bool test() const;
  /// The operation's completion as an event, for Stream::wait on another stream.
  Event event() const { return Event(c_); }
  /// "all_gather on 'mesh.shard' (seq 3, 1024 x f32)"-style description.
  std::string label() const;

 private:
  friend class Stream;
  explicit Work(std::shared_ptr<detail::Completion> c) : c_(std::move(c)) {}
  std::shared_ptr<detail::Completion> c_;
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

  const std::string& name() const noexcept;
  /// True for caller streams (operations run inside submit()).
  bool runs_inline() const noexcept;
  /// Unique id of this stream in the process (copies share it).
  std::uint64_t id() const noexcept;

  /// Enqueues `op`. Operations of one stream run one after another in submit order.
  /// `label` names the operation in errors and timeouts; `timeout_s` > 0 arms the timeout
  /// of Work::wait.
  Work submit(std::string label, std::function<void()> op, double timeout_s = 0.0);
  /// An event that completes when everything submitted so far has run.
  Event record();
  /// Operations submitted after this call start only once `e` completed.
  void wait(const Event& e);
  /// Blocks until everything submitted so far has run.
  void synchronize();

  /// Called after every operation with its label and its start and end times (for measured
  /// timelines); empty to stop. Runs on the thread that ran the operation.
  using Recorder =
      std::function<void(const std::string& label, std::chrono::steady_clock::time_point start,
                         std::chrono::steady_clock::time_point end)>;
  void set_recorder(Recorder recorder);

 private:
  explicit Stream(std::shared_ptr<detail::StreamImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<detail::StreamImpl> impl_;
};

}  // namespace fullshard::comm
