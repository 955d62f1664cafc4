// fullshard-bench-shard-copy: the shard copy kernels against std::memcpy of the same bytes.
//
// One group of 64 f32 parameters of shape (rows, 256), Shard(0) over W = 4 ranks, seen from
// rank 0; rows = 16 * <MiB> so that the group's unsharded size is <MiB> MiB (1 to 256). Per size:
//   memcpy/<MiB>           std::memcpy of <MiB> MiB (the bytes copy_out and copy_in move)
//   memcpy_runs/<MiB>      std::memcpy of each of copy_out's runs in turn: the same bytes in
//                          the same pieces (a single large memcpy switches to non-temporal
//                          stores above glibc's threshold, one run of <= 4 MiB does not)
//   copy_out/<MiB>         run_copies, all-gather buffer (W slots) -> unsharded arena, host
//   copy_out_device/<MiB>  the same on ExecTarget::device (DefaultExecutionSpace: with a
//                          host-only Kokkos the same host algorithm, with its own plan)
//   copy_in/<MiB>          run_copies, unsharded gradient arena -> reduce-scatter input, host
//   copy_in_device/<MiB>   the same on ExecTarget::device
//   copy_in_bf16/<MiB>     copy_in casting f32 -> bf16 (reduce_dtype bf16)
//   cast_copy_in/<MiB>     cast_copy of the group shard (<MiB>/4 MiB of f32) to bf16
//   reduce_copy_out/<MiB>  reduce_copy_out of the group shard, f32 -> f32, divisor 4, accumulate
//   memcpy_<kernel>/<MiB>  std::memcpy of half the bytes <kernel> reads plus writes, i.e. the
//                          same bytes processed (for the kernels whose reads and writes differ)
//   quantize_<code>/<MiB>  quantize_packed of the group shard (f32) into a compressed
//                          all-gather's slot (codes and per-block scales, blocks of 256)
//   copy_out_<code>/<MiB>  run_dequantize_copies: W packed slots -> unsharded arena (f32), the
//                          compressed all-gather's copy-out (against copy_out)
// bytes_per_second counts bytes read plus bytes written (accumulate reads the destination
// too). Every buffer is allocated and written before timing; a single process is enough.
// Times are CPU times of the calling thread (Kokkos Serial runs there): on a shared machine
// they leave out the time the process waits to be scheduled.
//
// Launch: fullshard-bench-shard-copy [--benchmark_* flags]
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/kernels/quantize.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/runtime/runtime.hpp"
#include "fullshard/tensor/sharding.hpp"

namespace {

using fullshard::DType;
using namespace fullshard::kernels;

constexpr int kWorld = 4;
constexpr int kParams = 64;
constexpr std::int64_t kCols = 256;
constexpr std::int64_t kMiB = std::int64_t{1} << 20;
constexpr int kSizesMiB[] = {1, 4, 16, 64, 256};

fullshard::kernels::GroupLayout group(std::int64_t mib) {
  std::vector<fullshard::ShardLayout> layouts;
  const std::int64_t rows = 16 * mib;  // 64 * rows * 256 * 4 bytes = mib MiB
  for (int p = 0; p < kParams; ++p)
    layouts.push_back(fullshard::shard_layout({rows, kCols}, fullshard::Placement::Shard(0), kWorld,
                                              0, "p" + std::to_string(p)));
  return make_group_layout(layouts);
}

// A pre-touched buffer of n elements of T.
template <class T>
std::vector<T> touched(std::int64_t n, T value) {
  return std::vector<T>(static_cast<std::size_t>(n), value);
}

void bytes_processed(benchmark::State& state, std::int64_t bytes) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * bytes);
  state.counters["MiB"] = static_cast<double>(state.range(0));
}

// std::memcpy of `bytes`: counted as bytes read + written.
void memcpy_bytes(benchmark::State& state, std::int64_t bytes) {
  auto src = touched<unsigned char>(bytes, 1);
  auto dst = touched<unsigned char>(bytes, 2);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), static_cast<std::size_t>(bytes));
    benchmark::ClobberMemory();
  }
  bytes_processed(state, 2 * bytes);
}

void BM_memcpy(benchmark::State& state) {
  memcpy_bytes(state, state.range(0) * kMiB);
}

