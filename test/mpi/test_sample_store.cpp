// The sample store (fullshard/store/sample_store.hpp) over MPI, on 1 to 4 ranks: every rank
// both producer and consumer, and MPMD splits (one producer and the rest consumers, one
// consumer and the rest producers); cross-rank mixing; lossless determinism and order; the
// end-of-stream drain; nonblocking drops exactly counted; the checks of a put (shapes, dtypes,
// non-finite values, masks); strided, column-major, negative-stride and 9-dim puts; f64 kept
// as f32; f16 and bf16 fields; the window policy; moments; bytes(); a refused put's unsent
// slot; timeouts naming the peer; option agreement and bad options on some ranks; the header's
// example (a put per cell, a draw per step) to completion; draws that only this rank could
// supply, refused at once; lossless close() while a producer still puts; the destructor path.
#include <doctest/doctest.h>

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "error_check.hpp"
#include "fullshard/base/dtype.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/store/sample_store.hpp"
#include "test_support.hpp"

using namespace fullshard;
using namespace fullshard::store;
using fullshard::test::contains;
using fullshard::test::error_of;

namespace {

/// Element i of sample k of producer `rank`: exact in f32.
float value(int rank, std::int64_t k, std::int64_t i) {
  return static_cast<float>(rank * 1000 + k) + 0.25f * static_cast<float>(i);
}

/// One field "x" of 3 f32.
StoreOptions x_options(Policy policy, Delivery delivery, const std::string& name) {
  StoreOptions o;
  o.fields = {Field{"x", {3}, DType::f32, false, false}};
  o.policy = policy;
  o.delivery = delivery;
  o.capacity = 64;
  o.seed = 1;
  o.name = name;
  return o;
}

/// Puts this rank's sample k (step and tag k).
bool put_sample(SampleStore& s, std::int64_t k, int rank = test::world_rank()) {
  float x[3];
  for (int i = 0; i < 3; ++i)
    x[i] = value(rank, k, i);
  return s.put(k, k, {ArrayView{x, DType::f32, {3}, {}}});
}

struct Batch {
  std::int64_t n = 0;
  std::vector<float> x;
  std::vector<SampleMeta> meta;
};

Batch draw_batch(SampleStore& s, std::int64_t batch) {
  Batch b;
  b.x.assign(static_cast<std::size_t>(batch) * 3, std::numeric_limits<float>::quiet_NaN());
  b.n = s.draw(batch, {MutableArrayView{b.x.data(), DType::f32, {batch, 3}}}, &b.meta);
  CHECK(b.meta.size() == static_cast<std::size_t>(b.n));
  return b;
}

/// Every drawn sample holds the values its producer put.
void check_values(const Batch& b) {
  for (std::int64_t j = 0; j < b.n; ++j) {
    const SampleMeta& m = b.meta[static_cast<std::size_t>(j)];
    CHECK(m.step == m.tag);
    for (int i = 0; i < 3; ++i)
      CHECK(b.x[static_cast<std::size_t>(j * 3 + i)] == value(m.rank, m.tag, i));
  }
}

long long sum_over_ranks(long long v) {
  long long out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  return out;
}

/// A communicator this test made, freed at the end of its scope.
struct OwnedComm {
  MPI_Comm comm = MPI_COMM_NULL;
  OwnedComm() = default;
  OwnedComm(const OwnedComm&) = delete;
  OwnedComm& operator=(const OwnedComm&) = delete;
  ~OwnedComm() {
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
};

/// Ranks 0 and 1 of the world (nothing on the others), or this rank alone on one rank.
MPI_Comm pair_of_ranks(OwnedComm& owned) {
  if (test::world_size() == 1) return MPI_COMM_SELF;
  MPI_Comm_split(MPI_COMM_WORLD, test::world_rank() < 2 ? 0 : MPI_UNDEFINED, test::world_rank(),
                 &owned.comm);
  return owned.comm;
}

}  // namespace

TEST_CASE("every rank both: lossless FIFO batches hold one sample of every producer, in order") {
  const int W = test::world_size();
  const int r = test::world_rank();
  SampleStore s(MPI_COMM_WORLD, Role::both, x_options(Policy::fifo, Delivery::lossless, "mixing"));
  REQUIRE(static_cast<int>(s.producers().size()) == W);
  REQUIRE(static_cast<int>(s.consumers().size()) == W);
  const int P = W, C = W, steps = 6;
  for (int step = 0; step < steps; ++step) {
    for (int j = 0; j < C; ++j)
      REQUIRE(put_sample(s, step * C + j));  // one to each consumer
    const Batch b = draw_batch(s, P);
    REQUIRE(b.n == P);
    check_values(b);
    for (int p = 0; p < P; ++p) {
      // Round robin over the producers from the first; producer p's samples to consumer r are
      // those with (p + k) mod C == r.
      CHECK(b.meta[static_cast<std::size_t>(p)].rank == p);
      CHECK(b.meta[static_cast<std::size_t>(p)].tag == step * C + ((r - p) % C + C) % C);
    }
  }
  s.end_of_stream();
  CHECK(draw_batch(s, P).n == 0);
  CHECK(s.ended());
  const StoreStats st = s.stats();
  CHECK(st.produced == steps * C);
  CHECK(st.dropped == 0);
  CHECK(st.ingested == steps * P);
  CHECK(st.drawn == steps * P);
  CHECK(st.reused == 0);
  CHECK(st.evicted == 0);
  CHECK(st.discarded_at_close == 0);
  // Each draw follows the ingestion of one sample of every producer, tags step * C + d for d in
  // 0..C-1 (d = (r - p) mod C): the newest is step * C + C - 1, so the staleness of the sample
  // with d is C - 1 - d, and their mean (C - 1) / 2.
  CHECK(st.mean_staleness == doctest::Approx((C - 1) / 2.0));
  // W send rings and W staging rings of in_flight (4) messages, and the buffer's slots: a FIFO
  // ring whose tail reaches slot steps * P - 1, allocated from 16 slots by doubling.
  const std::size_t ring = 4 * (32 + s.sample_bytes());
  std::size_t slots = 16;
  while (slots < static_cast<std::size_t>(steps * P))
    slots *= 2;
  CHECK(s.bytes() == 2 * static_cast<std::size_t>(W) * ring + slots * s.sample_bytes());
  CHECK(st.bytes == s.bytes());
  s.close();
  CHECK(s.stats().discarded_at_close == 0);  // everything was drawn
}

TEST_CASE("lossless: the same seed and puts give the same batches; another seed others") {
  const int W = test::world_size();
  auto run = [&](std::uint64_t seed) {
    StoreOptions o = x_options(Policy::reservoir, Delivery::lossless, "determinism");
    o.capacity = 3;
    o.seed = seed;
    SampleStore s(MPI_COMM_WORLD, Role::both, o);
    std::vector<std::pair<int, std::int64_t>> drawn;
    for (int step = 0; step < 10; ++step) {
      for (int j = 0; j < W; ++j)
        REQUIRE(put_sample(s, step * W + j));
      const Batch b = draw_batch(s, W);
      REQUIRE(b.n == W);
      check_values(b);
      for (const SampleMeta& m : b.meta)
        drawn.emplace_back(m.rank, m.tag);
    }
    s.end_of_stream();
    for (Batch b = draw_batch(s, W); b.n > 0; b = draw_batch(s, W)) {
      check_values(b);
      for (const SampleMeta& m : b.meta)
        drawn.emplace_back(m.rank, m.tag);
    }
    const StoreStats st = s.stats();
    CHECK(st.ingested == 10 * W);
    CHECK(st.evicted + st.rejected == 10 * W - 3);
    s.close();
    return drawn;
  };
  const auto a = run(7);
  const auto b = run(7);
  CHECK(a == b);
  CHECK(a != run(8));
}

TEST_CASE("MPMD: rank 0 produces, the others consume; and the reverse") {
  const int W = test::world_size();
  const int r = test::world_rank();
  if (W < 2) {
    MESSAGE("needs 2 ranks; skipped on 1");
    return;
  }
  SUBCASE("one producer: its samples spread over the consumers in turn, each once") {
    StoreOptions o = x_options(Policy::fifo, Delivery::lossless, "one producer");
    o.in_flight = 2;
    SampleStore s(MPI_COMM_WORLD, r == 0 ? Role::producer : Role::consumer, o);
    CHECK(s.producers() == std::vector<int>{0});
    CHECK(static_cast<int>(s.consumers().size()) == W - 1);
    const int C = W - 1, N = 40;
    long long got = 0;
    if (r == 0) {
      CHECK(contains(error_of<InvalidArgument>([&] { draw_batch(s, 1); }), "not a consumer"));
      for (int k = 0; k < N; ++k)
        REQUIRE(put_sample(s, k));
      s.end_of_stream();
      CHECK(s.ended());
      CHECK(s.stats().produced == N);
    } else {
      CHECK(contains(error_of<InvalidArgument>([&] { put_sample(s, 0); }), "not a producer"));
      std::int64_t next = r - 1;  // the producer's k-th goes to consumer k mod C
      for (Batch b = draw_batch(s, 3); b.n > 0; b = draw_batch(s, 3)) {
        check_values(b);
        for (const SampleMeta& m : b.meta) {
          CHECK(m.rank == 0);
          CHECK(m.tag == next);  // FIFO, one producer: in the order put
          next += C;
        }
        got += b.n;
      }
      CHECK(s.ended());
      CHECK(got == (N - (r - 1) + C - 1) / C);
    }
    CHECK(sum_over_ranks(got) == N);
    s.close();
  }
  SUBCASE("one consumer: each batch one sample of every producer") {
    if (W < 3) {
      MESSAGE("needs 3 ranks; skipped on 2");
      return;
    }
    const int P = W - 1, N = 8;
    SampleStore s(MPI_COMM_WORLD, r == 0 ? Role::consumer : Role::producer,
                  x_options(Policy::fifo, Delivery::lossless, "one consumer"));
    CHECK(s.consumers() == std::vector<int>{0});
    if (r == 0) {
      for (int batch = 0; batch < N; ++batch) {
        const Batch b = draw_batch(s, P);
        REQUIRE(b.n == P);
        check_values(b);
        for (int p = 0; p < P; ++p) {
          CHECK(b.meta[static_cast<std::size_t>(p)].rank == p + 1);
          CHECK(b.meta[static_cast<std::size_t>(p)].tag == batch);
        }
      }
      CHECK(draw_batch(s, P).n == 0);
      CHECK(s.ended());
    } else {
      for (int k = 0; k < N; ++k)
        REQUIRE(put_sample(s, k));
      s.end_of_stream();
    }
    s.close();
  }
  SUBCASE("nonblocking: what was sent is what was ingested") {
    StoreOptions o = x_options(Policy::reservoir, Delivery::nonblocking, "mpmd nonblocking");
    o.in_flight = 2;
    o.capacity = 16;
    SampleStore s(MPI_COMM_WORLD, r == 0 ? Role::producer : Role::consumer, o);
    const int N = 200;
    if (r == 0) {
      long long sent = 0;
      for (int k = 0; k < N; ++k)
        sent += put_sample(s, k) ? 1 : 0;
      s.end_of_stream();
      CHECK(s.stats().produced == sent);
      CHECK(s.stats().produced + s.stats().dropped == N);
    } else {
      for (Batch b = draw_batch(s, 4); b.n > 0; b = draw_batch(s, 4))
        check_values(b);
      CHECK(s.ended());
    }
    const StoreStats st = s.stats();
    CHECK(sum_over_ranks(st.produced) == sum_over_ranks(st.ingested));
    s.close();
  }
}

TEST_CASE("nonblocking, every rank both: each consumer holds samples of every producer") {
  const int W = test::world_size();
  StoreOptions o = x_options(Policy::reservoir, Delivery::nonblocking, "mixing nonblocking");
  o.capacity = 10000;  // nothing evicted: the drain gives everything ingested
  o.in_flight = 2;
  SampleStore s(MPI_COMM_WORLD, Role::both, o);
  const int N = 30;
  for (int k = 0; k < N; ++k) {
    put_sample(s, k);
    s.progress();
  }
  s.end_of_stream();
  std::set<int> producers;
  for (Batch b = draw_batch(s, 8); b.n > 0; b = draw_batch(s, 8)) {
    check_values(b);
    for (const SampleMeta& m : b.meta)
      producers.insert(m.rank);
  }
  // Each producer's first in_flight samples to each consumer always find credit.
  CHECK(static_cast<int>(producers.size()) == W);
  const StoreStats st = s.stats();
  CHECK(st.produced + st.dropped == N);
  CHECK(st.produced >= std::min(N, 2 * W));
  CHECK(sum_over_ranks(st.produced) == sum_over_ranks(st.ingested));
  s.close();
}

TEST_CASE("nonblocking: a consumer that never draws gets in_flight samples, the rest dropped") {
  OwnedComm owned;
  const MPI_Comm comm = pair_of_ranks(owned);
  if (comm == MPI_COMM_NULL) return;  // ranks 2 and 3
  const bool alone = test::world_size() == 1;
  const bool producer = alone || test::world_rank() == 0;
  StoreOptions o = x_options(Policy::reservoir, Delivery::nonblocking, "never drawn");
  o.in_flight = 3;
  SampleStore s(comm, alone ? Role::both : (producer ? Role::producer : Role::consumer), o);
  const int N = 20;
  if (producer) {
    int sent = 0;
    for (int k = 0; k < N; ++k)
      sent += put_sample(s, k) ? 1 : 0;
    CHECK(sent == 3);
    CHECK(s.stats().produced == 3);
    CHECK(s.stats().dropped == N - 3);
  }
  // The consumer enters close() only after the puts: close() acknowledges what arrives, so a
  // producer still putting would get its credit back there.
  MPI_Barrier(comm);
  s.close();  // the consumer receives them
  if (!producer || alone) CHECK(s.stats().ingested == 3);
}

TEST_CASE("lossless: the end of stream drains the reservoir without replacement, then 0") {
  const int W = test::world_size();
  StoreOptions o = x_options(Policy::reservoir, Delivery::lossless, "drain");
  o.capacity = 4;
  SampleStore s(MPI_COMM_WORLD, Role::both, o);
  for (int k = 0; k < 3 * W; ++k)
    REQUIRE(put_sample(s, k));  // 3 to each consumer
  s.end_of_stream();
  std::vector<std::int64_t> counts;
  Batch last;
  for (int i = 0; i < 100; ++i) {
    Batch b = draw_batch(s, 5);
    check_values(b);
    counts.push_back(b.n);
    if (b.n == 0) break;
    last = std::move(b);
  }
  REQUIRE(!counts.empty());
  CHECK(counts.back() == 0);
  REQUIRE(counts.size() >= 2);
  // The drain: at most the capacity, each sample once.
  CHECK(last.n <= 4);
  std::set<std::pair<int, std::int64_t>> distinct;
  for (const SampleMeta& m : last.meta)
    distinct.emplace(m.rank, m.tag);
  CHECK(static_cast<std::int64_t>(distinct.size()) == last.n);
  CHECK(s.ended());
  CHECK(draw_batch(s, 5).n == 0);
  const StoreStats st = s.stats();
  CHECK(st.ingested == 3 * W);
  CHECK(st.evicted + st.rejected == std::max(0, 3 * W - 4));
  const std::size_t message = 32 + s.sample_bytes();
  CHECK(s.bytes() <= 4 * s.sample_bytes() +
                         static_cast<std::size_t>(2 * W * o.in_flight) * message +
                         s.sample_bytes() + static_cast<std::size_t>(W) * 40);
  s.close();
}

TEST_CASE("strided, column-major and negative-stride puts draw the values of a contiguous put") {
  const int W = test::world_size();
  const int r = test::world_rank();
  StoreOptions o;
  o.fields = {Field{"a", {3, 4}, DType::f32, false, false}};
  o.policy = Policy::fifo;
  o.delivery = Delivery::lossless;
  o.in_flight = 8;
  o.name = "layouts";
  SampleStore s(MPI_COMM_WORLD, Role::both, o);
  auto a = [](int rank, std::int64_t k, int i, int j) {
    return static_cast<float>(rank * 100 + k * 10 + i) + 0.25f * static_cast<float>(j);
  };
  // k = 0: contiguous; 1: column-major (strides {1, 3}); 2: every second element of a 6 x 8
  // array; 3: rows reversed in memory (stride -4).
  float contiguous[12], column_major[12], big[48] = {}, reversed[12];
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) {
      contiguous[i * 4 + j] = a(r, 0, i, j);
      column_major[i + 3 * j] = a(r, 1, i, j);
      big[(2 * i) * 8 + 2 * j] = a(r, 2, i, j);
      reversed[(2 - i) * 4 + j] = a(r, 3, i, j);
    }
  REQUIRE(s.put(0, 0, {ArrayView{contiguous, DType::f32, {3, 4}, {}}}));
  REQUIRE(s.put(1, 1, {ArrayView{column_major, DType::f32, {3, 4}, {1, 3}}}));
  REQUIRE(s.put(2, 2, {ArrayView{big, DType::f32, {3, 4}, {16, 2}}}));
  REQUIRE(s.put(3, 3, {ArrayView{reversed + 8, DType::f32, {3, 4}, {-4, 1}}}));
  s.end_of_stream();
  long long drawn = 0;
  for (;;) {
    float out[2 * 12];
    std::vector<SampleMeta> meta;
    const std::int64_t n = s.draw(2, {MutableArrayView{out, DType::f32, {2, 3, 4}}}, &meta);
    if (n == 0) break;
    for (std::int64_t b = 0; b < n; ++b)
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 4; ++j)
          CHECK(out[b * 12 + i * 4 + j] == a(meta[static_cast<std::size_t>(b)].rank,
                                             meta[static_cast<std::size_t>(b)].tag, i, j));
    drawn += n;
  }
  CHECK(sum_over_ranks(drawn) == 4LL * W);
  s.close();
}

