// Compressed collectives (CompressionPolicy) against references the test computes with the
// quantize kernels' host form, on 1-4 ranks: the all-gather (int8 and fp8 e4m3, f32 and bf16
// parameters) gives every rank each peer's shard as encoded and decoded; the int8
// reduce-scatter gives the decoded chunks' f32 sum in rank order, divided, accumulated; HSDP
// all-reduces that sum; the bytes moved are the packed slots; errors name the group. Each
// decoded value is also checked against the uncompressed one within the code's half step.
//
// The parameter is one {13, 3} tensor, so rank q's slot is rows [4q, 4q + 4) of it (13 rows
// over W ranks: torch.chunk's ceil(13 / W) rows each), zero-padded: the slot layout the test
// rebuilds without the library's layout code.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "fullshard/kernels/quantize.hpp"
#include "lib/graph/json_forms.hpp"
#include "test_devices.hpp"
#include "test_support.hpp"

using namespace fullshard;
using fsdp::CompressionPolicy;
using fsdp::FullyShardOptions;
using kernels::QuantCode;

namespace {

constexpr std::int64_t kRows = 13, kCols = 3;

int W() {
  return test::world_size();
}
int R() {
  return test::world_rank();
}
std::int64_t chunk_rows(int world) {
  return (kRows + world - 1) / world;
}

// x rounded to dtype t.
double rounded(double x, DType t) {
  std::uint64_t word = 0;
  store_from_double(&word, t, 0, x);
  return load_as_double(&word, t, 0);
}

// Parameter values with magnitudes spread over two decades (blocks of different scales).
double param_value(std::int64_t e) {
  return std::sin(0.37 * double(e) + 0.1) * (1.0 + double(e % 5) * 20.0);
}
// Rank r's gradient of element e.
double grad_value(int r, std::int64_t e) {
  return std::cos(0.21 * double(e) + 0.5 * r) * (0.5 + double((e + r) % 4));
}

// Slot q (gsn elements, zero padding) of a full {13, 3} tensor of values f(e) as f32.
template <class F>
std::vector<float> slot_of(int q, int world, F f) {
  const std::int64_t rows = chunk_rows(world);
  std::vector<float> s(static_cast<std::size_t>(rows * kCols), 0.0f);
  for (std::int64_t i = 0; i < rows * kCols; ++i) {
    const std::int64_t e = q * rows * kCols + i;
    if (e < kRows * kCols) s[static_cast<std::size_t>(i)] = static_cast<float>(f(e));
  }
  return s;
}

// A root module with the one parameter; backward adds grad_value(rank, e) into grad().
struct Model {
  std::unique_ptr<graph::Module> root = graph::Module::make_root("model");
  graph::Parameter* p = nullptr;
  std::vector<double> seen_forward;  // the unsharded values forward saw
  int backward_mismatches = 0;       // backward saw other unsharded values than forward

