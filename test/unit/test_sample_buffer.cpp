// The consumer's sample buffer (lib/store/sample_buffer.hpp), without MPI: FIFO order and
// bound, reservoir uniformity (algorithm R) over many seeds, the window's contents and its
// uniform draws, evictions, reuse, staleness, the drain, determinism for a seed, the
// memory bound, and admit() (the slot the store fills in its own pass) against ingest().
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "lib/store/sample_buffer.hpp"

using fullshard::store::BufferOptions;
using fullshard::store::Policy;
using fullshard::store::SampleBuffer;
using fullshard::store::SampleMeta;
using fullshard::store::uniform_below;

namespace {

BufferOptions options(Policy policy, std::int64_t capacity, std::int64_t window = 0,
                      std::uint64_t seed = 1, std::size_t sample_bytes = sizeof(std::int64_t)) {
  BufferOptions o;
  o.policy = policy;
  o.capacity = capacity;
  o.window = window;
  o.sample_bytes = sample_bytes;
  o.seed = seed;
  return o;
}

/// Sample i of a stream: its bytes start with i, its step and tag are i.
void ingest_position(SampleBuffer& b, std::int64_t i) {
  std::vector<std::byte> bytes(b.options().sample_bytes, std::byte{0});
  std::memcpy(bytes.data(), &i, sizeof i);
  b.ingest(bytes.data(), SampleMeta{i, 0, i});
}

/// The positions a sink was given, each checked against its bytes.
struct Collect {
  std::vector<std::int64_t> positions;
  SampleBuffer::Sink sink() {
    return [this](const std::byte* sample, const SampleMeta& meta) {
      std::int64_t i = 0;
      std::memcpy(&i, sample, sizeof i);
      CHECK(i == meta.step);
      CHECK(i == meta.tag);
      positions.push_back(i);
    };
  }
};

std::vector<std::int64_t> held(const SampleBuffer& b) {
  Collect c;
  b.visit(c.sink());
  return c.positions;
}

std::vector<std::int64_t> draws(SampleBuffer& b, std::int64_t n) {
  Collect c;
  const std::int64_t expected =
      b.options().policy == Policy::fifo ? std::min(n, b.size()) : (b.size() > 0 ? n : 0);
  CHECK(b.draw(n, c.sink()) == expected);
  return c.positions;
}

/// A 5-sigma bound on a binomial count of `trials` with probability `p`.
double five_sigma(double trials, double p) {
  return 5.0 * std::sqrt(trials * p * (1.0 - p));
}

}  // namespace

TEST_CASE("uniform_below: in range, the same for a seed, every residue equally likely") {
  std::mt19937_64 a(42), b(42);
  for (std::uint64_t n : {1ull, 2ull, 3ull, 7ull, 1000ull, (1ull << 63) + 5}) {
    for (int i = 0; i < 100; ++i) {
      const std::uint64_t x = uniform_below(a, n);
      CHECK(x < n);
      CHECK(x == uniform_below(b, n));
    }
  }
  // A power of two rejects nothing: the generator's value modulo n.
  std::mt19937_64 c(7), d(7);
  for (int i = 0; i < 100; ++i)
    CHECK(uniform_below(c, 16) == d() % 16);
  // Three residues over 30,000 draws.
  std::mt19937_64 e(3);
  std::vector<double> count(3, 0.0);
  const int n = 30000;
  for (int i = 0; i < n; ++i)
    count[uniform_below(e, 3)] += 1;
  for (double k : count)
    CHECK(std::abs(k - n / 3.0) <= five_sigma(n, 1.0 / 3.0));
}

