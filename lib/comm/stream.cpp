#include "fullshard/comm/stream.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "fullshard/base/deadline.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/config.hpp"
#include "lib/comm/device_stream.hpp"

namespace fullshard::comm {

const char* stream_name(StreamKind s) noexcept {
  switch (s) {
    case StreamKind::compute:
      return "compute";
    case StreamKind::all_gather:
      return "all_gather";
    case StreamKind::reduce_scatter:
      return "reduce_scatter";
    case StreamKind::all_reduce:
      return "all_reduce";
  }
  return "?";
}

const char* stream_type_name(StreamType k) noexcept {
  switch (k) {
    case StreamType::caller:
      return "caller";
    case StreamType::worker:
      return "worker";
    case StreamType::device:
      return "device";
  }
  return "?";
}

std::string LazyLabel::str() const {
  if (build_) return build_(text_, context_.get(), a_, b_);
  std::string out = text_;
  if (context_) out += *static_cast<const std::string*>(context_.get());
  return out += suffix_;
}

struct Completion {
  // The label: given as text, or built from `lazy` on first use (only errors, timeouts,
  // recorders and Work::label() need it).
  std::string label;
  LazyLabel lazy;
  bool label_is_lazy = false;
  std::once_flag label_once;
  double timeout_s = 0.0;
  std::atomic<bool> done{false};
  std::exception_ptr error;  // written before `done` is set, read after
  std::mutex m;
  std::condition_variable cv;
  // Device operations: done once `device` is ready (set by the first poll that sees it).
  // `device` is written once, before the Work is handed out (or by finish_deferred, before
  // anyone may wait); `pending_group` marks an operation whose group has not ended yet.
  std::shared_ptr<DeviceEvent> device;
  DeviceWatch watch;
  bool pending_group = false;

  bool is_device() const noexcept { return device != nullptr || pending_group; }

  const std::string& text() {
    if (label_is_lazy) std::call_once(label_once, [this] { label = lazy.str(); });
    return label;
  }

  void require_issued() {
    if (pending_group)
      throw InvalidArgument(text() +
                            ": waited on inside its NCCL group; end the group "
                            "(NcclGroup::end) before waiting on its operations");
  }

  // Non-blocking poll of a device operation: true when finished (or failed).
  bool poll_device() {
    if (done.load(std::memory_order_acquire)) return true;
    require_issued();
    try {
      const bool ready = device->ready();
      if (watch.check) watch.check();
      if (!ready) return false;
    } catch (...) {
      finish(std::current_exception());
      return true;
    }
    finish(nullptr);
    return true;
  }

  // Blocks until the device operation finished, polling the producer's asynchronous errors;
  // on timeout the producer is told (it aborts its communicator) and CommError is stored.
  void wait_device() {
    if (poll_device()) return;  // finished: no wait, no label
    struct TimedOut {};
    BoundedWait wait(WaitSite::labelled(text()), timeout_s, [this](const std::string& why) {
      std::string aborted;
      if (watch.on_timeout) {
        try {
          watch.on_timeout(why);
          aborted = "; its communicator was aborted and cannot be used again";
        } catch (...) {  // the timeout is the error to report
        }
      }
      finish(std::make_exception_ptr(CommError(why + aborted)));
      throw TimedOut{};
    });
    try {
      wait.poll([this] { return poll_device(); });
    } catch (const TimedOut&) {  // stored by finish
    }
  }

  void finish(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(m);
      error = std::move(e);
      done.store(true, std::memory_order_release);
    }
    cv.notify_all();
  }

  void block(bool with_timeout) {
    if (done.load(std::memory_order_acquire)) return;
    std::unique_lock<std::mutex> lock(m);
    auto is_done = [&] { return done.load(std::memory_order_acquire); };
    BoundedWait(WaitSite::labelled(text()), with_timeout ? timeout_s : 0.0)
        .block(cv, lock, is_done);
  }
};