  explicit Model(DType dtype = DType::f32) {
    graph::Module& layer = root->add_module("layer");
    p = &layer.add_param("w", {kRows, kCols}, dtype);
    p->init(param_value);
    layer.on_forward([this](graph::Module&) {
      const Tensor v = test::host_copy(p->data());
      seen_forward.assign(static_cast<std::size_t>(v.numel()), 0.0);
      for (std::int64_t e = 0; e < v.numel(); ++e)
        seen_forward[static_cast<std::size_t>(e)] = v.at(e);
    });
    layer.on_backward([this](graph::Module&) {
      const Tensor v = test::host_copy(p->data());
      for (std::int64_t e = 0; e < v.numel(); ++e)
        backward_mismatches += v.at(e) != seen_forward[static_cast<std::size_t>(e)];
      Tensor g = test::host_copy(p->grad());
      for (std::int64_t e = 0; e < g.numel(); ++e)
        g.set(e, g.at(e) + grad_value(R(), e));
      test::write_back(p->grad(), g);
    });
  }
  graph::Module& layer() { return root->module("layer"); }
};

// What a compressed all-gather gives for slot q: its f32 values encoded and decoded to `t`.
std::vector<float> decoded_slot(int q, int world, QuantCode code, std::int64_t block, DType orig,
                                DType t) {
  std::vector<float> s = slot_of(q, world, param_value);
  const auto n = static_cast<std::int64_t>(s.size());
  Tensor src = Tensor::empty({n}, orig, MemorySpace::host, "src");
  for (std::int64_t i = 0; i < n; ++i)
    src.set(i, s[static_cast<std::size_t>(i)]);
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(n));
  std::vector<float> scales(static_cast<std::size_t>(kernels::quant_blocks(n, block)));
  const auto host = kernels::ExecStream::host();
  kernels::quantize(host, src.data(), orig, n, block, code, codes.data(), scales.data());
  Tensor out = Tensor::empty({n}, t, MemorySpace::host, "out");
  kernels::dequantize(host, codes.data(), scales.data(), code, n, block, out.data(), t, false);
  host.fence();
  std::vector<float> r(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    r[static_cast<std::size_t>(i)] = static_cast<float>(out.at(i));
  return r;
}

// The int8 reduce-scatter's result on the rank holding chunk `dst` of the shard dim, whose
// shard group is `ranks` (their gradients as sent, f32): every rank's chunk encoded, the
// slots decoded and summed in f32 in rank order, divided, added to `acc` when given.
std::vector<float> reduced_chunk(int dst, const std::vector<int>& ranks, std::int64_t block,
                                 double divisor, const std::vector<float>* acc) {
  const int S = static_cast<int>(ranks.size());
  const std::int64_t n = chunk_rows(S) * kCols;
  const std::int64_t slot = kernels::quant_packed_bytes(n, block);
  std::vector<float> packed(static_cast<std::size_t>(slot / 4 * S));
  const auto host = kernels::ExecStream::host();
  for (int i = 0; i < S; ++i) {
    const std::vector<float> chunk = slot_of(
        dst, S, [&](std::int64_t e) { return grad_value(ranks[static_cast<std::size_t>(i)], e); });
    kernels::quantize_packed(
        host, chunk.data(), DType::f32, n, block, QuantCode::int8,
        packed.data() + static_cast<std::size_t>(i) * static_cast<std::size_t>(slot / 4));
  }
  std::vector<float> out = acc ? *acc : std::vector<float>(static_cast<std::size_t>(n), 0.0f);
  kernels::reduce_dequantize(host, packed.data(), S, n, block, QuantCode::int8, divisor, out.data(),
                             DType::f32, acc != nullptr);
  host.fence();
  return out;
}

// max |x| of block b of a slot.
float block_max(const std::vector<float>& s, std::int64_t b, std::int64_t block) {
  float m = 0;
  for (std::int64_t i = b * block;
       i < std::min<std::int64_t>((b + 1) * block, std::int64_t(s.size())); ++i)
    m = std::max(m, std::fabs(s[static_cast<std::size_t>(i)]));
  return m;
}

FullyShardOptions compressed(std::optional<QuantCode> gather, std::optional<QuantCode> reduce,
                             int block) {
  FullyShardOptions o;
  o.compression.all_gather = gather;
  o.compression.reduce_scatter = reduce;
  o.compression.block = block;
  return o;
}

}  // namespace

TEST_CASE_TEMPLATE(
    "compressed all-gather: each rank's shard encoded and decoded, within half a step", D,
    FULLSHARD_TEST_DEVICE) {
  struct Case {
    QuantCode code;
    DType orig, param;
    int block;
  };
  for (const Case& c : {Case{QuantCode::int8, DType::f32, DType::f32, 8},
                        Case{QuantCode::fp8_e4m3, DType::f32, DType::f32, 16},
                        Case{QuantCode::int8, DType::f32, DType::bf16, 256},
                        Case{QuantCode::fp8_e4m3, DType::bf16, DType::bf16, 8}}) {
    CAPTURE(kernels::quant_code_name(c.code));
    CAPTURE(dtype_name(c.param));
    CAPTURE(c.block);
    Model m(c.orig);
    FullyShardOptions o = compressed(c.code, std::nullopt, c.block);
    if (c.param != c.orig) o.mp_policy.param_dtype = c.param;
    auto mesh = D::mesh({W()}, {"dp"});
    auto& st = fsdp::fully_shard(m.layer(), mesh, o);
    fsdp::fully_shard(*m.root, mesh);
    const comm::Traffic before = mesh.device_comm("dp", comm::StreamKind::all_gather).traffic();
    st.unshard();
    const comm::Traffic after = mesh.device_comm("dp", comm::StreamKind::all_gather).traffic();
    const std::int64_t gsn = chunk_rows(W()) * kCols;
    // One rank sends nothing; W ranks send W packed slots (codes and scales), not W shards.
    const std::uint64_t expect_bytes =
        W() == 1 ? 0
                 : std::uint64_t(W()) * std::uint64_t(kernels::quant_packed_bytes(gsn, c.block));
    CHECK(after.all_gather - before.all_gather == expect_bytes);

    const Tensor full = test::host_copy(m.p->data());
    REQUIRE(full.numel() == kRows * kCols);
    int bad = 0, outside = 0;
    for (int q = 0; q < W(); ++q) {
      // Slot q as its owner stores it (the original dtype), then what the wire gives.
      std::vector<float> stored = slot_of(q, W(), param_value);
      if (c.orig == DType::bf16)
        for (float& x : stored)
          x = static_cast<float>(rounded(x, DType::bf16));
      const std::vector<float> want =
          W() == 1 ? std::vector<float>() : decoded_slot(q, W(), c.code, c.block, c.orig, c.param);
      for (std::size_t i = 0; i < stored.size(); ++i) {
        const std::int64_t e = q * gsn + static_cast<std::int64_t>(i);
        if (e >= kRows * kCols) break;
        const double got = full.at(e);
        if (W() == 1) {  // nothing sent: the shard itself (cast)
          bad += got != rounded(stored[i], c.param);
          continue;
        }
        bad += got != want[i];
        // Half a step of the block's scale (int8), or of the code's binade (e4m3: 2^-4
        // relative, with the subnormal step 2^-9 as a floor), plus the parameter dtype's rounding.
        const float scale = block_max(stored, static_cast<std::int64_t>(i) / c.block, c.block) /
                            kernels::quant_code_max(c.code);
        const double half_step = c.code == QuantCode::int8
                                     ? 0.5 * scale
                                     : std::max(std::fabs(stored[i]) / 16.0, 0.5 * scale / 512.0);
        const double tol = half_step * 1.0001 + std::fabs(stored[i]) * dtype_unit_roundoff(c.param);
        outside += std::fabs(got - stored[i]) > tol;
      }
    }
    CHECK(bad == 0);
    CHECK(outside == 0);
    st.reshard();
  }
}