TEST_CASE("a field of 9 dims put column-major draws the values of its row-major layout") {
  // More dims than pack.cpp keeps without a heap allocation (8), and extent-1 dims among them.
  const std::vector<std::int64_t> shape{2, 1, 3, 1, 2, 1, 2, 1, 2};
  std::int64_t n = 1;
  for (std::int64_t e : shape)
    n *= e;
  std::vector<std::int64_t> column_major(shape.size());
  std::int64_t stride = 1;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    column_major[d] = stride;
    stride *= shape[d];
  }
  StoreOptions o;
  o.fields = {Field{"t", shape, DType::f32, false, false}};
  o.policy = Policy::fifo;
  o.delivery = Delivery::lossless;
  o.name = "nine dims";
  SampleStore s(MPI_COMM_SELF, Role::both, o);
  // Element e (row-major) holds e; its column-major position is sum_d index_d x stride_d.
  std::vector<float> given(static_cast<std::size_t>(n));
  for (std::int64_t e = 0; e < n; ++e) {
    std::int64_t rest = e, at = 0;
    for (std::size_t d = shape.size(); d-- > 0;) {
      at += (rest % shape[d]) * column_major[d];
      rest /= shape[d];
    }
    given[static_cast<std::size_t>(at)] = static_cast<float>(e);
  }
  REQUIRE(s.put(0, 0, {ArrayView{given.data(), DType::f32, shape, column_major}}));
  std::vector<std::int64_t> batch_shape{1};
  batch_shape.insert(batch_shape.end(), shape.begin(), shape.end());
  std::vector<float> out(static_cast<std::size_t>(n), -1.0f);
  REQUIRE(s.draw(1, {MutableArrayView{out.data(), DType::f32, batch_shape}}) == 1);
  for (std::int64_t e = 0; e < n; ++e)
    CHECK(out[static_cast<std::size_t>(e)] == static_cast<float>(e));
  s.close();
}