struct StreamImpl {
  struct Task {
    std::function<void()> op;
    std::shared_ptr<Completion> done;
    std::shared_ptr<const Stream::Recorder> recorder;  // set when the stream records
  };

  std::string name;
  std::shared_ptr<const std::string> shared_name;  // the same, for lazy labels
  bool inline_ = false;
  std::uint64_t id = 0;
  std::mutex m;
  std::condition_variable cv;
  std::deque<Task> queue;
  bool stopping = false;
  std::thread worker;
  std::unique_ptr<Watchdog> watchdog;                // caller streams only, created on first use
  std::shared_ptr<const Stream::Recorder> recorder;  // guarded by m
  std::unique_ptr<DeviceStreamBackend> device;       // device streams only

  StreamType kind() const noexcept {
    return device ? StreamType::device : (inline_ ? StreamType::caller : StreamType::worker);
  }

  static std::uint64_t next_id() {
    static std::atomic<std::uint64_t> counter{0};
    return ++counter;
  }

  StreamImpl(std::string n, bool run_inline)
      : name(std::move(n)),
        shared_name(std::make_shared<const std::string>(name)),
        inline_(run_inline),
        id(next_id()) {
    if (!inline_) worker = std::thread([this] { run(); });
  }
  StreamImpl(std::string n, std::unique_ptr<DeviceStreamBackend> backend)
      : name(std::move(n)),
        shared_name(std::make_shared<const std::string>(name)),
        inline_(true),
        id(next_id()),
        device(std::move(backend)) {}

  ~StreamImpl() {
    if (!inline_) {
      {
        std::lock_guard<std::mutex> lock(m);
        stopping = true;
      }
      cv.notify_one();
      worker.join();  // drains the queue first
    }
  }

  static void execute(Task& t) noexcept {
    std::exception_ptr err;
    const auto start =
        t.recorder ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
    try {
      t.op();
    } catch (...) {
      err = std::current_exception();
    }
    if (t.recorder) {
      try {
        (*t.recorder)(t.done->text(), start, std::chrono::steady_clock::now());
      } catch (...) {  // a failing recorder must not fail the operation
      }
    }
    // Release what the operation captured (buffers) before signalling completion: a waiter
    // that then drops its own references frees the memory at a deterministic point.
    t.op = nullptr;
    t.done->finish(std::move(err));
  }

  void run() {
    for (;;) {
      Task t;
      {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) return;
        t = std::move(queue.front());
        queue.pop_front();
      }
      execute(t);
    }
  }

  std::shared_ptr<Completion> enqueue(std::string label, std::function<void()> op,
                                      double timeout_s) {
    auto c = std::make_shared<Completion>();
    c->label = std::move(label);
    return enqueue(std::move(c), std::move(op), timeout_s);
  }
  // The label becomes text only when a message, a recorder or Work::label() needs it.
  std::shared_ptr<Completion> enqueue(const LazyLabel& label, std::function<void()> op,
                                      double timeout_s) {
    auto c = std::make_shared<Completion>();
    c->lazy = label;
    c->label_is_lazy = true;
    return enqueue(std::move(c), std::move(op), timeout_s);
  }
  std::shared_ptr<Completion> enqueue(std::shared_ptr<Completion> c, std::function<void()> op,
                                      double timeout_s) {
    c->timeout_s = timeout_s;
    Task t{std::move(op), c, nullptr};
    {
      std::lock_guard<std::mutex> lock(m);
      t.recorder = recorder;
    }
    if (inline_) {
      if (timeout_s > 0) {
        if (!watchdog) watchdog = std::make_unique<Watchdog>();
        watchdog->arm(c->text(), timeout_s);
        execute(t);
        watchdog->disarm();
      } else {
        execute(t);
      }
    } else {
      {
        std::lock_guard<std::mutex> lock(m);
        queue.push_back(std::move(t));
      }
      cv.notify_one();
    }
    return c;
  }
};