void BM_memcpy_runs(benchmark::State& state) {
  const auto g = group(state.range(0));
  const auto runs = all_gather_copy_out_runs(g);
  auto ag = touched<float>(kWorld * g.shard_numel, 1.0f);
  auto arena = touched<float>(g.arena_numel, 0.0f);
  std::int64_t elements = 0;
  for (const CopyRun& r : runs)
    elements += r.len;
  for (auto _ : state) {
    for (const CopyRun& r : runs)
      std::memcpy(arena.data() + r.dst_offset, ag.data() + r.src_offset,
                  static_cast<std::size_t>(r.len) * sizeof(float));
    benchmark::ClobberMemory();
  }
  bytes_processed(state, 2 * 4 * elements);
}

void copy_out(benchmark::State& state, ExecTarget where) {
  const auto g = group(state.range(0));
  const CopyPlan plan(where, all_gather_copy_out_runs(g));
  auto ag = touched<float>(kWorld * g.shard_numel, 1.0f);
  auto arena = touched<float>(g.arena_numel, 0.0f);
  for (auto _ : state) {
    run_copies(plan, ag.data(), DType::f32, arena.data(), DType::f32);
    benchmark::ClobberMemory();
  }
  bytes_processed(state, 4 * (plan.elements_read() + plan.elements_written()));
}
void BM_copy_out(benchmark::State& state) {
  copy_out(state, ExecTarget::host);
}
void BM_copy_out_device(benchmark::State& state) {
  copy_out(state, ExecTarget::device);
}

void copy_in(benchmark::State& state, ExecTarget where, DType rs_dtype) {
  const auto g = group(state.range(0));
  const CopyPlan plan(where, reduce_scatter_copy_in_runs(g));
  auto arena = touched<float>(g.arena_numel, 1.0f);
  auto rs = touched<double>((kWorld * g.shard_numel + 1) / 2, 0.0);  // room for f32 or bf16
  for (auto _ : state) {
    run_copies(plan, arena.data(), DType::f32, rs.data(), rs_dtype);
    benchmark::ClobberMemory();
  }
  bytes_processed(
      state, 4 * plan.elements_read() + static_cast<std::int64_t>(fullshard::dtype_size(rs_dtype)) *
                                            plan.elements_written());
}
void BM_copy_in(benchmark::State& state) {
  copy_in(state, ExecTarget::host, DType::f32);
}
void BM_copy_in_device(benchmark::State& state) {
  copy_in(state, ExecTarget::device, DType::f32);
}
void BM_copy_in_bf16(benchmark::State& state) {
  copy_in(state, ExecTarget::host, DType::bf16);
}
void BM_memcpy_copy_in_bf16(benchmark::State& state) {
  const auto g = group(state.range(0));
  memcpy_bytes(state, (4 * g.arena_numel + 2 * kWorld * g.shard_numel) / 2);
}

void BM_cast_copy_in(benchmark::State& state) {
  const auto g = group(state.range(0));
  const std::int64_t n = g.shard_numel;
  auto shard = touched<float>(n, 1.5f);
  auto slot = touched<std::uint16_t>(n, 0);
  for (auto _ : state) {
    cast_copy(ExecTarget::host, shard.data(), DType::f32, slot.data(), DType::bf16, n);
    benchmark::ClobberMemory();
  }
  bytes_processed(state, (4 + 2) * n);
}
void BM_memcpy_cast_copy_in(benchmark::State& state) {
  memcpy_bytes(state, (4 + 2) * group(state.range(0)).shard_numel / 2);
}

void BM_reduce_copy_out(benchmark::State& state) {
  const auto g = group(state.range(0));
  const std::int64_t n = g.shard_numel;
  auto out = touched<float>(n, 8.0f);
  auto grad = touched<float>(n, 0.0f);
  for (auto _ : state) {
    reduce_copy_out(ExecTarget::host, out.data(), DType::f32, grad.data(), DType::f32, n, 4.0,
                    true);
    benchmark::ClobberMemory();
  }
  bytes_processed(state, 3 * 4 * n);  // src read, dst read and written
}
void BM_memcpy_reduce_copy_out(benchmark::State& state) {
  memcpy_bytes(state, 3 * 4 * group(state.range(0)).shard_numel / 2);
}