TEST_CASE("an f64 field kept as f32: puts take f64 or f32, draws give f32") {
  StoreOptions o;
  o.fields = {Field{"u", {2}, DType::f64, true, false}};
  o.policy = Policy::fifo;
  o.delivery = Delivery::lossless;
  o.name = "narrow";
  SampleStore s(MPI_COMM_SELF, Role::both, o);
  CHECK(s.sample_bytes() == 8);
  const double u[2] = {1.0 / 3.0, -2.0 / 3.0};
  const float v[2] = {0.5f, 0.25f};
  REQUIRE(s.put(0, 0, {ArrayView{u, DType::f64, {2}, {}}}));
  REQUIRE(s.put(1, 1, {ArrayView{v, DType::f32, {2}, {}}}));
  CHECK(contains(error_of<InvalidArgument>([&] {
                   s.put(2, 2, {ArrayView{v, DType::f16, {2}, {}}});
                 }),
                 "field 'u' expects dtype f64 (or f32; kept as f32), given f16"));
  double wide[4];
  CHECK(contains(error_of<InvalidArgument>([&] {
                   s.draw(2, {MutableArrayView{wide, DType::f64, {2, 2}}});
                 }),
                 "field 'u' gives dtype f32"));
  // A finite f64 beyond f32's range is infinite as stored: refused.
  const double huge[2] = {1e300, 0};
  CHECK(contains(error_of<InvalidArgument>([&] {
                   s.put(2, 2, {ArrayView{huge, DType::f64, {2}, {}}});
                 }),
                 "is inf (as f32)"));
  float out[4];
  REQUIRE(s.draw(2, {MutableArrayView{out, DType::f32, {2, 2}}}) == 2);
  CHECK(out[0] == static_cast<float>(1.0 / 3.0));
  CHECK(out[1] == static_cast<float>(-2.0 / 3.0));
  CHECK(out[2] == 0.5f);
  CHECK(out[3] == 0.25f);
  s.close();
}

TEST_CASE("a put with a wrong shape, dtype or count is refused naming the field") {
  StoreOptions o = x_options(Policy::fifo, Delivery::nonblocking, "checks");
  o.fields.push_back(Field{"y", {2, 2}, DType::bf16, false, false});
  SampleStore s(MPI_COMM_WORLD, Role::both, o);
  float x[4] = {};
  std::uint16_t y[4] = {};
  const std::string shape = error_of<InvalidArgument>([&] {
    s.put(0, 0, {ArrayView{x, DType::f32, {4}, {}}, ArrayView{y, DType::bf16, {2, 2}, {}}});
  });
  CHECK(contains(shape, "sample store 'checks'"));
  CHECK(contains(shape, "field 'x' expects shape [3], given [4]"));
  const std::string dtype = error_of<InvalidArgument>([&] {
    s.put(0, 0, {ArrayView{x, DType::f32, {3}, {}}, ArrayView{y, DType::f16, {2, 2}, {}}});
  });
  CHECK(contains(dtype, "field 'y' expects dtype bf16, given f16"));
  CHECK(contains(error_of<InvalidArgument>([&] {
                   s.put(0, 0, {ArrayView{x, DType::f32, {3}, {}}});
                 }),
                 "put got 1 arrays for the 2 fields"));
  CHECK(contains(
      error_of<InvalidArgument>([&] {
        s.put(0, 0, {ArrayView{x, DType::f32, {3}, {1, 1}}, ArrayView{y, DType::bf16, {2, 2}, {}}});
      }),
      "field 'x' has 2 strides for a shape of 1 dims"));
  CHECK(s.stats().produced == 0);
  std::vector<float> bx(6);
  std::vector<std::uint16_t> by(8);
  CHECK(contains(error_of<InvalidArgument>([&] {
                   s.draw(2, {MutableArrayView{bx.data(), DType::f32, {2, 3}},
                              MutableArrayView{by.data(), DType::bf16, {2, 4}}});
                 }),
                 "field 'y' expects an output of shape [2, 2, 2], given [2, 4]"));
  s.close();
}

