// The device-stream logic of Stream/StreamEvent/Work (lib/comm/stream.cpp) driven by a fake device
// backend: events complete when the test opens their gate, so polling, cross-stream waits,
// timeouts, error hooks and grouped (deferred) operations are checked without a GPU. The CUDA
// backend itself (lib/comm/cuda/cuda_stream.cpp) runs in test/gpu/test_gpu_streams.cpp.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fake_device.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/comm/stream.hpp"
#include "lib/base/message_of.hpp"
#include "lib/comm/device_stream.hpp"

using fullshard::CommError;
using fullshard::ConfigError;
using fullshard::InvalidArgument;
using fullshard::comm::DeferredDevice;
using fullshard::comm::DeviceEvent;
using fullshard::comm::DeviceStreamBackend;
using fullshard::comm::DeviceWatch;
using fullshard::comm::Stream;
using fullshard::comm::StreamAccess;
using fullshard::comm::StreamEvent;
using fullshard::comm::StreamType;
using fullshard::comm::Work;

namespace {

using fullshard::test::FakeDevice;

std::string message_of(const Work& w) {
  try {
    w.wait();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("a device stream runs the host part at submit and completes with its event") {
  FakeDevice dev("compute");
  CHECK(dev.stream.kind() == StreamType::device);
  CHECK(dev.stream.is_device());
  CHECK(dev.stream.runs_inline());
  CHECK(dev.stream.native_handle() == dev.backend);
  int enqueued = 0;
  Work w = dev.stream.submit("kernel", [&] { ++enqueued; });
  CHECK(enqueued == 1);  // enqueued by the submitting thread
  CHECK(w.is_device());
  CHECK(dev.log->records == 1);
  CHECK_FALSE(w.test());
  CHECK_FALSE(w.event().query());
  dev.open();
  CHECK(w.test());
  CHECK(w.event().query());
  CHECK_NOTHROW(w.wait());
  // Once seen complete, the event is not queried again.
  const int queries = dev.log->queries;
  w.wait();
  CHECK(dev.log->queries == queries);
}

TEST_CASE("Work::wait(consumer) and Stream::wait order device streams without blocking the host") {
  FakeDevice producer("all_gather");
  FakeDevice consumer("compute");
  Work w = producer.stream.submit("all_gather on 'dp'", [] {});
  // Not complete: the consumer stream gets a cudaStreamWaitEvent, the call returns at once.
  w.wait(consumer.stream);
  REQUIRE(producer.log->waits.size() == 1);
  CHECK(producer.log->waits[0] == consumer.stream.native_handle());
  // Stream::wait on a device event does the same.
  StreamEvent e = producer.stream.record();
  CHECK(e.is_device());
  consumer.stream.wait(e);
  CHECK(producer.log->waits.size() == 2);
  // Complete events add no wait.
  producer.open();
  w.wait(consumer.stream);
  consumer.stream.wait(e);
  CHECK(producer.log->waits.size() == 2);
  // A host consumer blocks instead (wait() semantics): here it returns because it is done.
  Stream host = Stream::caller("host");
  CHECK_NOTHROW(w.wait(host));
}

TEST_CASE("a host worker stream waits for a device event on its own thread") {
  FakeDevice dev("copy");
  Stream worker = Stream::worker("worker");
  StreamEvent e = dev.stream.record();
  worker.wait(e);  // returns: the worker thread does the waiting
  std::atomic<bool> ran{false};
  Work after = worker.submit("after", [&] { ran = true; });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK_FALSE(ran.load());  // still behind the device event
  dev.open();
  after.wait();
  CHECK(ran.load());
}

TEST_CASE("a device operation past its timeout calls the timeout hook and throws CommError") {
  FakeDevice dev("nccl");
  int timeouts = 0;
  std::string told;
  DeviceWatch watch;
  watch.on_timeout = [&](const std::string& why) {
    ++timeouts;
    told = why;
  };
  Work w = StreamAccess::submit_device(
      dev.stream, "all_gather on communicator 'dp' (rank 0/2)", [] {}, 0.05, watch);
  const std::string m = message_of(w);
  INFO(m);
  CHECK(contains(m,
                 "all_gather on communicator 'dp' (rank 0/2) did not finish within "
                 "FULLSHARD_TIMEOUT"));
  CHECK(contains(m, "communicator was aborted"));
  CHECK(timeouts == 1);
  CHECK(contains(told, "all_gather on communicator 'dp'"));
  // The error stays: waiting again throws the same without calling the hook again.
  CHECK(contains(message_of(w), "did not finish within"));
  CHECK(timeouts == 1);
}

TEST_CASE("an asynchronous error reported by the check hook surfaces in wait and test") {
  FakeDevice dev("nccl");
  std::atomic<bool> broken{false};
  DeviceWatch watch;
  watch.check = [&] {
    if (broken) throw CommError("reduce_scatter on communicator 'dp': ncclRemoteError");
  };
  Work w = StreamAccess::submit_device(
      dev.stream, "reduce_scatter", [] {}, 60.0, watch);
  CHECK_FALSE(w.test());
  broken = true;
  CHECK_THROWS_AS(w.test(), CommError);
  CHECK(contains(message_of(w), "ncclRemoteError"));
  // Work::wait(consumer) re-throws a known error instead of ordering the consumer.
  FakeDevice consumer("compute");
  CHECK_THROWS_AS(w.wait(consumer.stream), CommError);
  CHECK(dev.log->waits.empty());
}

TEST_CASE("an error while enqueueing is stored in the Work") {
  FakeDevice dev("nccl");
  Work w = dev.stream.submit("broadcast", [] { throw CommError("ncclBroadcast failed"); });
  CHECK(contains(message_of(w), "ncclBroadcast failed"));
  CHECK(dev.log->records == 0);  // no event for an operation that was not enqueued
}

TEST_CASE("grouped operations get their events when the group ends") {
  FakeDevice dev("nccl");
  std::vector<DeferredDevice> group;
  Work a = StreamAccess::submit_device(
      dev.stream, "all_gather (grouped)", [] {}, 0.0, {}, &group);
  Work b = StreamAccess::submit_device(
      dev.stream, "reduce_scatter (grouped)", [] {}, 0.0, {}, &group);
  CHECK(group.size() == 2);
  CHECK(dev.log->records == 0);
  CHECK(a.is_device());
  const std::string early = message_of(a);
  CHECK(contains(early, "inside its NCCL group"));
  StreamAccess::finish_deferred(group[0]);
  StreamAccess::finish_deferred(group[1],
                                std::make_exception_ptr(CommError("ncclGroupEnd failed")));
  CHECK(dev.log->records == 1);
  CHECK_FALSE(a.test());
  dev.open();
  CHECK_NOTHROW(a.wait());
  CHECK(contains(message_of(b), "ncclGroupEnd failed"));
}

TEST_CASE("device operations on a host stream are refused") {
  Stream host = Stream::caller("host");
  CHECK(host.native_handle() == nullptr);
  CHECK_FALSE(host.is_device());
  try {
    StreamAccess::submit_device(host, "all_gather on 'dp'", [] {}, 0.0, {});
    FAIL("no error");
  } catch (const InvalidArgument& e) {
    CHECK(contains(e.what(), "stream 'host' is a caller stream"));
  }
}

TEST_CASE("Stream::device without a usable GPU is a clear error") {
  try {
    Stream s = Stream::device("fsdp.compute");
    MESSAGE("a CUDA device is present: Stream::device created '" << s.name() << "'");
    CHECK(s.is_device());
    CHECK(s.native_handle() != nullptr);
  } catch (const CommError& e) {  // CUDA built, no device
    CHECK(contains(e.what(), "creating device stream 'fsdp.compute': no usable CUDA device"));
  } catch (const ConfigError& e) {  // built without CUDA
    CHECK(contains(e.what(), "built without CUDA"));
  }
}

namespace {

std::atomic<int> label_builds{0};
std::string build_label(const char* text, const void* context, std::uint64_t a, std::uint64_t b) {
  ++label_builds;
  return std::string(text) + " on '" + *static_cast<const std::string*>(context) + "' (seq " +
         std::to_string(a) + ", " + std::to_string(b) + " x f32)";
}

}  // namespace

TEST_CASE("a lazy label is built only when a message needs it, once") {
  using fullshard::comm::LazyLabel;
  FakeDevice dev("nccl");
  label_builds = 0;
  auto name = std::make_shared<const std::string>("dp");
  const LazyLabel label(&build_label, "all_gather", name, 7, 1024);
  Work w = StreamAccess::submit_device(dev.stream, label, [] {}, 60.0, {});
  CHECK_FALSE(w.test());  // polled: no text needed
  dev.open();
  CHECK(w.test());
  w.wait();
  CHECK(label_builds == 0);  // submitted, polled and finished without a string
  CHECK(w.label() == "all_gather on 'dp' (seq 7, 1024 x f32)");
  CHECK(w.label() == "all_gather on 'dp' (seq 7, 1024 x f32)");
  CHECK(label_builds == 1);
  // Stream::record on a device stream: "record on stream '<name>'", built on demand.
  CHECK(LazyLabel("record on stream '", dev.stream.shared_name(), "'").str() ==
        "record on stream 'nccl'");
  CHECK(LazyLabel("static").str() == "static");
  // A timeout names the operation by its label (built then).
  FakeDevice stuck("rs");
  Work t = stuck.stream.submit(
      LazyLabel(&build_label, "reduce_scatter", name, 8, 16), [] {}, 0.05);
  const std::string m = message_of(t);
  INFO(m);
  CHECK(contains(m,
                 "reduce_scatter on 'dp' (seq 8, 16 x f32) did not finish within "
                 "FULLSHARD_TIMEOUT"));
  // Host streams too: no text at submit or wait; once for Work::label() or a recorder.
  Stream host = Stream::caller("host");
  label_builds = 0;
  Work h = host.submit(LazyLabel(&build_label, "copy", name, 1, 2), [] {});
  h.wait();
  CHECK(label_builds == 0);
  CHECK(h.label() == "copy on 'dp' (seq 1, 2 x f32)");
  CHECK(label_builds == 1);
  Stream worker = Stream::worker("worker");
  std::vector<std::string> recorded;
  worker.set_recorder([&recorded](const std::string& label, std::chrono::steady_clock::time_point,
                                  std::chrono::steady_clock::time_point) {
    recorded.push_back(label);  // the worker thread (waited for below)
  });
  label_builds = 0;
  worker.submit(LazyLabel(&build_label, "rs", name, 2, 3), [] {}).wait();
  CHECK(label_builds == 1);  // for the recorder
  REQUIRE(recorded.size() == 1);
  CHECK(recorded[0] == "rs on 'dp' (seq 2, 3 x f32)");
  worker.set_recorder(nullptr);
  label_builds = 0;
  Work failed = worker.submit(LazyLabel(&build_label, "ag", name, 4, 5),
                              [] { throw std::runtime_error("boom"); });
  std::string why;  // polled, not waited for: a wait that blocks names its site (the text)
  for (;;) {
    try {
      if (failed.test()) break;
    } catch (const std::exception& e) {
      why = e.what();
      break;
    }
    std::this_thread::yield();
  }
  CHECK(why == "boom");      // a host operation's own error, re-thrown as it is
  CHECK(label_builds == 0);  // so no text was needed
}
