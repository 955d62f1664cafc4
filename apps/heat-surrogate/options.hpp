// heat-surrogate's command line: every flag, its default and its check.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "bounded_comm.hpp"
#include "cli.hpp"
#include "fullshard/schedule/plan.hpp"

namespace fullshard::apps::heat {

struct Options {
  // The simulation.
  int nx = 256;      // grid columns (boundary columns included)
  int ny = 256;      // grid rows (boundary rows included), decomposed over the sim ranks
  int steps = 4000;  // solver steps
  int interval = 4;  // K: solver steps per round (sample interval and prediction horizon)
  double cfl = 0.2;  // alpha dt / dx^2 (FTCS is stable up to 0.25)
  int blobs = 6;     // initial hot Gaussian blobs
  int sources = 3;   // moving heat sources
  // Sampling.
  int radius = 2;         // patch radius R: (2R+1)^2 input values
  int samples = 512;      // training samples per round, over all sim ranks together
  int eval_points = 512;  // held-out positions (never trained on)
  int report_every = 50;  // rounds between progress lines (and held-out evaluations)
  // The surrogate and its training.
  int hidden = 64;
  int blocks = 2;       // residual blocks (0: input and output layers only)
  int batch = 256;      // global minibatch of one optimizer step
  int train_steps = 1;  // optimizer steps per round
  int buffer = 8192;    // replay buffer capacity per training rank
  double lr = 3e-3;
  double weight_decay = 0.0;
  int warmup = -1;    // optimizer steps of linear warm-up (-1: warmup_steps())
  double clip = 1.0;  // global gradient-norm clip (0: off)
  std::uint64_t seed = 1;
  int train_ranks = 0;         // 0: every rank simulates and trains (time-sliced)
  double pass_ratio = 0.5;     // verdict: surrogate RMSE / no-change RMSE must end below this
  schedule::PlanOptions plan;  // --prefetch, --reshard, --param-dtype, --reduce-dtype

  int rounds() const noexcept { return steps / interval; }
  int optimizer_steps() const noexcept { return rounds() * train_steps; }
  /// --warmup, or by default 50 steps but at most a tenth of the optimizer steps.
  int warmup_steps() const noexcept {
    return warmup >= 0 ? warmup : std::min(50, optimizer_steps() / 10);
  }
};

/// The --help text.
const char* usage();

/// Parses and checks the flags (not the world size: see check_world). Sets `help` when
/// --help was given (the other flags are then not checked). Throws apps::UsageError.
Options parse_options(int argc, char** argv, bool& help);

/// Every flag with its effective value (defaults included), in --help order: what the ranks
/// compare at start (apps::agree_on_options), so that ranks given different options stop with
/// an error naming the first differing flag instead of hanging or computing nonsense.
std::vector<OptionValue> option_values(const Options& o);

/// Checks what depends on the world size: the split into simulation and training ranks and
/// the row decomposition. Throws apps::UsageError naming the flag.
void check_world(const Options& o, int world_size);

}  // namespace fullshard::apps::heat
