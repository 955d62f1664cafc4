// Host streams: order, events between streams, errors at wait(), test() semantics.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "fullshard/comm/stream.hpp"

using fullshard::comm::Stream;
using fullshard::comm::StreamEvent;
using fullshard::comm::Work;

TEST_CASE("a worker stream runs its operations in submit order, off the calling thread") {
  Stream s = Stream::worker("w");
  CHECK_FALSE(s.runs_inline());
  std::vector<int> order;
  const auto caller = std::this_thread::get_id();
  std::atomic<bool> off_thread{true};
  std::vector<Work> works;
  for (int i = 0; i < 100; ++i)
    works.push_back(s.submit("op", [&, i] {
      if (std::this_thread::get_id() == caller) off_thread = false;
      order.push_back(i);
    }));
  works.back().wait();
  REQUIRE(order.size() == 100);
  for (int i = 0; i < 100; ++i)
    CHECK(order[i] == i);
  CHECK(off_thread.load());
}

TEST_CASE("a caller stream runs an operation inside submit") {
  Stream s = Stream::caller();
  CHECK(s.runs_inline());
  int x = 0;
  Work w = s.submit("set", [&] { x = 7; });
  CHECK(x == 7);
  CHECK(w.test());
}

TEST_CASE("Stream::wait orders one stream after another's event") {
  Stream a = Stream::worker("a");
  Stream b = Stream::worker("b");
  std::atomic<int> stage{0};
  std::atomic<bool> release{false};
  a.submit("slow", [&] {
    while (!release.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    stage = 1;
  });
  StreamEvent e = a.record();
  CHECK_FALSE(e.query());
  b.wait(e);
  int seen = -1;
  Work w = b.submit("after", [&] { seen = stage.load(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK_FALSE(w.test());  // still held back by the event
  release = true;
  w.wait();
  CHECK(seen == 1);
  CHECK(e.query());
}

TEST_CASE("errors are raised at wait() and test(), and the stream keeps going") {
  for (Stream s : {Stream::worker("w"), Stream::caller()}) {
    CAPTURE(s.name());
    Work bad = s.submit("bad op", [] { throw std::runtime_error("boom"); });
    CHECK_THROWS_WITH_AS(bad.wait(), "boom", std::runtime_error);
    CHECK_THROWS_AS(bad.test(), std::runtime_error);
    CHECK_THROWS_AS(bad.wait(), std::runtime_error);  // every wait re-raises
    int x = 0;
    Work good = s.submit("good op", [&] { x = 1; });
    good.wait();
    CHECK(x == 1);
    CHECK(good.test());
    CHECK(good.label() == "good op");
  }
}

TEST_CASE("test() is false while running and true, once, on completion") {
  Stream s = Stream::worker("w");
  std::atomic<bool> go{false};
  Work w = s.submit("gate", [&] {
    while (!go.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  CHECK_FALSE(w.test());
  go = true;
  while (!w.test())
    std::this_thread::yield();
  CHECK(w.test());  // stays true
  Work empty;
  CHECK(empty.test());
  empty.wait();
}

TEST_CASE("destroying the last handle of a stream drains its queue") {
  std::atomic<int> done{0};
  {
    Stream s = Stream::worker("drain");
    for (int i = 0; i < 50; ++i)
      s.submit("inc", [&] {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        ++done;
      });
  }
  CHECK(done.load() == 50);
}
