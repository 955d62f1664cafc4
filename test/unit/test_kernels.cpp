// Shard copy kernels: group layouts, the all-gather copy-out and reduce-scatter copy-in runs,
// casts and the reduce-scatter copy-out, on both execution targets. Every reference is
// computed here from the definitions (torch.chunk rows, rank-major padded slots), never from
// the runs the library builds.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "error_check.hpp"
#include "fullshard/base/dtype.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/tensor/sharding.hpp"
#include "test_support.hpp"
// The kernel templates themselves, to run the team/flat algorithms (what a GPU build runs) on
// the host and compare them with the host loops that the public functions use here.
#include "lib/kernels/shard_copy_impl.hpp"
#include "lib/tensor/shard_extent.hpp"

using namespace fullshard;
using namespace fullshard::kernels;

namespace {

constexpr DType kDTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16};
constexpr ExecTarget kTargets[] = {ExecTarget::host, ExecTarget::device};

std::string target_name(ExecTarget t) {
  return t == ExecTarget::host ? "host" : "device";
}

// A flat buffer of n elements of a dtype, 8-byte aligned.
struct Buffer {
  DType dtype;
  std::int64_t n;
  std::vector<std::uint64_t> words;
  Buffer(DType t, std::int64_t count)
      : dtype(t),
        n(count),
        words(static_cast<std::size_t>((count * static_cast<std::int64_t>(dtype_size(t)) + 7) / 8 +
                                       1)) {}
  void* data() { return words.data(); }
  const void* data() const { return words.data(); }
  double get(std::int64_t i) const {
    return load_as_double(data(), dtype, static_cast<std::size_t>(i));
  }
  void set(std::int64_t i, double v) {
    store_from_double(data(), dtype, static_cast<std::size_t>(i), v);
  }
  // The raw bits of element i.
  std::uint64_t bits(std::int64_t i) const {
    std::uint64_t b = 0;
    std::memcpy(&b, reinterpret_cast<const unsigned char*>(data()) + i * dtype_size(dtype),
                dtype_size(dtype));
    return b;
  }
  void poison() {
    for (std::int64_t i = 0; i < n; ++i)
      set(i, std::numeric_limits<double>::quiet_NaN());
  }
};

// A parameter of a group: its shape and shard dim.
struct Spec {
  Shape shape;
  int dim = 0;
};

// The layouts of a group, from the definitions.
struct RefMember {
  Shape shape;
  std::int64_t outer = 1, d = 0, inner = 1, chunk = 0, numel = 1, slot = 0, arena = 0;
};
struct RefGroup {
  int world = 1;
  std::vector<RefMember> members;
  std::int64_t gsn = 0;
  std::int64_t arena = 0;
};

RefGroup ref_group(const std::vector<Spec>& specs, int world) {
  RefGroup g;
  g.world = world;
  for (const Spec& s : specs) {
    RefMember m;
    m.shape = s.shape;
    for (std::size_t i = 0; i < s.shape.size(); ++i) {
      m.numel *= s.shape[i];
      if (static_cast<int>(i) < s.dim) m.outer *= s.shape[i];
      if (static_cast<int>(i) > s.dim) m.inner *= s.shape[i];
    }
    m.d = s.shape[static_cast<std::size_t>(s.dim)];
    m.chunk = (m.d + world - 1) / world;  // torch.chunk
    m.slot = g.gsn;
    m.arena = g.arena;
    g.gsn += m.outer * m.chunk * m.inner;
    g.arena += m.numel;
    g.members.push_back(m);
  }
  return g;
}

// Position in the all-gather buffer (rank-major slots) of element k of member m's full tensor.
std::int64_t slot_position(const RefGroup& g, const RefMember& m, std::int64_t k) {
  const std::int64_t o = k / (m.d * m.inner);
  const std::int64_t r = (k / m.inner) % m.d;
  const std::int64_t i = k % m.inner;
  const std::int64_t q = r / m.chunk;  // owner rank
  const std::int64_t local_row = r % m.chunk;
  return q * g.gsn + m.slot + (o * m.chunk + local_row) * m.inner + i;
}

