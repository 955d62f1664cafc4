// heat-surrogate: a 2-D heat-equation solver (Kokkos, rows over the ranks, MPI halo exchange)
// that trains a fully_shard'ed MLP surrogate in situ on samples of its live field, and
// reports the surrogate's error on held-out points against the "no change" predictor.
//
//   mpirun -n 4 heat-surrogate                    every rank simulates and trains, in turn
//   mpirun -n 4 heat-surrogate --train-ranks 2    ranks 0-1 train, ranks 2-3 simulate
//
// One round = K solver steps (--interval). At the start of round k each simulation rank
// extracts the patches of its sample positions; at its end it reads the centres' values
// (the targets) and hands the records to the trainers, which add them to their replay
// buffers and take --train-steps optimizer steps. Rank 0 prints the progress lines.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "blas_kernel.hpp"
#include "cli.hpp"
#include "fullshard/runtime/runtime.hpp"
#include "heat_solver.hpp"
#include "options.hpp"
#include "sampling.hpp"
#include "surrogate.hpp"
#include "transport.hpp"

namespace {

namespace apps = fullshard::apps;
namespace heat = fullshard::apps::heat;
using Clock = std::chrono::steady_clock;

// Exit codes.
constexpr int kPass = 0, kFail = 1, kUsage = 2, kRunError = 3;
// The first entry of the options the ranks compare: whether this rank accepted its own.
constexpr const char* kAccepted = "(options accepted)";

// The records of one round that a simulation rank is filling: inputs now, targets K steps on.
struct Pending {
  std::vector<heat::Cell> train_cells, eval_cells;
  heat::RoundRecords records;
};

Pending start_round(heat::HeatSolver& solver, const heat::Sampler& sampler, const heat::Options& o,
                    int round) {
  Pending p;
  p.train_cells = sampler.train_cells(round);
  solver.extract(p.train_cells, p.records.train);
  if (heat::Sampler::is_report_round(o, round)) {
    p.eval_cells = sampler.eval_cells();
    solver.extract(p.eval_cells, p.records.eval);
  }
  return p;
}

void finish_round(heat::HeatSolver& solver, Pending& p) {
  const int stride = solver.record_floats();
  // The last float of each record is the centre's value now, K steps after the inputs.
  if (!p.train_cells.empty())
    solver.read(p.train_cells, p.records.train.data() + stride - 1, stride);
  if (!p.eval_cells.empty()) solver.read(p.eval_cells, p.records.eval.data() + stride - 1, stride);
}

int run(const fullshard::Runtime& rt, const heat::Options& o) {
  const auto t_start = Clock::now();
  const int rank = rt.rank();
  const bool printer = rank == 0;
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - t_start).count(); };

  const double timeout_s = rt.settings().timeout_s;
  heat::Roles roles(rt.world(), o.train_ranks, timeout_s);
  std::optional<heat::HeatSolver> solver;
  std::optional<heat::Sampler> sampler;
  std::optional<heat::Surrogate> surrogate;
  if (roles.simulates()) {
    solver.emplace(o, roles.sim_comm(), timeout_s);
    sampler.emplace(o, solver->first_row(), solver->rows());
  }
  if (roles.trains())
    surrogate.emplace(o, roles.train_comm(), timeout_s, rt.settings().host_progress);
  const int span = 2 * o.radius + 1;
  const int stride = span * span + 2;

  if (printer) {
    std::printf(
        "heat-surrogate: %d x %d grid, %d solver steps (cfl %.3g), %d hot blobs, "
        "%d moving sources, heated bottom wall\n",
        o.nx, o.ny, o.steps, o.cfl, o.blobs, o.sources);
    if (roles.split())
      std::printf(
          "ranks: %d simulate (~%d rows each), %d train (ranks 0-%d); samples go over MPI\n",
          roles.sim_ranks(), o.ny / roles.sim_ranks(), roles.train_ranks(),
          roles.train_ranks() - 1);
    else
      std::printf("ranks: %d, each simulates ~%d rows and trains, in turn\n", roles.sim_ranks(),
                  o.ny / roles.sim_ranks());
    std::printf(
        "samples: %d per round of %d steps, %dx%d patches -> centre %d steps later; "
        "%d held-out points\n",
        o.samples, o.interval, span, span, o.interval, o.eval_points);
    std::printf(
        "surrogate: residual MLP %d inputs, %d blocks x %d hidden, %lld parameters, "
        "fully_shard over %d training ranks; AdamW lr %.3g, batch %d, %d step(s) per round\n",
        span * span + 1, o.blocks, o.hidden, static_cast<long long>(surrogate->num_params()),
        surrogate->mesh().size(), o.lr, o.batch, o.train_steps);
    std::fflush(stdout);
  }

  std::optional<heat::SampleSender> sender;
  if (roles.split() && roles.simulates()) sender.emplace(roles, stride);

  Pending pending;
  if (solver) pending = start_round(*solver, *sampler, o, 1);
  double first_loss = 0, last_loss = 0;
  heat::EvalResult last_eval;
  heat::TrainProgress progress;
  const int rounds = o.rounds();
  for (int k = 1; k <= rounds; ++k) {
    heat::RoundRecords done;
    if (solver) {
      solver->advance(o.interval);
      finish_round(*solver, pending);
      done = std::move(pending.records);
      if (k < rounds) pending = start_round(*solver, *sampler, o, k + 1);
      if (sender) sender->send(done);
    }
    if (!surrogate) continue;
    if (roles.split()) done = heat::receive_round(roles, stride);
    surrogate->add(done.train);
    surrogate->train();
    const bool report = heat::Sampler::is_report_round(o, k);
    if (k == 1 || report) {
      progress = surrogate->take_progress();
      if (k == 1) first_loss = progress.loss;
      last_loss = progress.loss;
    }
    if (report) {
      last_eval = surrogate->evaluate(done.eval);
      if (printer) {
        std::printf(
            "step %d samples %lld loss %.4g rmse %.4g no-change %.4g ratio %.3f "
            "elapsed %.1fs\n",
            k * o.interval, static_cast<long long>(progress.received), progress.loss,
            last_eval.rmse_model, last_eval.rmse_trivial, last_eval.ratio(), elapsed());
        std::fflush(stdout);
      }
    }
  }
  if (sender) sender->finish();

  // Rank 0 decides; every rank exits with its verdict.
  int code = kPass;
  if (printer) {
    const double ratio = last_eval.ratio();
    std::printf(
        "summary: %d rounds (%d solver steps), %lld samples received, %lld trained on "
        "(with repetition), wall %.1f s\n",
        rounds, rounds * o.interval, static_cast<long long>(progress.received),
        static_cast<long long>(progress.presented), elapsed());
    std::printf(
        "held-out (%lld points, last round): surrogate RMSE %.4g, no-change RMSE %.4g, "
        "ratio %.3f\n",
        static_cast<long long>(last_eval.points), last_eval.rmse_model, last_eval.rmse_trivial,
        ratio);
    std::printf("loss (normalised): first round %.4g -> last %.4g\n", first_loss, last_loss);
    const heat::Verdict verdict = heat::decide(last_eval, first_loss, last_loss, o.pass_ratio);
    code = verdict.code == 0 ? kPass : kFail;
    std::printf("%s\n", verdict.line.c_str());
    std::fflush(stdout);
  }
  roles.transfer().bcast(&code, 1, MPI_INT, 0, "verdict");
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  apps::run_on_best_blas_kernel(argv);
  bool help = apps::take_help(argc, argv);
  int args_count = argc;
  char** args_data = argv;
  std::optional<fullshard::Runtime> rt;
  try {
    rt.emplace(args_count, args_data);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "heat-surrogate: %s\n", e.what());
    return apps::startup_exit_code(e, kRunError);
  }
  const int rank = rt->rank();
  try {
    if (!help) {
      heat::Options o;
      std::optional<apps::UsageError> refused;
      try {
        o = heat::parse_options(args_count, args_data, help);
      } catch (const apps::UsageError& e) {
        refused = e;
      }
      if (!help) {
        // Before any other communication: every rank must have accepted the same options
        // (a mismatch would hang or compute nonsense). A rank that refused its options
        // compares the defaults, so the first entry tells the others.
        apps::BoundedComm world(rt->world(), "heat.world", rt->settings().timeout_s);
        std::vector<apps::OptionValue> values = heat::option_values(refused ? heat::Options{} : o);
        values.insert(values.begin(), {kAccepted, refused ? "no" : "yes"});
        try {
          apps::agree_on_options(world, values);
        } catch (const apps::OptionMismatch& e) {
          // Every rank gets here and says why: this rank's own error, or the difference.
          std::fprintf(stderr, "heat-surrogate: rank %d: %s\n", rank,
                       refused               ? (refused->message + " (see --help)").c_str()
                       : e.flag == kAccepted ? "another rank refused its options (see its message)"
                                             : e.message.c_str());
          return kUsage;
        }
        if (refused) throw *refused;
        heat::check_world(o, rt->world_size());
        return run(*rt, o);
      }
    }
    if (rank == 0) std::fputs(heat::usage(), stdout);
    return kPass;
  } catch (const apps::UsageError& e) {
    // The ranks agreed on their options first, so every rank gets here: no one is left
    // waiting.
    if (rank == 0) std::fprintf(stderr, "heat-surrogate: %s (see --help)\n", e.message.c_str());
    return kUsage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "heat-surrogate: rank %d: %s\n", rank, apps::one_line(e.what()).c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, kRunError);  // other ranks may be inside a collective
    return kRunError;
  }
}
