// fullshard-tour: a guided run through the runtime, the device mesh and the collectives.
// Launch with any number of ranks, e.g. `mpirun -n 4 fullshard-tour` or `srun -n 4 ...`.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "bounded_comm.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/state_dict.hpp"
#include "fullshard/fullshard.hpp"
#include "fullshard/schedule/executor.hpp"

namespace {

using fullshard::DType;
using fullshard::comm::ReduceOp;
using fullshard::comm::Stream;

using fullshard::apps::BoundedComm;

// Prints one line per rank, in rank order, through rank 0. (The tour's own MPI calls are
// bounded by FULLSHARD_TIMEOUT like the library's.)
void print_ordered(BoundedComm& world, const std::string& line) {
  const MPI_Comm comm = world.get();
  const int rank = world.rank();
  const int size = world.size();
  int len = static_cast<int>(line.size());
  std::vector<int> lens(size);
  world.run("gather line lengths", [&](MPI_Request* r) {
    return MPI_Igather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, comm, r);
  });
  std::vector<int> offs(size, 0);
  int total = 0;
  for (int r = 0; r < size; ++r)
    offs[r] = (total += (r ? lens[r - 1] : 0));
  if (rank == 0) total += lens[size - 1];
  std::vector<char> all(rank == 0 ? total : 0);
  world.run("gather lines", [&](MPI_Request* r) {
    return MPI_Igatherv(line.data(), len, MPI_CHAR, all.data(), lens.data(), offs.data(), MPI_CHAR,
                        0, comm, r);
  });
  if (rank == 0)
    for (int r = 0; r < size; ++r)
      std::printf("  %.*s\n", lens[r], all.data() + offs[r]);
  std::fflush(stdout);
}