TEST_CASE("non-finite values: refused naming field, element, step and rank; or dropped") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float x[3] = {1, nan, 2};
  SUBCASE("refuse") {
    SampleStore s(MPI_COMM_SELF, Role::both,
                  x_options(Policy::fifo, Delivery::nonblocking, "refuse"));
    const std::string e = error_of<InvalidArgument>([&] {
      s.put(5, 0, {ArrayView{x, DType::f32, {3}, {}}});
    });
    CHECK(contains(e,
                   "sample store 'refuse': field 'x' element 1 (index [1]) is nan at step 5 "
                   "on rank 0"));
    CHECK(s.stats().non_finite == 1);
    CHECK(s.stats().produced == 0);
    s.close();
  }
  SUBCASE("drop") {
    StoreOptions o = x_options(Policy::fifo, Delivery::nonblocking, "drop");
    o.non_finite = NonFinite::drop;
    SampleStore s(MPI_COMM_SELF, Role::both, o);
    CHECK_FALSE(s.put(5, 0, {ArrayView{x, DType::f32, {3}, {}}}));
    x[1] = std::numeric_limits<float>::infinity();
    CHECK_FALSE(s.put(6, 0, {ArrayView{x, DType::f32, {3}, {}}}));
    x[1] = 0;
    CHECK(s.put(7, 0, {ArrayView{x, DType::f32, {3}, {}}}));
    const StoreStats st = s.stats();
    CHECK(st.non_finite == 2);
    CHECK(st.dropped == 2);
    CHECK(st.produced == 1);
    s.close();
  }
  SUBCASE("a mask holds 0 or 1") {
    StoreOptions o = x_options(Policy::fifo, Delivery::nonblocking, "mask");
    o.fields.push_back(Field{"m", {2}, DType::f32, false, true});
    SampleStore s(MPI_COMM_SELF, Role::both, o);
    const float ok[2] = {0, 1}, bad[2] = {1, 0.5f};
    x[1] = 0;
    CHECK(s.put(0, 0, {ArrayView{x, DType::f32, {3}, {}}, ArrayView{ok, DType::f32, {2}, {}}}));
    CHECK(contains(
        error_of<InvalidArgument>([&] {
          s.put(1, 0, {ArrayView{x, DType::f32, {3}, {}}, ArrayView{bad, DType::f32, {2}, {}}});
        }),
        "mask field 'm' element 1 (index [1]) is 0.5 at step 1"));
    s.close();
  }
}

TEST_CASE("moments: each consumer's Welford moments, and merged across the ranks") {
  const int W = test::world_size();
  StoreOptions o = x_options(Policy::fifo, Delivery::lossless, "moments");
  o.fields.push_back(Field{"m", {2}, DType::f32, false, true});
  o.capacity = 1000;
  o.in_flight = 8;
  SampleStore s(MPI_COMM_WORLD, Role::both, o);
  const int M = 2 * W;  // two to each consumer
  const float mask[2] = {0, 1};
  for (int k = 0; k < M; ++k) {
    float x[3];
    for (int i = 0; i < 3; ++i)
      x[i] = value(test::world_rank(), k, i);
    REQUIRE(s.put(k, k, {ArrayView{x, DType::f32, {3}, {}}, ArrayView{mask, DType::f32, {2}, {}}}));
  }
  s.end_of_stream();
  std::vector<double> mine;  // FIFO drain: every ingested sample drawn once
  for (;;) {
    float x[9], m[6];
    const std::int64_t n = s.draw(
        3, {MutableArrayView{x, DType::f32, {3, 3}}, MutableArrayView{m, DType::f32, {3, 2}}});
    if (n == 0) break;
    for (std::int64_t e = 0; e < 3 * n; ++e)
      mine.push_back(x[e]);
  }
  auto mean_std = [](const std::vector<double>& v) {
    double mean = 0, sq = 0;
    for (double x : v)
      mean += x;
    mean /= static_cast<double>(v.size());
    for (double x : v)
      sq += (x - mean) * (x - mean);
    return std::make_pair(mean, std::sqrt(sq / static_cast<double>(v.size())));
  };
  const FieldMoments local = s.moments("x");
  REQUIRE(local.count == static_cast<std::int64_t>(mine.size()));
  const std::pair<double, double> expected_local = mean_std(mine);
  CHECK(local.mean == doctest::Approx(expected_local.first).epsilon(1e-12));
  CHECK(local.stddev == doctest::Approx(expected_local.second).epsilon(1e-9));

  std::vector<double> all;
  for (int p = 0; p < W; ++p)
    for (int k = 0; k < M; ++k)
      for (int i = 0; i < 3; ++i)
        all.push_back(value(p, k, i));
  const FieldMoments global = s.global_moments("x");
  const std::pair<double, double> expected_global = mean_std(all);
  CHECK(global.count == static_cast<std::int64_t>(all.size()));
  CHECK(global.mean == doctest::Approx(expected_global.first).epsilon(1e-12));
  CHECK(global.stddev == doctest::Approx(expected_global.second).epsilon(1e-9));
  CHECK(contains(error_of<InvalidArgument>([&] { s.moments("m"); }), "is a mask"));
  CHECK(contains(error_of<InvalidArgument>([&] { s.moments("nope"); }), "no field 'nope'"));
  s.close();
}

TEST_CASE("lossless: a put that only this rank's own draws could free is refused at once") {
  StoreOptions o = x_options(Policy::fifo, Delivery::lossless, "self");
  o.in_flight = 2;
  SampleStore s(MPI_COMM_SELF, Role::both, o);
  REQUIRE(put_sample(s, 0));
  REQUIRE(put_sample(s, 1));
  CHECK(contains(error_of<InvalidArgument>([&] { put_sample(s, 2); }), "must draw before"));
  CHECK(draw_batch(s, 1).n == 1);  // frees one credit
  CHECK(put_sample(s, 2));
  s.close();
}

TEST_CASE("timeouts: CommError naming the store, the rank and the peer waited for") {
  if (test::world_size() < 2) {
    MESSAGE("needs 2 ranks; skipped on 1");
    return;
  }
  OwnedComm owned;
  const MPI_Comm comm = pair_of_ranks(owned);
  if (comm == MPI_COMM_NULL) return;
  const bool producer = test::world_rank() == 0;
  StoreOptions o = x_options(Policy::fifo, Delivery::lossless, "timeouts");
  o.in_flight = 1;
  o.timeout_s = 0.3;
  SampleStore s(comm, producer ? Role::producer : Role::consumer, o);
  if (!producer) {
    const std::string e = error_of<CommError>([&] { draw_batch(s, 1); });
    CHECK(contains(e,
                   "sample store 'timeouts' (rank 1/2, from producer rank 0) did not finish "
                   "within FULLSHARD_TIMEOUT=0.3 s"));
  }
  MPI_Barrier(comm);
  if (producer) {
    REQUIRE(put_sample(s, 0));
    const std::string e = error_of<CommError>([&] { put_sample(s, 1); });
    CHECK(contains(e, "sample store 'timeouts' (rank 0/2, for consumer rank 1)"));
  }
  MPI_Barrier(comm);
  s.close();
}

TEST_CASE("large samples (beyond MPI's eager size) arrive whole in both deliveries") {
  const int W = test::world_size();
  const int r = test::world_rank();
  const std::int64_t n = 50000;  // 200 KB
  auto big = [](int rank, std::int64_t k, std::int64_t i) {
    return static_cast<float>(rank * 100 + k) + 0.5f * static_cast<float>(i % 1000);
  };
  auto put_big = [&](SampleStore& s, std::int64_t k) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i)
      v[static_cast<std::size_t>(i)] = big(r, k, i);
    return s.put(k, k, {ArrayView{v.data(), DType::f32, {n}, {}}});
  };
  auto drain_and_check = [&](SampleStore& s) {
    long long got = 0;
    std::vector<float> out(static_cast<std::size_t>(2 * n));
    for (;;) {
      std::vector<SampleMeta> meta;
      const std::int64_t d = s.draw(2, {MutableArrayView{out.data(), DType::f32, {2, n}}}, &meta);
      if (d == 0) break;
      for (std::int64_t b = 0; b < d; ++b)
        for (std::int64_t i : {std::int64_t(0), std::int64_t(777), n - 1})
          CHECK(out[static_cast<std::size_t>(b * n + i)] ==
                big(meta[static_cast<std::size_t>(b)].rank, meta[static_cast<std::size_t>(b)].tag,
                    i));
      got += d;
    }
    return got;
  };
  StoreOptions o;
  o.fields = {Field{"big", {n}, DType::f32, false, false}};
  o.name = "large";
  o.in_flight = 2;
  SUBCASE("lossless FIFO") {
    o.policy = Policy::fifo;
    o.delivery = Delivery::lossless;
    SampleStore s(MPI_COMM_WORLD, Role::both, o);
    for (int k = 0; k < 2 * W; ++k)
      REQUIRE(put_big(s, k));
    s.end_of_stream();
    CHECK(sum_over_ranks(drain_and_check(s)) == 2LL * W * W);
    s.close();
  }
  SUBCASE("nonblocking reservoir") {
    o.policy = Policy::reservoir;
    o.delivery = Delivery::nonblocking;
    o.capacity = 100;
    SampleStore s(MPI_COMM_WORLD, Role::both, o);
    for (int k = 0; k < 3 * W; ++k) {
      put_big(s, k);
      s.progress();
    }
    s.end_of_stream();
    drain_and_check(s);
    CHECK(sum_over_ranks(s.stats().produced) == sum_over_ranks(s.stats().ingested));
    s.close();
  }
}

