! heat-fortran: a Fortran simulation that trains a sharded surrogate of itself in situ.
!
! A 2-D heat-equation solver (heat2d: rows over the MPI ranks, halo exchange with mpi_f08)
! runs `--rounds` rounds of `--interval` steps. At the end of each round every rank turns its
! own rows into training samples (the 3x3 patch around each point, the source) and targets
! (the change of the point over one step), and the ranks take `--train-steps` optimizer steps
! of a fully_shard'ed MLP (the fullshard Fortran module: the model is sharded over all ranks).
! At the end the surrogate predicts one step of a state it never saw, and its error is
! compared with the no-change baseline: PASS (exit 0) when it is below half of it and the
! loss fell, FAIL (exit 1) otherwise; bad options exit 2.
!
!   mpirun -n 4 heat-fortran [--nx 64] [--ny 64] [--rounds 12] [--interval 10]
!                            [--train-steps 25] [--config surrogate.json]
program heat_fortran
  use, intrinsic :: iso_c_binding, only: c_double, c_float
  use, intrinsic :: iso_fortran_env, only: real64, error_unit
  use mpi_f08
  use fullshard
  use heat2d
  implicit none

  integer :: nx = 64, ny = 64, rounds = 12, interval = 10, train_steps = 25
  character(len=1024) :: config = ''
  type(heat_field) :: field
  type(fullshard_mesh) :: mesh
  type(fullshard_model) :: model
  type(fullshard_plan_info) :: plan
  integer :: rank, nranks, npts, round, s, bad
  real(c_float), allocatable :: feats(:, :), target(:, :), pred(:, :)
  real(real64), allocatable :: before(:), delta(:)
  real(real64) :: s_in = 1, s_out = 1, loss, round_loss, first_loss = -1, last_loss = 0
  real(real64) :: t0, solver_s = 0, train_s = 0, rmse_model, rmse_trivial, ratio, sums(2)
  character(len=512) :: json

  call MPI_Init()
  call MPI_Comm_rank(MPI_COMM_WORLD, rank)
  call MPI_Comm_size(MPI_COMM_WORLD, nranks)
  call parse_options(bad)
  if (bad /= 0) then
    call MPI_Finalize()
    if (bad > 0) stop 2
    stop
  end if
  call heat_init(field, MPI_COMM_WORLD, nx, ny, 0.2_real64)
  npts = nx*field%nloc
  allocate (feats(10, npts), target(1, npts), pred(1, npts), before(npts), delta(npts))

  ! ---- what a simulation adds to use fullshard (docs/guide/c-fortran.md) ----
  call fullshard_init(MPI_COMM_WORLD)
  call fullshard_mesh_create(MPI_COMM_WORLD, [nranks], 'dp', mesh)
  if (len_trim(config) > 0) then
    call fullshard_model_create(mesh, trim(config), model)
  else
    write (json, '(a, i0, a)') '{"model": {"type": "mlp", "inputs": 10, "hidden": [64, 64], &
      &"outputs": 1, "activation": "tanh"}, "optimizer": {"type": "adamw", "lr": 0.003}, &
      &"lr_schedule": {"type": "warmup_cosine", "warmup_steps": 10, "total_steps": ', &
      rounds*train_steps + 1, ', "min_lr": 0.0003}, "seed": 1}'
    call fullshard_model_create_from_json(mesh, trim(json), model, source='heat-fortran')
  end if
  call fullshard_model_plan(model, plan)
  if (rank == 0) print '(a, i0, a, i0, a, i0, a, f6.3, a, f8.1, a)', 'heat-fortran: ', nx, &
    ' x ', ny, ' grid on ', nranks, ' ranks; surrogate sharded over all ranks, plan: ', &
    plan%step_ms, ' ms per step, ', real(plan%peak_bytes)/1024, ' KiB pool peak per rank'

  do round = 1, rounds
    t0 = MPI_Wtime()
    call heat_step(field, interval - 1)
    call sample(field, round == 1)
    solver_s = solver_s + MPI_Wtime() - t0
    target(1, :) = real(delta/s_out, c_float)
    round_loss = 0
    t0 = MPI_Wtime()
    do s = 1, train_steps
      call fullshard_train_step(model, feats, target, loss)  ! feats(10, samples): no copy
      round_loss = round_loss + loss/train_steps
    end do
    train_s = train_s + MPI_Wtime() - t0
    call MPI_Allreduce(MPI_IN_PLACE, round_loss, 1, MPI_DOUBLE_PRECISION, MPI_SUM, &
                       MPI_COMM_WORLD)
    round_loss = round_loss/nranks
    if (first_loss < 0) first_loss = round_loss
    last_loss = round_loss
    if (rank == 0) print '(a, i0, a, es10.3)', 'round ', round, ' loss ', round_loss
  end do

  ! Held out: one step of a later state, never trained on.
  call heat_step(field, interval - 1)
  call sample(field, .false.)
  call fullshard_predict(model, feats, pred)
  rmse_model = heat_rmse(field, real(pred(1, :), real64)*s_out, delta)
  rmse_trivial = heat_rmse(field, 0*delta, delta)
  ratio = rmse_model/rmse_trivial
  call fullshard_model_plan(model, plan)  ! calibrated by the first steps' measured times
  sums = [solver_s, train_s]
  call MPI_Allreduce(MPI_IN_PLACE, sums, 2, MPI_DOUBLE_PRECISION, MPI_MAX, MPI_COMM_WORLD)
  if (rank == 0) then
    print '(a, f7.3, a, f8.3, a, f7.3, a, i0, a)', 'solver ', sums(1), ' s; training ', &
      1000*sums(2)/(rounds*train_steps), ' ms per step (plan predicted ', plan%step_ms, &
      ' ms, calibrated over ', plan%calibrated_iterations, ' steps)'
    print '(a, es10.3, a, es10.3, a, f7.4)', 'held-out rmse: surrogate ', rmse_model, &
      ', no-change ', rmse_trivial, ', ratio ', ratio
    if (ratio < 0.5 .and. last_loss < first_loss) then
      print '(a)', 'verdict: PASS (the surrogate beats the no-change baseline)'
    else
      print '(a)', 'verdict: FAIL (the surrogate does not beat half of the no-change error, or '// &
        'the loss did not fall)'
    end if
  end if
  call fullshard_model_free(model)
  call fullshard_mesh_free(mesh)
  call fullshard_finalize()
  call MPI_Finalize()
  if (.not. (ratio < 0.5 .and. last_loss < first_loss)) stop 1

contains

  ! Features of the present state, then one solver step: delta is each point's change. The
  ! first call fixes the scales (over every rank's points).
  subroutine sample(f, set_scales)
    type(heat_field), intent(inout) :: f
    logical, intent(in) :: set_scales
    real(real64) :: local(3), total(3)
    call heat_features(f, s_in, s_out, feats)
    before = reshape(f%u(:, 1:f%nloc), [npts])
    call heat_step(f, 1)
    delta = reshape(f%u(:, 1:f%nloc), [npts]) - before
    if (.not. set_scales) return
    local = [sum(real(feats(1:8, :), real64)**2), sum(delta**2), real(npts, real64)]
    call MPI_Allreduce(local, total, 3, MPI_DOUBLE_PRECISION, MPI_SUM, f%comm)
    s_in = sqrt(total(1)/(8*total(3)))
    s_out = sqrt(total(2)/total(3))
    feats(1:8, :) = real(feats(1:8, :)/s_in, c_float)
    feats(10, :) = real(feats(10, :)/s_out, c_float)
  end subroutine

  subroutine parse_options(bad)
    integer, intent(out) :: bad
    integer :: i, n, stat
    character(len=1024) :: arg, val
    bad = 0
    n = command_argument_count()
    i = 1
    do while (i <= n)
      call get_command_argument(i, arg)
      if (arg == '--help' .or. arg == '-h') then
        if (rank == 0) print '(a)', 'usage: heat-fortran [--nx N] [--ny N] [--rounds N] '// &
          '[--interval N] [--train-steps N] [--config FILE]'
        bad = -1
        return
      end if
      if (i == n) then
        call usage('option '//trim(arg)//' needs a value')
        bad = 2
        return
      end if
      call get_command_argument(i + 1, val)
      select case (arg)
      case ('--nx')
        read (val, *, iostat=stat) nx
      case ('--ny')
        read (val, *, iostat=stat) ny
      case ('--rounds')
        read (val, *, iostat=stat) rounds
      case ('--interval')
        read (val, *, iostat=stat) interval
      case ('--train-steps')
        read (val, *, iostat=stat) train_steps
      case ('--config')
        config = val
        stat = 0
      case default
        call usage('unknown option '//trim(arg))
        bad = 2
        return
      end select
      if (stat /= 0 .or. min(nx - 2, ny, rounds, interval, train_steps) < 1) then
        call usage('bad value '//trim(val)//' for '//trim(arg))
        bad = 2
        return
      end if
      i = i + 2
    end do
    if (ny < nranks) then
      call usage('--ny must be at least the number of ranks')
      bad = 2
    end if
  end subroutine

  subroutine usage(msg)
    character(*), intent(in) :: msg
    if (rank == 0) write (error_unit, '(a)') 'heat-fortran: '//msg//' (see --help)'
  end subroutine

end program heat_fortran