bool StreamEvent::query() const noexcept {
  if (!c_) return true;
  if (c_->is_device()) {
    try {
      return c_->poll_device();
    } catch (...) {  // waited on inside its group: not finished
      return false;
    }
  }
  return c_->done.load(std::memory_order_acquire);
}

void StreamEvent::synchronize() const {
  if (!c_) return;
  if (c_->is_device()) {
    if (c_->done.load(std::memory_order_acquire)) return;
    c_->require_issued();
    c_->device->synchronize();
    return;
  }
  c_->block(false);
}

bool StreamEvent::is_device() const noexcept {
  return c_ && c_->is_device();
}

void Work::wait() const {
  if (!c_) return;
  if (c_->is_device())
    c_->wait_device();
  else
    c_->block(true);
  if (c_->error) std::rethrow_exception(c_->error);
}

void Work::wait(Stream& consumer) const {
  if (!c_) return;
  if (!c_->is_device() || !consumer.is_device()) return wait();
  if (!c_->poll_device()) {  // polls the producer's errors once, never blocks
    c_->device->enqueue_wait(consumer.native_handle());
    return;
  }
  if (c_->error) std::rethrow_exception(c_->error);
}

bool Work::test() const {
  if (!c_) return true;
  if (c_->is_device() ? !c_->poll_device() : !c_->done.load(std::memory_order_acquire))
    return false;
  if (c_->error) std::rethrow_exception(c_->error);
  return true;
}

std::string Work::label() const {
  return c_ ? c_->text() : std::string("(none)");
}

bool Work::is_device() const noexcept {
  return c_ && c_->is_device();
}

Stream Stream::caller(std::string name) {
  return Stream(std::make_shared<StreamImpl>(std::move(name), true));
}

Stream Stream::worker(std::string name) {
  return Stream(std::make_shared<StreamImpl>(std::move(name), false));
}

Stream::Stream(std::string name, HostProgress progress)
    : impl_(std::make_shared<StreamImpl>(std::move(name), progress == HostProgress::inline_)) {}

Stream Stream::device(std::string name, int priority) {
#if FULLSHARD_HAS_CUDA
  auto backend = make_cuda_stream_backend(name, priority);
  return StreamAccess::make_device(std::move(name), std::move(backend));
#else
  (void)priority;
  throw ConfigError("Stream::device('" + name +
                    "'): fullshard was built without CUDA (FULLSHARD_ENABLE_CUDA=OFF)");
#endif
}

Stream Stream::wrap_device(void* cuda_stream, std::string name) {
#if FULLSHARD_HAS_CUDA
  auto backend = wrap_cuda_stream_backend(cuda_stream, name);
  return StreamAccess::make_device(std::move(name), std::move(backend));
#else
  (void)cuda_stream;
  throw ConfigError("Stream::wrap_device('" + name +
                    "'): fullshard was built without CUDA (FULLSHARD_ENABLE_CUDA=OFF)");
#endif
}

const std::string& Stream::name() const noexcept {
  return impl_->name;
}
const std::shared_ptr<const std::string>& Stream::shared_name() const noexcept {
  return impl_->shared_name;
}
StreamType Stream::kind() const noexcept {
  return impl_->kind();
}
void* Stream::native_handle() const noexcept {
  return impl_->device ? impl_->device->native() : nullptr;
}
bool Stream::runs_inline() const noexcept {
  return impl_->inline_;
}
std::uint64_t Stream::id() const noexcept {
  return impl_->id;
}

Work Stream::submit(std::string label, std::function<void()> op, double timeout_s) {
  if (impl_->device) return StreamAccess::submit_device(*this, std::move(label), op, timeout_s, {});
  return Work(impl_->enqueue(std::move(label), std::move(op), timeout_s));
}

Work Stream::submit(const LazyLabel& label, std::function<void()> op, double timeout_s) {
  if (impl_->device) return StreamAccess::submit_device(*this, label, op, timeout_s, {});
  return Work(impl_->enqueue(label, std::move(op), timeout_s));
}

