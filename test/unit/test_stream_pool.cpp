// StreamOrderedPool: accounting (in use, peak, cached, reuse) and stream-ordered reuse, with
// fake device streams whose events the test completes (test/support/fake_device.hpp).
#include <doctest/doctest.h>

#include <string>

#include "fake_device.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/tensor/buffer_pool.hpp"
#include "lib/tensor/pool_label.hpp"
#include "lib/tensor/stream_pool.hpp"

using fullshard::DType;
using fullshard::InvalidArgument;
using fullshard::MemorySpace;
using fullshard::StreamOrderedPool;
using fullshard::Tensor;
using fullshard::comm::Stream;
using fullshard::test::FakeDevice;

TEST_CASE("pool accounting: in use, peak, cached, reuse of the same byte size") {
  StreamOrderedPool pool(MemorySpace::host, "test");
  Stream s = Stream::caller("s");
  {
    Tensor a = pool.acquire({256}, DType::f32, s, "a");   // 1024 B
    Tensor b = pool.acquire({512}, DType::bf16, s, "b");  // 1024 B
    CHECK(a.nbytes() == 1024);
    CHECK(a.space() == MemorySpace::host);
    CHECK(pool.bytes_in_use() == 2048);
    Tensor c = pool.acquire({10}, DType::f64, s);  // 80 B
    CHECK(pool.stats().peak_bytes_in_use == 2128);
  }
  auto st = pool.stats();
  CHECK(st.bytes_in_use == 0);
  CHECK(st.bytes_cached == 2128);
  CHECK(st.bytes_reserved == 2128);
  CHECK(st.allocations == 3);
  CHECK(st.reuses == 0);
  pool.reset_peak();
  CHECK(pool.peak_bytes_in_use() == 0);
  {
    // Same byte size, another dtype/shape: a cached block is reused, nothing allocated.
    Tensor d = pool.acquire({2, 128}, DType::f32, s);
    Tensor e = pool.acquire({1024}, DType::f16, s);  // 2048 B: new
    st = pool.stats();
    CHECK(st.reuses == 1);
    CHECK(st.allocations == 4);
    CHECK(st.bytes_in_use == 3072);
    CHECK(st.bytes_cached == 1104);
    // A view keeps the block in use.
    Tensor view = d.flat_view(64, {64});
    d = Tensor();
    CHECK(pool.bytes_in_use() == 3072);
  }
  CHECK(pool.bytes_in_use() == 0);
  CHECK(pool.stats().peak_bytes_in_use == 3072);
  pool.trim();
  CHECK(pool.stats().bytes_cached == 0);
  CHECK(pool.stats().bytes_reserved == 0);
  // Empty tensors are not pooled.
  Tensor z = pool.acquire({0}, DType::f32, s);
  CHECK(z.numel() == 0);
  CHECK(pool.bytes_in_use() == 0);
}

TEST_CASE("a block used on another stream is reused only after that stream's release event") {
  StreamOrderedPool pool(MemorySpace::host, "dev");
  FakeDevice ag("all_gather");
  FakeDevice compute("compute");
  auto ag_gate = ag.backend->gate;
  auto compute_gate = compute.backend->gate;
  const void* first = nullptr;
  {
    Tensor buf = pool.acquire({1024}, DType::f32, ag.stream, "unsharded");
    first = buf.data();
    pool.used_on(buf, compute.stream);  // the compute stream reads the gathered parameters
    pool.used_on(buf, compute.stream);  // declared twice: one event
  }
  // Released: one event recorded on each stream, bytes no longer in use (not deferred).
  CHECK(ag.log->records == 1);
  CHECK(compute.log->records == 1);
  CHECK(pool.bytes_in_use() == 0);
  CHECK(pool.stats().bytes_cached == 4096);

  // Reuse on the all-gather stream while compute has not finished: the block comes back at
  // once (no new allocation), and the all-gather stream waits for compute's event on the
  // device (a cudaStreamWaitEvent), not on the host. Its own event needs no wait.
  Tensor again = pool.acquire({1024}, DType::f32, ag.stream);
  CHECK(again.data() == first);
  CHECK(pool.stats().allocations == 1);
  CHECK(pool.stats().stream_waits == 1);
  REQUIRE(compute.log->waits.size() == 1);
  CHECK(compute.log->waits[0] == ag.stream.native_handle());
  CHECK(ag.log->waits.empty());
  again = Tensor();

  // Once both streams passed their release events, reuse needs no wait.
  ag_gate->store(true);
  compute_gate->store(true);
  Tensor third = pool.acquire({1024}, DType::f32, compute.stream);
  CHECK(third.data() == first);
  CHECK(pool.stats().stream_waits == 1);
  CHECK(pool.stats().reuses == 2);
}

