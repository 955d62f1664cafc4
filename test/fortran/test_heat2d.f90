! heat-fortran's solver (apps/heat-fortran/heat2d.f90): the field after 50 steps on all ranks
! equals the one-rank field bitwise (uneven row splits included), and the surrogate's
! features of a point are its 3x3 patch minus the centre, read from the one-rank field.
program test_heat2d
  use, intrinsic :: iso_fortran_env, only: real64
  use mpi_f08
  use heat2d
  implicit none
  integer, parameter :: nx = 31, ny = 23
  type(heat_field) :: all, one
  type(MPI_Comm) :: solo
  integer :: rank, nranks, failures, i, j, p
  integer, allocatable :: counts(:), displs(:)
  real(real64), allocatable :: gathered(:, :)
  real(4), allocatable :: feats(:, :)

  call MPI_Init()
  call MPI_Comm_rank(MPI_COMM_WORLD, rank)
  call MPI_Comm_size(MPI_COMM_WORLD, nranks)
  failures = 0
  call heat_init(all, MPI_COMM_WORLD, nx, ny, 0.2_real64)
  call heat_step(all, 50)
  allocate (counts(nranks), displs(nranks), gathered(nx, ny), feats(10, nx*all%nloc))
  call MPI_Allgather(nx*all%nloc, 1, MPI_INTEGER, counts, 1, MPI_INTEGER, MPI_COMM_WORLD)
  displs(1) = 0
  do i = 2, nranks
    displs(i) = displs(i - 1) + counts(i - 1)
  end do
  call MPI_Gatherv(all%u(:, 1:all%nloc), nx*all%nloc, MPI_DOUBLE_PRECISION, gathered, counts, &
                   displs, MPI_DOUBLE_PRECISION, 0, MPI_COMM_WORLD)
  ! Features of this rank's first row's middle point, checked on rank 0 against the one-rank
  ! field below (rank 0 receives them).
  call heat_features(all, 1.0_real64, 1.0_real64, feats)
  call MPI_Comm_split(MPI_COMM_WORLD, merge(0, MPI_UNDEFINED, rank == 0), 0, solo)
  if (rank == 0) then
    call heat_init(one, solo, nx, ny, 0.2_real64)
    call heat_step(one, 50)
    if (maxval(abs(gathered - one%u(:, 1:ny))) > 0) then
      failures = failures + 1
      print '(a, es12.4)', 'FAILED: the fields differ; max |diff| ', &
        maxval(abs(gathered - one%u(:, 1:ny)))
    end if
    ! Rank 0's point (i=5, j=1): the neighbours above are the boundary (0).
    i = 5
    j = 1
    p = i
    if (abs(feats(2, p) - real(0 - one%u(i, j), 4)) > 0 .or. &
        abs(feats(6, p) - real(one%u(i - 1, j + 1) - one%u(i, j), 4)) > 0 .or. &
        abs(feats(7, p) - real(one%u(i, j + 1) - one%u(i, j), 4)) > 0 .or. &
        abs(feats(9, p) - real(one%u(i, j), 4)) > 0) then
      failures = failures + 1
      print '(a)', 'FAILED: the features of point (5, 1)'
    end if
    call MPI_Comm_free(solo)
  end if
  call MPI_Bcast(failures, 1, MPI_INTEGER, 0, MPI_COMM_WORLD)
  if (rank == 0 .and. failures == 0) print '(a, i0, a)', 'test_heat2d: pass (', nranks, ' ranks)'
  call MPI_Finalize()
  if (failures /= 0) error stop 1
end program test_heat2d