TEST_CASE_TEMPLATE("int8 reduce-scatter: the decoded chunks summed in f32, divided, accumulated", D,
                   FULLSHARD_TEST_DEVICE) {
  for (int block : {8, 64}) {
    CAPTURE(block);
    Model m;
    auto mesh = D::mesh({W()}, {"dp"});
    fsdp::fully_shard(m.layer(), mesh, compressed(std::nullopt, QuantCode::int8, block));
    auto& root = fsdp::fully_shard(*m.root, mesh);
    const comm::Traffic before = mesh.device_comm("dp", comm::StreamKind::reduce_scatter).traffic();
    fsdp::forward(*m.root);
    fsdp::backward(*m.root);
    const comm::Traffic after = mesh.device_comm("dp", comm::StreamKind::reduce_scatter).traffic();
    const std::int64_t gsn = chunk_rows(W()) * kCols;
    if (W() > 1) {  // an all-to-all of W packed chunks; no reduce-scatter
      CHECK(after.all_to_all - before.all_to_all ==
            std::uint64_t(W()) * std::uint64_t(kernels::quant_packed_bytes(gsn, block)));
      CHECK(after.reduce_scatter == before.reduce_scatter);
    }
    std::vector<int> ranks;
    for (int r = 0; r < W(); ++r)
      ranks.push_back(r);
    // One rank sends nothing: its own gradient, divided by 1.
    auto expect = [&](const std::vector<float>* acc) {
      if (W() > 1) return reduced_chunk(R(), ranks, block, W(), acc);
      std::vector<float> g = slot_of(0, 1, [](std::int64_t e) { return grad_value(0, e); });
      if (acc)
        for (std::size_t i = 0; i < g.size(); ++i)
          g[i] += (*acc)[i];
      return g;
    };
    const std::vector<float> first = expect(nullptr);
    const Tensor grad = test::host_copy(m.p->grad());
    int bad = 0, outside = 0;
    for (std::int64_t i = 0; i < grad.numel(); ++i) {
      bad += grad.at(i) != first[static_cast<std::size_t>(i)];
      // Against the exact mean: each rank's chunk within half a step of its block.
      double exact = 0, tol = 0;
      const std::int64_t e = R() * gsn + i;
      for (int r = 0; r < W(); ++r) {
        exact += grad_value(r, e) / W();
        const std::vector<float> chunk =
            slot_of(R(), W(), [&](std::int64_t x) { return grad_value(r, x); });
        tol += 0.5 * block_max(chunk, i / block, block) / 127.0 / W();
      }
      outside += std::fabs(grad.at(i) - exact) > tol * 1.0001 + 1e-6 * std::fabs(exact);
    }
    CHECK(bad == 0);
    CHECK(outside == 0);
    CHECK(m.backward_mismatches == 0);
    // A second backward accumulates into the sharded gradients.
    fsdp::forward(*m.root);
    fsdp::backward(*m.root);
    const std::vector<float> second = expect(&first);
    const Tensor grad2 = test::host_copy(m.p->grad());
    bad = 0;
    for (std::int64_t i = 0; i < grad2.numel(); ++i)
      bad += grad2.at(i) != second[static_cast<std::size_t>(i)];
    CHECK(bad == 0);
    root.zero_grad();
  }
}