TEST_CASE("lossless window: a consumer holds the last `window` samples it ingested") {
  const int W = test::world_size();
  const int r = test::world_rank();
  const int M = 4;           // samples from each producer to each consumer
  const std::int64_t N = 3;  // the window
  StoreOptions o = x_options(Policy::window, Delivery::lossless, "window");
  o.capacity = 8;
  o.window = N;
  o.in_flight = M;  // every put finds credit before any draw
  SampleStore s(MPI_COMM_WORLD, Role::both, o);
  for (int k = 0; k < M * W; ++k)
    REQUIRE(put_sample(s, k));
  s.end_of_stream();
  // The order of ingestion: round robin over the producers, each in its own order; producer
  // p's j-th sample to consumer r is its put k = (r - p) mod W + j W.
  std::vector<std::pair<int, std::int64_t>> order;
  for (int j = 0; j < M; ++j)
    for (int p = 0; p < W; ++p)
      order.emplace_back(p, ((r - p) % W + W) % W + j * W);
  auto last_ingested = [&](std::int64_t ingested) {
    std::vector<std::pair<int, std::int64_t>> v(
        order.begin() + std::max<std::int64_t>(0, ingested - N), order.begin() + ingested);
    std::sort(v.begin(), v.end());
    return v;
  };
  std::vector<std::pair<int, std::int64_t>> drained;
  bool draining = false;
  std::int64_t before = 0;
  for (int i = 0; i < 100; ++i) {
    const Batch b = draw_batch(s, 2);
    check_values(b);
    const std::int64_t after = s.stats().ingested;
    draining = draining || after - before < 2;  // an ingestion came up short: the drain
    const auto held = last_ingested(after);
    for (const SampleMeta& m : b.meta) {
      CHECK(std::binary_search(held.begin(), held.end(), std::make_pair(m.rank, m.tag)));
      if (draining) drained.emplace_back(m.rank, m.tag);
    }
    before = after;
    if (b.n == 0) break;
  }
  CHECK(draining);
  CHECK(before == M * W);
  // The drain gives what the buffer held, each sample once: the last N ingested.
  std::sort(drained.begin(), drained.end());
  CHECK(drained == last_ingested(M * W));
  const StoreStats st = s.stats();
  CHECK(st.ingested == M * W);
  CHECK(st.evicted == M * W - N);
  s.close();
}

TEST_CASE("f16 and bf16 fields: contiguous and strided puts drawn bit for bit; moments") {
  const int W = test::world_size();
  const int r = test::world_rank();
  // Halves below 64: exact in f16 (11 significant bits) and bf16 (8).
  auto h = [](int rank, std::int64_t k, int i) {
    return static_cast<float>(rank * 16 + k) + 0.5f * static_cast<float>(i);
  };
  auto b = [](int rank, std::int64_t k, int i, int j) {
    return -static_cast<float>(rank * 16 + k) - 0.5f * static_cast<float>(3 * i + j);
  };
  StoreOptions o;
  o.fields = {Field{"h", {4}, DType::f16, false, false},
              Field{"b", {2, 3}, DType::bf16, false, false}};
  o.policy = Policy::fifo;
  o.delivery = Delivery::lossless;
  o.in_flight = 2;
  o.name = "half";
  SampleStore s(MPI_COMM_WORLD, Role::both, o);
  CHECK(s.sample_bytes() == 24);  // h: 8 bytes at 0; b: 12 bytes at 8; rounded to 8
  const int K = 2 * W;            // two to each consumer
  for (int k = 0; k < K; ++k) {
    // Even k contiguous; odd k: h every second element of 8, b column-major.
    std::uint16_t hs[8] = {}, bs[6] = {};
    for (int i = 0; i < 4; ++i)
      hs[k % 2 ? 2 * i : i] = float_to_f16(h(r, k, i));
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j)
        bs[k % 2 ? i + 2 * j : 3 * i + j] = float_to_bf16(b(r, k, i, j));
    const std::vector<std::int64_t> h_strides =
        k % 2 ? std::vector<std::int64_t>{2} : std::vector<std::int64_t>{};
    const std::vector<std::int64_t> b_strides =
        k % 2 ? std::vector<std::int64_t>{1, 2} : std::vector<std::int64_t>{};
    REQUIRE(s.put(k, k,
                  {ArrayView{hs, DType::f16, {4}, h_strides},
                   ArrayView{bs, DType::bf16, {2, 3}, b_strides}}));
  }
  s.end_of_stream();
  long long drawn = 0;
  for (;;) {
    std::uint16_t hb[2 * 4], bb[2 * 6];
    std::vector<SampleMeta> meta;
    const std::int64_t n = s.draw(
        2, {MutableArrayView{hb, DType::f16, {2, 4}}, MutableArrayView{bb, DType::bf16, {2, 2, 3}}},
        &meta);
    if (n == 0) break;
    for (std::int64_t row = 0; row < n; ++row) {
      const SampleMeta& m = meta[static_cast<std::size_t>(row)];
      for (int i = 0; i < 4; ++i) {
        CHECK(hb[row * 4 + i] == float_to_f16(h(m.rank, m.tag, i)));
        CHECK(f16_to_float(hb[row * 4 + i]) == h(m.rank, m.tag, i));
      }
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 3; ++j)
          CHECK(bf16_to_float(bb[row * 6 + 3 * i + j]) == b(m.rank, m.tag, i, j));
    }
    drawn += n;
  }
  CHECK(sum_over_ranks(drawn) == 1LL * K * W);
  // Every value of every sample: the moments of the 16-bit fields, merged over the consumers.
  std::vector<double> hv, bv;
  for (int p = 0; p < W; ++p)
    for (int k = 0; k < K; ++k) {
      for (int i = 0; i < 4; ++i)
        hv.push_back(h(p, k, i));
      for (int e = 0; e < 6; ++e)
        bv.push_back(b(p, k, e / 3, e % 3));
    }
  for (const auto& [name, values] : {std::make_pair("h", hv), std::make_pair("b", bv)}) {
    double mean = 0, sq = 0;
    for (double x : values)
      mean += x;
    mean /= static_cast<double>(values.size());
    for (double x : values)
      sq += (x - mean) * (x - mean);
    const FieldMoments g = s.global_moments(name);
    CHECK(g.count == static_cast<std::int64_t>(values.size()));
    CHECK(g.mean == doctest::Approx(mean).epsilon(1e-12));
    CHECK(g.stddev ==
          doctest::Approx(std::sqrt(sq / static_cast<double>(values.size()))).epsilon(1e-9));
  }
  s.close();

  // A 16-bit infinity or NaN is found like a 32-bit one.
  SampleStore checks(MPI_COMM_SELF, Role::both, [&] {
    StoreOptions c = o;
    c.delivery = Delivery::nonblocking;
    c.name = "half checks";
    return c;
  }());
  std::uint16_t hs[4] = {0, 0, 0x7c00u, 0}, bs[6] = {};
  CHECK(contains(error_of<InvalidArgument>([&] {
                   checks.put(3, 0,
                              {ArrayView{hs, DType::f16, {4}, {}},
                               ArrayView{bs, DType::bf16, {2, 3}, {}}});
                 }),
                 "field 'h' element 2 (index [2]) is inf at step 3"));
  hs[2] = 0;
  bs[4] = 0x7fc0u;
  CHECK(contains(error_of<InvalidArgument>([&] {
                   checks.put(4, 0,
                              {ArrayView{hs, DType::f16, {4}, {}},
                               ArrayView{bs, DType::bf16, {2, 3}, {}}});
                 }),
                 "field 'b' element 4 (index [1, 1]) is nan at step 4"));
  CHECK(checks.stats().non_finite == 2);
  CHECK(checks.stats().produced == 0);
  checks.close();
}

