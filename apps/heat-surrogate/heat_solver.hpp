// The 2-D heat equation u_t = alpha (u_xx + u_yy) + s on an nx x ny grid (boundary cells
// included), explicit FTCS: u' = u + cfl * (5-point Laplacian of u) + dt * s, with
// cfl = alpha dt / dx^2 <= 1/4 (stable). The rows are decomposed over the simulation ranks;
// each step exchanges one ghost row with each neighbour (MPI_Irecv + MPI_Isend on a
// duplicate of the simulation communicator, waited for under FULLSHARD_TIMEOUT). Kokkos
// kernels on the default execution space.
//
// The forcing changes once per window of K steps (constant within a window, so a sample's
// inputs describe its whole window): moving Gaussian heat sources s, and the bottom wall
// (row 0) held at a travelling sine wave; the other walls are held at 0. The initial field
// is a sum of hot Gaussian blobs plus a warm layer above the heated wall. Everything is drawn
// from the seed, identically on every rank. Time in the forcing is physical (step * dt), so
// the physics does not depend on the grid resolution or the run length.
#pragma once

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <memory>
#include <vector>

#include "bounded_comm.hpp"

#include "options.hpp"

namespace fullshard::apps::heat {

namespace detail {
struct Slab;
}

/// A grid cell by global row and column.
struct Cell {
  int row = 0;
  int col = 0;
};

class HeatSolver {
 public:
  using Exec = Kokkos::DefaultExecutionSpace;
  using Field = Kokkos::View<double**, Kokkos::LayoutRight, Exec::memory_space>;

  /// Collective over `sim_comm` (duplicated for the halo exchange). Sets the initial field,
  /// the forcing of the first window, and fills the ghost rows. Every MPI wait is bounded by
  /// `timeout_s` (FULLSHARD_TIMEOUT; apps::BoundedComm 'heat.sim'): a stopped neighbour
  /// aborts the job with the library's timeout message.
  HeatSolver(const Options& o, MPI_Comm sim_comm, double timeout_s);
  ~HeatSolver();
  HeatSolver(const HeatSolver&) = delete;
  HeatSolver& operator=(const HeatSolver&) = delete;

  /// First global row this rank owns, and how many.
  int first_row() const noexcept { return row0_; }
  int rows() const noexcept { return rows_; }
  /// Solver steps done.
  int step() const noexcept { return step_; }
  double dt() const noexcept { return dt_; }

  /// `n` solver steps. At every multiple of the window length (--interval) the forcing of
  /// the next window is set. Collective over the simulation ranks.
  void advance(int n);

  /// Records of the cells (owned by this rank; the patch must lie inside the grid), one per
  /// cell: the (2R+1)^2 patch values around it (row-major), then the source increment
  /// dt * s * K of the current window at the centre, then 0 (room for the future value).
  /// Collective (exchanges R ghost rows). Appends record_floats() floats per cell to `out`.
  void extract(const std::vector<Cell>& cells, std::vector<float>& out);
  /// The current value of each cell (owned by this rank) into out[i * stride].
  void read(const std::vector<Cell>& cells, float* out, int stride);

  /// Floats per record: (2R+1)^2 + 2.
  int record_floats() const noexcept { return patch_ + 2; }

  /// Global field mean and maximum (collective).
  void field_stats(double& mean, double& max) const;

 private:
  void set_forcing();
  void exchange(int width);
  void upload_cells(const std::vector<Cell>& cells);
  detail::Slab slab() const;

  Options o_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::unique_ptr<apps::BoundedComm> halo_;  // comm_ with bounded waits
  int rank_ = 0, size_ = 1;
  int row0_ = 0, rows_ = 0;
  int ghost_ = 1;  // ghost rows on each side (the patch radius)
  int patch_ = 0;  // (2R+1)^2
  int step_ = 0;
  double dx_ = 1, dt_ = 1;
  Field u_, next_;
  Field src_;                                           // dt * s for each owned cell, this window
  Kokkos::View<double**, Exec::memory_space> sources_;  // per source: x, y, width, amplitude
  Kokkos::View<int**, Exec::memory_space> cells_;       // (n, 2): local row, column
  Kokkos::View<float**, Kokkos::LayoutRight, Exec::memory_space> records_;
  // Ghost-row staging for MPI when the field is not in host-accessible memory.
  Kokkos::View<double*, Kokkos::HostSpace> send_up_, send_down_, recv_up_, recv_down_;
};

}  // namespace fullshard::apps::heat
