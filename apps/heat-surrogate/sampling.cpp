#include "sampling.hpp"

#include "residual_mlp.hpp"
#include "streams.hpp"

namespace fullshard::apps::heat {

Sampler::Sampler(const Options& o, int first_row, int rows) : o_(o), row0_(first_row), rows_(rows) {
  // Distinct held-out cells; parse_options ensures they fill at most half the centres.
  std::uint64_t index = 0;
  std::vector<Cell> all;
  while (static_cast<int>(all.size()) < o.eval_points) {
    const Cell c = draw(kStreamEval, index++);
    if (held_out_.insert(static_cast<std::int64_t>(c.row) * o.nx + c.col).second) all.push_back(c);
  }
  for (const Cell& c : all)
    if (mine(c)) eval_.push_back(c);
}

Cell Sampler::draw(std::uint64_t stream, std::uint64_t index) const {
  // Centres whose patch lies inside the grid (walls included).
  const int r = o_.radius;
  const int rows = o_.ny - 2 * r, cols = o_.nx - 2 * r;
  Cell c;
  c.row = r + static_cast<int>(uniform01(o_.seed, stream, 2 * index) * rows);
  c.col = r + static_cast<int>(uniform01(o_.seed, stream, 2 * index + 1) * cols);
  if (c.row >= r + rows) c.row = r + rows - 1;  // uniform01 < 1, but be safe
  if (c.col >= r + cols) c.col = r + cols - 1;
  return c;
}

std::vector<Cell> Sampler::train_cells(int round) const {
  std::vector<Cell> out;
  const auto first = static_cast<std::uint64_t>(round - 1) * o_.samples;
  for (std::uint64_t i = first; i < first + o_.samples; ++i) {
    // Redraw (next attempt stream) until the cell is not a held-out one.
    Cell c;
    for (std::uint64_t attempt = 0;; ++attempt) {
      c = draw(kStreamTrain + 0x10000 * attempt, i);
      if (!held_out_.count(static_cast<std::int64_t>(c.row) * o_.nx + c.col)) break;
    }
    if (mine(c)) out.push_back(c);
  }
  return out;
}

}  // namespace fullshard::apps::heat