TEST_CASE("bytes(): the send rings, the staging and the buffer, and nothing else") {
  const int W = test::world_size();
  const int r = test::world_rank();
  StoreOptions o = x_options(Policy::fifo, Delivery::lossless, "bytes");
  o.capacity = 10;  // under the buffer's first allocation (16 slots): allocated whole
  o.in_flight = 3;
  const std::size_t sample = 16;            // 3 x f32, rounded to 8 bytes
  const std::size_t message = 32 + sample;  // a header, then the sample
  const std::size_t ring = 3 * message;     // in_flight messages
  const std::size_t buffer = 10 * sample;   // capacity samples
  SUBCASE("every rank both: W rings + W staging rings + the buffer") {
    SampleStore s(MPI_COMM_WORLD, Role::both, o);
    REQUIRE(s.sample_bytes() == sample);
    CHECK(s.bytes() == 0);  // nothing before the first sample
    for (int k = 0; k < W; ++k)
      REQUIRE(put_sample(s, k));  // one to each consumer: every ring allocated
    CHECK(s.bytes() ==
          static_cast<std::size_t>(W) * ring);  // no scratch: a put packs into its ring slot
    CHECK(draw_batch(s, W).n == W);  // one from each producer: every staging ring allocated
    const std::size_t expected = 2 * static_cast<std::size_t>(W) * ring + buffer;
    CHECK(s.bytes() == expected);
    for (int step = 1; step < 4; ++step) {  // steady state: no growth
      for (int k = 0; k < W; ++k)
        REQUIRE(put_sample(s, step * W + k));
      CHECK(draw_batch(s, W).n == W);
    }
    CHECK(s.bytes() == expected);
    CHECK(s.stats().bytes == expected);
    s.close();
  }
  SUBCASE("one producer: its rings only; a consumer: one staging ring and the buffer") {
    if (W < 2) {
      MESSAGE("needs 2 ranks; skipped on 1");
      return;
    }
    SampleStore s(MPI_COMM_WORLD, r == 0 ? Role::producer : Role::consumer, o);
    if (r == 0) {
      for (int k = 0; k < W - 1; ++k)
        REQUIRE(put_sample(s, k));  // one to each consumer
      CHECK(s.bytes() == static_cast<std::size_t>(W - 1) * ring);
    } else {
      CHECK(s.bytes() == 0);
      CHECK(draw_batch(s, 1).n == 1);
      CHECK(s.bytes() == ring + buffer);
    }
    s.close();
  }
}

TEST_CASE("a refused put leaves its send slot unsent: the stream goes on as if it was not made") {
  const int W = test::world_size();
  const int r = test::world_rank();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  SUBCASE("lossless, one slot per consumer: a dropped sample, then the next in its slot") {
    StoreOptions o = x_options(Policy::fifo, Delivery::lossless, "refused slot");
    o.in_flight = 1;
    o.non_finite = NonFinite::drop;
    o.fields.push_back(Field{"m", {1}, DType::f32, false, true});
    SampleStore s(MPI_COMM_WORLD, Role::both, o);
    const float x_nan[3] = {0, 0, nan}, ok_mask[1] = {1}, bad_mask[1] = {2};
    for (int k = 0; k < W; ++k) {
      // Each claims consumer (r + k) mod W's one slot, and leaves it unsent.
      CHECK_FALSE(s.put(
          k, k, {ArrayView{x_nan, DType::f32, {3}, {}}, ArrayView{ok_mask, DType::f32, {1}, {}}}));
      float x[3];
      for (int i = 0; i < 3; ++i)
        x[i] = value(r, k, i);
      CHECK(contains(error_of<InvalidArgument>([&] {
                       s.put(k, k,
                             {ArrayView{x, DType::f32, {3}, {}},
                              ArrayView{bad_mask, DType::f32, {1}, {}}});
                     }),
                     "mask field 'm' element 0 (index [0]) is 2"));
      REQUIRE(s.put(k, k,
                    {ArrayView{x, DType::f32, {3}, {}}, ArrayView{ok_mask, DType::f32, {1}, {}}}));
    }
    // One sample of every producer, the one each put to this consumer.
    std::vector<float> xb(static_cast<std::size_t>(3 * W)), mb(static_cast<std::size_t>(W));
    std::vector<SampleMeta> meta;
    REQUIRE(s.draw(W,
                   {MutableArrayView{xb.data(), DType::f32, {W, 3}},
                    MutableArrayView{mb.data(), DType::f32, {W, 1}}},
                   &meta) == W);
    for (int p = 0; p < W; ++p) {
      const SampleMeta& m = meta[static_cast<std::size_t>(p)];
      CHECK(m.rank == p);
      CHECK(m.tag == ((r - p) % W + W) % W);
      CHECK(xb[static_cast<std::size_t>(3 * p)] == value(p, m.tag, 0));
      CHECK(mb[static_cast<std::size_t>(p)] == 1.0f);
    }
    const StoreStats st = s.stats();
    CHECK(st.produced == W);
    CHECK(st.dropped == W);
    CHECK(st.non_finite == W);
    s.close();
  }
  SUBCASE("nonblocking: a sample with no credit is dropped before its values are looked at") {
    StoreOptions o = x_options(Policy::fifo, Delivery::nonblocking, "no credit");
    o.in_flight = 1;  // NonFinite::refuse
    SampleStore s(MPI_COMM_SELF, Role::both, o);
    const float x_nan[3] = {0, nan, 0};
    REQUIRE(put_sample(s, 0, 0));                                       // the one credit
    CHECK_FALSE(s.put(1, 1, {ArrayView{x_nan, DType::f32, {3}, {}}}));  // dropped, not refused
    CHECK(s.stats().dropped == 1);
    CHECK(s.stats().non_finite == 0);
    s.progress();  // ingests sample 0: the credit is back
    CHECK(contains(error_of<InvalidArgument>([&] {
                     s.put(2, 2, {ArrayView{x_nan, DType::f32, {3}, {}}});
                   }),
                   "element 1 (index [1]) is nan at step 2"));
    CHECK(s.stats().non_finite == 1);
    REQUIRE(put_sample(s, 3, 0));
    CHECK(s.stats().produced == 2);
    s.close();
  }
}

