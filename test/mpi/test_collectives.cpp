// Every collective and dtype of the MPI communicator against references computed here from
// rank-dependent data. Runs on any number of ranks (CTest: 1, 2, 3, 4).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "test_support.hpp"

using namespace fullshard;
using comm::ReduceOp;
using comm::Stream;
using test::sample;

namespace {

const DType kDTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

// A buffer of `n` elements of `t`, filled from sample(rank, offset + i, salt).
std::vector<unsigned char> make(DType t, std::size_t n, int rank, int salt, bool exact,
                                std::size_t offset = 0) {
  std::vector<unsigned char> b(std::max<std::size_t>(n, 1) * dtype_size(t));
  for (std::size_t i = 0; i < n; ++i)
    store_from_double(b.data(), t, i, sample(rank, offset + i, salt, exact));
  return b;
}

// The value rank q contributes at index i, as stored (rounded to t).
double stored(DType t, int q, std::size_t i, int salt, bool exact) {
  unsigned char tmp[8];
  store_from_double(tmp, t, 0, sample(q, i, salt, exact));
  return load_as_double(tmp, t, 0);
}

// Reference reduction over ranks of the stored inputs at index i, with its error bound under
// the documented rule (pairwise combines rounded to t; avg divides once more).
struct Expected {
  double value;
  double tolerance;
};
Expected reference(DType t, ReduceOp op, int W, std::size_t i, int salt, bool exact) {
  double sum = 0, abs_sum = 0, mx = -INFINITY, mn = INFINITY;
  for (int q = 0; q < W; ++q) {
    const double v = stored(t, q, i, salt, exact);
    sum += v;
    abs_sum += std::fabs(v);
    mx = std::max(mx, v);
    mn = std::min(mn, v);
  }
  const double u = dtype_unit_roundoff(t);
  switch (op) {
    case ReduceOp::max:
      return {mx, 0.0};
    case ReduceOp::min:
      return {mn, 0.0};
    case ReduceOp::sum:
      return {sum, exact ? 0.0 : W * u * abs_sum};
    case ReduceOp::avg: {
      const double avg = sum / W;
      const double tol = (exact ? 0.0 : u * abs_sum) + u * std::fabs(avg);
      return {avg, tol};
    }
  }
  return {0, 0};
}

}  // namespace

TEST_CASE("all_gather, every dtype, in place and not") {
  DeviceMesh mesh(test::runtime(), {test::world_size()}, {"dp"});
  auto& c = mesh.comm("dp");
  const int W = c.size();
  const int r = c.rank();
  Stream s = Stream::caller();
  for (DType t : kDTypes)
    for (std::size_t n : {std::size_t(1), std::size_t(7), std::size_t(1000)})
      for (bool in_place : {true, false}) {
        CAPTURE(dtype_name(t));
        CAPTURE(n);
        CAPTURE(in_place);
        const std::size_t es = dtype_size(t);
        std::vector<unsigned char> out(W * n * es, 0xAB);
        auto mine = make(t, n, r, 1, false);
        if (in_place) {
          std::copy(mine.begin(), mine.begin() + n * es, out.begin() + r * n * es);
          c.all_gather(out.data() + r * n * es, out.data(), n, t, s).wait();
        } else {
          c.all_gather(mine.data(), out.data(), n, t, s).wait();
        }
        bool ok = true;
        for (int q = 0; q < W; ++q)
          for (std::size_t i = 0; i < n; ++i)
            ok &= load_as_double(out.data(), t, q * n + i) == stored(t, q, i, 1, false);
        CHECK(ok);
      }
}

TEST_CASE("reduce_scatter and all_reduce, every dtype and op") {
  DeviceMesh mesh(test::runtime(), {test::world_size()}, {"dp"});
  auto& c = mesh.comm("dp");
  const int W = c.size();
  const int r = c.rank();
  Stream s = Stream::worker("rs");
  for (DType t : kDTypes)
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min})
      for (bool exact : {true, false})
        for (bool in_place : {true, false}) {
          CAPTURE(dtype_name(t));
          CAPTURE(comm::reduce_op_name(op));
          CAPTURE(exact);
          CAPTURE(in_place);
          const std::size_t n = 257;
          const std::size_t es = dtype_size(t);
          // reduce_scatter: rank q's input has W*n elements; element j is sample(q, j).
          auto in = make(t, W * n, r, 2, exact);
          std::vector<unsigned char> out(n * es, 0xCD);
          if (in_place) {
            c.reduce_scatter(in.data(), in.data() + r * n * es, n, t, op, s).wait();
          } else {
            c.reduce_scatter(in.data(), out.data(), n, t, op, s).wait();
          }
          const unsigned char* got = in_place ? in.data() + r * n * es : out.data();
          int bad = 0;
          for (std::size_t i = 0; i < n; ++i) {
            const Expected e = reference(t, op, W, r * n + i, 2, exact);
            const double v = load_as_double(got, t, i);
            if (!(std::fabs(v - e.value) <= e.tolerance)) {
              if (bad++ < 3)
                MESSAGE("reduce_scatter element " << i << ": " << v << " vs " << e.value);
            }
          }
          CHECK(bad == 0);

          // all_reduce over n elements.
          auto ar = make(t, n, r, 3, exact);
          std::vector<unsigned char> ar_out(n * es);
          if (in_place) {
            c.all_reduce(ar.data(), ar.data(), n, t, op, s).wait();
          } else {
            c.all_reduce(ar.data(), ar_out.data(), n, t, op, s).wait();
          }
          const unsigned char* ar_got = in_place ? ar.data() : ar_out.data();
          bad = 0;
          for (std::size_t i = 0; i < n; ++i) {
            const Expected e = reference(t, op, W, i, 3, exact);
            if (!(std::fabs(load_as_double(ar_got, t, i) - e.value) <= e.tolerance)) ++bad;
          }
          CHECK(bad == 0);
        }
}

