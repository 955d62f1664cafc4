// A fake device for host tests of the device-stream logic: events complete when the test
// opens the gate of the stream they were recorded on; stream waits and records are logged.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/comm/stream.hpp"
#include "lib/comm/device_stream.hpp"

namespace fullshard::test {

using comm::DeviceEvent;
using comm::DeviceStreamBackend;
using comm::Stream;
using comm::StreamAccess;

using Gate = std::shared_ptr<std::atomic<bool>>;

// What the fake device saw: stream waits (by native handle) and event records.
struct Log {
  std::vector<void*> waits;
  int records = 0;
  int queries = 0;
};

class FakeEvent final : public DeviceEvent {
 public:
  FakeEvent(Gate g, std::shared_ptr<Log> log) : gate_(std::move(g)), log_(std::move(log)) {}
  bool ready() override {
    ++log_->queries;
    return gate_->load();
  }
  void synchronize() override {
    while (!gate_->load())
      std::this_thread::yield();
  }
  void enqueue_wait(void* native) override { log_->waits.push_back(native); }

 private:
  Gate gate_;
  std::shared_ptr<Log> log_;
};

// Events recorded now complete when the current gate opens; next_gate() starts a new one.
class FakeStream final : public DeviceStreamBackend {
 public:
  explicit FakeStream(std::shared_ptr<Log> log) : log_(std::move(log)) {}
  void* native() const noexcept override { return const_cast<FakeStream*>(this); }
  std::shared_ptr<DeviceEvent> record() override {
    if (fail_record) throw CommError("fake device: cudaEventRecord failed: cudaErrorLaunchFailure");
    ++log_->records;
    return std::make_shared<FakeEvent>(gate, log_);
  }
  void synchronize() override {
    while (!gate->load())
      std::this_thread::yield();
  }
  Gate gate = std::make_shared<std::atomic<bool>>(false);
  bool fail_record = false;  // record() throws CommError (a device error)

 private:
  std::shared_ptr<Log> log_;
};

struct FakeDevice {
  std::shared_ptr<Log> log = std::make_shared<Log>();
  FakeStream* backend = nullptr;  // owned by the stream
  Stream stream;
  explicit FakeDevice(const std::string& name) : stream(make(name)) {}
  Stream make(const std::string& name) {
    auto b = std::make_unique<FakeStream>(log);
    backend = b.get();
    return StreamAccess::make_device(name, std::move(b));
  }
  void open() { backend->gate->store(true); }
  /// Events recorded from now on complete with a new gate.
  void next_gate() { backend->gate = std::make_shared<std::atomic<bool>>(false); }
};

}  // namespace fullshard::test
