// heat-surrogate's parts on 1-4 ranks: the decomposed solver against the same solver on one
// rank (bitwise) and one FTCS step against plain loops, the patch layout, the sample
// positions' independence of the decomposition, and the sample transport of the
// simulation/training split; its training replayed through the session's C++ API.
#include <doctest/doctest.h>

#include <mpi.h>

#include <cmath>
#include <set>
#include <vector>

#include "error_check.hpp"
#include "fullshard/session/native_session.hpp"
#include "heat_solver.hpp"
#include "options.hpp"
#include "sampling.hpp"
#include "surrogate.hpp"
#include "test_support.hpp"
#include "transport.hpp"

using namespace fullshard;
namespace ss = fullshard::session;
using apps::heat::Cell;
using apps::heat::HeatSolver;
using apps::heat::Options;
using apps::heat::Sampler;

namespace {

constexpr double kTimeout = 60;  // bounds every wait (FULLSHARD_TIMEOUT of the test jobs)

Options small() {
  Options o;
  o.nx = 40;
  o.ny = 37;  // uneven over 2-4 ranks
  o.steps = 100;
  o.interval = 4;
  o.radius = 2;
  o.blobs = 3;
  o.sources = 2;
  o.samples = 50;
  o.eval_points = 30;
  return o;
}

std::vector<Cell> owned_cells(const HeatSolver& s, int nx) {
  std::vector<Cell> cells;
  for (int r = s.first_row(); r < s.first_row() + s.rows(); ++r)
    for (int c = 0; c < nx; ++c)
      cells.push_back({r, c});
  return cells;
}

std::vector<float> values(HeatSolver& s, const std::vector<Cell>& cells) {
  std::vector<float> v(cells.size());
  s.read(cells, v.data(), 1);
  return v;
}

}  // namespace

TEST_CASE("the decomposed solver equals the one-rank solver bitwise") {
  const Options o = small();
  HeatSolver whole(o, MPI_COMM_SELF, kTimeout);
  HeatSolver part(o, MPI_COMM_WORLD, kTimeout);
  CHECK(whole.rows() == o.ny);
  int rows = part.rows();
  MPI_Allreduce(MPI_IN_PLACE, &rows, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  CHECK(rows == o.ny);
  // 13 steps: three forcing changes (every 4 steps) and halo exchanges across every rank
  // boundary.
  whole.advance(13);
  part.advance(13);
  const auto cells = owned_cells(part, o.nx);
  const auto a = values(whole, cells), b = values(part, cells);
  int mismatches = 0;
  float peak = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    mismatches += a[i] != b[i];
    peak = std::max(peak, std::fabs(a[i]));
  }
  CHECK(mismatches == 0);
  CHECK(test::all_ranks(mismatches == 0));
  double mean = 0, max = 0;
  part.field_stats(mean, max);
  CHECK(max > 0.1);  // blobs and a heated wall: not a zero field
  CHECK(mean > 0);
}

TEST_CASE("one FTCS step against plain loops, with the walls") {
  Options o = small();
  o.radius = 1;  // every interior cell has a patch, so extract gives its source
  HeatSolver whole(o, MPI_COMM_SELF, kTimeout);
  HeatSolver part(o, MPI_COMM_WORLD, kTimeout);
  const int nx = o.nx, ny = o.ny;
  std::vector<Cell> all;
  for (int r = 0; r < ny; ++r)
    for (int c = 0; c < nx; ++c)
      all.push_back({r, c});
  const auto u0 = values(whole, all);
  std::vector<Cell> interior;
  for (int r = 1; r < ny - 1; ++r)
    for (int c = 1; c < nx - 1; ++c)
      interior.push_back({r, c});
  std::vector<float> rec;
  whole.extract(interior, rec);
  const int stride = whole.record_floats();  // 9 patch values, source increment, 0
  REQUIRE(stride == 11);

  // Walls: the bottom row is the travelling wave at t = 0, the others are 0.
  const double pi = 3.14159265358979323846;
  for (int c = 0; c < nx; ++c) {
    const double x = static_cast<double>(c) / (nx - 1);
    CHECK(u0[c] == doctest::Approx(0.8 * (0.5 + 0.5 * std::sin(2 * pi * 2 * x))).epsilon(1e-6));
    CHECK(u0[static_cast<std::size_t>(ny - 1) * nx + c] == 0.0f);
  }
  for (int r = 1; r < ny; ++r) {
    CHECK(u0[static_cast<std::size_t>(r) * nx] == 0.0f);
    CHECK(u0[static_cast<std::size_t>(r) * nx + nx - 1] == 0.0f);
  }

  part.advance(1);
  const auto cells = owned_cells(part, nx);
  const auto u1 = values(part, cells);
  auto at = [&](int r, int c) {
    return static_cast<double>(u0[static_cast<std::size_t>(r) * nx + c]);
  };
  int bad = 0;
  double worst = 0;
  for (std::size_t i = 0; i < cells.size(); ++i) {
    const int r = cells[i].row, c = cells[i].col;
    double want = at(r, c);
    if (r > 0 && r < ny - 1 && c > 0 && c < nx - 1) {
      const std::size_t k = static_cast<std::size_t>(r - 1) * (nx - 2) + (c - 1);
      const double source_per_step = rec[k * stride + 9] / o.interval;
      want += o.cfl * (at(r - 1, c) + at(r + 1, c) + at(r, c - 1) + at(r, c + 1) - 4 * at(r, c)) +
              source_per_step;
      // The patch holds the neighbourhood, row-major.
      CHECK(rec[k * stride + 1] == u0[static_cast<std::size_t>(r - 1) * nx + c]);
      CHECK(rec[k * stride + 3] == u0[static_cast<std::size_t>(r) * nx + c - 1]);
      CHECK(rec[k * stride + 4] == u0[static_cast<std::size_t>(r) * nx + c]);
      CHECK(rec[k * stride + 8] == u0[static_cast<std::size_t>(r + 1) * nx + c + 1]);
      CHECK(rec[k * stride + 10] == 0.0f);
    }
    const double err = std::fabs(u1[i] - want);
    worst = std::max(worst, err);
    bad += err > 2e-6;
  }
  INFO("worst error " << worst);
  CHECK(bad == 0);
}

