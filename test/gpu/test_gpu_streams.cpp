// CUDA streams and events behind Stream/StreamEvent: cross-stream order without host blocking, and
// the measured overlap of a compute kernel with a copy on another stream (printed; no timing
// assertion). The FSDP engine itself still runs on the host (MPI): this checks the stream layer
// the GPU executor will use.
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <vector>

#include "fullshard/comm/stream.hpp"
#include "gpu_support.hpp"
#include "lib/tensor/stream_pool.hpp"

using namespace fullshard;
using comm::Stream;
using gpu_test::check;

namespace {
cudaStream_t native(const Stream& s) {
  return static_cast<cudaStream_t>(s.native_handle());
}
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

TEST_CASE("Work::wait(consumer) orders a device stream without blocking the host") {
  Stream producer = Stream::device("producer");
  Stream consumer = Stream::device("consumer");
  const std::size_t n = 1 << 20;
  float* a = nullptr;
  float* b = nullptr;
  check(cudaMalloc(&a, n * 4), "cudaMalloc");
  check(cudaMalloc(&b, n * 4), "cudaMalloc");
  comm::Work w = producer.submit("spin + fill", [&] {
    gpu_test::launch_spin(200.0, native(producer));
    gpu_test::launch_fill(a, n, 7.0f, native(producer));
  });
  w.wait(consumer);
  CHECK_FALSE(w.test());  // the host came back while the producer still spins
  check(cudaMemcpyAsync(b, a, n * 4, cudaMemcpyDeviceToDevice, native(consumer)), "copy");
  consumer.synchronize();
  std::vector<float> h(n);
  check(cudaMemcpy(h.data(), b, n * 4, cudaMemcpyDeviceToHost), "D2H");
  int bad = 0;
  for (float v : h)
    bad += v != 7.0f;
  CHECK(bad == 0);  // the consumer's copy saw the producer's fill
  cudaFree(a);
  cudaFree(b);
}

TEST_CASE("a compute kernel overlaps a copy on another stream (measured)") {
  Stream compute = Stream::device("compute");
  Stream copy = Stream::device("copy");
  const std::size_t bytes = std::size_t{256} << 20;
  void* src = nullptr;
  void* dst = nullptr;
  check(cudaMalloc(&src, bytes), "cudaMalloc");
  check(cudaMallocHost(&dst, bytes), "cudaMallocHost");
  auto run_copy = [&] {
    copy.submit("d2h", [&] {
      check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, native(copy)), "copy");
    });
  };
  run_copy();  // warm up
  copy.synchronize();
  auto t0 = std::chrono::steady_clock::now();
  run_copy();
  copy.synchronize();
  const double t_copy = seconds_since(t0);
  const double spin_ms = std::max(5.0, t_copy * 1e3);
  t0 = std::chrono::steady_clock::now();
  compute.submit("spin", [&] { gpu_test::launch_spin(spin_ms, native(compute)); });
  compute.synchronize();
  const double t_compute = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  compute.submit("spin", [&] { gpu_test::launch_spin(spin_ms, native(compute)); });
  run_copy();
  compute.synchronize();
  copy.synchronize();
  const double t_both = seconds_since(t0);
  const double overlap = (t_compute + t_copy - t_both) / std::min(t_compute, t_copy);
  std::printf("GPU-CHECK overlap compute=%.3f ms copy=%.3f ms both=%.3f ms overlap=%.2f\n",
              t_compute * 1e3, t_copy * 1e3, t_both * 1e3, overlap);
  CHECK(t_both > 0);
  cudaFree(src);
  cudaFreeHost(dst);
}

TEST_CASE("StreamOrderedPool on CUDA streams: reuse across streams adds an event wait") {
  StreamOrderedPool pool(MemorySpace::device, "gpu.pool");
  Stream ag = Stream::device("ag");
  Stream compute = Stream::device("compute");
  const void* first = nullptr;
  {
    Tensor t = pool.acquire({1 << 20}, DType::f32, ag);
    first = t.data();
    pool.used_on(t, compute);
    compute.submit("spin", [&] { gpu_test::launch_spin(50.0, native(compute)); });
  }
  Tensor again = pool.acquire({1 << 20}, DType::f32, ag);
  CHECK(again.data() == first);
  CHECK(pool.stats().allocations == 1);
  CHECK(pool.stats().stream_waits == 1);  // compute was still spinning
}
