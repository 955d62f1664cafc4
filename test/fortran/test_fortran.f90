! The Fortran module on 1 to 4 ranks: column-major arrays of rank 1 to 3 (and sections, used
! in place), training against a reference computed here, a 2-D HSDP mesh, checkpoint resume
! on another rank count, statuses and messages.
program test_fortran
  use, intrinsic :: iso_c_binding, only: c_float, c_double, c_int64_t
  use mpi_f08
  use fullshard
  use test_checks
  implicit none

  integer, parameter :: nin = 3, nout = 2, nb = 6
  type(fullshard_mesh) :: mesh, hsdp, small
  type(fullshard_model) :: model, other
  type(fullshard_plan_info) :: plan
  type(fullshard_memory_parts) :: planned, measured
  type(MPI_Comm) :: sub
  integer :: nranks, st, i, s
  character(len=64) :: line
  integer(c_int64_t) :: step, nparams
  real(c_float) :: x(nin, nb), y(nout, nb), out(nout, nb), one(nout), wide(0:nin + 1, 2*nb)
  real(c_float) :: out3(nout, 2, 3), x3(nin, 2, 3), again(nout, nb)
  real(c_double) :: loss, first, last, lr, sums(2), tot(2)
  character(len=*), parameter :: cfg = 'test_fortran.json'

  call MPI_Init()
  call MPI_Comm_rank(MPI_COMM_WORLD, rank)
  call MPI_Comm_size(MPI_COMM_WORLD, nranks)
  failures = 0

  ! Before init: a status, not a crash.
  call fullshard_model_step(model, step, status=st)
  call check(st == FULLSHARD_ERR_NOT_INITIALIZED, 'a call before init', 'not initialised')

  if (rank == 0) then
    open (10, file=cfg, status='replace', action='write')
    write (10, '(a)') '{"model": {"type": "mlp", "inputs": 3, "hidden": [8, 8], "outputs": 2},'
    write (10, '(a)') ' "optimizer": {"type": "adamw", "lr": 0.02}, "seed": 11}'
    close (10)
  end if
  call MPI_Barrier(MPI_COMM_WORLD)

  call fullshard_init(MPI_COMM_WORLD)  ! mpi_f08; no status: an error would abort the job
  call check(fullshard_initialized(), 'initialised', '')
  call fullshard_mesh_create(MPI_COMM_WORLD, [nranks], 'dp', mesh)
  call fullshard_model_create(mesh, cfg, model)
  call fullshard_model_num_params(model, nparams)
  call check(nparams == (3*8 + 8) + (8*8 + 8) + (8*2 + 2), 'parameter count', '')
  call fullshard_model_plan(model, plan)
  call check(plan%groups == 3 .and. plan%step_ms > 0 .and. plan%peak_bytes > 0, 'plan', '')
  call check(plan%process_peak_bytes > plan%sharded_bytes + plan%peak_bytes, 'process peak', '')

  ! Column-major: x(features, samples) is the (samples, features) tensor. The batch's
  ! prediction equals each sample's alone (rank-1 arrays), and a rank-3 array's.
  call fill(0, x, y)
  call fullshard_predict(model, x, out)
  do i = 1, nb
    call fullshard_predict(model, x(:, i), one)
    call check(maxval(abs(one - out(:, i))) <= 1e-6, 'rank-1 prediction', '')
  end do
  x3 = reshape(x, [nin, 2, 3])
  call fullshard_predict(model, x3, out3)
  call check(maxval(abs(reshape(out3, [nout, nb]) - out)) <= 1e-6, 'rank-3 prediction', '')
  ! A section (every other column, without the halo rows 0 and nin+1) is used in place.
  wide = 1e30
  wide(1:nin, 1:2*nb:2) = x
  call fullshard_predict(model, wide(1:nin, 1:2*nb:2), again)
  call check(.not. (maxval(abs(again - out)) > 0), 'section prediction', '')

  ! The loss of a step is this rank's MSE before it (recomputed from the prediction).
  call fullshard_train_step(model, x, y, first)
  call check(abs(first - sum(real(out - y, c_double)**2)/(nout*nb)) <= 1e-6*first, &
             'first loss', '')
  do s = 1, 40
    call fill(s, x, y)
    call fullshard_train_step(model, x, y, last)
  end do
  sums = [first, last]
  call MPI_Allreduce(sums, tot, 2, MPI_DOUBLE_PRECISION, MPI_SUM, MPI_COMM_WORLD)
  if (rank == 0) print '(a, f10.6, a, f10.6)', 'fortran mlp: loss ', tot(1)/nranks, ' -> ', &
    tot(2)/nranks
  call check(tot(2) < 0.5*tot(1), 'the loss falls', '')
  call fullshard_model_step(model, step)
  call check(step == 41, 'step count', '')
  ! The memory account: the library's parts held between steps are the plan's; the first step
  ! measured the activations, and the planned process peak holds them.
  call fullshard_model_memory(model, planned, measured)
  call fullshard_model_plan(model, plan)
  call check(planned%activations > 0 .and. planned%process_peak == plan%process_peak_bytes, &
             'memory planned', '')
  call check(measured%shards == planned%shards .and. measured%gradients == planned%gradients &
             .and. measured%optimizer_state == planned%optimizer_state &
             .and. measured%pool == planned%pool .and. measured%windows == planned%windows, &
             'memory measured', '')
  call fullshard_model_lr(model, lr)
  call check(abs(lr - 0.02_c_double) < 1e-12, 'constant learning rate', '')

  ! Statuses: a wrong shape, a freed handle, a bad configuration key.
  call fullshard_train_step(model, x(1:2, :), y, loss, status=st)
  call check(st == FULLSHARD_ERR_ARGUMENT, 'wrong input shape', 'the mlp takes (batch, 3)')
  call fullshard_model_create(mesh, 'no-such-file.json', other, status=st)
  call check(st == FULLSHARD_ERR_CONFIG, 'missing file', 'no-such-file.json')
  call fullshard_mesh_create(MPI_COMM_WORLD, [nranks], 'a,b', small, status=st)
  call check(st == FULLSHARD_ERR_ARGUMENT, 'mesh names', 'dim names')
  ! The integer handle of the communicator (the `use mpi` / mpif.h form) works too.
  call fullshard_mesh_create(MPI_COMM_WORLD%MPI_VAL, [nranks], 'dp', small, status=st)
  call check(st == FULLSHARD_OK .and. small%id /= 0, 'integer communicator handle', '')
  call fullshard_mesh_free(small)

  ! Checkpoint on every rank, resumed on n-1 ranks (a sub-communicator): the same predictions.
  call execute_command_line('rm -rf test_fortran_ckpt_np'//achar(48 + nranks))
  call MPI_Barrier(MPI_COMM_WORLD)
  call fullshard_checkpoint_save(model, 'test_fortran_ckpt_np'//achar(48 + nranks))
  call fill(99, x, y)
  call fullshard_predict(model, x, out)
  if (nranks > 1) then
    call MPI_Comm_split(MPI_COMM_WORLD, merge(0, MPI_UNDEFINED, rank < nranks - 1), rank, sub)
    if (rank < nranks - 1) then
      call fullshard_mesh_create(sub, [nranks - 1], 'dp', small)
      call fullshard_model_create(small, cfg, other)
      call fullshard_checkpoint_load(other, 'test_fortran_ckpt_np'//achar(48 + nranks))
      call fullshard_model_step(other, step)
      call check(step == 41, 'resumed step', '')
      call fullshard_predict(other, x, again)
      call check(maxval(abs(again - out)) <= 1e-6, 'resumed prediction', '')
      call fullshard_model_free(other)
      call fullshard_mesh_free(small)
      call MPI_Comm_free(sub)
    end if
  end if
  call fullshard_export_safetensors(model, 'test_fortran.safetensors')
  call fullshard_model_free(model)
  call check(model%id == 0, 'freed handle is null', '')
  call fullshard_model_step(model, step, status=st)
  call check(st == FULLSHARD_ERR_HANDLE, 'null handle', 'null model handle')

  ! A 2-D HSDP mesh (replicate over pairs of ranks' halves, shard inside), float64 arrays.
  if (mod(nranks, 2) == 0) then
    call fullshard_mesh_create(MPI_COMM_WORLD, [2, nranks/2], 'replicate,shard', hsdp)
    call fullshard_model_create(hsdp, cfg, other)
    call fill(0, x, y)
    call fullshard_train_step(other, real(x, c_double), real(y, c_double), loss)
    call check(loss > 0, 'HSDP step', '')
    call fullshard_model_free(other)
    call fullshard_mesh_free(hsdp)
  end if

  call fullshard_mesh_free(mesh)
  call fullshard_finalize()
  write (line, '(a, i0, a)') 'test_fortran: pass (', nranks, ' ranks)'
  call finish('test_fortran', trim(line))

contains

  ! Deterministic samples of step s on this rank; targets a smooth function of the inputs.
  subroutine fill(s, x, y)
    integer, intent(in) :: s
    real(c_float), intent(out) :: x(:, :), y(:, :)
    integer :: j, k
    do j = 1, size(x, 2)
      do k = 1, size(x, 1)
        x(k, j) = real(sin(0.7*(s*100 + rank*10 + j) + 1.1*k), c_float)
      end do
      y(1, j) = tanh(sum(x(:, j)))
      y(2, j) = x(1, j)*x(2, j)
    end do
  end subroutine

end program test_fortran
