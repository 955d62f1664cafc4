! A 2-D heat-equation solver with MPI domain decomposition (mpi_f08): the simulation side of
! heat-fortran. The global grid is nx x ny; each rank owns a band of whole rows.
!
! Layout: u(nx, 0:nloc+1), x the first (contiguous) index, rows 0 and nloc+1 the halo rows
! exchanged with the neighbour ranks (MPI_Sendrecv of whole rows). Dirichlet boundary: the
! field is 0 outside the grid. Explicit FTCS steps:
!   u' = u + r * (u(i-1,j) + u(i+1,j) + u(i,j-1) + u(i,j+1) - 4 u(i,j)) + q(i,j)
! with a fixed source q. Every point is computed from global indices with the same
! arithmetic, so the field does not depend on the number of ranks.
module heat2d
  use, intrinsic :: iso_fortran_env, only: real64
  use mpi_f08
  implicit none
  private

  type, public :: heat_field
    type(MPI_Comm) :: comm
    integer :: rank = 0, size = 1
    integer :: nx = 0, ny = 0, nloc = 0, first_row = 1  ! global rows first_row .. +nloc-1
    real(real64) :: r = 0.2_real64
    real(real64), allocatable :: u(:, :), next(:, :), q(:, :)
  end type

  public :: heat_init, heat_step, heat_exchange_halos, heat_features, heat_rmse

contains

  !> Splits ny rows over the ranks of comm (the first mod(ny, size) ranks one more) and sets
  !> the initial field (smooth bumps) and the source. r <= 0.25 (stability).
  subroutine heat_init(f, comm, nx, ny, r)
    type(heat_field), intent(out) :: f
    type(MPI_Comm), intent(in) :: comm
    integer, intent(in) :: nx, ny
    real(real64), intent(in) :: r
    integer :: i, j, base, extra
    real(real64) :: x, y
    real(real64), parameter :: pi = acos(-1.0_real64)
    f%comm = comm
    call MPI_Comm_rank(comm, f%rank)
    call MPI_Comm_size(comm, f%size)
    if (ny < f%size .or. nx < 3) error stop 'heat2d: the grid needs nx >= 3 and a row per rank'
    if (r <= 0 .or. r > 0.25_real64) error stop 'heat2d: r must be in (0, 0.25] (stability)'
    f%nx = nx
    f%ny = ny
    f%r = r
    base = ny/f%size
    extra = mod(ny, f%size)
    f%nloc = base + merge(1, 0, f%rank < extra)
    f%first_row = f%rank*base + min(f%rank, extra) + 1
    allocate (f%u(nx, 0:f%nloc + 1), f%next(nx, f%nloc), f%q(nx, f%nloc))
    f%u = 0
    do j = 1, f%nloc
      y = real(f%first_row + j - 1, real64)/(ny + 1)
      do i = 1, nx
        x = real(i, real64)/(nx + 1)
        f%u(i, j) = sin(pi*x)*sin(pi*y) + 0.5_real64*sin(3*pi*x)*sin(2*pi*y)
        f%q(i, j) = 2e-3_real64*exp(-40*((x - 0.3_real64)**2 + (y - 0.6_real64)**2))
      end do
    end do
  end subroutine

  !> The halo rows from the neighbours (zero beyond the first and last rank).
  subroutine heat_exchange_halos(f)
    type(heat_field), intent(inout) :: f
    integer :: up, down
    up = merge(MPI_PROC_NULL, f%rank - 1, f%rank == 0)
    down = merge(MPI_PROC_NULL, f%rank + 1, f%rank == f%size - 1)
    f%u(:, 0) = 0
    f%u(:, f%nloc + 1) = 0
    call MPI_Sendrecv(f%u(:, 1), f%nx, MPI_DOUBLE_PRECISION, up, 1, f%u(:, f%nloc + 1), f%nx, &
                      MPI_DOUBLE_PRECISION, down, 1, f%comm, MPI_STATUS_IGNORE)
    call MPI_Sendrecv(f%u(:, f%nloc), f%nx, MPI_DOUBLE_PRECISION, down, 2, f%u(:, 0), f%nx, &
                      MPI_DOUBLE_PRECISION, up, 2, f%comm, MPI_STATUS_IGNORE)
  end subroutine

  !> n explicit steps.
  subroutine heat_step(f, n)
    type(heat_field), intent(inout) :: f
    integer, intent(in) :: n
    integer :: s, i, j
    real(real64) :: w, e
    do s = 1, n
      call heat_exchange_halos(f)
      do j = 1, f%nloc
        do i = 1, f%nx
          w = 0
          e = 0
          if (i > 1) w = f%u(i - 1, j)
          if (i < f%nx) e = f%u(i + 1, j)
          f%next(i, j) = f%u(i, j) + f%r*(w + e + f%u(i, j - 1) + f%u(i, j + 1) - 4*f%u(i, j)) &
                         + f%q(i, j)
        end do
      end do
      f%u(:, 1:f%nloc) = f%next
    end do
  end subroutine

  !> The surrogate's features of every local point p = i + (j-1)*nx: the 8 neighbours minus
  !> the centre (3x3 patch, x fastest, 0 outside the grid) scaled by 1/s_in, the centre value,
  !> and the source scaled by 1/s_out. feats(10, nx*nloc): column-major, one sample per column
  !> (the (samples, 10) tensor the model takes). Halos are exchanged first.
  subroutine heat_features(f, s_in, s_out, feats)
    type(heat_field), intent(inout) :: f
    real(real64), intent(in) :: s_in, s_out
    real(4), intent(out) :: feats(:, :)
    integer :: i, j, di, dj, k, p
    real(real64) :: c, v
    call heat_exchange_halos(f)
    do j = 1, f%nloc
      do i = 1, f%nx
        p = i + (j - 1)*f%nx
        c = f%u(i, j)
        k = 0
        do dj = -1, 1
          do di = -1, 1
            if (di == 0 .and. dj == 0) cycle
            k = k + 1
            v = 0
            if (i + di >= 1 .and. i + di <= f%nx) v = f%u(i + di, j + dj)
            feats(k, p) = real((v - c)/s_in, 4)
          end do
        end do
        feats(9, p) = real(c, 4)
        feats(10, p) = real(f%q(i, j)/s_out, 4)
      end do
    end do
  end subroutine

  !> sqrt of the mean of (a - b)**2 over every rank's points.
  function heat_rmse(f, a, b) result(e)
    type(heat_field), intent(in) :: f
    real(real64), intent(in) :: a(:), b(:)
    real(real64) :: e, local(2), total(2)
    local = [sum((a - b)**2), real(size(a), real64)]
    call MPI_Allreduce(local, total, 2, MPI_DOUBLE_PRECISION, MPI_SUM, f%comm)
    e = sqrt(total(1)/total(2))
  end function

end module heat2d
