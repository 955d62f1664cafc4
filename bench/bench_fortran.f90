! fullshard-bench-fortran: a training step through the Fortran module against the same step
! written with the C++ front end (bench_fortran_cpp.cpp, called through bind(C)), alternated
! in one run. The model: a residual MLP (64 inputs, `hidden` wide, 4 blocks, 16 outputs;
! fully_shard on every block and the root, AdamW), 128 rows per rank, float32 arrays
! x(64, 128) passed as they are. Prints, per width, the medians of both step times (slowest
! rank) and the median of the per-pair ratios fortran / C++ (1: no overhead).
!
!   mpiexec -n 2 build/bench/fullshard-bench-fortran [pairs (default 40)]
program bench_fortran
  use, intrinsic :: iso_c_binding
  use, intrinsic :: ieee_arithmetic, only: ieee_is_nan
  use mpi_f08
  use fullshard
  implicit none
  interface
    subroutine bench_cpp_init(hidden, inputs, outputs, blocks) bind(C)
      import :: c_int
      integer(c_int), value :: hidden, inputs, outputs, blocks
    end subroutine
    function bench_cpp_step(x, y, rows, inputs, outputs) bind(C) result(loss)
      import :: c_float, c_int, c_double
      real(c_float), intent(in) :: x(*), y(*)
      integer(c_int), value :: rows, inputs, outputs
      real(c_double) :: loss
    end function
    subroutine bench_cpp_free() bind(C)
    end subroutine
    subroutine bench_set_threads(n) bind(C)
      import :: c_int
      integer(c_int), value :: n
    end subroutine
  end interface
  integer, parameter :: rows = 128, nin = 64, nout = 16, blocks = 4
  integer, parameter :: widths(3) = [64, 256, 1024]
  type(fullshard_mesh) :: mesh
  type(fullshard_model) :: model
  real(c_float) :: x(nin, rows), y(nout, rows)
  real(c_double) :: loss, sink, t0, tf, tc
  real(c_double), allocatable :: f_t(:), c_t(:), ratio(:)
  integer :: rank, nranks, w, i, pairs, stat
  character(len=32) :: arg
  character(len=256) :: json

  call MPI_Init()
  call MPI_Comm_rank(MPI_COMM_WORLD, rank)
  call MPI_Comm_size(MPI_COMM_WORLD, nranks)
  pairs = 40
  if (command_argument_count() >= 1) then
    call get_command_argument(1, arg)
    read (arg, *, iostat=stat) pairs
    if (stat /= 0 .or. pairs < 6) pairs = 40
  end if
  call fullshard_init(MPI_COMM_WORLD)
  call bench_set_threads(1_c_int)
  call fullshard_mesh_create(MPI_COMM_WORLD, [nranks], 'dp', mesh)
  call random_number(x)
  call random_number(y)
  allocate (f_t(pairs), c_t(pairs), ratio(pairs))
  sink = 0
  do w = 1, size(widths)
    write (json, '(a, i0, a)') '{"model": {"type": "residual_mlp", "inputs": 64, "hidden": ', &
      widths(w), ', "outputs": 16, "blocks": 4}, "optimizer": {"type": "adamw", "lr": 0.001}}'
    call fullshard_model_create_from_json(mesh, trim(json), model)
    call bench_cpp_init(int(widths(w), c_int), nin, nout, blocks)
    do i = 1, 3  ! warm-up
      call fullshard_train_step(model, x, y, loss)
      sink = sink + bench_cpp_step(x, y, rows, nin, nout)
    end do
    do i = 1, pairs
      call MPI_Barrier(MPI_COMM_WORLD)
      t0 = MPI_Wtime()
      call fullshard_train_step(model, x, y, loss)
      tf = MPI_Wtime() - t0
      call MPI_Barrier(MPI_COMM_WORLD)
      t0 = MPI_Wtime()
      sink = sink + bench_cpp_step(x, y, rows, nin, nout) + loss
      tc = MPI_Wtime() - t0
      call MPI_Allreduce(MPI_IN_PLACE, tf, 1, MPI_DOUBLE_PRECISION, MPI_MAX, MPI_COMM_WORLD)
      call MPI_Allreduce(MPI_IN_PLACE, tc, 1, MPI_DOUBLE_PRECISION, MPI_MAX, MPI_COMM_WORLD)
      f_t(i) = tf
      c_t(i) = tc
      ratio(i) = tf/tc
    end do
    if (rank == 0) print '(a, i5, a, f10.1, a, f10.1, a, f7.4, a, i0, a)', 'fortran/step/', &
      widths(w), ': fortran_us ', 1e6*median(f_t), ' cpp_us ', 1e6*median(c_t), &
      ' ratio ', median(ratio), ' (median of ', pairs, ' alternated pairs)'
    call bench_cpp_free()
    call fullshard_model_free(model)
  end do
  call fullshard_mesh_free(mesh)
  call fullshard_finalize()
  if (rank == 0 .and. ieee_is_nan(sink)) print '(a)', 'NaN'
  call MPI_Finalize()

contains

  function median(v) result(m)
    real(c_double), intent(in) :: v(:)
    real(c_double) :: m, s(size(v)), t
    integer :: a, b, n
    s = v
    n = size(s)
    do a = 2, n  ! insertion sort (a few dozen values)
      t = s(a)
      b = a - 1
      do while (b >= 1)
        if (s(b) <= t) exit
        s(b + 1) = s(b)
        b = b - 1
      end do
      s(b + 1) = t
    end do
    if (mod(n, 2) == 1) then
      m = s(n/2 + 1)
    else
      m = 0.5_c_double*(s(n/2) + s(n/2 + 1))
    end if
  end function

end program bench_fortran
