! The training session's checkpoints from Fortran:
!   test-test_fortran_session save DIR    asynchronous saves while training goes on, keep_last 2,
!                                         the save handles' bad uses, an unwritable checkpoint
!                                         directory, non-finite data (skipped and counted,
!                                         or refused); writes the losses to
!                                         DIR/fortran_losses.txt
!   test-test_fortran_session resume DIR  on another rank count: resumes DIR/ck, the losses of a
!                                         straight run.
! The global batch is 12 samples split over the ranks, so every rank count trains the same
! model on the same data (test/capi/test_capi_session.c does the same from C).
program test_fortran_session
  use, intrinsic :: iso_c_binding, only: c_float, c_double, c_int64_t
  use, intrinsic :: ieee_arithmetic, only: ieee_value, ieee_quiet_nan, ieee_is_nan
  use mpi_f08
  use fullshard
  use test_checks
  implicit none

  integer, parameter :: nin = 6, nout = 2, nglobal = 12, nsteps = 8, nsaved = 6
  type(fullshard_mesh) :: mesh
  integer :: nranks
  character(len=1024) :: mode, dir

  call MPI_Init()
  call MPI_Comm_rank(MPI_COMM_WORLD, rank)
  call MPI_Comm_size(MPI_COMM_WORLD, nranks)
  failures = 0
  call get_command_argument(1, mode)
  call get_command_argument(2, dir)
  call fullshard_init(MPI_COMM_WORLD)
  call fullshard_mesh_create(MPI_COMM_WORLD, [nranks], 'dp', mesh)
  if (trim(mode) == 'save') then
    call save_mode()
  else
    call resume_mode()
  end if
  call fullshard_mesh_free(mesh)
  call fullshard_finalize()
  call finish('test_fortran_session', 'test_fortran_session '//trim(mode)//': pass')

contains

  function config(checkpoint) result(text)
    character(*), intent(in) :: checkpoint
    character(:), allocatable :: text
    text = '{"model": {"type": "residual_mlp", "inputs": 6, "hidden": 16, "outputs": 2, ' // &
           '"blocks": 3}, "optimizer": {"type": "adamw", "lr": 0.01, "in_backward": true}, ' // &
           '"seed": 3'
    if (len(checkpoint) > 0) text = text // ', ' // checkpoint
    text = text // '}'
  end function

  ! One step on this rank's samples of step s's global batch; returns the global loss.
  function step(model, s) result(global)
    type(fullshard_model), intent(in) :: model
    integer, intent(in) :: s
    real(c_double) :: global, loss
    real(c_float) :: x(nin, nglobal/nranks), y(nout, nglobal/nranks)
    integer :: i, j, k, first
    first = rank*(nglobal/nranks)
    do i = 0, nglobal/nranks - 1
      do j = 0, nin - 1
        x(j + 1, i + 1) = real(sin(0.37d0*dble((first + i)*nin + j) + 1.7d0*s), c_float)
      end do
      do k = 0, nout - 1
        y(k + 1, i + 1) = real(cos(0.11d0*dble((first + i)*nout + k) + 0.9d0*s), c_float)
      end do
    end do
    call fullshard_train_step(model, x, y, loss)
    loss = loss/nranks
    call MPI_Allreduce(loss, global, 1, MPI_DOUBLE_PRECISION, MPI_SUM, MPI_COMM_WORLD)
  end function

  subroutine save_mode()
    type(fullshard_model) :: model, other
    type(fullshard_save) :: save, copy, second
    real(c_double) :: losses(nsaved)
    integer(c_int64_t) :: n
    integer :: s, st, count
    logical :: done
    character(len=1100) :: listing

    call fullshard_model_create_from_json(mesh, config('"checkpoint": {"dir": "' // &
                                          trim(dir) // '/ck", "keep_last": 2}'), model, &
                                          source='save.json')
    do s = 0, nsaved - 1
      losses(s + 1) = step(model, s)
      if (save%id /= 0) then  ! training goes on while the files are written
        call fullshard_save_test(save, done)
        call check(done .eqv. (save%id == 0), 'a done save''s handle is reset', '')
      end if
      if (s == 1 .or. s == 3) then
        if (save%id /= 0) call fullshard_save_wait(save)
        call fullshard_checkpoint_save_async(model, save)
        call check(save%id /= 0, 'a save handle', '')
        copy = save
        call fullshard_checkpoint_save_async(model, second, status=st)
        call check(st == FULLSHARD_ERR_ARGUMENT .and. second%id == 0, &
                   'a second save while one is in flight', 'is still in flight')
      end if
    end do
    if (save%id /= 0) call fullshard_save_wait(save)
    call fullshard_save_wait(copy, status=st)
    call check(st == FULLSHARD_ERR_HANDLE, 'waiting on a finished handle', 'was finished')
    call fullshard_checkpoint_save(model)  ! step 6, into the configured directory
    call fullshard_model_step(model, n)
    call check(n == nsaved, 'steps taken', '')
    if (rank == 0) then
      write (listing, '(3a)') 'ls -d ', trim(dir), '/ck/step-* | wc -l > ' // trim(dir) // '/count'
      call execute_command_line(trim(listing))
      open (11, file=trim(dir)//'/count', status='old', action='read')
      read (11, *) count
      close (11)
      call check(count == 2, 'keep_last 2 keeps two step directories', '')
      open (12, file=trim(dir)//'/fortran_losses.txt', status='replace', action='write')
      do s = 1, nsaved
        write (12, '(es25.17)') losses(s)
      end do
      close (12)
    end if
    call fullshard_model_free(model)

    ! A directory the ranks cannot write: refused at creation, naming the path.
    call fullshard_model_create_from_json(mesh, config('"checkpoint": {"dir": ' // &
                                          '"/proc/fullshard-fortran-session"}'), other, &
                                          source='unwritable.json', status=st)
    call check(st == FULLSHARD_ERR_CONFIG .and. other%id == 0, 'an unwritable directory', &
               "checkpoint directory '/proc/fullshard-fortran-session'")
    call non_finite()
  end subroutine

  ! A NaN in the last rank's input: the step is skipped on every rank (loss NaN, counted, the
  ! step count stays); with the stop policy FULLSHARD_ERR_ARGUMENT names the rank and element.
  subroutine non_finite()
    type(fullshard_model) :: model
    real(c_float) :: x(nin, nglobal/nranks), y(nout, nglobal/nranks)
    real(c_double) :: loss
    integer(c_int64_t) :: skipped, n
    integer :: i, st
    character(len=80) :: want
    do i = 1, nglobal/nranks
      x(:, i) = real(sin(0.3d0*i), c_float)
      y(:, i) = real(cos(0.2d0*i), c_float)
    end do
    if (rank == nranks - 1) x(5, 2) = ieee_value(0.0_c_float, ieee_quiet_nan)  ! row 1, column 4
    call fullshard_model_create_from_json(mesh, config('"non_finite": {"max_skipped": 3}'), model)
    call fullshard_train_step(model, x, y, loss, status=st)
    call check(st == FULLSHARD_OK .and. ieee_is_nan(loss), 'a NaN input skips the step', '')
    call fullshard_model_skipped_steps(model, skipped)
    call fullshard_model_step(model, n)
    call check(skipped == 1 .and. n == 0, 'the skipped step is counted, not taken', '')
    call fullshard_model_free(model)
    call fullshard_model_create_from_json(mesh, config('"non_finite": {"policy": "stop"}'), model)
    write (want, '(a, i0, a)') 'step 1: rank ', nranks - 1, ': input 0 holds nan at [1, 4]'
    call fullshard_train_step(model, x, y, loss, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT, 'a NaN input with the stop policy', trim(want))
    call fullshard_model_free(model)
  end subroutine

  subroutine resume_mode()
    type(fullshard_model) :: straight, model
    real(c_double) :: want(nsteps), got
    integer(c_int64_t) :: n
    integer :: s

    call fullshard_model_create_from_json(mesh, config(''), straight)
    do s = 0, nsteps - 1
      want(s + 1) = step(straight, s)
    end do
    call fullshard_model_free(straight)
    call fullshard_model_create_from_json(mesh, config('"checkpoint": {"dir": "' // &
                                          trim(dir) // '/ck", "resume": true}'), model)
    call fullshard_model_step(model, n)
    call check(n == nsaved, 'resumed at the saved step', '')
    do s = nsaved, nsteps - 1
      got = step(model, s)
      if (rank == 0) print '(a, i0, 2(a, es16.9))', 'step ', s, ': resumed ', got, &
        ' straight ', want(s + 1)
      call check(abs(got - want(s + 1)) <= 1d-5*abs(want(s + 1)), &
                 'the resumed run''s loss is the straight run''s', '')
    end do
    call fullshard_model_free(model)
  end subroutine

end program test_fortran_session