TEST_CASE("sample positions do not depend on the decomposition and avoid the held-out cells") {
  const Options o = small();
  HeatSolver part(o, MPI_COMM_WORLD, kTimeout);
  const Sampler mine(o, part.first_row(), part.rows());
  const Sampler whole(o, 0, o.ny);
  REQUIRE(whole.eval_cells().size() == static_cast<std::size_t>(o.eval_points));
  std::set<std::pair<int, int>> held_out;
  for (const Cell& c : whole.eval_cells())
    held_out.insert({c.row, c.col});
  CHECK(held_out.size() == static_cast<std::size_t>(o.eval_points));  // distinct
  auto in_rows = [&](const Cell& c) {
    return c.row >= part.first_row() && c.row < part.first_row() + part.rows();
  };
  auto same = [&](const std::vector<Cell>& got, const std::vector<Cell>& all) {
    std::vector<Cell> want;
    for (const Cell& c : all)
      if (in_rows(c)) want.push_back(c);
    bool ok = got.size() == want.size();
    for (std::size_t i = 0; ok && i < got.size(); ++i)
      ok = got[i].row == want[i].row && got[i].col == want[i].col;
    return ok;
  };
  CHECK(same(mine.eval_cells(), whole.eval_cells()));
  for (int round : {1, 2, 7}) {
    const auto all = whole.train_cells(round);
    CHECK(all.size() == static_cast<std::size_t>(o.samples));
    int hits = 0, outside = 0;
    for (const Cell& c : all) {
      hits += held_out.count({c.row, c.col}) ? 1 : 0;
      outside += c.row < o.radius || c.row >= o.ny - o.radius || c.col < o.radius ||
                 c.col >= o.nx - o.radius;
    }
    CHECK(hits == 0);
    CHECK(outside == 0);
    CHECK(same(mine.train_cells(round), all));
  }
  CHECK(!same(whole.train_cells(1), whole.train_cells(2)));
  CHECK(Sampler::is_report_round(o, o.report_every));
  CHECK(Sampler::is_report_round(o, o.rounds()));
  CHECK(Sampler::is_report_round(o, 1));
  CHECK(Sampler::is_report_round(o, 16));
  CHECK(!Sampler::is_report_round(o, 3));
  CHECK(!Sampler::is_report_round(o, o.report_every + 1));
  CHECK(!Sampler::is_report_round(o, 2 * o.report_every + 64));
}

namespace {

// Value j of record i of kind (0 train, 1 eval) of simulation rank s in round k.
float code(int s, int kind, int k, int i, int j) {
  return static_cast<float>(s * 100000 + kind * 50000 + k * 1000 + i * 10 + j);
}

}  // namespace

