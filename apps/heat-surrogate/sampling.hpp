// Where the samples come from. Every simulation rank draws the same global sequence of
// positions (counter-based, from the seed) and keeps those in its rows, so the samples do
// not depend on the decomposition. The held-out positions are a fixed set drawn once; the
// training positions never hit one of them.
//
// A record (HeatSolver::extract) is (2R+1)^2 patch values at the round's start, the source
// increment of the window at the centre, and the centre's value K solver steps later.
#pragma once

#include <cstdint>
#include <unordered_set>
#include <vector>

#include "heat_solver.hpp"
#include "options.hpp"

namespace fullshard::apps::heat {

class Sampler {
 public:
  /// For the simulation rank owning global rows [first_row, first_row + rows).
  Sampler(const Options& o, int first_row, int rows);

  /// This rank's training positions for `round` (1-based; inputs at step (round-1) K).
  std::vector<Cell> train_cells(int round) const;
  /// This rank's held-out positions (fixed).
  const std::vector<Cell>& eval_cells() const noexcept { return eval_; }
  /// Whether `round` ends with a progress line and a held-out evaluation: every
  /// --report-every rounds, the last round, and rounds 1, 2, 4, 8, ... before the first
  /// (where the surrogate learns most).
  static bool is_report_round(const Options& o, int round) noexcept {
    const bool early_power_of_two = round < o.report_every && (round & (round - 1)) == 0;
    return round % o.report_every == 0 || round == o.rounds() || early_power_of_two;
  }

 private:
  Cell draw(std::uint64_t stream, std::uint64_t index) const;
  bool mine(const Cell& c) const noexcept { return c.row >= row0_ && c.row < row0_ + rows_; }

  Options o_;
  int row0_, rows_;
  std::unordered_set<std::int64_t> held_out_;  // every rank's held-out cells (row * nx + col)
  std::vector<Cell> eval_;
};

}  // namespace fullshard::apps::heat
