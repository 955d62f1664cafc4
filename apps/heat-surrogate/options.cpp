#include "options.hpp"

#include <cstdio>
#include <optional>
#include <string>

#include "fullshard/base/dtype.hpp"

namespace fullshard::apps::heat {
namespace {

const char* const kUsage =
    "usage: mpirun -n N heat-surrogate [options]\n"
    "\n"
    "Solves the 2-D heat equation u_t = alpha (u_xx + u_yy) + s (explicit FTCS, rows\n"
    "decomposed over the simulation ranks with MPI halo exchange) from hot Gaussian blobs,\n"
    "with moving heat sources s and a bottom wall heated by a travelling wave. Every K solver\n"
    "steps (a round) it samples (2R+1)^2 stencil patches of the live field and trains, in\n"
    "situ, a fully_shard'ed residual MLP to predict the value at the patch centre K steps\n"
    "later. Progress lines compare the surrogate's error on held-out points (never trained\n"
    "on) with the error of predicting \"no change\".\n"
    "\n"
    "simulation:\n"
    "  --nx N              grid columns, boundary included (default 256)\n"
    "  --ny N              grid rows, boundary included; split over the sim ranks (default 256)\n"
    "  --steps S           solver steps (default 4000); S / K rounds\n"
    "  --interval K        solver steps per round: sample interval and prediction horizon\n"
    "                      (default 4)\n"
    "  --cfl C             alpha dt / dx^2, in (0, 0.25] (default 0.2)\n"
    "  --blobs N           initial hot blobs (default 6)\n"
    "  --sources N         moving heat sources (default 3)\n"
    "sampling:\n"
    "  --radius R          patch radius: (2R+1)^2 inputs (default 2)\n"
    "  --samples N         training samples per round, all sim ranks together (default 512)\n"
    "  --eval-points N     fixed held-out positions, never trained on (default 512)\n"
    "  --report-every N    rounds between progress lines / held-out evaluations, plus rounds\n"
    "                      1, 2, 4, 8, ... before the first (default 50)\n"
    "surrogate and training:\n"
    "  --hidden H          MLP hidden size (default 64)\n"
    "  --blocks L          residual blocks (default 2)\n"
    "  --batch B           global minibatch per optimizer step (default 256)\n"
    "  --train-steps N     optimizer steps per round (default 1)\n"
    "  --buffer N          replay buffer capacity per training rank, samples (default 8192)\n"
    "  --lr X              AdamW peak learning rate (default 3e-3); warm-up + cosine decay\n"
    "  --weight-decay X    AdamW weight decay (default 0)\n"
    "  --warmup N          optimizer steps of learning-rate warm-up (default 50, at most a\n"
    "                      tenth of the optimizer steps)\n"
    "  --clip X            global gradient-norm clip, 0 = off (default 1)\n"
    "  --param-dtype T     mixed precision: dtype of the unsharded parameters (f32, bf16, f16)\n"
    "  --reduce-dtype T    mixed precision: dtype of the gradient reduce-scatter\n"
    "  --prefetch D        forward prefetch depth (default 0)\n"
    "  --reshard true|false|auto|K\n"
    "                      reshard_after_forward of every group (default auto)\n"
    "  --seed N            seed of the initial field, the sampling and the model (default 1)\n"
    "ranks:\n"
    "  --train-ranks T     0 (default): every rank simulates and trains, in turn; T >= 1:\n"
    "                      ranks 0..T-1 train, the other ranks simulate and send them samples\n"
    "verdict:\n"
    "  --pass-ratio X      exit 0 only if the final held-out RMSE ratio surrogate / no-change\n"
    "                      is below X and the loss fell (default 0.5)\n"
    "  --help              print this help\n"
    "\n"
    "Exit status: 0 the surrogate beat no-change, 1 it did not, 2 bad options, 3 a run error.\n";

}  // namespace

const char* usage() {
  return kUsage;
}

Options parse_options(int argc, char** argv, bool& help) {
  Options o;
  help = false;
  std::optional<DType> param_dtype, reduce_dtype;
  ArgParser a(argc, argv);
  const int kBig = 1 << 20;
  while (a.next()) {
    const std::string& f = a.flag();
    if (f == "--help") {
      help = true;
      return o;
    } else if (f == "--nx")
      o.nx = a.int_value(8, 1 << 15);
    else if (f == "--ny")
      o.ny = a.int_value(8, 1 << 15);
    else if (f == "--steps")
      o.steps = a.int_value(1, 1 << 28);
    else if (f == "--interval")
      o.interval = a.int_value(1, 1000);
    else if (f == "--cfl") {
      o.cfl = a.double_value(0.0, 0.25);
      if (o.cfl <= 0) throw UsageError{"--cfl must be > 0 (FTCS is stable for 0 < C <= 0.25)"};
    } else if (f == "--blobs")
      o.blobs = a.int_value(0, 1000);
    else if (f == "--sources")
      o.sources = a.int_value(0, 100);
    else if (f == "--radius")
      o.radius = a.int_value(1, 8);
    else if (f == "--samples")
      o.samples = a.int_value(1, kBig);
    else if (f == "--eval-points")
      o.eval_points = a.int_value(1, kBig);
    else if (f == "--report-every")
      o.report_every = a.int_value(1, 1 << 28);
    else if (f == "--hidden")
      o.hidden = a.int_value(1, 1 << 14);
    else if (f == "--blocks")
      o.blocks = a.int_value(0, 256);
    else if (f == "--batch")
      o.batch = a.int_value(1, kBig);
    else if (f == "--train-steps")
      o.train_steps = a.int_value(1, 10000);
    else if (f == "--buffer")
      o.buffer = a.int_value(1, 1 << 26);
    else if (f == "--lr") {
      o.lr = a.double_value(0.0, 10.0);
      if (o.lr <= 0) throw UsageError{"--lr must be > 0"};
    } else if (f == "--weight-decay")
      o.weight_decay = a.double_value(0.0, 10.0);
    else if (f == "--warmup")
      o.warmup = a.int_value(0, 1 << 28);
    else if (f == "--clip")
      o.clip = a.double_value(0.0, 1e12);
    else if (f == "--param-dtype")
      param_dtype = a.dtype_value();
    else if (f == "--reduce-dtype")
      reduce_dtype = a.dtype_value();
    else if (f == "--prefetch")
      o.plan.forward_prefetch_depth = a.int_value(0, 64);
    else if (f == "--reshard")
      o.plan.defaults.reshard_after_forward = a.reshard_value();
    else if (f == "--seed")
      o.seed = static_cast<std::uint64_t>(a.int64_value(0));
    else if (f == "--train-ranks")
      o.train_ranks = a.int_value(0, kBig);
    else if (f == "--pass-ratio") {
      o.pass_ratio = a.double_value(0.0, 1e6);
      if (o.pass_ratio <= 0) throw UsageError{"--pass-ratio must be > 0"};
    } else
      a.unknown();
  }
  // Mixed precision as in fullshard-train: with a low-precision param dtype the gradients are
  // reduced in f32 unless --reduce-dtype says otherwise.
  auto& mp = o.plan.defaults.mp_policy;
  mp.param_dtype = param_dtype;
  mp.reduce_dtype =
      reduce_dtype ? reduce_dtype : (param_dtype ? std::optional(DType::f32) : std::nullopt);

  // Checks between flags.
  const int span = 2 * o.radius + 1;
  if (o.nx < span + 2 || o.ny < span + 2)
    throw UsageError{
        "--nx and --ny must be at least 2 * --radius + 3 = " + std::to_string(span + 2) + " (got " +
        std::to_string(o.nx) + " x " + std::to_string(o.ny) + ")"};
  if (o.steps < 2 * o.interval)
    throw UsageError{"--steps " + std::to_string(o.steps) + " must be at least 2 * --interval (" +
                     std::to_string(2 * o.interval) + "): two rounds or more"};
  const long long centres =
      static_cast<long long>(o.nx - 2 * o.radius) * static_cast<long long>(o.ny - 2 * o.radius);
  if (2LL * o.eval_points > centres)
    throw UsageError{"--eval-points " + std::to_string(o.eval_points) +
                     " is more than half of the " + std::to_string(centres) +
                     " patch centres of the grid (lower it or enlarge --nx/--ny)"};
  const long long total_steps = static_cast<long long>(o.rounds()) * o.train_steps;
  if (total_steps > (1 << 30))
    throw UsageError{"--steps / --interval x --train-steps gives more than 2^30 optimizer steps"};
  if (o.warmup >= total_steps)
    throw UsageError{"--warmup " + std::to_string(o.warmup) +
                     " must be below the number of optimizer steps (" +
                     std::to_string(total_steps) + " = rounds x --train-steps)"};
  return o;
}

std::vector<OptionValue> option_values(const Options& o) {
  auto num = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%.17g", v);
    return std::string(b);
  };
  auto dtype = [](const std::optional<DType>& t) {
    return t ? std::string(dtype_name(*t)) : std::string("(parameter dtype)");
  };
  const auto& mp = o.plan.defaults.mp_policy;
  return {{"--nx", std::to_string(o.nx)},
          {"--ny", std::to_string(o.ny)},
          {"--steps", std::to_string(o.steps)},
          {"--interval", std::to_string(o.interval)},
          {"--cfl", num(o.cfl)},
          {"--blobs", std::to_string(o.blobs)},
          {"--sources", std::to_string(o.sources)},
          {"--radius", std::to_string(o.radius)},
          {"--samples", std::to_string(o.samples)},
          {"--eval-points", std::to_string(o.eval_points)},
          {"--report-every", std::to_string(o.report_every)},
          {"--hidden", std::to_string(o.hidden)},
          {"--blocks", std::to_string(o.blocks)},
          {"--batch", std::to_string(o.batch)},
          {"--train-steps", std::to_string(o.train_steps)},
          {"--buffer", std::to_string(o.buffer)},
          {"--lr", num(o.lr)},
          {"--weight-decay", num(o.weight_decay)},
          {"--warmup", std::to_string(o.warmup)},
          {"--clip", num(o.clip)},
          {"--param-dtype", dtype(mp.param_dtype)},
          {"--reduce-dtype", dtype(mp.reduce_dtype)},
          {"--prefetch", std::to_string(o.plan.forward_prefetch_depth)},
          {"--reshard", o.plan.defaults.reshard_after_forward.to_string()},
          {"--seed", std::to_string(o.seed)},
          {"--train-ranks", std::to_string(o.train_ranks)},
          {"--pass-ratio", num(o.pass_ratio)}};
}

void check_world(const Options& o, int world_size) {
  if (o.train_ranks > 0 && o.train_ranks >= world_size)
    throw UsageError{"--train-ranks " + std::to_string(o.train_ranks) +
                     " leaves no simulation rank among the " + std::to_string(world_size) +
                     " ranks (use 0 to simulate and train on every rank)"};
  const int trainers = o.train_ranks == 0 ? world_size : o.train_ranks;
  const int sims = o.train_ranks == 0 ? world_size : world_size - o.train_ranks;
  const int ghost = o.radius;  // ghost rows come from the neighbour's owned rows
  if (o.ny / sims < ghost)
    throw UsageError{"--ny " + std::to_string(o.ny) + " gives fewer than --radius (" +
                     std::to_string(ghost) + ") rows to some of the " + std::to_string(sims) +
                     " simulation ranks"};
  if (o.batch < trainers)
    throw UsageError{"--batch " + std::to_string(o.batch) + " is smaller than the number of " +
                     "training ranks (" + std::to_string(trainers) + ")"};
}

}  // namespace fullshard::apps::heat