bool all_true(BoundedComm& world, bool ok) {
  int all = ok ? 1 : 0;
  world.allreduce(&all, 1, MPI_INT, MPI_MIN, "verdict");
  return all == 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    fullshard::Runtime rt(argc, argv);
    const int rank = rt.rank();
    const int world = rt.world_size();
    BoundedComm tour(rt.world(), "tour.world", rt.settings().timeout_s);
    auto say = [&](const std::string& s) {
      if (rank == 0) std::printf("%s\n", s.c_str());
      std::fflush(stdout);
    };
    auto verdict = [&](const std::string& what, bool ok) {
      const bool all = all_true(tour, ok);
      say(std::string(all ? "  [ok]   " : "  [FAIL] ") + what);
      return all;
    };
    bool ok = true;

    say("fullshard " FULLSHARD_VERSION_STRING " tour");
    say("runtime: " + rt.describe());
    print_ordered(tour, "rank " + std::to_string(rank) + ": local rank " +
                            std::to_string(rt.local_rank()) + " of " +
                            std::to_string(rt.local_size()));

    // --- Meshes -------------------------------------------------------------------------
    std::vector<int> shape = {world};
    std::vector<std::string> names = {"shard"};
    if (world % 2 == 0 && world >= 4) {
      shape = {2, world / 2};
      names = {"replicate", "shard"};
    }
    fullshard::DeviceMesh mesh(rt, shape, names);
    say("\nmesh " + std::to_string(mesh.ndim()) + "-D; each rank's place:");
    print_ordered(tour, mesh.describe());
    if (mesh.ndim() == 2) {
      auto dp = mesh.flatten({"replicate", "shard"}, "dp");
      say("flattened (replicate, shard) -> dp of " + std::to_string(dp.size()) + " ranks");
      ok &= verdict("flattened rank equals world rank", dp.rank() == rank);
    }

    // --- Collectives --------------------------------------------------------------------
    auto& shard = mesh.comm("shard", fullshard::comm::StreamKind::all_gather);
    const int W = shard.size();
    const int r = shard.rank();
    Stream caller = Stream::caller();
    say("\ncollectives on '" + shard.name() + "' (" + std::to_string(W) + " ranks)");

    const std::size_t n = 1 << 16;
    std::vector<float> gathered(n * W);
    for (std::size_t i = 0; i < n; ++i)
      gathered[r * n + i] = float(r * 1000 + i % 997);
    shard.all_gather(gathered.data() + r * n, gathered.data(), n, DType::f32, caller).wait();
    bool good = true;
    for (int q = 0; q < W; ++q)
      for (std::size_t i = 0; i < n; i += 101)
        good &= gathered[q * n + i] == float(q * 1000 + i % 997);
    ok &= verdict("all_gather (in place) of 64 Ki f32 per rank: every rank's slot arrived", good);

    auto& rs_comm = mesh.comm("shard", fullshard::comm::StreamKind::reduce_scatter);
    std::vector<float> grads(n * W);
    for (std::size_t i = 0; i < grads.size(); ++i)
      grads[i] = float((r + 1) * (i % 13));
    std::vector<float> mine(n);
    rs_comm.reduce_scatter(grads.data(), mine.data(), n, DType::f32, ReduceOp::avg, caller).wait();
    good = true;
    const float mean_factor = float(W + 1) / 2.0f;  // mean over ranks of (q + 1)
    for (std::size_t i = 0; i < n; ++i)
      good &= std::fabs(mine[i] - mean_factor * float((r * n + i) % 13)) < 1e-5f;
    ok &= verdict("reduce_scatter (avg) of gradients: each rank holds the mean of its chunk", good);

    std::vector<std::uint16_t> b(1024);
    for (std::size_t i = 0; i < b.size(); ++i)
      b[i] = fullshard::float_to_bf16(float(r + i % 7));
    shard.all_reduce(b.data(), b.data(), b.size(), DType::bf16, ReduceOp::sum, caller).wait();
    good = true;
    for (std::size_t i = 0; i < b.size(); ++i)
      good &= fullshard::bf16_to_float(b[i]) == float(W * (W - 1) / 2 + W * int(i % 7));
    ok &= verdict("all_reduce (sum) in bf16, pairwise f32 sums rounded to bf16", good);

    double token = rank == 0 ? 42.5 : 0.0;
    mesh.world_comm().broadcast(&token, 1, DType::f64, 0, caller).wait();
    ok &= verdict("broadcast from rank 0 over the whole mesh", token == 42.5);

    // --- Two streams at once ------------------------------------------------------------
    Stream ag_stream = Stream::worker("all_gather");
    Stream rs_stream = Stream::worker("reduce_scatter");
    auto w1 = shard.all_gather(gathered.data() + r * n, gathered.data(), n, DType::f32, ag_stream);
    auto w2 =
        rs_comm.reduce_scatter(grads.data(), mine.data(), n, DType::f32, ReduceOp::sum, rs_stream);
    w2.wait();
    w1.wait();
    good = true;
    for (std::size_t i = 0; i < n; ++i)
      good &= std::fabs(mine[i] - float(W * (W + 1) / 2) * float((r * n + i) % 13)) < 1e-3f;
    ok &= verdict("all_gather and reduce_scatter in flight together on two worker streams", good);

    // --- fully_shard ------------------------------------------------------------------
    {
      namespace fsdp = fullshard::fsdp;
      auto model = fullshard::graph::Module::make_root("model");
      auto& layers = model->add_module("layers");
      for (int i = 0; i < 3; ++i) {
        auto& layer = layers.add_module(std::to_string(i));
        layer.add_param("w", {5 + 2 * i, 4}).init([](std::int64_t e) { return double(e % 9); });
        layer.set_fully_shard_request(true);
        // The "loss" of rank r is sum (r+1) * w^2 / 2: its gradient is (r+1) * w.
        layer.on_backward([r = rank](fullshard::graph::Module& m) {
          auto& p = m.param("w");
          fullshard::Tensor g = p.grad();
          for (std::int64_t e = 0; e < g.numel(); ++e)
            g.set(e, g.at(e) + (r + 1) * p.data().at(e));
        });
      }
      model->add_param("bias", {3}).init([](std::int64_t e) { return double(e); });
      model->set_fully_shard_request(true);
      fullshard::DeviceMesh dp(rt, {world}, {"dp"});
      const auto plan =
          fullshard::schedule::Scheduler::plan(*model, fullshard::schedule::MeshShape::fsdp(world));
      fsdp::apply_fully_shard_requests(*model, dp);
      say("\nfully_shard of a 3-layer model over " + std::to_string(world) + " ranks (" +
          std::to_string(plan.groups.size()) + " communication groups)");
      print_ordered(tour,
                    "rank " + std::to_string(rank) + ": layers.0.w shard " +
                        fullshard::shape_string(model->find_param("layers.0.w").data().shape()) +
                        " of " + fullshard::shape_string({5, 4}));
      fullshard::schedule::Executor ex(*model, dp, plan);
      ex.step();
      good = true;
      const auto sd = fsdp::sharded_state_dict(*model);
      for (auto* p : model->parameters()) {
        const auto& st = sd.at(p->fqn());
        const std::int64_t row = st.layout.inner, off = st.global_offset()[0] * row;
        for (std::int64_t e = 0; e < p->grad().numel(); ++e) {
          const double v = p->fqn() == "bias" ? 0.0 : double((off + e) % 9) * (world + 1) / 2.0;
          good &= p->grad().at(e) == float(v);
        }
      }
      ok &= verdict("after backward every rank holds its shard of the mean gradient", good);
      ok &= verdict("measured peak memory " + std::to_string(ex.measured_peak_bytes()) +
                        " B equals the plan's " + std::to_string(plan.peak_bytes) + " B",
                    ex.measured_peak_bytes() == plan.peak_bytes);
    }

    say(ok ? "\ntour complete: all checks passed" : "\ntour complete: SOME CHECKS FAILED");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