TEST_CASE("FIFO: oldest first, bounded, pushes the oldest out when full") {
  SampleBuffer b(options(Policy::fifo, 5));
  CHECK(b.bound() == 5);
  for (std::int64_t i = 0; i < 3; ++i)
    ingest_position(b, i);
  CHECK(draws(b, 2) == std::vector<std::int64_t>{0, 1});
  CHECK(b.size() == 1);
  for (std::int64_t i = 3; i < 10; ++i) {
    ingest_position(b, i);
    CHECK(b.size() <= 5);
  }
  // 2..6 filled it; 7, 8, 9 pushed out 2, 3, 4.
  CHECK(b.counts().evicted == 3);
  CHECK(held(b) == std::vector<std::int64_t>{5, 6, 7, 8, 9});
  CHECK(draws(b, 10) == std::vector<std::int64_t>{5, 6, 7, 8, 9});
  CHECK(b.size() == 0);
  CHECK(draws(b, 3).empty());
  CHECK(b.counts().drawn == 7);
  CHECK(b.counts().reused == 0);
  CHECK(b.counts().ingested == 10);
}

TEST_CASE("reservoir: every stream position held with probability capacity / stream length") {
  // 2,000 runs of a stream of 10,000 samples into a reservoir of 100: the inclusion counts of
  // the positions, in 10 bins of 1,000, are each within 5 sigma of a binomial's expectation.
  const int runs = 2000;
  const std::int64_t stream = 10000, capacity = 100, bins = 10;
  const std::int64_t per_bin = stream / bins;
  std::vector<double> included(static_cast<std::size_t>(bins), 0.0);
  for (int run = 0; run < runs; ++run) {
    SampleBuffer b(options(Policy::reservoir, capacity, 0, static_cast<std::uint64_t>(run)));
    for (std::int64_t i = 0; i < stream; ++i)
      ingest_position(b, i);
    REQUIRE(b.size() == capacity);
    CHECK(b.counts().evicted + b.counts().rejected == stream - capacity);
    const std::vector<std::int64_t> h = held(b);
    CHECK(std::set<std::int64_t>(h.begin(), h.end()).size() == h.size());
    for (std::int64_t i : h)
      included[static_cast<std::size_t>(i / per_bin)] += 1;
  }
  const double p = static_cast<double>(capacity) / static_cast<double>(stream);
  const double trials = static_cast<double>(runs) * static_cast<double>(per_bin);
  const double expected = trials * p;  // 20,000
  const double bound = five_sigma(trials, p);
  for (std::int64_t k = 0; k < bins; ++k) {
    INFO("bin " << k << ": " << included[static_cast<std::size_t>(k)] << " inclusions, expected "
                << expected << " +- " << bound);
    CHECK(std::abs(included[static_cast<std::size_t>(k)] - expected) <= bound);
  }
}

TEST_CASE("reservoir: the first capacity samples are all kept; draws reuse samples") {
  SampleBuffer b(options(Policy::reservoir, 4));
  for (std::int64_t i = 0; i < 4; ++i)
    ingest_position(b, i);
  CHECK(b.counts().evicted == 0);
  CHECK(b.counts().rejected == 0);
  const std::vector<std::int64_t> d = draws(b, 100);
  REQUIRE(d.size() == 100);
  const std::set<std::int64_t> distinct(d.begin(), d.end());
  CHECK(distinct.size() == 4);  // 100 draws from 4: every one (deterministic for the seed)
  CHECK(b.counts().drawn == 100);
  CHECK(b.counts().reused == 100 - static_cast<std::int64_t>(distinct.size()));
  CHECK(b.size() == 4);  // draws with replacement keep the samples
}

