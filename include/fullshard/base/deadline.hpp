// Bounded waits: the one timeout mechanism of fullshard. Every wait that FULLSHARD_TIMEOUT
// bounds (host streams, NCCL polls, checkpoint collectives, the apps' MPI calls) is a
// BoundedWait (polls a predicate with one back-off policy, or blocks on a condition variable)
// or, for a blocking call that cannot be polled, an armed Watchdog. Both end an expired wait
// with the same message,
//
//   fullshard[rank R]: <operation> on <where> (rank r/n, seq s, <detail>) did not finish
//   within FULLSHARD_TIMEOUT=<t> s; <hint>
//
// and then either abort the job (MPI_Abort: the default, since a blocked MPI call cannot be
// cancelled) or call an on-timeout hook and throw CommError (NCCL: the hook aborts the
// communicator).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace fullshard {

/// What a bounded wait waits for, as its timeout message names it.
struct WaitSite {
  std::string operation;  ///< "all_gather", "MPI_Iallreduce (agreeing on errors)"
  std::string where;      ///< "communicator 'mesh.shard'", "checkpoint save of 'dir'"
  int rank = -1;          ///< this process's rank among `where`'s ranks (-1: not shown)
  int size = 0;           ///< the number of those ranks
  std::uint64_t seq = 0;  ///< sequence number of the operation on `where` (0: not shown)
  std::string detail;     ///< anything else: "1024 x f32", "with rank 2"

  /// A site known only by a finished description (a Stream operation's label).
  static WaitSite labelled(std::string description);
  /// "<operation> on <where> (rank r/n, seq s, <detail>)"; parts that are not set are left
  /// out (a labelled site: its description as given).
  std::string describe() const;
};

/// Timeouts above this (about 31.7 years; +inf included) are clamped to it, so that a
/// deadline never overflows the clock's 64-bit nanoseconds (which wrap at ~292 years, and at
/// 9.2e9 s when converted from a double).
inline constexpr double kMaxTimeoutSeconds = 1e9;

/// The hint of a collective's timeout message.
inline constexpr const char* kCollectiveTimeoutHint =
    "another rank is probably not calling the same collective (different order, sizes or "
    "communicator), or is stopped or stuck";

/// A point `timeout_s` after its construction. timeout_s <= 0 (or NaN): never expires.
class Deadline {
 public:
  using clock = std::chrono::steady_clock;
  explicit Deadline(double timeout_s) noexcept;
  /// `seconds` as a clock duration, clamped to [0, kMaxTimeoutSeconds].
  static clock::duration duration_of(double seconds) noexcept;

  bool bounded() const noexcept { return bounded_; }
  /// The timeout as given (for messages).
  double timeout_s() const noexcept { return timeout_s_; }
  /// The expiry time (bounded deadlines only).
  clock::time_point at() const noexcept { return at_; }
  bool expired(clock::time_point now = clock::now()) const noexcept {
    return bounded_ && now >= at_;
  }

 private:
  double timeout_s_;
  bool bounded_;
  clock::time_point at_;
};

/// The pause between two polls of a bounded wait: `spins` polls back to back (an operation
/// that finishes in microseconds), then `yields` polls separated by std::this_thread::yield()
/// (the core goes to another rank of an oversubscribed node), then sleeps that double from
/// `first_sleep` up to `max_sleep` (a long wait costs no CPU; a finished operation is seen
/// within max_sleep).
class BackOff {
 public:
  struct Policy {
    int spins = 16;
    int yields = 64;
    std::chrono::microseconds first_sleep{1};
    std::chrono::microseconds max_sleep{50};  // what the loops it replaced slept
  };
  enum class Kind { spin, yield, sleep };
  struct Pause {
    Kind kind;
    std::chrono::microseconds sleep;  ///< for Kind::sleep
  };

