// The one timeout mechanism (fullshard/base/deadline.hpp): the message format, the clamped
// deadline, the back-off sequence and expiry through a hook. (Expiry by MPI_Abort ends the
// process: comm.timeout_aborts, comm.timeout-inline_aborts and checkpoint.killed_writer
// check it on the output of a job.)
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fullshard/base/deadline.hpp"
#include "fullshard/base/error.hpp"
#include "lib/base/mpi_wait.hpp"

using fullshard::BackOff;
using fullshard::BoundedWait;
using fullshard::Deadline;
using fullshard::WaitSite;
using namespace std::chrono_literals;

namespace {

WaitSite site() {
  return WaitSite{"all_gather", "communicator 'mesh.shard'", 1, 4, 7, "1024 x f32"};
}

}  // namespace

TEST_CASE("a wait site describes operation, where, rank, sequence number and detail") {
  CHECK(site().describe() ==
        "all_gather on communicator 'mesh.shard' (rank 1/4, seq 7, 1024 x f32)");
  CHECK(WaitSite{"MPI_Ibcast", "checkpoint load of 'd'", 0, 2, 3, ""}.describe() ==
        "MPI_Ibcast on checkpoint load of 'd' (rank 0/2, seq 3)");
  CHECK(WaitSite{"halo exchange", "", -1, 0, 0, "with rank 2"}.describe() ==
        "halo exchange (with rank 2)");
  // A Stream label is kept as it is.
  CHECK(WaitSite::labelled("barrier on communicator 'w' (rank 0/1, seq 2, 0 x f32)").describe() ==
        "barrier on communicator 'w' (rank 0/1, seq 2, 0 x f32)");
}

TEST_CASE("the timeout message has one format") {
  CHECK(fullshard::timeout_message(site(), 2.5) ==
        "all_gather on communicator 'mesh.shard' (rank 1/4, seq 7, 1024 x f32) did not finish "
        "within FULLSHARD_TIMEOUT=2.5 s; another rank is probably not calling the same "
        "collective (different order, sizes or communicator), or is stopped or stuck");
  CHECK(fullshard::timeout_message(WaitSite::labelled("x"), 600, "hint") ==
        "x did not finish within FULLSHARD_TIMEOUT=600 s; hint");
  CHECK(fullshard::timeout_message(WaitSite::labelled("x"), 1e10, "") ==
        "x did not finish within FULLSHARD_TIMEOUT=1e+10 s");
}

TEST_CASE("deadlines are clamped: a huge timeout neither overflows nor expires at once") {
  using clock = Deadline::clock;
  const auto max = Deadline::duration_of(fullshard::kMaxTimeoutSeconds);
  CHECK(std::chrono::duration_cast<std::chrono::seconds>(max).count() == 1000000000);
  CHECK(Deadline::duration_of(1e10) == max);
  CHECK(Deadline::duration_of(9.3e9) == max);  // where the conversion used to wrap
  CHECK(Deadline::duration_of(std::numeric_limits<double>::infinity()) == max);
  CHECK(Deadline::duration_of(std::nan("")) == clock::duration::zero());
  CHECK(Deadline::duration_of(-5) == clock::duration::zero());
  CHECK(Deadline::duration_of(0.25) == 250ms);

  const auto before = clock::now();
  const Deadline huge(1e10);
  CHECK(huge.bounded());
  CHECK(huge.timeout_s() == 1e10);  // messages show the value as given
  CHECK(huge.at() > before + std::chrono::hours(24 * 365 * 31));
  CHECK_FALSE(huge.expired());
  CHECK_FALSE(Deadline(0).bounded());
  CHECK_FALSE(Deadline(-1).bounded());
  CHECK_FALSE(Deadline(0).expired());
  const Deadline passed(1e-9);
  std::this_thread::sleep_for(1ms);
  CHECK(passed.expired());
}

TEST_CASE("the back-off spins, then yields, then sleeps with a capped exponential") {
  BackOff b(BackOff::Policy{2, 3, 1us, 8us});
  using K = BackOff::Kind;
  std::vector<K> kinds;
  std::vector<long> sleeps;
  for (int i = 0; i < 10; ++i) {
    const BackOff::Pause next = b.next();
    const BackOff::Pause p = b.pause();
    CHECK(next.kind == p.kind);
    kinds.push_back(p.kind);
    if (p.kind == K::sleep) sleeps.push_back(static_cast<long>(p.sleep.count()));
  }
  CHECK(kinds == std::vector<K>{K::spin, K::spin, K::yield, K::yield, K::yield, K::sleep, K::sleep,
                                K::sleep, K::sleep, K::sleep});
  CHECK(sleeps == std::vector<long>{1, 2, 4, 8, 8});
  CHECK(b.pauses() == 10);

  // The default policy: 16 spins, 64 yields, then 1 us doubling to 50 us.
  BackOff d;
  for (int i = 0; i < 80; ++i)
    CHECK(d.pause().kind != K::sleep);
  std::vector<long> ds;
  for (int i = 0; i < 9; ++i)
    ds.push_back(static_cast<long>(d.pause().sleep.count()));
  CHECK(ds == std::vector<long>{1, 2, 4, 8, 16, 32, 50, 50, 50});
}

