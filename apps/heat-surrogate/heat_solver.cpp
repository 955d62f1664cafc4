#include "heat_solver.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "fullshard/base/error.hpp"
#include "residual_mlp.hpp"
#include "streams.hpp"

namespace fullshard::apps::heat {
namespace {

constexpr double kPi = 3.14159265358979323846;
// Time scale of the forcing: about the default run (4000 steps at cfl 0.2 on 256 columns),
// over which a blob of the initial field spreads by ~0.16 of the domain width.
constexpr double kPeriod = 0.0125;

// Views whose memory MPI can read and write directly (host memory).
constexpr bool kHostField =
    Kokkos::SpaceAccessibility<Kokkos::HostSpace, HeatSolver::Field::memory_space>::accessible;

}  // namespace

// The kernels, as free functions with external linkage: CUDA's extended lambdas may not sit
// in constructors or private member functions.
namespace detail {

using Exec = HeatSolver::Exec;
using Field = HeatSolver::Field;
using Table = Kokkos::View<double**, Exec::memory_space>;
using Cells = Kokkos::View<int**, Exec::memory_space>;
using Records = Kokkos::View<float**, Kokkos::LayoutRight, Exec::memory_space>;
using Range2 = Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2>>;

/// Where this rank's rows sit: owned local row i is u(i + ghost, .), global row row0 + i.
struct Slab {
  int nx, ny, ghost, row0, rows;
  double dx;
};

void init_field(const Field& u, const Slab& sl, const Table& blobs, int nblobs) {
  const int g = sl.ghost, r0 = sl.row0, nx = sl.nx, ny = sl.ny;
  const double dx = sl.dx, two_pi = 2 * kPi;
  Kokkos::parallel_for(
      "heat::init", Range2({0, 0}, {sl.rows, nx}), KOKKOS_LAMBDA(int i, int j) {
        const int row = r0 + i;
        double v = 0;
        if (row > 0 && row < ny - 1 && j > 0 && j < nx - 1) {
          const double x = j * dx, y = row * dx;
          for (int b = 0; b < nblobs; ++b) {
            const double ddx = x - blobs(b, 0), ddy = y - blobs(b, 1), w = blobs(b, 2);
            v += blobs(b, 3) * exp(-(ddx * ddx + ddy * ddy) / (2 * w * w));
          }
          // A warm layer above the heated wall (its value at t = 0), so that the run does not
          // start with a jump at the wall.
          v += 0.8 * (0.5 + 0.5 * sin(two_pi * 2 * x)) * exp(-y / 0.03);
        }
        u(i + g, j) = v;
      });
}

void set_forcing(const Field& src, const Field& u, const Field& next, const Slab& sl,
                 const Table& sources, int nsrc, double wave) {
  const int g = sl.ghost, r0 = sl.row0, nx = sl.nx, ny = sl.ny;
  const double dx = sl.dx, two_pi = 2 * kPi;
  Kokkos::parallel_for(
      "heat::forcing", Range2({0, 0}, {sl.rows, nx}), KOKKOS_LAMBDA(int i, int j) {
        const int row = r0 + i;
        const double x = j * dx, y = row * dx;
        double s = 0;
        for (int k = 0; k < nsrc; ++k) {
          const double ddx = x - sources(k, 0), ddy = y - sources(k, 1), w = sources(k, 2);
          s += sources(k, 3) * exp(-(ddx * ddx + ddy * ddy) / (2 * w * w));
        }
        src(i, j) = s;
        if (row == 0) {
          const double v = 0.8 * (0.5 + 0.5 * sin(two_pi * 2 * x - wave));
          u(i + g, j) = v;
          next(i + g, j) = v;
        } else if (row == ny - 1 || j == 0 || j == nx - 1) {
          u(i + g, j) = 0;
          next(i + g, j) = 0;
        }
      });
}

// next = u + c * laplacian(u) + src on local rows [lo, hi), columns [1, nx - 1).
void ftcs(const Field& u, const Field& next, const Field& src, int lo, int hi, int nx, int g,
          double c) {
  Kokkos::parallel_for(
      "heat::ftcs", Range2({lo, 1}, {hi, nx - 1}), KOKKOS_LAMBDA(int i, int j) {
        next(i, j) = u(i, j) +
                     c * (u(i - 1, j) + u(i + 1, j) + u(i, j - 1) + u(i, j + 1) - 4 * u(i, j)) +
                     src(i - g, j);
      });
}

void gather_patches(const Field& u, const Field& src, const Cells& cell, const Records& rec, int n,
                    int radius, int g, double window) {
  const int span = 2 * radius + 1, p = span * span;
  Kokkos::parallel_for(
      "heat::extract", Kokkos::RangePolicy<Exec>(0, n), KOKKOS_LAMBDA(int s) {
        const int i = cell(s, 0), j = cell(s, 1);
        for (int a = 0; a < span; ++a)
          for (int b = 0; b < span; ++b)
            rec(s, a * span + b) = static_cast<float>(u(i + a - radius, j + b - radius));
        rec(s, p) = static_cast<float>(src(i - g, j) * window);
        rec(s, p + 1) = 0.0f;
      });
}

void gather_values(const Field& u, const Cells& cell, const Records& rec, int n) {
  Kokkos::parallel_for(
      "heat::read", Kokkos::RangePolicy<Exec>(0, n),
      KOKKOS_LAMBDA(int s) { rec(s, 0) = static_cast<float>(u(cell(s, 0), cell(s, 1))); });
}

void sum_and_max(const Field& u, const Slab& sl, double& sum, double& top) {
  const int g = sl.ghost;
  Kokkos::parallel_reduce(
      "heat::sum", Range2({0, 0}, {sl.rows, sl.nx}),
      KOKKOS_LAMBDA(int i, int j, double& acc) { acc += u(i + g, j); }, sum);
  Kokkos::parallel_reduce(
      "heat::max", Range2({0, 0}, {sl.rows, sl.nx}),
      KOKKOS_LAMBDA(int i, int j, double& acc) {
        if (u(i + g, j) > acc) acc = u(i + g, j);
      },
      Kokkos::Max<double>(top));
}

}  // namespace detail

HeatSolver::HeatSolver(const Options& o, MPI_Comm sim_comm, double timeout_s) : o_(o) {
  MPI_Comm_rank(sim_comm, &rank_);
  MPI_Comm_size(sim_comm, &size_);
  // Rows split as evenly as possible; the first ny % size ranks get one more.
  rows_ = o.ny / size_ + (rank_ < o.ny % size_ ? 1 : 0);
  row0_ = rank_ * (o.ny / size_) + std::min(rank_, o.ny % size_);
  ghost_ = o.radius;
  // The halo exchange sends each neighbour `ghost_` owned rows: a rank needs that many.
  if (rows_ < std::max(ghost_, 1))
    throw fullshard::InvalidArgument(
        "heat solver: rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
        " simulation ranks owns " + std::to_string(rows_) + " rows of --ny " +
        std::to_string(o.ny) + ", fewer than the halo width " + std::to_string(ghost_) +
        " (--radius): use fewer simulation ranks or a taller grid");
  comm_ = apps::BoundedComm::dup(sim_comm, "heat.sim", timeout_s);
  halo_ = std::make_unique<apps::BoundedComm>(comm_, "heat.sim", timeout_s);
  const int span = 2 * o.radius + 1;
  patch_ = span * span;
  dx_ = 1.0 / (o.nx - 1);
  dt_ = o.cfl * dx_ * dx_;  // alpha = 1

  const int nx = o.nx;
  const int halo_rows = rows_ + 2 * ghost_;
  u_ = Field("heat::u", halo_rows, nx);
  next_ = Field("heat::next", halo_rows, nx);
  src_ = Field("heat::source", rows_, nx);
  sources_ = decltype(sources_)("heat::sources", std::max(o.sources, 1), 4);
  if constexpr (!kHostField) {
    const auto n = static_cast<std::size_t>(ghost_) * nx;
    send_up_ = decltype(send_up_)("heat::send_up", n);
    send_down_ = decltype(send_down_)("heat::send_down", n);
    recv_up_ = decltype(recv_up_)("heat::recv_up", n);
    recv_down_ = decltype(recv_down_)("heat::recv_down", n);
  }

  // Initial field: hot blobs (x in [0, 1], y in [0, ly]); walls are set by set_forcing.
  const double ly = (o.ny - 1) * dx_;
  const int nb = std::max(o.blobs, 1);
  Kokkos::View<double**, Exec::memory_space> blobs("heat::blobs", nb, 4);
  auto hb = Kokkos::create_mirror_view(blobs);
  for (int b = 0; b < o.blobs; ++b) {
    auto draw = [&](int k) { return uniform01(o.seed, kStreamBlobs, 4ULL * b + k); };
    hb(b, 0) = 0.1 + 0.8 * draw(0);
    hb(b, 1) = (0.1 + 0.8 * draw(1)) * ly;
    hb(b, 2) = 0.03 + 0.04 * draw(2);
    hb(b, 3) = 0.5 + 0.5 * draw(3);
  }
  Kokkos::deep_copy(blobs, hb);
  detail::init_field(u_, slab(), blobs, o.blobs);
  Kokkos::deep_copy(next_, u_);
  set_forcing();
}

HeatSolver::~HeatSolver() {
  halo_.reset();
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

detail::Slab HeatSolver::slab() const {
  return detail::Slab{o_.nx, o_.ny, ghost_, row0_, rows_, dx_};
}

void HeatSolver::set_forcing() {
  const Options& o = o_;
  // Physical time in units of kPeriod (the orbit time scale): the forcing, like the
  // diffusion, does not depend on the grid resolution or the run length.
  const double t = step_ * dt_ / kPeriod;
  const double ly = (o.ny - 1) * dx_;
  // Sources orbit the domain centre; each deposits ~0.5 (peak) while it passes a point.
  auto hs = Kokkos::create_mirror_view(sources_);
  for (int k = 0; k < o.sources; ++k) {
    auto draw = [&](int i) { return uniform01(o.seed, kStreamSources, 8ULL * k + i); };
    const double rho = (0.15 + 0.2 * draw(0)) * std::min(1.0, ly);
    const double phase = 2 * kPi * draw(1);
    const double dir = draw(2) < 0.5 ? -1.0 : 1.0;
    const double revs = 0.5 + draw(3);
    const double width = 0.03 + 0.02 * draw(4);
    const double angle = phase + dir * 2 * kPi * revs * t;
    const double speed = 2 * kPi * rho * revs / kPeriod;  // x units per unit time
    hs(k, 0) = 0.5 + rho * std::cos(angle);
    hs(k, 1) = 0.5 * ly + rho * std::sin(angle);
    hs(k, 2) = width;
    hs(k, 3) = dt_ * 0.25 * speed / width * (1.5 + draw(5));  // dt * s at the peak
  }
  Kokkos::deep_copy(sources_, hs);

  const double wave = 2 * kPi * 3.0 * t;  // the wall's wave: 3 periods per kPeriod
  detail::set_forcing(src_, u_, next_, slab(), sources_, o.sources, wave);
}

void HeatSolver::exchange(int width) {
  const int nx = o_.nx;
  const int count = width * nx;
  const int up = rank_ > 0 ? rank_ - 1 : MPI_PROC_NULL;
  const int down = rank_ + 1 < size_ ? rank_ + 1 : MPI_PROC_NULL;
  // Local rows: [0, ghost) top ghosts, [ghost, ghost + rows) owned, then bottom ghosts.
  const int first_owned = ghost_, last_owned_end = ghost_ + rows_;
  Kokkos::fence();
  if constexpr (kHostField) {
    double* base = u_.data();
    auto row = [&](int r) { return base + static_cast<std::size_t>(r) * nx; };
    halo_->sendrecv(row(first_owned), count, up, 0, row(last_owned_end), count, down, 0, MPI_DOUBLE,
                    "halo exchange (up)");
    halo_->sendrecv(row(last_owned_end - width), count, down, 1, row(first_owned - width), count,
                    up, 1, MPI_DOUBLE, "halo exchange (down)");
  } else {
    using Pair = std::pair<int, int>;
    auto rows = [&](int a) { return Kokkos::subview(u_, Pair(a, a + width), Kokkos::ALL()); };
    auto flat = [&](const Kokkos::View<double*, Kokkos::HostSpace>& v) {
      return Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace,
                          Kokkos::MemoryTraits<Kokkos::Unmanaged>>(v.data(), width, nx);
    };
    Kokkos::deep_copy(flat(send_up_), rows(first_owned));
    Kokkos::deep_copy(flat(send_down_), rows(last_owned_end - width));
    halo_->sendrecv(send_up_.data(), count, up, 0, recv_down_.data(), count, down, 0, MPI_DOUBLE,
                    "halo exchange (up)");
    halo_->sendrecv(send_down_.data(), count, down, 1, recv_up_.data(), count, up, 1, MPI_DOUBLE,
                    "halo exchange (down)");
    if (down != MPI_PROC_NULL) Kokkos::deep_copy(rows(last_owned_end), flat(recv_down_));
    if (up != MPI_PROC_NULL) Kokkos::deep_copy(rows(first_owned - width), flat(recv_up_));
  }
}

void HeatSolver::advance(int n) {
  // Owned rows that are not the top or bottom wall, as local (ghosted) row indices.
  const int lo = ghost_ + std::max(0, 1 - row0_);
  const int hi = ghost_ + rows_ - std::max(0, row0_ + rows_ - (o_.ny - 1));
  for (int s = 0; s < n; ++s) {
    exchange(1);
    if (lo < hi) detail::ftcs(u_, next_, src_, lo, hi, o_.nx, ghost_, o_.cfl);
    std::swap(u_, next_);
    ++step_;
    if (step_ % o_.interval == 0) set_forcing();
  }
}

void HeatSolver::upload_cells(const std::vector<Cell>& cells) {
  const int n = static_cast<int>(cells.size());
  if (static_cast<int>(cells_.extent(0)) < n) {
    cells_ = decltype(cells_)("heat::cells", n, 2);
    records_ = decltype(records_)("heat::records", n, record_floats());
  }
  auto hc = Kokkos::create_mirror_view(cells_);
  for (int i = 0; i < n; ++i) {
    const Cell& c = cells[i];
    if (c.row < row0_ || c.row >= row0_ + rows_ || c.col < 0 || c.col >= o_.nx)
      throw InvalidArgument("heat solver: cell (" + std::to_string(c.row) + ", " +
                            std::to_string(c.col) + ") is not owned by simulation rank " +
                            std::to_string(rank_));
    hc(i, 0) = c.row - row0_ + ghost_;
    hc(i, 1) = c.col;
  }
  Kokkos::deep_copy(cells_, hc);
}

void HeatSolver::extract(const std::vector<Cell>& cells, std::vector<float>& out) {
  exchange(ghost_);
  const int n = static_cast<int>(cells.size());
  const int stride = record_floats();
  if (n == 0) return;
  for (const Cell& c : cells)
    if (c.row < o_.radius || c.row >= o_.ny - o_.radius || c.col < o_.radius ||
        c.col >= o_.nx - o_.radius)
      throw InvalidArgument("heat solver: the patch of cell (" + std::to_string(c.row) + ", " +
                            std::to_string(c.col) + ") leaves the grid");
  upload_cells(cells);
  detail::gather_patches(u_, src_, cells_, records_, n, o_.radius, ghost_, o_.interval);
  auto host = Kokkos::create_mirror_view(records_);
  Kokkos::deep_copy(host, records_);
  const std::size_t at = out.size();
  out.resize(at + static_cast<std::size_t>(n) * stride);
  for (int s = 0; s < n; ++s)
    for (int k = 0; k < stride; ++k)
      out[at + static_cast<std::size_t>(s) * stride + k] = host(s, k);
}

void HeatSolver::read(const std::vector<Cell>& cells, float* out, int stride) {
  const int n = static_cast<int>(cells.size());
  if (n == 0) return;
  upload_cells(cells);
  detail::gather_values(u_, cells_, records_, n);
  auto host = Kokkos::create_mirror_view(records_);
  Kokkos::deep_copy(host, records_);
  for (int s = 0; s < n; ++s)
    out[static_cast<std::size_t>(s) * stride] = host(s, 0);
}

void HeatSolver::field_stats(double& mean, double& max) const {
  double sum = 0, top = -1e300;
  detail::sum_and_max(u_, slab(), sum, top);
  halo_->allreduce(&sum, 1, MPI_DOUBLE, MPI_SUM, "field sum");
  halo_->allreduce(&top, 1, MPI_DOUBLE, MPI_MAX, "field maximum");
  mean = sum / (static_cast<double>(o_.nx) * o_.ny);
  max = top;
}

}  // namespace fullshard::apps::heat