  BackOff() noexcept : BackOff(Policy{}) {}
  explicit BackOff(Policy policy) noexcept;
  /// The pause the next pause() makes.
  Pause next() const noexcept;
  /// Pauses (as next() says) and advances; returns what it did.
  Pause pause();
  /// Pauses made so far.
  std::uint64_t pauses() const noexcept { return count_; }

 private:
  Policy policy_;
  std::uint64_t count_ = 0;
  std::chrono::microseconds sleep_;
};

/// What an expired wait does besides building its message. Empty: abort the job. Otherwise
/// called with the message; when it returns, CommError(message) is thrown (it may throw its
/// own error instead).
using TimeoutHook = std::function<void(const std::string& message)>;

/// "<site.describe()> did not finish within FULLSHARD_TIMEOUT=<t> s; <hint>" (t as %g).
std::string timeout_message(const WaitSite& site, double timeout_s,
                            const std::string& hint = kCollectiveTimeoutHint);

/// Ends an expired wait: the hook (then CommError) or, without one, prints the message (with
/// the "fullshard[rank R]: " prefix) and aborts the job (MPI_Abort).
[[noreturn]] void expire(const WaitSite& site, double timeout_s, const TimeoutHook& on_timeout = {},
                         const std::string& hint = kCollectiveTimeoutHint);

/// One wait bounded by a timeout; the deadline starts at construction.
class BoundedWait {
 public:
  BoundedWait(WaitSite site, double timeout_s, TimeoutHook on_timeout = {},
              BackOff::Policy policy = {})
      : site_(std::move(site)),
        deadline_(timeout_s),
        on_timeout_(std::move(on_timeout)),
        back_off_(policy) {}

  /// Replaces the hint of the timeout message (default kCollectiveTimeoutHint).
  BoundedWait& hint(std::string h) {
    hint_ = std::move(h);
    return *this;
  }

  /// Calls `done()` until it returns true, pausing between calls with the back-off; expires
  /// when the deadline passes first. Exceptions of `done` propagate.
  template <class Done>
  void poll(Done&& done) {
    while (!done()) {
      if (deadline_.expired()) expire();
      back_off_.pause();
    }
  }

  /// Waits on `cv` (holding `lock`) until `pred()`; expires when the deadline passes first.
  template <class Pred>
  void block(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, Pred pred) {
    if (!deadline_.bounded()) {
      cv.wait(lock, pred);
      return;
    }
    if (!cv.wait_until(lock, deadline_.at(), pred)) {
      lock.unlock();
      expire();
    }
  }

  [[noreturn]] void expire() const {
    fullshard::expire(site_, deadline_.timeout_s(), on_timeout_, hint_);
  }
  std::string message() const { return timeout_message(site_, deadline_.timeout_s(), hint_); }
  const WaitSite& site() const noexcept { return site_; }
  const Deadline& deadline() const noexcept { return deadline_; }
  const BackOff& back_off() const noexcept { return back_off_; }

 private:
  WaitSite site_;
  Deadline deadline_;
  TimeoutHook on_timeout_;
  BackOff back_off_;
  std::string hint_ = kCollectiveTimeoutHint;
};

// Opaque: the watchdog thread's state (lib/base/deadline.cpp).
struct WatchdogState;

/// Bounds blocking calls that cannot be polled (a blocking MPI call on the calling thread): a
/// thread of its own (started with the first arm()) aborts the job with the common timeout
/// message when a call stays armed past its deadline. One call at a time.
class Watchdog {
 public:
  Watchdog();
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// Starts watching a call described by `description` (a WaitSite::describe() text or a
  /// Stream label; it must stay alive until disarm()). timeout_s <= 0: not watched (and a
  /// call armed before is disarmed).
  void arm(const std::string& description, double timeout_s,
           const char* hint = kCollectiveTimeoutHint);
  void disarm() noexcept;

 private:
  std::unique_ptr<WatchdogState> s_;
};

}  // namespace fullshard