std::vector<ShardLayout> layouts(const std::vector<Spec>& specs, int world) {
  std::vector<ShardLayout> out;
  for (std::size_t i = 0; i < specs.size(); ++i)
    out.push_back(shard_layout(specs[i].shape, Placement::Shard(specs[i].dim), world, 0,
                               "p" + std::to_string(i)));
  return out;
}

// The test groups: uneven Shard(0) (D=5), tiny, 1-D, 3-D, empty, and Shard(1) where the dim
// divides evenly.
std::vector<Spec> test_specs(int world) {
  std::vector<Spec> specs = {{{5, 3}, 0}, {{1}, 0}, {{7}, 0}, {{13, 2, 3}, 0}, {{0, 4}, 0}};
  if (6 % world == 0) specs.push_back({{4, 6}, 1});
  specs.push_back({{3, 2}, 0});
  return specs;
}

// The mixed group, and every parameter alone (then the slots of consecutive ranks touch, and
// runs merge across ranks).
std::vector<std::vector<Spec>> test_groups(int world) {
  std::vector<std::vector<Spec>> groups = {test_specs(world)};
  for (const Spec& s : test_specs(world))
    groups.push_back({s});
  return groups;
}

// A full value for element k of member p (exact in every dtype).
double full_value(std::size_t p, std::int64_t k) {
  return test::sample(static_cast<int>(p), static_cast<std::size_t>(k), 7, true);
}

// Equality of one element against a reference value of the same dtype: same bits, or both NaN.
bool same_element(const Buffer& got, std::int64_t i, const Buffer& want, std::int64_t j) {
  if (std::isnan(want.get(j))) return std::isnan(got.get(i));
  return got.bits(i) == want.bits(j);
}

std::string pair_name(DType s, DType d) {
  return std::string(dtype_name(s)) + " -> " + dtype_name(d);
}

}  // namespace

TEST_CASE("shard_extent: shard_layout's sizes and errors, without the layout") {
  const std::int64_t big = std::int64_t(1) << 40;
  const std::vector<Shape> shapes = {{5},    {0},       {13, 7},    {8, 6},   {3, 4, 6},
                                     {1, 1}, {7, 0, 3}, {big, big}, {big, 4}, {}};
  for (const Shape& shape : shapes)
    for (int dim : {0, 1, 2, 5})
      for (int W : {1, 2, 3, 4, 7}) {
        CAPTURE(shape_string(shape));
        CAPTURE(dim);
        CAPTURE(W);
        const Placement pl = Placement::Shard(dim);
        std::string layout_error, extent_error;
        ShardLayout l;
        try {
          l = shard_layout(shape, pl, W, 0, "tensor 't'");
        } catch (const InvalidArgument& e) {
          layout_error = e.what();
        }
        ShardExtent x;
        try {
          x = shard_extent(shape, pl, W, [] { return std::string("tensor 't'"); });
        } catch (const InvalidArgument& e) {
          extent_error = e.what();
        }
        CHECK(extent_error == layout_error);
        if (layout_error.empty()) {
          CHECK(x.padded_numel == l.padded_numel());
          CHECK(x.numel == numel(shape));
        }
      }
}