TEST_CASE("window: holds exactly the last N, draws uniformly over them") {
  const std::int64_t window = 10;
  SampleBuffer b(options(Policy::window, 100, window, 11));
  CHECK(b.bound() == window);
  for (std::int64_t i = 0; i < 1000; ++i)
    ingest_position(b, i);
  std::vector<std::int64_t> expected;
  for (std::int64_t i = 990; i < 1000; ++i)
    expected.push_back(i);
  CHECK(held(b) == expected);
  CHECK(b.counts().evicted == 1000 - window);
  CHECK(b.bytes() <= static_cast<std::size_t>(window) * sizeof(std::int64_t));

  const std::int64_t n = 20000;
  const std::vector<std::int64_t> d = draws(b, n);
  std::vector<double> count(static_cast<std::size_t>(window), 0.0);
  for (std::int64_t i : d) {
    REQUIRE(i >= 990);
    count[static_cast<std::size_t>(i - 990)] += 1;
  }
  const double p = 1.0 / static_cast<double>(window);
  double chi2 = 0;
  for (double k : count) {
    CHECK(std::abs(k - n * p) <= five_sigma(static_cast<double>(n), p));
    chi2 += (k - n * p) * (k - n * p) / (n * p);
  }
  // 9 degrees of freedom: P(chi2 > 45) is about 1e-6.
  CHECK(chi2 < 45.0);
  CHECK(b.counts().reused == n - window);  // every slot drawn: all but its first draw reuse it
}

TEST_CASE("window of 0 means the capacity") {
  SampleBuffer b(options(Policy::window, 7, 0));
  CHECK(b.bound() == 7);
  for (std::int64_t i = 0; i < 20; ++i)
    ingest_position(b, i);
  CHECK(held(b) == std::vector<std::int64_t>{13, 14, 15, 16, 17, 18, 19});
  CHECK(b.counts().evicted == 13);
}

TEST_CASE("the drain gives what is left without replacement, then nothing") {
  SUBCASE("reservoir") {
    SampleBuffer b(options(Policy::reservoir, 100, 0, 5));
    for (std::int64_t i = 0; i < 1000; ++i)
      ingest_position(b, i);
    const std::vector<std::int64_t> before = held(b);
    (void)draws(b, 50);  // some drawn before the end: drawn again in the drain, as reuse
    const std::int64_t reused_before = b.counts().reused;
    std::vector<std::int64_t> drained;
    for (std::int64_t got : {30, 30, 30, 10, 0}) {
      Collect c;
      CHECK(b.drain(30, c.sink()) == got);
      drained.insert(drained.end(), c.positions.begin(), c.positions.end());
    }
    CHECK(b.size() == 0);
    CHECK(b.draining());
    std::vector<std::int64_t> a = before, d = drained;
    std::sort(a.begin(), a.end());
    std::sort(d.begin(), d.end());
    CHECK(a == d);  // every held sample once
    CHECK(b.counts().reused > reused_before);
    Collect none;
    CHECK(b.draw(5, none.sink()) == 0);  // draw() after the drain began drains too
    CHECK_THROWS_AS(ingest_position(b, 1000), fullshard::Error);
  }
  SUBCASE("fifo keeps its order") {
    SampleBuffer b(options(Policy::fifo, 10));
    for (std::int64_t i = 0; i < 14; ++i)
      ingest_position(b, i);
    Collect c;
    CHECK(b.drain(4, c.sink()) == 4);
    CHECK(b.drain(100, c.sink()) == 6);
    CHECK(c.positions == std::vector<std::int64_t>{4, 5, 6, 7, 8, 9, 10, 11, 12, 13});
  }
  SUBCASE("window") {
    SampleBuffer b(options(Policy::window, 10, 5));
    for (std::int64_t i = 0; i < 12; ++i)
      ingest_position(b, i);
    Collect c;
    CHECK(b.drain(100, c.sink()) == 5);
    std::sort(c.positions.begin(), c.positions.end());
    CHECK(c.positions == std::vector<std::int64_t>{7, 8, 9, 10, 11});
  }
}

TEST_CASE("the same seed gives the same samples and draws; another seed others") {
  auto run = [](Policy policy, std::uint64_t seed) {
    SampleBuffer b(options(policy, 20, policy == Policy::window ? 8 : 0, seed));
    std::vector<std::int64_t> out;
    for (std::int64_t i = 0; i < 500; ++i) {
      ingest_position(b, i);
      if (i % 10 == 9) {
        const std::vector<std::int64_t> d = draws(b, 4);
        out.insert(out.end(), d.begin(), d.end());
      }
    }
    const std::vector<std::int64_t> h = held(b);
    out.insert(out.end(), h.begin(), h.end());
    return out;
  };
  for (Policy p : {Policy::reservoir, Policy::window}) {
    CHECK(run(p, 9) == run(p, 9));
    CHECK(run(p, 9) != run(p, 10));
  }
  CHECK(run(Policy::fifo, 9) == run(Policy::fifo, 10));  // FIFO draws no random numbers
}