constexpr std::int64_t kQuantBlock = 256;

void BM_quantize(benchmark::State& state, QuantCode code) {
  const auto g = group(state.range(0));
  const std::int64_t n = g.shard_numel;
  auto shard = touched<float>(n, 1.5f);
  auto slot = touched<float>(quant_packed_bytes(n, kQuantBlock) / 4, 0.0f);
  const ExecStream host = ExecStream::host();
  for (auto _ : state) {
    quantize_packed(host, shard.data(), DType::f32, n, kQuantBlock, code, slot.data());
    host.fence();
    benchmark::ClobberMemory();
  }
  bytes_processed(state, 4 * n + quant_packed_bytes(n, kQuantBlock));
}

void BM_copy_out_dequantize(benchmark::State& state, QuantCode code) {
  const auto g = group(state.range(0));
  const CopyPlan plan(ExecTarget::host, all_gather_copy_out_runs(g));
  const std::int64_t slot = quant_packed_bytes(g.shard_numel, kQuantBlock);
  auto packed = touched<float>(kWorld * slot / 4, 0.0f);
  auto shard = touched<float>(g.shard_numel, 1.5f);
  const ExecStream host = ExecStream::host();
  for (int q = 0; q < kWorld; ++q)
    quantize_packed(host, shard.data(), DType::f32, g.shard_numel, kQuantBlock, code,
                    reinterpret_cast<unsigned char*>(packed.data()) + q * slot);
  auto arena = touched<float>(g.arena_numel, 0.0f);
  for (auto _ : state) {
    run_dequantize_copies(plan, packed.data(), g.shard_numel, kQuantBlock, code, arena.data(),
                          DType::f32, host);
    host.fence();
    benchmark::ClobberMemory();
  }
  bytes_processed(state, kWorld * slot + 4 * plan.elements_written());
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int mib : kSizesMiB)
    b->Arg(mib);
  b->Unit(benchmark::kMicrosecond);
}

BENCHMARK(BM_memcpy)->Name("memcpy")->Apply(sizes);
BENCHMARK(BM_memcpy_runs)->Name("memcpy_runs")->Apply(sizes);
BENCHMARK(BM_copy_out)->Name("copy_out")->Apply(sizes);
BENCHMARK(BM_copy_out_device)->Name("copy_out_device")->Apply(sizes);
BENCHMARK(BM_copy_in)->Name("copy_in")->Apply(sizes);
BENCHMARK(BM_copy_in_device)->Name("copy_in_device")->Apply(sizes);
BENCHMARK(BM_memcpy_copy_in_bf16)->Name("memcpy_copy_in_bf16")->Apply(sizes);
BENCHMARK(BM_copy_in_bf16)->Name("copy_in_bf16")->Apply(sizes);
BENCHMARK(BM_memcpy_cast_copy_in)->Name("memcpy_cast_copy_in")->Apply(sizes);
BENCHMARK(BM_cast_copy_in)->Name("cast_copy_in")->Apply(sizes);
BENCHMARK(BM_memcpy_reduce_copy_out)->Name("memcpy_reduce_copy_out")->Apply(sizes);
BENCHMARK(BM_reduce_copy_out)->Name("reduce_copy_out")->Apply(sizes);
BENCHMARK_CAPTURE(BM_quantize, int8, QuantCode::int8)->Name("quantize_int8")->Apply(sizes);
BENCHMARK_CAPTURE(BM_quantize, fp8, QuantCode::fp8_e4m3)->Name("quantize_fp8")->Apply(sizes);
BENCHMARK_CAPTURE(BM_copy_out_dequantize, int8, QuantCode::int8)
    ->Name("copy_out_int8")
    ->Apply(sizes);
BENCHMARK_CAPTURE(BM_copy_out_dequantize, fp8, QuantCode::fp8_e4m3)
    ->Name("copy_out_fp8")
    ->Apply(sizes);

}  // namespace

int main(int argc, char** argv) {
  try {
    fullshard::Runtime rt(argc, argv);
    benchmark::AddCustomContext("fullshard_runtime", rt.describe());
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fullshard-bench-shard-copy: %s\n", e.what());
    return 1;
  }
  return 0;
}
