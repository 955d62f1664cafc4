#include "fullshard/comm/stream.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "fullshard/base/error.hpp"

namespace fullshard::comm {
namespace detail {

[[noreturn]] void report_timeout(const std::string& label, double timeout_s) {
  fullshard::detail::abort_job(
      label + " did not finish within FULLSHARD_TIMEOUT=" + std::to_string(timeout_s) +
      " s; another rank is probably not calling the same collective (different order, "
      "sizes or communicator). Aborting the job.");
}

// Watches operations that run on the calling thread (caller streams): nobody waits on them,
// so a thread of its own aborts the job when one runs past its timeout. Started with the
// first timed operation of the stream.
class Watchdog {
 public:
  Watchdog() : thread_([this] { loop(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void arm(const std::string& label, double timeout_s) {
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(m_);
      armed_ = true;
      label_ = &label;
      timeout_s_ = timeout_s;
      deadline_ = std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                      std::chrono::duration<double>(timeout_s));
      // A thread already waiting for an earlier deadline wakes then and re-checks: no need to
      // wake it now (a wake-up per collective cost ~3 us on a one-core rank).
      wake = idle_;
    }
    if (wake) cv_.notify_all();
  }
  void disarm() {
    std::lock_guard<std::mutex> lock(m_);
    armed_ = false;
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(m_);
    while (!stop_) {
      if (!armed_) {
        idle_ = true;
        cv_.wait(lock);
        idle_ = false;
      } else if (cv_.wait_until(lock, deadline_) == std::cv_status::timeout && armed_ &&
                 std::chrono::steady_clock::now() >= deadline_) {
        report_timeout(*label_, timeout_s_);
      }
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool armed_ = false;
  bool idle_ = false;  // waiting with no deadline
  const std::string* label_ = nullptr;
  double timeout_s_ = 0.0;
  std::chrono::steady_clock::time_point deadline_;
  std::thread thread_;
};

struct Completion {
  std::string label;
  double timeout_s = 0.0;
  std::atomic<bool> done{false};
  std::exception_ptr error;  // written before `done` is set, read after
  std::mutex m;
  std::condition_variable cv;

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
    if (!with_timeout || timeout_s <= 0) {
      cv.wait(lock, is_done);
      return;
    }
    const auto limit = std::chrono::duration<double>(timeout_s);
    if (!cv.wait_for(lock, limit, is_done)) report_timeout(label, timeout_s);
  }
};

struct StreamImpl {
  struct Task {
    std::function<void()> op;
    std::shared_ptr<Completion> done;
    std::shared_ptr<const Stream::Recorder> recorder;  // set when the stream records
  };

  std::string name;
  bool inline_ = false;
  std::uint64_t id = 0;
  std::mutex m;
  std::condition_variable cv;
  std::deque<Task> queue;
  bool stopping = false;
  std::thread worker;
  std::unique_ptr<Watchdog> watchdog;                // caller streams only, created on first use
  std::shared_ptr<const Stream::Recorder> recorder;  // guarded by m

  static std::uint64_t next_id() {
    static std::atomic<std::uint64_t> counter{0};
    return ++counter;
  }

  StreamImpl(std::string n, bool run_inline)
      : name(std::move(n)), inline_(run_inline), id(next_id()) {
    if (!inline_) worker = std::thread([this] { run(); });
  }

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
        (*t.recorder)(t.done->label, start, std::chrono::steady_clock::now());
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
    c->timeout_s = timeout_s;
    Task t{std::move(op), c, nullptr};
    {
      std::lock_guard<std::mutex> lock(m);
      t.recorder = recorder;
    }
    if (inline_) {
      if (timeout_s > 0) {
        if (!watchdog) watchdog = std::make_unique<Watchdog>();
        watchdog->arm(c->label, timeout_s);
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

}  // namespace detail

bool Event::query() const noexcept {
  return !c_ || c_->done.load(std::memory_order_acquire);
}

void Event::synchronize() const {
  if (c_) c_->block(false);
}

void Work::wait() const {
  if (!c_) return;
  c_->block(true);
  if (c_->error) std::rethrow_exception(c_->error);
}

bool Work::test() const {
  if (!c_) return true;
  if (!c_->done.load(std::memory_order_acquire)) return false;
  if (c_->error) std::rethrow_exception(c_->error);
  return true;
}

std::string Work::label() const {
  return c_ ? c_->label : std::string("(none)");
}

Stream Stream::caller(std::string name) {
  return Stream(std::make_shared<detail::StreamImpl>(std::move(name), true));
}

Stream Stream::worker(std::string name) {
  return Stream(std::make_shared<detail::StreamImpl>(std::move(name), false));
}

Stream::Stream(std::string name, HostProgress progress)
    : impl_(std::make_shared<detail::StreamImpl>(std::move(name),
                                                 progress == HostProgress::inline_)) {}

const std::string& Stream::name() const noexcept {
  return impl_->name;
}
bool Stream::runs_inline() const noexcept {
  return impl_->inline_;
}
std::uint64_t Stream::id() const noexcept {
  return impl_->id;
}

Work Stream::submit(std::string label, std::function<void()> op, double timeout_s) {
  return Work(impl_->enqueue(std::move(label), std::move(op), timeout_s));
}

Event Stream::record() {
  if (impl_->inline_) return Event();
  return Event(impl_->enqueue(
      "record on stream '" + impl_->name + "'", [] {}, 0.0));
}

void Stream::wait(const Event& e) {
  if (e.query()) return;
  if (impl_->inline_) {
    e.synchronize();
    return;
  }
  impl_->enqueue(
      "wait on stream '" + impl_->name + "'", [e] { e.synchronize(); }, 0.0);
}

void Stream::synchronize() {
  record().synchronize();
}

void Stream::set_recorder(Recorder recorder) {
  std::lock_guard<std::mutex> lock(impl_->m);
  impl_->recorder = recorder ? std::make_shared<const Recorder>(std::move(recorder)) : nullptr;
}

}  // namespace fullshard::comm
