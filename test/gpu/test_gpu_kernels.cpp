// The shard copy kernels on the device (Kokkos::Cuda) against the host kernels, bit for bit.
// Needs a CUDA-enabled Kokkos; skipped with a message otherwise.
#include <cuda_runtime.h>
#include <doctest/doctest.h>
#include <Kokkos_Core.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/kernels/quantize.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/tensor/sharding.hpp"
#include "gpu_support.hpp"

using namespace fullshard;
using namespace fullshard::kernels;
using gpu_test::check;

#if defined(KOKKOS_ENABLE_CUDA)
namespace {

std::vector<unsigned char> host_values(std::size_t n, DType t, int salt) {
  std::vector<unsigned char> h(n * dtype_size(t));
  for (std::size_t i = 0; i < n; ++i)
    store_from_double(h.data(), t, i, static_cast<double>((i * 37 + salt) % 101) / 7.0 - 6.0);
  return h;
}

struct Dev {
  void* p = nullptr;
  std::size_t bytes;
  explicit Dev(const std::vector<unsigned char>& h) : bytes(h.size()) {
    check(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
    check(cudaMemcpy(p, h.data(), bytes, cudaMemcpyHostToDevice), "H2D");
  }
  ~Dev() { cudaFree(p); }
  std::vector<unsigned char> get() const {
    std::vector<unsigned char> h(bytes);
    check(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost), "D2H");
    return h;
  }
};

const DType kTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

}  // namespace

TEST_CASE("run_copies on the device equals the host, every dtype pair") {
  const int W = 4;
  std::vector<ShardLayout> layouts;
  for (const Shape& s : {Shape{13, 5}, Shape{7}, Shape{3, 4, 6}, Shape{1}})
    layouts.push_back(shard_layout(s, Placement::Shard(0), W, 0, "p"));
  const GroupLayout g = make_group_layout(layouts);
  const auto runs = all_gather_copy_out_runs(g);
  const CopyPlan host(ExecTarget::host, runs), device(ExecTarget::device, runs);
  const std::size_t in_n = static_cast<std::size_t>(W * g.shard_numel);
  const std::size_t out_n = static_cast<std::size_t>(g.arena_numel);
  for (DType s : kTypes)
    for (DType d : kTypes) {
      CAPTURE(dtype_name(s));
      CAPTURE(dtype_name(d));
      auto in = host_values(in_n, s, 1);
      std::vector<unsigned char> out_h(out_n * dtype_size(d), 0xAB);
      run_copies(host, in.data(), s, out_h.data(), d);
      Dev din(in), dout(std::vector<unsigned char>(out_n * dtype_size(d), 0xAB));
      run_copies(device, din.p, s, dout.p, d);
      CHECK(dout.get() == out_h);
    }
}

TEST_CASE("cast_copy and reduce_copy_out on the device equal the host") {
  const std::int64_t n = 100003;
  for (DType s : kTypes)
    for (DType d : kTypes) {
      CAPTURE(dtype_name(s));
      CAPTURE(dtype_name(d));
      auto in = host_values(n, s, 3);
      auto acc = host_values(n, d, 5);
      std::vector<unsigned char> cast_h(n * dtype_size(d));
      cast_copy(ExecTarget::host, in.data(), s, cast_h.data(), d, n);
      Dev din(in), dcast(cast_h);
      cast_copy(ExecTarget::device, din.p, s, dcast.p, d, n);
      CHECK(dcast.get() == cast_h);
      std::vector<unsigned char> red_h = acc;
      reduce_copy_out(ExecTarget::host, in.data(), s, red_h.data(), d, n, 3.0, true);
      Dev dred(acc);
      reduce_copy_out(ExecTarget::device, din.p, s, dred.p, d, n, 3.0, true);
      CHECK(dred.get() == red_h);
    }
}

TEST_CASE("quantize and dequantize on the device equal the host, both codes") {
  const std::int64_t n = 100003, block = 256;
  const std::int64_t blocks = quant_blocks(n, block);
  for (QuantCode code : {QuantCode::int8, QuantCode::fp8_e4m3})
    for (DType t : kTypes) {
      CAPTURE(std::string(quant_code_name(code)));
      CAPTURE(dtype_name(t));
      const auto in = host_values(static_cast<std::size_t>(n), t, 7);
      std::vector<unsigned char> codes_h(static_cast<std::size_t>(n));
      std::vector<unsigned char> scales_h(static_cast<std::size_t>(blocks) * sizeof(float));
      std::vector<unsigned char> out_h = in;
      quantize(ExecStream::host(), in.data(), t, n, block, code, codes_h.data(),
               reinterpret_cast<float*>(scales_h.data()));
      dequantize(ExecStream::host(), codes_h.data(),
                 reinterpret_cast<const float*>(scales_h.data()), code, n, block, out_h.data(), t,
                 true);
      Dev din(in), dcodes(std::vector<unsigned char>(codes_h.size(), 0xAB)),
          dscales(std::vector<unsigned char>(scales_h.size(), 0xAB)), dout(in);
      const ExecStream dev = ExecStream::device();
      quantize(dev, din.p, t, n, block, code, static_cast<std::uint8_t*>(dcodes.p),
               static_cast<float*>(dscales.p));
      dequantize(dev, static_cast<const std::uint8_t*>(dcodes.p),
                 static_cast<const float*>(dscales.p), code, n, block, dout.p, t, true);
      dev.fence();
      CHECK(dcodes.get() == codes_h);
      CHECK(dscales.get() == scales_h);
      CHECK(dout.get() == out_h);
    }
}
#else
TEST_CASE("shard copy kernels on the device") {
  gpu_test::skip(
      "this Kokkos has no CUDA backend (Kokkos::DefaultExecutionSpace is " +
      std::string(Kokkos::DefaultExecutionSpace::name()) +
      "): rebuild against a CUDA-enabled Kokkos (Kokkos_ROOT, see docs/gpu.md) to run the "
      "device copy kernels");
}
#endif