TEST_CASE("the ranks agree on the options; bad options and missing roles are refused") {
  const int W = test::world_size();
  const int r = test::world_rank();
  StoreOptions o = x_options(Policy::fifo, Delivery::nonblocking, "agreement");
  if (W >= 2) {
    StoreOptions differ = o;
    if (r == 1) differ.capacity = 65;
    const std::string e =
        error_of<RankMismatch>([&] { SampleStore s(MPI_COMM_WORLD, Role::both, differ); });
    CHECK(contains(e, "sample store 'agreement': the options differ across ranks"));
    CHECK(contains(e, "rank 0 has \"capacity = 64\"; rank 1 has \"capacity = 65\""));
  }
  StoreOptions bad = o;
  bad.capacity = 0;
  CHECK(contains(error_of<InvalidArgument>([&] { SampleStore s(MPI_COMM_WORLD, Role::both, bad); }),
                 "sample store 'agreement': bad options on rank 0: capacity 0"));
  for (std::int64_t m : {std::int64_t(0), std::int64_t(65)}) {
    StoreOptions min = o;
    min.min_samples = m;
    CHECK(
        contains(error_of<InvalidArgument>([&] { SampleStore s(MPI_COMM_WORLD, Role::both, min); }),
                 "min_samples " + std::to_string(m) +
                     ": expected 1 to the buffer's bound (the capacity 64)"));
  }
  StoreOptions min_window = o;
  min_window.policy = Policy::window;
  min_window.window = 8;
  min_window.min_samples = 9;
  CHECK(contains(
      error_of<InvalidArgument>([&] { SampleStore s(MPI_COMM_WORLD, Role::both, min_window); }),
      "min_samples 9: expected 1 to the buffer's bound (the window 8)"));
  StoreOptions window = o;
  window.policy = Policy::window;
  window.window = 65;
  CHECK(contains(
      error_of<InvalidArgument>([&] { SampleStore s(MPI_COMM_WORLD, Role::both, window); }),
      "window 65"));
  StoreOptions twice = o;
  twice.fields.push_back(twice.fields.front());
  CHECK(
      contains(error_of<InvalidArgument>([&] { SampleStore s(MPI_COMM_WORLD, Role::both, twice); }),
               "two fields named 'x'"));
  CHECK(
      contains(error_of<InvalidArgument>([&] { SampleStore s(MPI_COMM_WORLD, Role::producer, o); }),
               "no consumer"));
  CHECK(
      contains(error_of<InvalidArgument>([&] { SampleStore s(MPI_COMM_WORLD, Role::consumer, o); }),
               "no producer"));
}

TEST_CASE("bad options on some ranks: InvalidArgument on every rank with the first one's problem") {
  const int W = test::world_size();
  const int r = test::world_rank();
  StoreOptions o = x_options(Policy::fifo, Delivery::nonblocking, "bad somewhere");
  SUBCASE("the last rank's capacity, and options that also differ elsewhere") {
    // The last rank's options are bad, rank 1's only differ: every rank is told the last
    // rank's problem (InvalidArgument, not the RankMismatch that the difference would be).
    StoreOptions mine = o;
    if (r == W - 1) mine.capacity = 0;
    if (r == 1 && W > 2) mine.seed = 99;
    const std::string e =
        error_of<InvalidArgument>([&] { SampleStore s(MPI_COMM_WORLD, Role::both, mine); });
    CHECK(contains(e, "sample store 'bad somewhere': bad options on rank " + std::to_string(W - 1) +
                          ": capacity 0: a buffer holds at least 1 sample"));
  }
  SUBCASE("two ranks with different problems: the first one's") {
    StoreOptions mine = o;
    if (r == W - 1) mine.in_flight = 0;
    if (r == W / 2) mine.fields.clear();  // rank 0 on one rank, else a middle one
    const std::string e =
        error_of<InvalidArgument>([&] { SampleStore s(MPI_COMM_WORLD, Role::both, mine); });
    if (W == 1)
      CHECK(contains(e, "bad options on rank 0: no fields: a sample needs at least one"));
    else
      CHECK(contains(e, "bad options on rank " + std::to_string(W / 2) +
                            ": no fields: a sample needs at least one"));
  }
  SUBCASE("a binding's refusal on one rank carries its text to every rank") {
    StoreOptions mine = o;
    if (r == 0) mine.binding_refusal = "options->fields[0] ('x'): ndim is 9; expected 0 to 8";
    const std::string e =
        error_of<InvalidArgument>([&] { SampleStore s(MPI_COMM_WORLD, Role::both, mine); });
    CHECK(contains(e,
                   "sample store 'bad somewhere': bad options on rank 0: options->fields[0] "
                   "('x'): ndim is 9; expected 0 to 8"));
  }
  // Afterwards the ranks are still in step: a store with good options works.
  SampleStore s(MPI_COMM_WORLD, Role::both, o);
  CHECK(s.consumers().size() == static_cast<std::size_t>(W));
  s.close();
}

TEST_CASE(
    "the header's example runs as written: every rank both, a put per cell, a draw per step") {
  const int W = test::world_size();
  const int r = test::world_rank();
  const int steps = 20;
  // x = value(rank, k), y = -value(rank, k), k = step * cells + cell: every drawn sample checked.
  auto run = [&](Policy policy, Delivery delivery, int cells) {
    StoreOptions o;
    o.fields = {Field{"x", {3}}, Field{"y", {2}}};
    o.policy = policy;
    o.delivery = delivery;
    if (policy == Policy::window) o.window = 16;
    if (delivery == Delivery::lossless) o.ingest_per_draw = cells;  // what each consumer gets
    o.timeout_s = 60;
    o.name = "example";
    SampleStore samples(MPI_COMM_WORLD, Role::both, o);
    float xb[32][3], yb[32][2];
    const std::vector<MutableArrayView> batch = {{xb, DType::f32, {32, 3}},
                                                 {yb, DType::f32, {32, 2}}};
    std::vector<SampleMeta> meta;
    auto check_batch = [&](std::int64_t n) {
      REQUIRE(meta.size() == static_cast<std::size_t>(n));
      for (std::int64_t b = 0; b < n; ++b) {
        const SampleMeta& m = meta[static_cast<std::size_t>(b)];
        REQUIRE((m.step >= 0 && m.step < steps && m.tag >= 0 && m.tag < cells));
        const std::int64_t k = m.step * cells + m.tag;
        for (int i = 0; i < 3; ++i)
          CHECK(xb[b][i] == value(m.rank, k, i));
        for (int i = 0; i < 2; ++i)
          CHECK(yb[b][i] == -value(m.rank, k, i));
      }
    };
    for (std::int64_t step = 0; step < steps; ++step) {
      for (std::int64_t cell = 0; cell < cells; ++cell) {  // every sampled cell of the step
        float x[3], y[2];
        for (int i = 0; i < 3; ++i)
          x[i] = value(r, step * cells + cell, i);
        for (int i = 0; i < 2; ++i)
          y[i] = -value(r, step * cells + cell, i);
        samples.put(step, cell, {{x, DType::f32, {3}, {}}, {y, DType::f32, {2}, {}}});
      }
      const std::int64_t n = samples.draw(32, batch, &meta);
      CHECK(n == 32);  // with replacement from what arrived
      check_batch(n);
    }
    samples.end_of_stream();
    // Nonblocking: once every end marker arrived (ended()), every draw drains, so the draws
    // below give what the buffer holds, each sample once. (Lossless drains from the first draw
    // whose ingestion comes up short; the draws before it are with replacement.)
    if (delivery == Delivery::nonblocking)
      while (!samples.ended())
        samples.progress();
    std::int64_t after = 0;
    std::set<std::pair<int, std::int64_t>> distinct;
    for (std::int64_t n = samples.draw(32, batch, &meta); n > 0;
         n = samples.draw(32, batch, &meta)) {
      check_batch(n);
      after += n;
      for (const SampleMeta& m : meta)
        distinct.emplace(m.rank, m.step * cells + m.tag);
    }
    CHECK(samples.ended());
    const StoreStats st = samples.stats();
    CHECK(st.produced + st.dropped == steps * cells);
    if (delivery == Delivery::lossless) CHECK(st.dropped == 0);
    CHECK(sum_over_ranks(st.produced) == sum_over_ranks(st.ingested));
    CHECK(st.drawn == steps * 32 + after);
    if (delivery == Delivery::nonblocking) {
      CHECK(after == std::min<std::int64_t>(st.ingested, policy == Policy::window ? 16 : 1024));
      CHECK(static_cast<std::int64_t>(distinct.size()) == after);
    }
    samples.close();
    CHECK(samples.stats().discarded_at_close == 0);
  };
  SUBCASE("nonblocking reservoir (the defaults), 6 cells a step") {
    run(Policy::reservoir, Delivery::nonblocking, 6);
  }
  SUBCASE("nonblocking window, 6 cells a step") {
    run(Policy::window, Delivery::nonblocking, 6);
  }
  SUBCASE("lossless reservoir, 2 cells a step for each consumer") {
    run(Policy::reservoir, Delivery::lossless, 2 * W);
  }
}