TEST_CASE("the pool prefers a cached block that needs no wait") {
  StreamOrderedPool pool(MemorySpace::host, "dev");
  FakeDevice a("a");
  FakeDevice b("b");
  Tensor x = pool.acquire({64}, DType::f32, a.stream);
  Tensor y = pool.acquire({64}, DType::f32, b.stream);
  const void* on_a = x.data();
  x = Tensor();  // released on a (pending)
  y = Tensor();  // released on b (pending)
  // On stream a: the block last used on a needs no wait, so it is chosen.
  Tensor z = pool.acquire({64}, DType::f32, a.stream);
  CHECK(z.data() == on_a);
  CHECK(pool.stats().stream_waits == 0);
  // The other one (pending on b) must make a wait for b.
  Tensor w = pool.acquire({64}, DType::f32, a.stream);
  CHECK(pool.stats().stream_waits == 1);
  CHECK(b.log->waits.size() == 1);
  CHECK(pool.stats().allocations == 2);
  CHECK(pool.stats().peak_bytes_in_use == 512);
}

TEST_CASE("host worker streams order a reuse too, and bad used_on calls are refused") {
  StreamOrderedPool pool(MemorySpace::host, "host");
  Stream w1 = Stream::worker("w1");
  Stream w2 = Stream::worker("w2");
  Tensor t = pool.acquire({16}, DType::f32, w1);
  float* p = t.data_as<float>();
  w1.submit("fill", [p] {
    for (int i = 0; i < 16; ++i)
      p[i] = 1.0f;
  });
  t = Tensor();
  Tensor u = pool.acquire({16}, DType::f32, w2);  // w2 waits for w1's release event
  float sum = 0;
  w2.submit("read", [&sum, q = u.data_as<float>()] {
      for (int i = 0; i < 16; ++i)
        sum += q[i];
    }).wait();
  CHECK(sum == 16.0f);

  StreamOrderedPool other(MemorySpace::host, "other");
  Tensor foreign = other.acquire({4}, DType::f32, w1);
  try {
    pool.used_on(foreign, w2);
    FAIL("no error");
  } catch (const InvalidArgument& e) {
    CHECK(std::string(e.what()).find("pool 'host': used_on(stream 'w2')") != std::string::npos);
  }
}

TEST_CASE(
    "a new pool block's label joins the pool, the label and the owner, leaving out empty parts") {
  CHECK(fullshard::detail::pool_block_label("pool", "", "") == "pool");
  CHECK(fullshard::detail::pool_block_label("pool", "ag_buffer", "") == "pool:ag_buffer");
  CHECK(fullshard::detail::pool_block_label("pool", "ag_buffer", "layers.0") ==
        "pool:ag_buffer:layers.0");
  CHECK(fullshard::detail::pool_block_label("pool", "", "layers.0") == "pool:layers.0");
}

TEST_CASE("a release that cannot record its event is reported at the next acquire, never thrown") {
  // The old deleter let the event's CommError escape a shared_ptr deleter: std::terminate.
  StreamOrderedPool pool(MemorySpace::host, "p");
  FakeDevice dev("dev.rs");
  {
    Tensor a = pool.acquire({256}, DType::f32, dev.stream, "a");
    CHECK(pool.bytes_in_use() == 1024);
    dev.backend->fail_record = true;
  }  // the deleter: the record fails; nothing escapes
  dev.backend->fail_record = false;
  CHECK(pool.bytes_in_use() == 0);
  CHECK(pool.stats().bytes_cached == 0);  // not cached: never reused
  try {
    (void)pool.acquire({256}, DType::f32, dev.stream, "b");
    FAIL("the release failure was not re-thrown");
  } catch (const fullshard::CommError& e) {
    const std::string m = e.what();
    INFO(m);
    CHECK(m.find("pool 'p': releasing a block of 1024 bytes could not record its release event "
                 "on stream 'dev.rs' (the block is not reused): fake device: cudaEventRecord "
                 "failed") != std::string::npos);
    CHECK(m.find("fullshard[rank", 1) == std::string::npos);  // one prefix only
  }
  // Reported once; the pool goes on with a new block.
  Tensor c = pool.acquire({256}, DType::f32, dev.stream, "c");
  CHECK(c.nbytes() == 1024);
  const auto st = pool.stats();
  CHECK(st.allocations == 2);
  CHECK(st.reuses == 0);
  CHECK(st.bytes_in_use == 1024);
}