TEST_CASE_TEMPLATE("HSDP with an int8 reduce-scatter: the shard sums all-reduced, then divided", D,
                   FULLSHARD_TEST_DEVICE) {
  if (W() % 2 != 0) {
    MESSAGE("needs an even number of ranks");
    return;
  }
  const int S = W() / 2;
  Model m;
  DeviceMesh mesh = D::mesh({2, S}, {"replicate", "shard"});
  fsdp::fully_shard(m.layer(), mesh, compressed(QuantCode::int8, QuantCode::int8, 16));
  fsdp::fully_shard(*m.root, mesh);
  fsdp::forward(*m.root);
  fsdp::backward(*m.root);
  // Replica rho's shard group is ranks rho*S .. rho*S + S - 1; each sums its chunk in f32
  // (compressed when S > 1), the all-reduce adds the two sums, the copy-out divides by W.
  const int s = R() % S;
  std::vector<float> sum;
  for (int rho = 0; rho < 2; ++rho) {
    std::vector<int> ranks;
    for (int i = 0; i < S; ++i)
      ranks.push_back(rho * S + i);
    std::vector<float> part =
        S > 1 ? reduced_chunk(s, ranks, 16, 1.0, nullptr)
              : slot_of(0, 1, [&](std::int64_t e) { return grad_value(rho, e); });
    if (sum.empty())
      sum = part;
    else
      for (std::size_t i = 0; i < sum.size(); ++i)
        sum[i] += part[i];
  }
  const Tensor grad = test::host_copy(m.p->grad());
  int bad = 0;
  for (std::int64_t i = 0; i < grad.numel(); ++i)
    bad += grad.at(i) != sum[static_cast<std::size_t>(i)] / static_cast<float>(W());
  CHECK(bad == 0);
}

TEST_CASE_TEMPLATE(
    "compressed all-gather with reshard_after_forward=k: backward sees forward's values", D,
    FULLSHARD_TEST_DEVICE) {
  for (int k : {1, 2, W()}) {
    if (W() % k != 0) continue;
    CAPTURE(k);
    Model m;
    auto mesh = D::mesh({W()}, {"dp"});
    FullyShardOptions o = compressed(QuantCode::fp8_e4m3, QuantCode::int8, 8);
    o.reshard_after_forward = fsdp::ReshardAfterForward::group_size(k);
    fsdp::fully_shard(m.layer(), mesh, o);
    fsdp::fully_shard(*m.root, mesh);
    fsdp::forward(*m.root);
    fsdp::backward(*m.root);
    CHECK(m.backward_mismatches == 0);
    // Forward saw the decoded slots.
    int bad = 0;
    const std::int64_t gsn = chunk_rows(W()) * kCols;
    for (int q = 0; q < W() && W() > 1; ++q) {
      const std::vector<float> want =
          decoded_slot(q, W(), QuantCode::fp8_e4m3, 8, DType::f32, DType::f32);
      for (std::int64_t i = 0; i < gsn && q * gsn + i < kRows * kCols; ++i)
        bad += m.seen_forward[static_cast<std::size_t>(q * gsn + i)] !=
               want[static_cast<std::size_t>(i)];
    }
    CHECK(bad == 0);
  }
}

TEST_CASE("a bad compression policy is refused naming the group and the JSON path") {
  Model m;
  auto mesh = test::HostDevice::mesh({W()}, {"dp"});
  CHECK_THROWS_WITH_AS(
      fsdp::fully_shard(m.layer(), mesh, compressed(QuantCode::int8, std::nullopt, 100)),
      doctest::Contains("fully_shard(layer): compression block 100 must be a power of two"),
      InvalidArgument);
  CHECK_THROWS_WITH_AS(
      fsdp::fully_shard(m.layer(), mesh, compressed(std::nullopt, QuantCode::fp8_e4m3, 256)),
      doctest::Contains("fully_shard(layer): the reduce-scatter's compression must be int8"),
      InvalidArgument);
  const FullyShardOptions none;
  CHECK_THROWS_WITH_AS(
      fsdp::options_from_request(
          graph::shard_request_from_json(
              nlohmann::json::parse(R"({"compression": {"all_gather": "int4"}})"),
              "modules[0].fully_shard"),
          none),
      doctest::Contains("modules[0].fully_shard.compression.all_gather: unknown code 'int4'"),
      ConfigError);
  CHECK_THROWS_WITH_AS(
      fsdp::options_from_request(graph::shard_request_from_json(
                                     nlohmann::json::parse(R"({"compression": {"bits": 8}})"), "x"),
                                 none),
      doctest::Contains("x.compression.bits: unknown compression field"), ConfigError);
  const FullyShardOptions o = fsdp::options_from_request(
      graph::shard_request_from_json(
          nlohmann::json::parse(
              R"({"compression": {"all_gather": "fp8_e4m3", "reduce_scatter": "int8", "block": 64}})"),
          "x"),
      none);
  CHECK(o.compression.all_gather == QuantCode::fp8_e4m3);
  CHECK(o.compression.reduce_scatter == QuantCode::int8);
  CHECK(o.compression.block == 64);
}