StreamEvent Stream::record() {
  if (impl_->device) {
    auto c = std::make_shared<Completion>();
    c->lazy = LazyLabel("record on stream '", impl_->shared_name, "'");
    c->label_is_lazy = true;
    c->device = impl_->device->record();
    return StreamEvent(std::move(c));
  }
  if (impl_->inline_) return StreamEvent();
  return StreamEvent(impl_->enqueue(
      LazyLabel("record on stream '", impl_->shared_name, "'"), [] {}, 0.0));
}

void Stream::wait(const StreamEvent& e) {
  if (impl_->device && e.is_device()) {
    e.c_->require_issued();
    if (!e.c_->poll_device()) e.c_->device->enqueue_wait(native_handle());
    return;
  }
  if (e.query()) return;
  if (impl_->inline_) {
    e.synchronize();
    return;
  }
  impl_->enqueue(
      LazyLabel("wait on stream '", impl_->shared_name, "'"), [e] { e.synchronize(); }, 0.0);
}

void Stream::synchronize() {
  if (impl_->device) return impl_->device->synchronize();
  record().synchronize();
}

void Stream::set_recorder(Recorder recorder) {
  std::lock_guard<std::mutex> lock(impl_->m);
  impl_->recorder = recorder ? std::make_shared<const Recorder>(std::move(recorder)) : nullptr;
}

Stream StreamAccess::make_device(std::string name, std::unique_ptr<DeviceStreamBackend> backend) {
  if (!backend) throw InvalidArgument("device stream '" + name + "': no backend");
  return Stream(std::make_shared<StreamImpl>(std::move(name), std::move(backend)));
}

namespace {

std::shared_ptr<Completion> submit_device_op(Stream& stream, StreamImpl& s,
                                             std::shared_ptr<Completion> c,
                                             const std::function<void()>& enqueue, double timeout_s,
                                             DeviceWatch watch,
                                             std::vector<DeferredDevice>* deferred) {
  if (!s.device)
    throw InvalidArgument(c->text() + ": stream '" + s.name + "' is a " +
                          stream_type_name(s.kind()) +
                          " stream, but device operations need a device stream (Stream::device)");
  c->timeout_s = timeout_s;
  c->watch = std::move(watch);
  try {
    enqueue();
    if (deferred) {
      c->pending_group = true;
      deferred->push_back(DeferredDevice{c, stream});
    } else {
      c->device = s.device->record();
    }
  } catch (...) {
    c->finish(std::current_exception());
  }
  return c;
}

}  // namespace

Work StreamAccess::submit_device(Stream& stream, std::string label,
                                 const std::function<void()>& enqueue, double timeout_s,
                                 DeviceWatch watch, std::vector<DeferredDevice>* deferred) {
  auto c = std::make_shared<Completion>();
  c->label = std::move(label);
  return Work(submit_device_op(stream, *stream.impl_, std::move(c), enqueue, timeout_s,
                               std::move(watch), deferred));
}

Work StreamAccess::submit_device(Stream& stream, const LazyLabel& label,
                                 const std::function<void()>& enqueue, double timeout_s,
                                 DeviceWatch watch, std::vector<DeferredDevice>* deferred) {
  auto c = std::make_shared<Completion>();
  c->lazy = label;
  c->label_is_lazy = true;
  return Work(submit_device_op(stream, *stream.impl_, std::move(c), enqueue, timeout_s,
                               std::move(watch), deferred));
}

void StreamAccess::finish_deferred(DeferredDevice& d, std::exception_ptr error) {
  Completion& c = *d.completion;
  if (!c.pending_group) return;
  if (!error) {
    try {
      c.device = d.stream.impl_->device->record();
    } catch (...) {
      error = std::current_exception();
    }
  }
  c.pending_group = false;
  if (error) c.finish(std::move(error));
}

}  // namespace fullshard::comm
