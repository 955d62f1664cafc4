#include "fullshard/base/deadline.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <thread>

#include "fullshard/base/error.hpp"
#include "lib/base/abort.hpp"

namespace fullshard {

WaitSite WaitSite::labelled(std::string description) {
  WaitSite s;
  s.operation = std::move(description);
  return s;
}

std::string WaitSite::describe() const {
  std::string out = operation;
  if (!where.empty()) out += " on " + where;
  std::string parts;
  auto add = [&](const std::string& p) { parts += (parts.empty() ? "" : ", ") + p; };
  if (rank >= 0) add("rank " + std::to_string(rank) + "/" + std::to_string(size));
  if (seq > 0) add("seq " + std::to_string(seq));
  if (!detail.empty()) add(detail);
  if (!parts.empty()) out += " (" + parts + ")";
  return out;
}

Deadline::clock::duration Deadline::duration_of(double seconds) noexcept {
  // NaN and negatives: 0; +inf and huge values: kMaxTimeoutSeconds.
  const double s = seconds > 0 ? std::min(seconds, kMaxTimeoutSeconds) : 0.0;
  return std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
}

Deadline::Deadline(double timeout_s) noexcept
    : timeout_s_(timeout_s), bounded_(timeout_s > 0), at_() {
  if (bounded_) at_ = clock::now() + duration_of(timeout_s);
}

BackOff::BackOff(Policy policy) noexcept
    : policy_(policy), sleep_(std::max(policy.first_sleep, std::chrono::microseconds(1))) {}

BackOff::Pause BackOff::next() const noexcept {
  const auto spins = static_cast<std::uint64_t>(std::max(policy_.spins, 0));
  const auto yields = static_cast<std::uint64_t>(std::max(policy_.yields, 0));
  if (count_ < spins) return {Kind::spin, std::chrono::microseconds(0)};
  if (count_ < spins + yields) return {Kind::yield, std::chrono::microseconds(0)};
  return {Kind::sleep, std::min(sleep_, std::max(policy_.max_sleep, std::chrono::microseconds(1)))};
}

BackOff::Pause BackOff::pause() {
  const Pause p = next();
  ++count_;
  switch (p.kind) {
    case Kind::spin:
      break;
    case Kind::yield:
      std::this_thread::yield();
      break;
    case Kind::sleep:
      std::this_thread::sleep_for(p.sleep);
      if (sleep_ < policy_.max_sleep) sleep_ = std::min(2 * sleep_, policy_.max_sleep);
      break;
  }
  return p;
}

std::string timeout_message(const WaitSite& site, double timeout_s, const std::string& hint) {
  char t[32];
  std::snprintf(t, sizeof t, "%g", timeout_s);
  std::string m = site.describe() + " did not finish within FULLSHARD_TIMEOUT=" + t + " s";
  if (!hint.empty()) m += "; " + hint;
  return m;
}

void expire(const WaitSite& site, double timeout_s, const TimeoutHook& on_timeout,
            const std::string& hint) {
  std::string message = timeout_message(site, timeout_s, hint);
  if (!on_timeout) detail::abort_job(message + ". Aborting the job.");
  on_timeout(message);
  throw CommError(message);
}

// ---- Watchdog ----------------------------------------------------------------------------

struct WatchdogState {
  std::mutex m;
  std::condition_variable cv;
  bool stop = false;
  bool armed = false;
  bool idle = false;  // the thread waits with no deadline
  const std::string* description = nullptr;
  const char* hint = nullptr;
  double timeout_s = 0.0;
  Deadline::clock::time_point at;
  std::thread thread;

  void loop() {
    std::unique_lock<std::mutex> lock(m);
    while (!stop) {
      if (!armed) {
        idle = true;
        cv.wait(lock);
        idle = false;
      } else if (cv.wait_until(lock, at) == std::cv_status::timeout && armed &&
                 Deadline::clock::now() >= at) {
        expire(WaitSite::labelled(*description), timeout_s, {}, hint);
      }
    }
  }
};

Watchdog::Watchdog() : s_(std::make_unique<WatchdogState>()) {}

Watchdog::~Watchdog() {
  if (!s_->thread.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(s_->m);
    s_->stop = true;
  }
  s_->cv.notify_all();
  s_->thread.join();
}

void Watchdog::arm(const std::string& description, double timeout_s, const char* hint) {
  const Deadline d(timeout_s);
  if (!d.bounded()) {
    disarm();
    return;
  }
  if (!s_->thread.joinable()) s_->thread = std::thread([s = s_.get()] { s->loop(); });
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(s_->m);
    s_->armed = true;
    s_->description = &description;
    s_->hint = hint;
    s_->timeout_s = timeout_s;
    s_->at = d.at();
    // A thread already waiting for an earlier deadline wakes then and re-checks: no need to
    // wake it now (a wake-up per collective cost ~3 us on a one-core rank).
    wake = s_->idle;
  }
  if (wake) s_->cv.notify_all();
}

void Watchdog::disarm() noexcept {
  std::lock_guard<std::mutex> lock(s_->m);
  s_->armed = false;
}

}  // namespace fullshard