TEST_CASE("a bounded wait returns when its predicate holds, pausing between polls") {
  int polls = 0;
  BoundedWait w(site(), 60, [](const std::string&) { FAIL("expired"); });
  w.poll([&] { return ++polls == 40; });
  CHECK(polls == 40);
  CHECK(w.back_off().pauses() == 39);
  CHECK(w.back_off().next().kind == BackOff::Kind::yield);  // past the 16 spins
  int unbounded = 0;
  BoundedWait(site(), 0).poll([&] { return ++unbounded == 3; });
  CHECK(unbounded == 3);
}

TEST_CASE("an expired wait calls its hook with the message, then throws CommError") {
  std::vector<std::string> seen;
  // 0.5 s: long enough that the 16 spins and 64 yields end before it even on a loaded machine
  // (at 0.05 s they did not always, and the check below of the sleeping back-off failed).
  BoundedWait w(site(), 0.5, [&](const std::string& m) { seen.push_back(m); });
  std::string what;
  try {
    w.poll([] { return false; });
  } catch (const fullshard::CommError& e) {
    what = e.what();
  }
  REQUIRE(seen.size() == 1);
  CHECK(seen[0] == fullshard::timeout_message(site(), 0.5));
  CHECK(seen[0] == w.message());
  CHECK(what.find(seen[0]) != std::string::npos);
  CHECK(what.rfind("fullshard[rank ", 0) == 0);
  // It went through the spins and yields and was sleeping when the deadline passed.
  CHECK(w.back_off().next().kind == BackOff::Kind::sleep);

  // A hook may throw its own error instead (NCCL: CommError after aborting the communicator).
  struct Own {};
  BoundedWait own(WaitSite::labelled("op"), 0.01, [](const std::string&) { throw Own{}; });
  CHECK_THROWS_AS(own.poll([] { return false; }), Own);
}

TEST_CASE("a blocking wait on a condition variable is bounded the same way") {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::thread t([&] {
    std::this_thread::sleep_for(20ms);
    {
      std::lock_guard<std::mutex> lock(m);
      done = true;
    }
    cv.notify_all();
  });
  {
    // A huge timeout: the wait must not expire at once (the conversion is clamped).
    std::unique_lock<std::mutex> lock(m);
    BoundedWait(site(), 1e10, [](const std::string&) { FAIL("expired"); }).block(cv, lock, [&] {
      return done;
    });
    CHECK(done);
  }
  t.join();

  int hooks = 0;
  std::unique_lock<std::mutex> lock(m);
  BoundedWait w(site(), 0.02, [&](const std::string&) { ++hooks; });
  CHECK_THROWS_AS(w.block(cv, lock, [] { return false; }), fullshard::CommError);
  CHECK(hooks == 1);
  CHECK_FALSE(lock.owns_lock());  // released before the hook ran
}

TEST_CASE("an armed watchdog that is disarmed in time does nothing") {
  fullshard::Watchdog dog;
  const std::string what = "barrier on communicator 'w' (rank 0/1, seq 1, 0 x f32)";
  for (int i = 0; i < 100; ++i) {
    dog.arm(what, 0.5);
    dog.disarm();
  }
  dog.arm(what, 0.3);
  dog.arm(what, 0);  // not watched: disarms the call armed before
  // Past every deadline armed above: a watchdog that fired would have aborted this process.
  std::this_thread::sleep_for(600ms);
  dog.disarm();
}

TEST_CASE("wait_mpi completes a request under the bounded wait") {
  int x = 41, y = 0;
  MPI_Request r = MPI_REQUEST_NULL;
  REQUIRE(MPI_Iallreduce(&x, &y, 1, MPI_INT, MPI_SUM, MPI_COMM_SELF, &r) == MPI_SUCCESS);
  fullshard::wait_mpi(r, WaitSite{"MPI_Iallreduce", "self", 0, 1, 1, ""}, 60);
  CHECK(y == 41);
  CHECK(r == MPI_REQUEST_NULL);
  CHECK(fullshard::mpi_error_text(MPI_ERR_TRUNCATE).find("truncat") != std::string::npos);
}