TEST_CASE("samples travel from the simulation ranks to the training ranks in order") {
  const int W = test::world_size();
  std::vector<int> splits = {0};
  for (int t = 1; t < W; ++t)
    splits.push_back(t);
  for (int T : splits) {
    CAPTURE(T);
    apps::heat::Roles roles(MPI_COMM_WORLD, T, kTimeout);
    const int R = test::world_rank();
    if (T == 0) {
      CHECK(!roles.split());
      CHECK((roles.simulates() && roles.trains()));
      CHECK(roles.sim_ranks() == W);
      CHECK(roles.train_ranks() == W);
      continue;
    }
    CHECK(roles.trains() == (R < T));
    CHECK(roles.simulates() == (R >= T));
    CHECK(roles.sim_ranks() == W - T);
    int sub = 0;
    MPI_Comm_size(roles.trains() ? roles.train_comm() : roles.sim_comm(), &sub);
    CHECK(sub == (roles.trains() ? T : W - T));
    const int stride = 3, rounds = 6;  // more rounds than kMaxRoundsAhead
    auto counts = [&](int s, int k) { return std::pair<int, int>(2 + s + k % 3, (s + k) % 2); };
    if (roles.simulates()) {
      const int s = R - T;
      apps::heat::SampleSender sender(roles, stride);
      for (int k = 0; k < rounds; ++k) {
        apps::heat::RoundRecords rec;
        const auto [nt, ne] = counts(s, k);
        for (int i = 0; i < nt; ++i)
          for (int j = 0; j < stride; ++j)
            rec.train.push_back(code(s, 0, k, i, j));
        for (int i = 0; i < ne; ++i)
          for (int j = 0; j < stride; ++j)
            rec.eval.push_back(code(s, 1, k, i, j));
        sender.send(rec);
      }
      sender.finish();
    } else {
      const int t = R;
      for (int k = 0; k < rounds; ++k) {
        const auto got = apps::heat::receive_round(roles, stride);
        std::vector<float> want_train, want_eval;
        for (int s = 0; s < W - T; ++s) {
          const auto [nt, ne] = counts(s, k);
          for (int i = nt * t / T; i < nt * (t + 1) / T; ++i)
            for (int j = 0; j < stride; ++j)
              want_train.push_back(code(s, 0, k, i, j));
          for (int i = ne * t / T; i < ne * (t + 1) / T; ++i)
            for (int j = 0; j < stride; ++j)
              want_eval.push_back(code(s, 1, k, i, j));
        }
        CHECK(got.train == want_train);
        CHECK(got.eval == want_eval);
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

TEST_CASE("options: defaults pass, bad values name the flag") {
  auto parse = [](std::vector<std::string> args) {
    args.insert(args.begin(), "heat-surrogate");
    std::vector<char*> argv;
    for (auto& a : args)
      argv.push_back(a.data());
    bool help = false;
    return apps::heat::parse_options(static_cast<int>(argv.size()), argv.data(), help);
  };
  auto error = [&](std::vector<std::string> args, int world = 4) {
    try {
      apps::heat::check_world(parse(std::move(args)), world);
    } catch (const apps::UsageError& e) {
      return e.message;
    }
    return std::string("no error");
  };
  CHECK(error({}) == "no error");
  CHECK(error({"--train-ranks", "2"}) == "no error");
  CHECK(error({"--cfl", "0.3"}).find("--cfl") == 0);
  CHECK(error({"--cfl", "0"}).find("--cfl") == 0);
  CHECK(error({"--train-ranks", "4"}).find("--train-ranks 4 leaves no simulation rank") == 0);
  CHECK(error({"--ny", "40", "--radius", "8"}, 8).find("--ny 40") == 0);
  CHECK(error({"--steps", "5"}).find("--steps 5 must be at least") == 0);
  CHECK(error({"--warmup", "2000"}).find("--warmup 2000") == 0);
  CHECK(error({"--eval-points", "40000"}).find("--eval-points 40000") == 0);
  CHECK(error({"--batch", "3"}).find("--batch 3") == 0);
  CHECK(error({"--hidden", "x"}).find("--hidden expects an integer") == 0);
  CHECK(error({"--bogus"}).find("unknown option '--bogus'") == 0);
  CHECK(error({"--reshard", "maybe"}).find("--reshard") == 0);
}

TEST_CASE("the ranks compare their options: the first difference is named on every rank") {
  const int W = test::world_size();
  const int R = test::world_rank();
  apps::BoundedComm world(MPI_COMM_WORLD, "test.world", kTimeout);
  Options o = small();
  const auto same = apps::heat::option_values(o);
  REQUIRE(same.size() == 27);  // every flag of --help
  CHECK(same[2] == apps::OptionValue{"--steps", "100"});
  CHECK_NOTHROW(apps::agree_on_options(world, same));
  // Rank-dependent --steps (and, on the last rank, --train-ranks): --steps comes first.
  o.steps = 100 + (R == W - 1 ? 10 : 0);
  if (R == W - 1) o.train_ranks = 1;
  std::string flag = "(none)", message;
  try {
    apps::agree_on_options(world, apps::heat::option_values(o));
  } catch (const apps::OptionMismatch& e) {
    flag = e.flag;
    message = e.message;
  }
  if (W == 1) {
    CHECK(flag == "(none)");
    return;
  }
  CHECK(flag == "--steps");
  CHECK(message.find("--steps differs between ranks (this rank: --steps " +
                     std::to_string(o.steps) + ")") != std::string::npos);
  // Only --train-ranks differs.
  o.steps = 100;
  try {
    apps::agree_on_options(world, apps::heat::option_values(o));
    flag = "(none)";
  } catch (const apps::OptionMismatch& e) {
    flag = e.flag;
  }
  CHECK(flag == "--train-ranks");
}

TEST_CASE("verdict: PASS only against a sound no-change baseline") {
  using apps::heat::decide;
  using apps::heat::EvalResult;
  EvalResult good;
  good.rmse_model = 0.02;
  good.rmse_trivial = 0.1;
  good.points = 256;
  CHECK(good.ratio() == doctest::Approx(0.2));
  CHECK(decide(good, 1.0, 0.1, 0.5).code == 0);
  CHECK(test::contains(decide(good, 1.0, 0.1, 0.5).line, "verdict: PASS"));
  CHECK(decide(good, 1.0, 0.1, 0.1).code == 1);  // ratio 0.2, needs < 0.1
  CHECK(test::contains(decide(good, 1.0, 0.1, 0.1).line, "does not beat no-change"));
  CHECK(decide(good, 0.1, 1.0, 0.5).code == 1);  // the loss rose
  CHECK(test::contains(decide(good, 0.1, 1.0, 0.5).line, "loss did not fall"));
  // A field that does not change (--cfl 1e-300): no-change RMSE 0. The ratio used to be 0
  // and the verdict PASS.
  for (const double trivial : {0.0, std::nan(""), HUGE_VAL}) {
    CAPTURE(trivial);
    EvalResult bad = good;
    bad.rmse_trivial = trivial;
    CHECK_FALSE(bad.baseline_ok());
    CHECK(std::isnan(bad.ratio()));
    const auto v = decide(bad, 1.0, 0.1, 0.5);
    CHECK(v.code == 1);
    CHECK_MESSAGE(test::contains(v.line, "the no-change baseline is degenerate"), v.line);
    CHECK_MESSAGE(test::contains(v.line, "--cfl"), v.line);
  }
  EvalResult none = good;
  none.points = 0;
  CHECK(decide(none, 1.0, 0.1, 0.5).code == 1);
  EvalResult nan_model = good;
  nan_model.rmse_model = std::nan("");
  CHECK(decide(nan_model, 1.0, 0.1, 0.5).code == 1);
}

TEST_CASE("heat-surrogate's training is the session's: its steps replayed through NativeSession") {
  // The surrogate trains on the training ranks' replay buffers; every minibatch it drew is
  // replayed here through the session's C++ API with the configuration the program gives it.
  Options o = small();
  o.hidden = 16;
  o.blocks = 2;
  o.batch = 24;
  o.train_steps = 4;
  o.buffer = 64;
  const int R = test::world_rank();
  apps::heat::Surrogate s(o, MPI_COMM_WORLD, kTimeout, HostProgress::inline_);
  struct Step {
    std::vector<float> x, y;
    int rows;
    std::int64_t global_rows;
    double loss;
  };
  std::vector<Step> steps;
  s.set_step_observer([&](const std::vector<float>& x, const std::vector<float>& y, int rows,
                          std::int64_t global_rows, double loss) {
    steps.push_back({x, y, rows, global_rows, loss});
  });
  const int span = 2 * o.radius + 1, stride = span * span + 2;
  for (int round = 0; round < 3; ++round) {
    std::vector<float> records;
    for (int i = 0; i < 20 + R; ++i)
      for (int j = 0; j < stride; ++j)
        records.push_back(float(std::sin(0.3 * (R * 1000 + round * 100 + i) + 0.7 * j)));
    s.add(records);
    s.train();
  }
  REQUIRE(steps.size() == 12);
  const ss::Config c = apps::heat::Surrogate::session_config(o);
  CHECK(c.model.type == "native");
  CHECK(c.grad_clip == doctest::Approx(o.clip));
  DeviceMesh mesh(MPI_COMM_WORLD, {test::world_size()}, {"shard"}, kTimeout);
  apps::ResidualMlp net(s.model().shape(), o.seed);
  ss::NativeSession replay(mesh, net, c, steps.front().rows);
  for (std::size_t i = 0; i < steps.size(); ++i) {
    CAPTURE(i);
    const Step& st = steps[i];
    const double loss = replay.train_step(st.x.data(), st.y.data(), st.rows, st.global_rows);
    CHECK(std::isfinite(st.loss));
    CHECK(std::abs(loss - st.loss) <= 1e-6 * std::abs(st.loss));
  }
}
