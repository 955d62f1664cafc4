// What each transport operation is made of (lib/transport/charges.hpp), per
// transport kind: the rules the planner prices. A recording price list returns distinct
// times per piece, so each charge is checked piece by piece against the transports'
// behaviour written out here (docs/architecture.md, "transports").
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "lib/transport/charges.hpp"

using namespace fullshard;
using namespace fullshard::transport;

namespace {

// One piece of an operation's work.
struct Piece {
  enum What { copy, codec, collective, shm_collective } what;
  CollectiveKind kind = CollectiveKind::all_gather;
  double amount = 0.0;
  bool operator==(const Piece& o) const {
    return what == o.what && kind == o.kind && amount == o.amount;
  }
};

// Records every piece priced; each costs 1 ms.
struct Recorder {
  mutable std::vector<Piece> pieces;
  double copy(double bytes) const { return add({Piece::copy, CollectiveKind::all_gather, bytes}); }
  double codec(double elements) const {
    return add({Piece::codec, CollectiveKind::all_gather, elements});
  }
  double collective(CollectiveKind k, double bytes) const {
    return add({Piece::collective, k, bytes});
  }
  double shm_collective(CollectiveKind k, double bytes) const {
    return add({Piece::shm_collective, k, bytes});
  }
  double add(Piece p) const {
    pieces.push_back(p);
    return 1.0;
  }
  // The pieces recorded since the last call, and a check that the time is their count.
  std::vector<Piece> take(double ms) {
    CHECK(ms == static_cast<double>(pieces.size()));
    std::vector<Piece> out;
    out.swap(pieces);
    return out;
  }
};

// A group of 4 ranks: 100 f32 elements per shard, 400 unsharded.
Geometry group(int replicate = 1, std::uint8_t wire = 0) {
  Geometry g;
  g.shard_numel = 100;
  g.arena_numel = 400;
  g.world = 4;
  g.replicate = replicate;
  g.wire = wire;
  return g;
}

using V = std::vector<Piece>;
constexpr auto AG = CollectiveKind::all_gather;
constexpr auto RS = CollectiveKind::reduce_scatter;

}  // namespace

TEST_CASE(
    "shared memory: the gather is the copy-out, the reduce-scatter reads and writes in place") {
  Recorder r;
  const Geometry g = group();
  CHECK(r.take(charges::gather_copy_in(g, 400, r)) == V{{Piece::copy, AG, 400}});
  CHECK(r.take(charges::all_gather(Kind::shm, g, 1600, 0, r)).empty());  // a publish
  CHECK(r.take(charges::gather_copy_out(Kind::shm, g, 1600, false, r)) ==
        V{{Piece::shm_collective, AG, 400}});  // one shard's bytes per rank
  // From the slices of reshard_after_forward=2: an MPI gather in 2 ranks, then a copy.
  CHECK(r.take(charges::all_gather(Kind::shm, g, 1600, 2, r)) ==
        V{{Piece::collective, AG, 1600.0 / 3.0}});
  CHECK(r.take(charges::gather_copy_out(Kind::shm, g, 1600, true, r)) ==
        V{{Piece::copy, AG, 1600}});
  CHECK(r.take(charges::reduce_copy_in(Kind::shm, g, 1600, r)).empty());
  CHECK(r.take(charges::reduce_scatter(Kind::shm, g, 400, r)) ==
        V{{Piece::shm_collective, RS, 400}});
  CHECK(r.take(charges::reduce_copy_out(Kind::shm, g, 400, r)).empty());
  // With HSDP the sum goes to the all-reduce: the copy-out is an operation of its own.
  CHECK(r.take(charges::reduce_copy_out(Kind::shm, group(2), 400, r)) == V{{Piece::copy, AG, 400}});
  CHECK(r.take(charges::all_reduce(400, r)) ==
        V{{Piece::collective, CollectiveKind::all_reduce, 400}});
}

TEST_CASE("two levels: the gather across nodes fills the windows, the node sums, MPI across") {
  Recorder r;
  const Geometry g = group();
  const Kind k = Kind::two_level;
  CHECK(r.take(charges::gather_copy_in(g, 400, r)) == V{{Piece::copy, AG, 400}});
  CHECK(r.take(charges::all_gather(k, g, 1600, 0, r)) == V{{Piece::collective, AG, 1600}});
  CHECK(r.take(charges::gather_copy_out(k, g, 1600, false, r)) ==
        V{{Piece::shm_collective, AG, 400}});  // every slot read from the node's windows
  CHECK(r.take(charges::reduce_copy_in(k, g, 1600, r)).empty());  // read in place
  CHECK(r.take(charges::reduce_scatter(k, g, 400, r)) ==
        (V{{Piece::shm_collective, RS, 400}, {Piece::collective, RS, 400}}));
  // The sum of the nodes' sums divides, casts and accumulates; with HSDP the all-reduce first.
  CHECK(r.take(charges::reduce_copy_out(k, g, 400, r)).empty());
  CHECK(r.take(charges::reduce_copy_out(k, group(2), 400, r)) == V{{Piece::copy, AG, 400}});
  // Compressed groups leave it for MPI, as they leave shared memory.
  CHECK(group_kind(k, group(1, Geometry::make_wire(kernels::QuantCode::int8, false, 8))) ==
        Kind::mpi);
  CHECK(group_kind(k, g) == k);
  CHECK(std::string(kind_name(k)) == "shm+mpi");
}

TEST_CASE("MPI and NCCL: collectives with separate copies") {
  Recorder r;
  const Geometry g = group();
  for (Kind k : {Kind::mpi, Kind::nccl}) {
    CHECK(r.take(charges::all_gather(k, g, 1600, 0, r)) == V{{Piece::collective, AG, 1600}});
    CHECK(r.take(charges::gather_copy_out(k, g, 1600, false, r)) == V{{Piece::copy, AG, 1600}});
    CHECK(r.take(charges::reduce_copy_in(k, g, 1600, r)) == V{{Piece::copy, AG, 1600}});
    CHECK(r.take(charges::reduce_scatter(k, g, 400, r)) == V{{Piece::collective, RS, 400}});
    CHECK(r.take(charges::reduce_copy_out(k, g, 400, r)) == V{{Piece::copy, AG, 400}});
  }
}

TEST_CASE("compressed: MPI, with the codec passes fused into the copies") {
  Recorder r;
  const Geometry g = group(1, Geometry::make_wire(kernels::QuantCode::int8, true, 6));
  REQUIRE(group_kind(Kind::shm, g) == Kind::mpi);  // leaves shared memory
  const Kind k = group_kind(Kind::shm, g);
  CHECK(r.take(charges::gather_copy_in(g, 0, r)) == V{{Piece::codec, AG, 100}});
  CHECK(r.take(charges::all_gather(k, g, 512, 0, r)) == V{{Piece::collective, AG, 512}});
  CHECK(r.take(charges::gather_copy_out(k, g, 0, false, r)) == V{{Piece::codec, AG, 400}});
  // W chunks encoded, the all-to-all, W decoded and summed (with the copy-out).
  CHECK(r.take(charges::reduce_scatter(k, g, 512, r)) ==
        V{{Piece::codec, AG, 800}, {Piece::collective, RS, 512}});
  CHECK(r.take(charges::reduce_copy_out(k, g, 400, r)).empty());
}