TEST_CASE("16-bit sums follow the pairwise-rounding rule") {
  // Values whose exact sum is not representable: the result must be within the documented
  // bound of the exact sum, and equal to it when it is representable.
  DeviceMesh mesh(test::runtime(), {test::world_size()}, {"dp"});
  auto& c = mesh.comm("dp");
  const int W = c.size();
  Stream s = Stream::caller();
  std::vector<std::uint16_t> b(1, float_to_bf16(1.0f + 1.0f / 128));  // 1.0078125
  c.all_reduce(b.data(), b.data(), 1, DType::bf16, ReduceOp::sum, s).wait();
  const double exact = W * (1.0 + 1.0 / 128);
  CHECK(std::fabs(bf16_to_float(b[0]) - exact) <= W * dtype_unit_roundoff(DType::bf16) * exact);
  if (W == 1) CHECK(bf16_to_float(b[0]) == 1.0f + 1.0f / 128);
  if (W == 2) CHECK(bf16_to_float(b[0]) == 2.015625f);  // representable: exact
}

TEST_CASE("broadcast from every root, and barrier") {
  DeviceMesh mesh(test::runtime(), {test::world_size()}, {"dp"});
  auto& c = mesh.comm("dp");
  Stream s = Stream::worker("bc");
  for (int root = 0; root < c.size(); ++root)
    for (DType t : kDTypes) {
      auto buf = c.rank() == root ? make(t, 33, root, 4, false)
                                  : std::vector<unsigned char>(33 * dtype_size(t), 0);
      c.broadcast(buf.data(), 33, t, root, s).wait();
      bool ok = true;
      for (std::size_t i = 0; i < 33; ++i)
        ok &= load_as_double(buf.data(), t, i) == stored(t, root, i, 4, false);
      CHECK(ok);
    }
  c.barrier(s).wait();
}

TEST_CASE("traffic counters add the bytes of each collective's whole buffer") {
  DeviceMesh mesh(test::runtime(), {test::world_size()}, {"dp"});
  auto& ag = mesh.comm("dp", comm::StreamKind::all_gather);
  auto& rs = mesh.comm("dp", comm::StreamKind::reduce_scatter);
  const auto W = static_cast<std::uint64_t>(ag.size());
  const comm::Traffic before = mesh.traffic();
  CHECK(before.total() == 0);
  Stream s = Stream::caller("traffic");
  std::vector<float> full(10 * W, 1.f), part(10);
  ag.all_gather(full.data() + ag.rank() * 10, full.data(), 10, DType::f32, s).wait();
  ag.all_gather(full.data() + ag.rank() * 10, full.data(), 10, DType::f32, s).wait();
  rs.reduce_scatter(full.data(), part.data(), 5, DType::bf16, ReduceOp::sum, s).wait();
  mesh.world_comm().all_reduce(part.data(), part.data(), 3, DType::f64, ReduceOp::max, s).wait();
  mesh.comm("dp").broadcast(part.data(), 7, DType::f16, 0, s).wait();
  const comm::Traffic t = mesh.traffic();
  CHECK(t.all_gather == 2 * 10 * W * 4);
  CHECK(t.reduce_scatter == 5 * W * 2);
  CHECK(t.all_reduce == 3 * 8);
  CHECK(t.broadcast == 7 * 2);
  CHECK(t.total() == t.all_gather + t.reduce_scatter + t.all_reduce + t.broadcast);
  CHECK(ag.traffic().all_gather == t.all_gather);
  CHECK(rs.traffic().all_gather == 0);
}

TEST_CASE("bad arguments are errors that name the communicator and the operation") {
  DeviceMesh mesh(test::runtime(), {test::world_size()}, {"dp"});
  auto& c = mesh.comm("dp");
  Stream s = Stream::caller();
  std::vector<float> v(8 * c.size());
  CHECK_THROWS_WITH_AS(c.broadcast(v.data(), 1, DType::f32, c.size(), s),
                       doctest::Contains("broadcast on communicator 'mesh(dp).dp'"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(c.all_gather(nullptr, v.data(), 4, DType::f32, s),
                       doctest::Contains("null buffer"), InvalidArgument);
  if (c.size() > 1) {
    // send overlaps recv but is not this rank's slot.
    const std::size_t wrong = c.rank() == 0 ? 1 : 0;
    CHECK_THROWS_WITH_AS(c.all_gather(v.data() + wrong * 4 + 1, v.data(), 4, DType::f32, s),
                         doctest::Contains("in-place"), InvalidArgument);
  }
  CHECK_THROWS_WITH_AS(c.all_reduce(v.data(), v.data() + 1, 4, DType::f32, ReduceOp::sum, s),
                       doctest::Contains("overlap"), InvalidArgument);
  // The communicator still works afterwards.
  float x = 1.0f;
  c.all_reduce(&x, &x, 1, DType::f32, ReduceOp::sum, s).wait();
  CHECK(x == float(c.size()));
}