TEST_CASE("staleness: the newest step ingested minus the drawn sample's step") {
  SampleBuffer b(options(Policy::fifo, 10));
  for (std::int64_t i = 0; i < 10; ++i)
    ingest_position(b, i);
  (void)draws(b, 10);
  CHECK(b.mean_staleness() == doctest::Approx(4.5));  // (9 + 8 + ... + 0) / 10
  CHECK(b.counts().staleness_sum == 45.0);
}

TEST_CASE("memory: the slots grow with the samples held, never above capacity x sample bytes") {
  for (Policy p : {Policy::fifo, Policy::reservoir, Policy::window}) {
    const std::size_t sample_bytes = 24;
    const std::int64_t capacity = 50;
    SampleBuffer b(options(p, capacity, p == Policy::window ? 30 : 0, 3, sample_bytes));
    const std::size_t bound = static_cast<std::size_t>(b.bound()) * sample_bytes;
    CHECK(b.bytes() == 0);
    for (std::int64_t i = 0; i < 1000; ++i) {
      ingest_position(b, i);
      REQUIRE(b.bytes() <= bound);
      if (i % 7 == 0) (void)draws(b, 3);
    }
    CHECK(b.bytes() <= static_cast<std::size_t>(capacity) * sample_bytes);
    if (p != Policy::fifo) CHECK(b.bytes() == bound);  // full
  }
}

TEST_CASE("bad buffer options are refused") {
  CHECK_THROWS_AS(SampleBuffer(options(Policy::fifo, 0)), fullshard::InvalidArgument);
  CHECK_THROWS_AS(SampleBuffer(options(Policy::window, 10, 11)), fullshard::InvalidArgument);
  CHECK_THROWS_AS(SampleBuffer(options(Policy::window, 10, -1)), fullshard::InvalidArgument);
  CHECK_THROWS_AS(SampleBuffer(options(Policy::fifo, 10, 0, 1, 0)), fullshard::InvalidArgument);
}

TEST_CASE("admit gives the slot ingest would copy into; nullptr for a reservoir rejection") {
  for (Policy policy : {Policy::fifo, Policy::reservoir, Policy::window}) {
    CAPTURE(static_cast<int>(policy));
    // The same seed and arrivals: one buffer ingests, the other admits and fills the slot.
    SampleBuffer copied(options(policy, 4, policy == Policy::window ? 3 : 0, 9));
    SampleBuffer filled(options(policy, 4, policy == Policy::window ? 3 : 0, 9));
    std::int64_t rejected = 0;
    for (std::int64_t i = 0; i < 40; ++i) {
      ingest_position(copied, i);
      std::byte* slot = filled.admit(SampleMeta{i, 0, i});
      if (slot == nullptr) {
        ++rejected;
        continue;
      }
      std::memset(slot, 0, filled.options().sample_bytes);
      std::memcpy(slot, &i, sizeof i);
    }
    CHECK(held(filled) == held(copied));
    CHECK(filled.counts().ingested == 40);
    CHECK(filled.counts().rejected == rejected);
    CHECK(filled.counts().evicted == copied.counts().evicted);
    CHECK(rejected == (policy == Policy::reservoir ? copied.counts().rejected : 0));
    CHECK(draws(filled, 3) == draws(copied, 3));
  }
  SampleBuffer r(options(Policy::reservoir, 1, 0, 3));
  CHECK(r.admit(SampleMeta{0, 0, 0}) != nullptr);  // the first `capacity` are always kept
}