TEST_CASE("make_group_layout: slot offsets, gsn and arena offsets") {
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const auto specs = test_specs(world);
    const RefGroup ref = ref_group(specs, world);
    const GroupLayout g = make_group_layout(layouts(specs, world));
    CHECK(g.world == world);
    CHECK(g.shard_numel == ref.gsn);
    CHECK(g.arena_numel == ref.arena);
    REQUIRE(g.members.size() == specs.size());
    for (std::size_t p = 0; p < specs.size(); ++p) {
      CAPTURE(p);
      CHECK(g.members[p].slot_offset == ref.members[p].slot);
      CHECK(g.members[p].arena_offset == ref.members[p].arena);
      CHECK(g.members[p].layout.global_shape == specs[p].shape);
    }
  }
  // W = 4 by hand: (5,3) chunk 2 -> 6; (1,) -> 1; (7,) -> 2; (13,2,3) chunk 4 -> 24; (0,4) -> 0;
  // (3,2) chunk 1 -> 2.
  const GroupLayout g4 = make_group_layout(layouts(test_specs(4), 4));
  std::vector<std::int64_t> slots, arenas;
  for (const auto& m : g4.members) {
    slots.push_back(m.slot_offset);
    arenas.push_back(m.arena_offset);
  }
  CHECK(slots == std::vector<std::int64_t>{0, 6, 7, 9, 33, 33});
  CHECK(arenas == std::vector<std::int64_t>{0, 15, 16, 23, 101, 101});
  CHECK(g4.shard_numel == 35);
  CHECK(g4.arena_numel == 107);
  // Shard(1) of (4, 6) at W = 2: chunk 3, outer 4 -> 12.
  const GroupLayout s1 = make_group_layout(layouts({{{4, 6}, 1}}, 2));
  CHECK(s1.shard_numel == 12);

  const GroupLayout empty = make_group_layout({});
  CHECK(empty.members.empty());
  CHECK(empty.shard_numel == 0);
  CHECK(empty.arena_numel == 0);
  CHECK(all_gather_copy_out_runs(empty).empty());
  CHECK(reduce_scatter_copy_in_runs(empty).empty());
}

TEST_CASE("make_group_layout rejects mixed worlds and Replicate") {
  std::vector<ShardLayout> mixed = {shard_layout({4}, Placement::Shard(0), 2, 0, "a"),
                                    shard_layout({4}, Placement::Shard(0), 4, 0, "b")};
  CHECK_THROWS_AS(make_group_layout(mixed), InvalidArgument);
  std::vector<ShardLayout> rep = {shard_layout({4}, Placement::Shard(0), 2, 0, "a"),
                                  shard_layout({4}, Placement::Replicate(), 2, 0, "b")};
  CHECK_THROWS_WITH_AS(make_group_layout(rep),
                       doctest::Contains("Replicate placement is not supported"), InvalidArgument);
}

