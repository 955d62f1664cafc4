// The shard copy kernels on the device (Kokkos::Cuda) against the host kernels, bit for bit.
// Needs a CUDA-enabled Kokkos; skipped with a message otherwise.
#include <cuda_runtime.h>
#include <doctest/doctest.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/kernels/element_update.hpp"
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

TEST_CASE("the optimizer's update fused with the copy-out on the device equals the host's") {
  // kernels::reduce_update, what a copy-out runs with the optimizer inside backward: within
  // 1e-6 of the host loop (nvcc may contract the rule's multiply-adds), parameters and state.
  const std::int64_t n = 100003;
  const auto N = static_cast<std::size_t>(n);
  const auto floats = [](std::size_t count, int salt, double shift) {
    std::vector<unsigned char> h(count * 4);
    for (std::size_t i = 0; i < count; ++i)
      store_from_double(h.data(), DType::f32, i,
                        static_cast<double>((i * 29 + salt) % 97) / 13.0 + shift);
    return h;
  };
  const auto as_floats = [](const std::vector<unsigned char>& b) {
    std::vector<float> v(b.size() / 4);
    std::memcpy(v.data(), b.data(), b.size());
    return v;
  };
  const auto rel = [](const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      num = std::max(num, std::abs(double(a[i]) - double(b[i])));
      den = std::max(den, std::abs(double(b[i])));
    }
    return den > 0 ? num / den : num;
  };
  ElementUpdate momentum;
  momentum.lr = 0.05;
  momentum.weight_decay = 0.01;
  momentum.momentum = 0.9;
  ElementUpdate adamw;
  adamw.rule = ElementUpdate::Rule::adamw;
  adamw.lr = 0.01;
  adamw.weight_decay = 0.05;
  adamw.beta1 = 0.9;
  adamw.beta2 = 0.99;
  adamw.eps = 1e-8;
  adamw.step_size = 0.1;
  adamw.bc2_sqrt = 0.14;
  for (const ElementUpdate& rule : {momentum, adamw})
    for (DType s : {DType::f32, DType::bf16}) {
      CAPTURE(dtype_name(s));
      CAPTURE(rule.state_arrays());
      const auto src = host_values(N, s, 7);
      auto param = floats(N, 1, -3.0), s0 = floats(N, 2, -3.0), s1 = floats(N, 3, 0.1);
      Dev dsrc(src), dparam(param), ds0(s0), ds1(s1);
      ElementUpdate host = rule, dev = rule;
      host.param = reinterpret_cast<float*>(param.data());
      host.state0 = reinterpret_cast<float*>(s0.data());
      host.state1 = rule.state_arrays() > 1 ? reinterpret_cast<float*>(s1.data()) : nullptr;
      dev.param = static_cast<float*>(dparam.p);
      dev.state0 = static_cast<float*>(ds0.p);
      dev.state1 = rule.state_arrays() > 1 ? static_cast<float*>(ds1.p) : nullptr;
      reduce_update(ExecStream::host(), src.data(), s, n, 2.0, host);
      const ExecStream on = ExecStream::device();
      reduce_update(on, dsrc.p, s, n, 2.0, dev);
      on.fence();
      CHECK(rel(as_floats(dparam.get()), as_floats(param)) <= 1e-6);
      CHECK(rel(as_floats(ds0.get()), as_floats(s0)) <= 1e-6);
      CHECK(rel(as_floats(ds1.get()), as_floats(s1)) <= 1e-6);
      CHECK(as_floats(param) != as_floats(floats(N, 1, -3.0)));  // it updated something
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