TEST_CASE("a draw that only this rank's own puts could supply is refused at once") {
  SUBCASE("nonblocking reservoir on one rank: min_samples, then with replacement") {
    StoreOptions o = x_options(Policy::reservoir, Delivery::nonblocking, "self draw");
    o.min_samples = 3;
    SampleStore s(MPI_COMM_SELF, Role::both, o);
    CHECK(contains(error_of<InvalidArgument>([&] { draw_batch(s, 5); }),
                   "a draw waits for 3 samples (min_samples) and the buffer holds 0; only this "
                   "rank's own puts could bring more (it is the store's only producer"));
    REQUIRE(put_sample(s, 0, 0));
    REQUIRE(put_sample(s, 1, 0));
    CHECK(contains(error_of<InvalidArgument>([&] { draw_batch(s, 5); }),
                   "a draw waits for 3 samples (min_samples) and the buffer holds 2"));
    REQUIRE(put_sample(s, 2, 0));
    const Batch b = draw_batch(s, 5);  // 5 drawn with replacement from the 3 held
    REQUIRE(b.n == 5);
    check_values(b);
    for (const SampleMeta& m : b.meta)
      CHECK((m.tag >= 0 && m.tag <= 2));
    CHECK(s.stats().drawn == 5);
    CHECK(s.stats().reused >= 2);
    s.close();
  }
  SUBCASE("nonblocking FIFO on one rank: the whole batch") {
    StoreOptions o = x_options(Policy::fifo, Delivery::nonblocking, "self fifo");
    SampleStore s(MPI_COMM_SELF, Role::both, o);
    REQUIRE(put_sample(s, 0, 0));
    REQUIRE(put_sample(s, 1, 0));
    CHECK(contains(error_of<InvalidArgument>([&] { draw_batch(s, 3); }),
                   "a draw waits for 3 samples (FIFO: its whole batch) and the buffer holds 2"));
    const Batch b = draw_batch(s, 2);
    REQUIRE(b.n == 2);
    CHECK(b.meta[0].tag == 0);
    CHECK(b.meta[1].tag == 1);
    s.end_of_stream();
    CHECK(draw_batch(s, 3).n == 0);  // ended: a drain, not a refusal
    s.close();
  }
  SUBCASE("lossless on one rank: the next sample in order is this rank's own") {
    StoreOptions o = x_options(Policy::reservoir, Delivery::lossless, "self lossless");
    SampleStore s(MPI_COMM_SELF, Role::both, o);
    CHECK(contains(error_of<InvalidArgument>([&] { draw_batch(s, 2); }),
                   "a lossless draw waits for this rank's own next sample"));
    REQUIRE(put_sample(s, 0, 0));
    // One ingested, the second of the draw's two is again this rank's own next sample.
    CHECK(contains(error_of<InvalidArgument>([&] { draw_batch(s, 2); }),
                   "which only its own next put could bring"));
    CHECK(s.stats().ingested == 1);  // the refused draw kept what it had ingested
    REQUIRE(put_sample(s, 1, 0));
    REQUIRE(put_sample(s, 2, 0));
    const Batch b = draw_batch(s, 2);  // ingests 2 more
    CHECK(b.n == 2);
    check_values(b);
    CHECK(s.stats().ingested == 3);
    s.close();
  }
  SUBCASE("every rank: rank 0 produces and consumes, the others only consume") {
    if (test::world_size() < 2) {
      MESSAGE("needs 2 ranks; skipped on 1");
      return;
    }
    StoreOptions o = x_options(Policy::reservoir, Delivery::nonblocking, "one producer");
    SampleStore s(MPI_COMM_WORLD, test::world_rank() == 0 ? Role::both : Role::consumer, o);
    if (test::world_rank() == 0)
      CHECK(contains(error_of<InvalidArgument>([&] { draw_batch(s, 4); }),
                     "it is the store's only producer"));
    s.close();
  }
}

TEST_CASE("lossless close: consumers that close while a producer still puts let its puts finish") {
  const int W = test::world_size();
  const int r = test::world_rank();
  StoreOptions o = x_options(Policy::fifo, Delivery::lossless, "closing early");
  o.in_flight = 2;
  o.timeout_s = 60;
  if (W == 1) {
    // What is staged at close() is discarded, not ingested, and counted.
    SampleStore s(MPI_COMM_SELF, Role::both, o);
    REQUIRE(put_sample(s, 0));
    REQUIRE(put_sample(s, 1));
    CHECK(draw_batch(s, 1).n == 1);  // ingests sample 0
    REQUIRE(put_sample(s, 2));
    s.close();
    const StoreStats st = s.stats();
    CHECK(st.ingested == 1);
    CHECK(st.drawn == 1);
    CHECK(st.discarded_at_close == 2);
    CHECK(s.moments("x").count == 3);  // sample 0 only
    return;
  }
  // Rank 0 produces; every other rank consumes one sample and closes, while rank 0 still puts
  // ten times the credit of every consumer: each put completes (a closing consumer
  // acknowledges what arrives and discards it), then rank 0 closes too.
  const int C = W - 1;
  const int N = 10 * 2 * C;
  SampleStore s(MPI_COMM_WORLD, r == 0 ? Role::producer : Role::consumer, o);
  if (r == 0) {
    for (int k = 0; k < N; ++k)
      REQUIRE(put_sample(s, k));
    CHECK(s.stats().produced == N);
  } else {
    const Batch b = draw_batch(s, 1);
    REQUIRE(b.n == 1);
    CHECK(b.meta[0].tag == r - 1);  // the producer's k-th goes to consumer k mod C
  }
  s.close();
  const StoreStats st = s.stats();
  if (r != 0) {
    CHECK(st.ingested == 1);
    CHECK(st.discarded_at_close == N / C - 1);
    CHECK(s.moments("x").count == 3);
  }
  CHECK(sum_over_ranks(st.ingested + st.discarded_at_close) == N);
  CHECK(sum_over_ranks(st.produced) == N);
}

// Last in the file: the stores below end without close(), as on an error path, and leave
// messages to MPI.
TEST_CASE("a store destroyed without close() neither waits nor throws") {
  const int W = test::world_size();
  StoreOptions o;
  o.fields = {Field{"big", {50000}, DType::f32, false, false}};
  o.name = "no close";
  o.in_flight = 2;
  std::vector<float> v(50000, 1.0f);
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  {
    SampleStore s(MPI_COMM_WORLD, Role::both, o);
    for (int k = 0; k < 2 * W; ++k)  // two to each consumer: within the credit, all sent
      CHECK(s.put(k, k, {ArrayView{v.data(), DType::f32, {50000}, {}}}));
    s.progress();
    const StoreStats st = s.stats();
    CHECK(st.produced == 2 * W);
    CHECK(st.dropped == 0);
    CHECK(st.ingested <= 2 * W);  // what arrived so far, from W producers
    // The rings, one per consumer; staging rings only for producers whose samples arrived.
    const std::size_t ring = 2 * (32 + s.sample_bytes());
    CHECK(st.bytes >= static_cast<std::size_t>(W) * ring);
    CHECK(st.bytes <= 2 * static_cast<std::size_t>(W) * ring + 16 * s.sample_bytes());
  }  // sends in flight: their buffers are kept until MPI_Finalize
  // The ranks go on: a collective and a ring exchange on another duplicate of the world
  // complete on every rank with the right values (no store message is matched there).
  int sum = 0;
  const int mine = test::world_rank() + 1;
  MPI_Allreduce(&mine, &sum, 1, MPI_INT, MPI_SUM, dup);
  CHECK(sum == W * (W + 1) / 2);
  const int r = test::world_rank();
  int got = -1;
  MPI_Sendrecv(&mine, 1, MPI_INT, (r + 1) % W, 7, &got, 1, MPI_INT, (r + W - 1) % W, 7, dup,
               MPI_STATUS_IGNORE);
  CHECK(got == (r + W - 1) % W + 1);
  // And a new store on the same communicator works end to end.
  StoreOptions small = x_options(Policy::fifo, Delivery::lossless, "after no close");
  small.timeout_s = 60;
  SampleStore after(MPI_COMM_WORLD, Role::both, small);
  for (int k = 0; k < W; ++k)
    REQUIRE(put_sample(after, k));
  const Batch b = draw_batch(after, W);
  CHECK(b.n == W);
  check_values(b);
  after.close();
  MPI_Comm_free(&dup);
}