TEST_CASE("all-gather copy-out: every dtype pair, both targets, padding skipped") {
  for (int world = 1; world <= 4; ++world) {
    for (const auto& specs : test_groups(world)) {
      const RefGroup ref = ref_group(specs, world);
      const GroupLayout g = make_group_layout(layouts(specs, world));
      const auto runs = all_gather_copy_out_runs(g);
      if (world == 1) CHECK(runs.size() <= 1);  // one slot, no padding: one contiguous copy
      for (ExecTarget target : kTargets) {
        const CopyPlan plan(target, runs);
        CHECK(plan.target() == target);
        CHECK(plan.size() == runs.size());
        CHECK(plan.elements_read() == ref.arena);
        CHECK(plan.elements_written() == ref.arena);
        for (DType st : kDTypes) {
          for (DType dt : kDTypes) {
            CAPTURE(world);
            INFO(target_name(target), " ", pair_name(st, dt));
            // The all-gather buffer: rank q's slot holds q's shards, padding poisoned.
            Buffer ag(st, world * ref.gsn);
            ag.poison();
            for (std::size_t p = 0; p < ref.members.size(); ++p)
              for (std::int64_t k = 0; k < ref.members[p].numel; ++k)
                ag.set(slot_position(ref, ref.members[p], k), full_value(p, k));
            Buffer arena(dt, ref.arena);
            arena.poison();
            run_copies(plan, ag.data(), st, arena.data(), dt);
            int bad = 0;
            for (std::size_t p = 0; p < ref.members.size(); ++p)
              for (std::int64_t k = 0; k < ref.members[p].numel; ++k)
                if (arena.get(ref.members[p].arena + k) != full_value(p, k)) ++bad;
            CHECK(bad == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("reduce-scatter copy-in: every dtype pair, both targets, padding zero") {
  for (int world = 1; world <= 4; ++world) {
    for (const auto& specs : test_groups(world)) {
      const RefGroup ref = ref_group(specs, world);
      const GroupLayout g = make_group_layout(layouts(specs, world));
      const auto runs = reduce_scatter_copy_in_runs(g);
      for (ExecTarget target : kTargets) {
        const CopyPlan plan(target, runs);
        CHECK(plan.elements_read() == ref.arena);
        CHECK(plan.elements_written() == world * ref.gsn);
        for (DType st : kDTypes) {
          for (DType dt : kDTypes) {
            CAPTURE(world);
            INFO(target_name(target), " ", pair_name(st, dt));
            Buffer grads(st, ref.arena);
            for (std::size_t p = 0; p < ref.members.size(); ++p)
              for (std::int64_t k = 0; k < ref.members[p].numel; ++k)
                grads.set(ref.members[p].arena + k, full_value(p, k));
            Buffer rs(dt, world * ref.gsn);
            rs.poison();
            run_copies(plan, grads.data(), st, rs.data(), dt);
            std::vector<char> real(static_cast<std::size_t>(world * ref.gsn), 0);
            int bad = 0;
            for (std::size_t p = 0; p < ref.members.size(); ++p) {
              for (std::int64_t k = 0; k < ref.members[p].numel; ++k) {
                const std::int64_t pos = slot_position(ref, ref.members[p], k);
                real[static_cast<std::size_t>(pos)] = 1;
                if (rs.get(pos) != full_value(p, k)) ++bad;
              }
            }
            CHECK(bad == 0);
            int nonzero_padding = 0;
            for (std::int64_t i = 0; i < world * ref.gsn; ++i)
              if (!real[static_cast<std::size_t>(i)] && rs.bits(i) != 0) ++nonzero_padding;
            CHECK(nonzero_padding == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("reduce-scatter copy-in with a cast: f32 -> bf16 rounds, bf16 -> f32 is exact") {
  for (int world = 1; world <= 4; ++world) {
    for (const auto& specs : test_groups(world)) {
      const RefGroup ref = ref_group(specs, world);
      const auto runs = reduce_scatter_copy_in_runs(make_group_layout(layouts(specs, world)));
      for (ExecTarget target : kTargets) {
        CAPTURE(world);
        INFO(target_name(target));
        const CopyPlan plan(target, runs);
        // f32 -> bf16: non-integer values, compared with float_to_bf16 of each.
        std::vector<float> g32(static_cast<std::size_t>(ref.arena));
        for (std::size_t i = 0; i < g32.size(); ++i)
          g32[i] = static_cast<float>(test::sample(3, i, 11, false));
        std::vector<std::uint16_t> rs16(static_cast<std::size_t>(world * ref.gsn), 0x7fc0u);
        run_copies(plan, g32.data(), DType::f32, rs16.data(), DType::bf16);
        // bf16 -> f32: the bf16 words back, widened exactly.
        std::vector<std::uint16_t> g16(g32.size());
        for (std::size_t i = 0; i < g16.size(); ++i)
          g16[i] = float_to_bf16(g32[i]);
        std::vector<float> rs32(rs16.size(), std::numeric_limits<float>::quiet_NaN());
        run_copies(plan, g16.data(), DType::bf16, rs32.data(), DType::f32);
        std::vector<char> real(rs16.size(), 0);
        int bad16 = 0, bad32 = 0;
        for (const RefMember& m : ref.members) {
          for (std::int64_t k = 0; k < m.numel; ++k) {
            const auto pos = static_cast<std::size_t>(slot_position(ref, m, k));
            const auto src = static_cast<std::size_t>(m.arena + k);
            real[pos] = 1;
            if (rs16[pos] != float_to_bf16(g32[src])) ++bad16;
            if (rs32[pos] != bf16_to_float(g16[src])) ++bad32;
          }
        }
        CHECK(bad16 == 0);
        CHECK(bad32 == 0);
        int pad16 = 0, pad32 = 0;
        for (std::size_t i = 0; i < real.size(); ++i) {
          if (real[i]) continue;
          if (rs16[i] != 0) ++pad16;
          std::uint32_t b;
          std::memcpy(&b, &rs32[i], 4);
          if (b != 0) ++pad32;
        }
        CHECK(pad16 == 0);
        CHECK(pad32 == 0);
      }
    }
  }
}

TEST_CASE("copy-in then copy-out restores the arena bit for bit") {
  for (int world = 1; world <= 4; ++world) {
    // Long members, so that runs are split into pieces on both targets.
    auto groups = test_groups(world);
    const Spec long_spec{{(std::int64_t{1} << 21) + 5}, 0};
    groups.front().push_back(long_spec);
    groups.front().push_back({{9, 5}, 0});
    groups.push_back({long_spec});
    for (const auto& specs : groups) {
      const RefGroup ref = ref_group(specs, world);
      const GroupLayout g = make_group_layout(layouts(specs, world));
      for (ExecTarget target : kTargets) {
        const CopyPlan in(target, reduce_scatter_copy_in_runs(g));
        const CopyPlan out(target, all_gather_copy_out_runs(g));
        for (DType t : {DType::f32, DType::bf16}) {
          CAPTURE(world);
          INFO(target_name(target), " ", std::string(dtype_name(t)));
          Buffer arena(t, ref.arena);
          for (std::int64_t i = 0; i < ref.arena; ++i)
            arena.set(i, test::sample(1, static_cast<std::size_t>(i), 5, false));
          Buffer rs(t, world * ref.gsn);
          rs.poison();
          run_copies(in, arena.data(), t, rs.data(), t);
          Buffer back(t, ref.arena);
          back.poison();
          run_copies(out, rs.data(), t, back.data(), t);
          CHECK(std::memcmp(back.data(), arena.data(),
                            static_cast<std::size_t>(ref.arena) * dtype_size(t)) == 0);
        }
      }
    }
  }
}

TEST_CASE("run_copies follows hand-written runs, zero padding included") {
  // src 0..9; runs: [2,5) -> dst 0 then 2 zeros; [0,1) -> dst 6; 3 zeros only at dst 7.
  const std::vector<CopyRun> runs = {{2, 0, 3, 2}, {0, 6, 1, 0}, {0, 7, 0, 3}};
  for (ExecTarget target : kTargets) {
    INFO(target_name(target));
    const CopyPlan plan(target, runs);
    CHECK(plan.size() == 3);
    CHECK(plan.elements_read() == 4);
    CHECK(plan.elements_written() == 9);
    std::vector<double> src(10);
    for (int i = 0; i < 10; ++i)
      src[static_cast<std::size_t>(i)] = i + 1;
    std::vector<float> dst(12, -1.0f);
    run_copies(plan, src.data(), DType::f64, dst.data(), DType::f32);
    CHECK(dst == std::vector<float>{3, 4, 5, 0, 0, -1, 1, 0, 0, 0, -1, -1});
  }
  CHECK_THROWS_AS(CopyPlan(ExecTarget::host, {{0, 0, -1, 0}}), InvalidArgument);
  const CopyPlan none;
  CHECK(none.size() == 0);
  CHECK(none.target() == ExecTarget::host);
  run_copies(none, nullptr, DType::f32, nullptr, DType::f32);  // nothing to do
}

TEST_CASE("cast_copy: all 16 dtype pairs against store_from_double(load_as_double)") {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> values = {0.0,     -0.0,   1.0,    -1.0, 0.1,   -2.5e-3, 65504.0,   65519.0,
                                65520.0, 1e5,    6e-8,   1e-8, 1e-40, 1e-45,   3.4e38,    -3.4e38,
                                1e300,   -1e300, 1e-300, inf,  -inf,  nan,     3.0039062, 1.0 / 3};
  for (std::size_t i = 0; i < 1000; ++i)
    values.push_back(test::sample(2, i, 9, false) * 1e3);
  const auto n = static_cast<std::int64_t>(values.size());
  for (ExecTarget target : kTargets) {
    for (DType st : kDTypes) {
      Buffer src(st, n);
      for (std::int64_t i = 0; i < n; ++i)
        src.set(i, values[static_cast<std::size_t>(i)]);
      for (DType dt : kDTypes) {
        INFO(target_name(target), " ", pair_name(st, dt));
        Buffer want(dt, n);
        for (std::int64_t i = 0; i < n; ++i)
          want.set(i, src.get(i));
        Buffer got(dt, n);
        got.poison();
        cast_copy(target, src.data(), st, got.data(), dt, n);
        int bad = 0;
        for (std::int64_t i = 0; i < n; ++i)
          if (!same_element(got, i, want, i)) ++bad;
        CHECK(bad == 0);
      }
    }
  }
}

TEST_CASE("cast_copy over several blocks, and bad arguments") {
  const std::int64_t n = (std::int64_t{1} << 21) + 3;
  std::vector<float> src(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < src.size(); ++i)
    src[i] = static_cast<float>(test::sample(4, i, 1, false));
  for (ExecTarget target : kTargets) {
    INFO(target_name(target));
    std::vector<std::uint16_t> dst(src.size() + 1, 0xffffu);
    cast_copy(target, src.data(), DType::f32, dst.data(), DType::bf16, n);
    int bad = 0;
    for (std::size_t i = 0; i < src.size(); ++i)
      if (dst[i] != float_to_bf16(src[i])) ++bad;
    CHECK(bad == 0);
    CHECK(dst.back() == 0xffffu);  // nothing past n
  }
  float x = 1.0f;
  CHECK_THROWS_AS(cast_copy(ExecTarget::host, &x, DType::f32, &x, DType::f32, -1), InvalidArgument);
  CHECK_THROWS_AS(cast_copy(ExecTarget::host, nullptr, DType::f32, &x, DType::f32, 1),
                  InvalidArgument);
  cast_copy(ExecTarget::host, nullptr, DType::f32, nullptr, DType::f32, 0);  // nothing to do
  CHECK_THROWS_AS(reduce_copy_out(ExecTarget::host, &x, DType::f32, &x, DType::f32, 1, 0.0, false),
                  InvalidArgument);
}

namespace {

// Reference of one reduce-scatter copy-out element: t = D(src / divisor) with the division in
// f64 when either buffer is f64 and in f32 otherwise; then old + t in D's arithmetic.
double ref_reduce(double src, DType st, double old, DType dt, double divisor, bool accumulate) {
  const bool wide = st == DType::f64 || dt == DType::f64;
  double v = src;
  if (divisor != 1.0)
    v = wide ? src / divisor
             : static_cast<double>(static_cast<float>(src) / static_cast<float>(divisor));
  Buffer t(dt, 1);
  t.set(0, v);
  if (!accumulate) return t.get(0);
  Buffer r(dt, 1);
  if (dt == DType::f64)
    r.set(0, old + t.get(0));
  else
    r.set(0, static_cast<double>(static_cast<float>(old) + static_cast<float>(t.get(0))));
  return r.get(0);
}

}  // namespace

TEST_CASE("reduce_copy_out: divisor, cast and accumulate against a reference") {
  const std::pair<DType, DType> pairs[] = {{DType::f32, DType::f32},  {DType::bf16, DType::f32},
                                           {DType::f32, DType::bf16}, {DType::f64, DType::f64},
                                           {DType::f16, DType::bf16}, {DType::f64, DType::f16}};
  const std::int64_t n = 5000;
  for (ExecTarget target : kTargets) {
    for (const auto& pair : pairs) {
      const DType st = pair.first;
      const DType dt = pair.second;
      for (double divisor : {1.0, 3.0}) {
        for (bool accumulate : {false, true}) {
          INFO(target_name(target), " ", pair_name(st, dt), " divisor ", divisor, " accumulate ",
               accumulate);
          Buffer src(st, n);
          Buffer dst(dt, n);
          for (std::int64_t i = 0; i < n; ++i) {
            src.set(i, test::sample(5, static_cast<std::size_t>(i), 3, false));
            dst.set(i, test::sample(6, static_cast<std::size_t>(i), 4, false));
          }
          src.set(0, std::numeric_limits<double>::quiet_NaN());
          src.set(1, std::numeric_limits<double>::infinity());
          Buffer want(dt, n);
          for (std::int64_t i = 0; i < n; ++i)
            want.set(i, ref_reduce(src.get(i), st, dst.get(i), dt, divisor, accumulate));
          reduce_copy_out(target, src.data(), st, dst.data(), dt, n, divisor, accumulate);
          int bad = 0;
          for (std::int64_t i = 0; i < n; ++i)
            if (!same_element(dst, i, want, i)) ++bad;
          CHECK(bad == 0);
        }
      }
    }
  }
}

TEST_CASE("team and flat algorithms (the GPU path) match the host loops on the host") {
  namespace kd = fullshard::kernels::detail;
  using Exec = Kokkos::DefaultHostExecutionSpace;
  const Exec exec;
  for (int world = 1; world <= 4; ++world) {
    for (const auto& specs : test_groups(world)) {
      const RefGroup ref = ref_group(specs, world);
      const GroupLayout g = make_group_layout(layouts(specs, world));
      for (int direction = 0; direction < 2; ++direction) {
        const auto runs =
            direction == 0 ? all_gather_copy_out_runs(g) : reduce_scatter_copy_in_runs(g);
        const std::int64_t n_src = direction == 0 ? world * ref.gsn : ref.arena;
        const std::int64_t n_dst = direction == 0 ? ref.arena : world * ref.gsn;
        Kokkos::View<CopyRun*, Exec::memory_space> view("runs", runs.size());
        for (std::size_t i = 0; i < runs.size(); ++i)
          view(i) = runs[i];
        const CopyPlan plan(ExecTarget::host, runs);
        for (DType st : kDTypes) {
          Buffer src(st, n_src);
          for (std::int64_t i = 0; i < n_src; ++i)
            src.set(i, test::sample(8, static_cast<std::size_t>(i), direction, false));
          for (DType dt : kDTypes) {
            CAPTURE(world);
            CAPTURE(direction);
            INFO(pair_name(st, dt));
            Buffer want(dt, n_dst);
            Buffer got(dt, n_dst);
            want.poison();
            got.poison();
            run_copies(plan, src.data(), st, want.data(), dt);
            kd::dispatch(st, dt, [&](auto s, auto d) {
              using S = decltype(s);
              using D = decltype(d);
              kd::run_copies_team<Exec, S, D>(exec, view,
                                              static_cast<const typename S::storage*>(src.data()),
                                              static_cast<typename D::storage*>(got.data()));
            });
            int bad = 0;
            for (std::int64_t i = 0; i < n_dst; ++i)
              if (!same_element(got, i, want, i)) ++bad;
            CHECK(bad == 0);
          }
        }
      }
    }
  }

  const std::int64_t n = 3001;
  for (DType st : kDTypes) {
    Buffer src(st, n);
    for (std::int64_t i = 0; i < n; ++i)
      src.set(i, test::sample(9, static_cast<std::size_t>(i), 2, false) * 100);
    src.set(0, std::numeric_limits<double>::quiet_NaN());
    src.set(1, -std::numeric_limits<double>::infinity());
    for (DType dt : kDTypes) {
      INFO(pair_name(st, dt));
      Buffer want(dt, n);
      Buffer got(dt, n);
      cast_copy(ExecTarget::host, src.data(), st, want.data(), dt, n);
      kd::dispatch(st, dt, [&](auto s, auto d) {
        using S = decltype(s);
        using D = decltype(d);
        kd::cast_copy_flat<Exec, S, D>(exec, static_cast<const typename S::storage*>(src.data()),
                                       static_cast<typename D::storage*>(got.data()), n);
      });
      int bad = 0;
      for (std::int64_t i = 0; i < n; ++i)
        if (!same_element(got, i, want, i)) ++bad;
      CHECK(bad == 0);
      for (double divisor : {1.0, 3.0}) {
        for (bool accumulate : {false, true}) {
          INFO("divisor ", divisor, " accumulate ", accumulate);
          for (std::int64_t i = 0; i < n; ++i) {
            want.set(i, test::sample(10, static_cast<std::size_t>(i), 1, false));
            got.set(i, want.get(i));
          }
          reduce_copy_out(ExecTarget::host, src.data(), st, want.data(), dt, n, divisor,
                          accumulate);
          kd::dispatch(st, dt, [&](auto s, auto d) {
            using S = decltype(s);
            using D = decltype(d);
            const auto* in = static_cast<const typename S::storage*>(src.data());
            auto* out = static_cast<typename D::storage*>(got.data());
            const auto div = static_cast<kd::Acc<S, D>>(divisor);
            if (accumulate)
              kd::reduce_copy_out_flat<Exec, S, D, true>(exec, in, out, n, div, divisor != 1.0);
            else
              kd::reduce_copy_out_flat<Exec, S, D, false>(exec, in, out, n, div, divisor != 1.0);
          });
          int bad_reduce = 0;
          for (std::int64_t i = 0; i < n; ++i)
            if (!same_element(got, i, want, i)) ++bad_reduce;
          CHECK(bad_reduce == 0);
        }
      }
    }
  }
}

TEST_CASE("kernels on an ExecStream: enqueued without a fence, in order, fenced once") {
  // Three kernels on one host instance, each reading what the previous wrote: after one
  // fence the chain's result is the reference computed here.
  const std::int64_t n = 1000;
  std::vector<float> a(static_cast<std::size_t>(n)), b(a.size()), c(a.size());
  for (std::int64_t i = 0; i < n; ++i)
    a[static_cast<std::size_t>(i)] = static_cast<float>(i % 97) - 40.0f;
  const ExecStream on = ExecStream::host();
  CHECK(on.target() == ExecTarget::host);
  cast_copy(on, a.data(), DType::f32, b.data(), DType::f32, n);
  reduce_copy_out(on, b.data(), DType::f32, c.data(), DType::f32, n, 4.0, false);
  reduce_copy_out(on, b.data(), DType::f32, c.data(), DType::f32, n, 2.0, true);
  on.fence();
  int bad = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = a[static_cast<std::size_t>(i)];
    bad += c[static_cast<std::size_t>(i)] != x / 4.0f + x / 2.0f;
  }
  CHECK(bad == 0);

  // A copy plan runs only on its own target's stream.
  const CopyPlan plan(ExecTarget::host, {{0, 0, 4, 2}});
  std::vector<float> dst(6, 9.0f);
  run_copies(plan, a.data(), DType::f32, dst.data(), DType::f32, on);
  on.fence();
  CHECK(dst == std::vector<float>{a[0], a[1], a[2], a[3], 0.0f, 0.0f});
  const std::string msg = test::error_of<InvalidArgument>([&] {
    run_copies(plan, a.data(), DType::f32, dst.data(), DType::f32, ExecStream::device());
  });
  CHECK(test::contains(msg, "built for the host but the stream runs on the device"));
}
