! Several inputs and outputs from Fortran (fullshard_arrays lists): the scripted two-input,
! two-output model of test/capi/make_torchscript.py, trained on each rank's slice of the
! global batch, against PyTorch's losses and outputs on the whole batch (multi.ref).
!   test_fortran_lists DIR   (make_torchscript.py's output directory)
program test_fortran_lists
  use, intrinsic :: iso_c_binding, only: c_float, c_double
  use mpi_f08
  use fullshard
  implicit none
  integer, parameter :: nb = 12, steps = 6
  real(c_double) :: a_all(4, nb), b_all(3, nb), t1_all(2, nb), t2_all(1, nb)
  real(c_double) :: losses(steps), o1_all(2, nb), o2_all(1, nb), loss, mean, worst
  real(c_float), allocatable :: a(:, :), b(:, :), t1(:, :), t2(:, :), p1(:, :), p2(:, :)
  type(fullshard_mesh) :: mesh
  type(fullshard_model) :: model
  type(fullshard_arrays) :: inputs, targets, outputs
  character(len=1024) :: dir
  integer :: rank, nranks, rows, first, s, failures, unit

  call MPI_Init()
  call MPI_Comm_rank(MPI_COMM_WORLD, rank)
  call MPI_Comm_size(MPI_COMM_WORLD, nranks)
  call get_command_argument(1, dir)
  failures = 0
  ! Row-major (samples, features) in the file: read in order, it is x(features, samples).
  open (newunit=unit, file=trim(dir)//'/multi.ref', status='old', action='read')
  read (unit, *) a_all, b_all, t1_all, t2_all, losses, o1_all, o2_all
  close (unit)
  rows = nb/nranks
  first = rank*rows + 1
  allocate (a(4, rows), b(3, rows), t1(2, rows), t2(1, rows), p1(2, rows), p2(1, rows))
  a(:, :) = real(a_all(:, first:first + rows - 1), c_float)
  b(:, :) = real(b_all(:, first:first + rows - 1), c_float)
  t1(:, :) = real(t1_all(:, first:first + rows - 1), c_float)
  t2(:, :) = real(t2_all(:, first:first + rows - 1), c_float)

  call fullshard_init(MPI_COMM_WORLD)
  call fullshard_mesh_create(MPI_COMM_WORLD, [nranks], 'dp', mesh)
  call fullshard_model_create(mesh, trim(dir)//'/multi.json', model)
  call inputs%add(a)
  call inputs%add(b)
  call targets%add(t1)
  call targets%add(t2)
  do s = 1, steps
    call fullshard_train_step(model, inputs, targets, loss)
    call MPI_Allreduce(loss, mean, 1, MPI_DOUBLE_PRECISION, MPI_SUM, MPI_COMM_WORLD)
    mean = mean/nranks
    if (abs(mean - losses(s)) > 1e-5*abs(losses(s))) then
      failures = failures + 1
      print '(a, i0, a, es14.6, a, es14.6)', 'FAILED: step ', s, ' loss ', mean, &
        ', PyTorch ', losses(s)
    end if
  end do
  call outputs%add(p1)
  call outputs%add(p2)
  call fullshard_predict(model, inputs, outputs)
  worst = max(maxval(abs(p1 - o1_all(:, first:first + rows - 1)))/maxval(abs(o1_all)), &
              maxval(abs(p2 - o2_all(:, first:first + rows - 1)))/maxval(abs(o2_all)))
  if (worst > 1e-5) then
    failures = failures + 1
    print '(a, es12.4)', 'FAILED: the outputs differ from PyTorch''s by ', worst
  end if
  call inputs%clear()
  call fullshard_train_step(model, inputs, targets, loss, status=s)
  if (s /= FULLSHARD_ERR_ARGUMENT) then
    failures = failures + 1
    print '(a, i0)', 'FAILED: no inputs gave status ', s
  end if
  call fullshard_model_free(model)
  call fullshard_mesh_free(mesh)
  call fullshard_finalize()
  call MPI_Allreduce(MPI_IN_PLACE, failures, 1, MPI_INTEGER, MPI_SUM, MPI_COMM_WORLD)
  if (rank == 0 .and. failures == 0) print '(a, i0, a)', 'test_fortran_lists: pass (', &
    nranks, ' ranks)'
  call MPI_Finalize()
  if (failures /= 0) error stop 1
end program test_fortran_lists
