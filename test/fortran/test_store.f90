! The sample store from Fortran on 1 to 4 ranks: fields declared in Fortran order, put from
! column-major arrays of rank 0 to 3 (sections included) and drawn into batches of rank 1 to 4
! (the samples in the last dim; a strided section too). Every value is computed from (step,
! rank, tag, field, Fortran index), so each drawn sample is checked exactly against its
! metadata: the round trip keeps Fortran's layout. Then rank 0 consumes the others' samples
! (lossless, FIFO, an integer communicator handle), and the refusals: shapes, dtypes, a field
! skipped, short metadata arrays, bad options (min_samples; on one rank only: every rank is
! refused with its problem), freed and null handles, calls outside init.
program test_store
  use, intrinsic :: iso_c_binding, only: c_float, c_double, c_int64_t, c_int32_t
  use mpi_f08
  use fullshard
  use test_checks
  implicit none

  integer, parameter :: nsteps = 6, nputs = 4, nb = 4
  type(fullshard_store) :: store, copy, none, split
  type(fullshard_store_options) :: opt, lossless
  type(fullshard_store_stats_info) :: stats
  type(fullshard_field_moments) :: mine, merged
  integer :: nranks, st, s, t, n, drained, partial
  integer(c_int64_t) :: bytes, sample_bytes, sums(3), total(3), checked
  logical :: sent, ended
  real(c_float) :: a(5), c(2, 3, 2), y32
  real(c_double) :: b(3, 2), y, wide(0:4, 2), bt(2, 3), a8(5)
  integer(c_int32_t) :: ai(5)
  real(c_float) :: ab(5, nb), cb(2, 3, 2, nb), yb(nb)
  real(c_double) :: bb(3, 2, nb), bwide(4, 2, nb), yb8(nb)
  integer(c_int64_t) :: msteps(nb), mtags(nb), short(2)
  integer :: mranks(nb)

  call MPI_Init()
  call MPI_Comm_rank(MPI_COMM_WORLD, rank)
  call MPI_Comm_size(MPI_COMM_WORLD, nranks)
  failures = 0
  checked = 0

  ! Fortran order: a(5), b(3, 2), c(2, 3, 2), a scalar y (float64 kept as float32).
  call opt%add_field('a', [5])
  call opt%add_field('b', [3, 2], dtype=FULLSHARD_FLOAT64)
  call opt%add_field('c', [2, 3, 2])
  call opt%add_field('y', dtype=FULLSHARD_FLOAT64, store_as_f32=.true.)
  opt%capacity = 64
  opt%seed = 5
  opt%timeout_s = 120
  opt%name = 'fortran'

  call fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, opt, store, status=st)
  call check(st == FULLSHARD_ERR_NOT_INITIALIZED, 'a store before init', 'not initialised')
  call fullshard_init(MPI_COMM_WORLD)

  call fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, opt, store)
  call check(store%id /= 0, 'a store handle', '')
  call fullshard_store_bytes(store, bytes, sample_bytes)
  ! a 20 -> 24, b 48 -> 72, c 48 -> 120, y 4 -> 124 -> 128 (each field 8-byte aligned)
  call check(sample_bytes == 128 .and. bytes == 0, 'sample bytes; nothing before a sample', '')

  call refusals()

  do s = 1, nsteps
    do t = 1, nputs
      call put(s, t)
    end do
    call fullshard_store_progress(store)
    call draw(mod(s, 2) == 0, n)
    call check(n == nb, 'a full batch before the end of the stream', '')
  end do
  call fullshard_store_end_of_stream(store)
  drained = 0
  partial = 0
  do
    call draw(mod(drained, 2) == 1, n)
    if (n == 0) exit
    if (n < nb) partial = partial + 1
    drained = drained + n
  end do
  call check(partial <= 1, 'only the last batch of the drain is partial', '')
  call fullshard_store_ended(store, ended)
  call check(ended, 'ended after the drain', '')

  call fullshard_store_stats(store, stats)
  call check(stats%produced + stats%dropped == nsteps*nputs, 'produced + dropped = puts', '')
  call fullshard_store_moments(store, 'c', mine)
  call check(mine%count == 12*stats%ingested, 'moments count every element ingested', '')
  call fullshard_store_global_moments(store, 'c', merged)
  sums = [stats%produced, stats%ingested, mine%count]
  call MPI_Allreduce(sums, total, 3, MPI_INTEGER8, MPI_SUM, MPI_COMM_WORLD)
  call check(total(1) == total(2), 'every sample sent was ingested', '')
  call check(merged%count == total(3) .and. merged%mean > 100000 .and. merged%stddev > 0, &
             'global moments', '')
  if (rank == 0) print '(a, i0, a, i0, a, i0, a)', 'test_store: ', nranks, ' ranks: ', &
    total(1), ' samples sent; rank 0 checked ', checked, ' drawn samples exactly'

  call fullshard_store_close(store)
  call put_status(1, 1, st)
  call check(st == FULLSHARD_ERR_ARGUMENT, 'a put after close', 'after close()')
  call fullshard_store_stats(store, stats)
  call check(stats%discarded_at_close == 0, 'nonblocking: close discards nothing', '')
  copy = store
  call fullshard_store_free(store)
  call check(store%id == 0, 'free resets the handle', '')
  call fullshard_store_free(store)  ! the null handle: nothing to do
  call fullshard_store_progress(copy, status=st)
  call check(st == FULLSHARD_ERR_HANDLE, 'a freed handle', 'store is a store handle that was freed')
  call fullshard_store_end_of_stream(none, status=st)
  call check(st == FULLSHARD_ERR_HANDLE, 'the null handle', 'store is the null store handle')

  if (nranks > 1) call consume_the_others()
  call bad_options()

  call fullshard_finalize()
  call fullshard_store_stats(copy, stats, status=st)
  call check(st == FULLSHARD_ERR_NOT_INITIALIZED, 'a store call after finalize', 'not initialised')
  call finish('test_store', 'test_store: pass')

contains

  ! Exact comparisons (gfortran's -Wcompare-reals: equality written as no difference).
  logical function same4(x, y)
    real(c_float), intent(in) :: x, y
    same4 = .not. (abs(x - y) > 0)
  end function

  logical function same8(x, y)
    real(c_double), intent(in) :: x, y
    same8 = .not. (abs(x - y) > 0)
  end function

  real(c_double) function v(step, r, tag, field, index)
    integer(c_int64_t), intent(in) :: step, tag
    integer, intent(in) :: r, field, index
    v = real(step*100000 + r*10000 + tag*100 + field*20 + index, c_double)
  end function

  ! The sample (s, rank, t): a(i), b(i, j), c(i, j, k) of their Fortran index, y.
  subroutine fill(s, t)
    integer, intent(in) :: s, t
    integer(c_int64_t) :: s8, t8
    integer :: i, j, k
    s8 = s
    t8 = t
    do i = 1, 5
      a(i) = real(v(s8, rank, t8, 0, i), c_float)
    end do
    do j = 1, 2
      do i = 1, 3
        b(i, j) = v(s8, rank, t8, 1, i + 3*(j - 1))
      end do
    end do
    do k = 1, 2
      do j = 1, 3
        do i = 1, 2
          c(i, j, k) = real(v(s8, rank, t8, 2, i + 2*(j - 1) + 6*(k - 1)), c_float)
        end do
      end do
    end do
    y = v(s8, rank, t8, 3, 0) + 0.25_c_double
  end subroutine

  ! Puts the sample (s, rank, t) four ways: arrays, b from a section, the integer(c_int64_t)
  ! step and tag, y as real(c_float).
  subroutine put(s, t)
    integer, intent(in) :: s, t
    call fill(s, t)
    select case (t)
    case (1)
      call fullshard_store_put(store, s, t, a, b, c, y, sent=sent)
    case (2)
      wide = -1
      wide(1:3, :) = b
      call fullshard_store_put(store, s, t, a, wide(1:3, :), c, y, sent=sent)
    case (3)
      call fullshard_store_put(store, int(s, c_int64_t), int(t, c_int64_t), a, b, c, y, sent=sent)
    case default
      y32 = real(y, c_float)
      call fullshard_store_put(store, s, t, a, b, c, y32, sent=sent)
    end select
  end subroutine

  subroutine put_status(s, t, code)
    integer, intent(in) :: s, t
    integer, intent(out) :: code
    call fill(s, t)
    call fullshard_store_put(store, s, t, a, b, c, y, status=code)
  end subroutine

  ! Draws a batch (b into a strided section when `strided`) and checks every sample drawn.
  subroutine draw(strided, count)
    logical, intent(in) :: strided
    integer, intent(out) :: count
    integer :: m, i, j, k
    bwide = -1
    if (strided) then
      call fullshard_store_draw(store, count, ab, bwide(2:4, :, :), cb, yb, steps=msteps, &
                                ranks=mranks, tags=mtags)
    else
      call fullshard_store_draw(store, count, ab, bb, cb, yb, steps=msteps, ranks=mranks, &
                                tags=mtags)
    end if
    if (strided) bb = bwide(2:4, :, :)
    do m = 1, count
      call check(msteps(m) >= 1 .and. msteps(m) <= nsteps .and. mtags(m) >= 1 .and. &
                 mtags(m) <= nputs .and. mranks(m) >= 0 .and. mranks(m) < nranks, &
                 'a drawn sample''s metadata', '')
      do i = 1, 5
        call check(same4(ab(i, m), real(v(msteps(m), mranks(m), mtags(m), 0, i), c_float)), &
                   'field a, exactly', '')
      end do
      do j = 1, 2
        do i = 1, 3
          call check(same8(bb(i, j, m), v(msteps(m), mranks(m), mtags(m), 1, i + 3*(j - 1))), &
                     'field b, exactly (column-major)', '')
        end do
      end do
      if (strided) call check(.not. any(abs(bwide(1, :, m) + 1) > 0), &
                              'a section''s other rows stay', '')
      do k = 1, 2
        do j = 1, 3
          do i = 1, 2
            call check(same4(cb(i, j, k, m), real(v(msteps(m), mranks(m), mtags(m), 2, &
                                                        i + 2*(j - 1) + 6*(k - 1)), c_float)), &
                       'field c, exactly (column-major)', '')
          end do
        end do
      end do
      call check(same4(yb(m), real(v(msteps(m), mranks(m), mtags(m), 3, 0) + 0.25_c_double, &
                                   c_float)), 'field y (float64 kept as float32)', '')
      checked = checked + 1
    end do
  end subroutine

  ! Refusals of a live store; nothing is sent or drawn.
  subroutine refusals()
    call fill(1, 1)
    call fullshard_store_put(store, 1, 1, a(1:4), b, c, y, sent=sent, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT .and. .not. sent, 'a put of a wrong shape', &
               "field 'a' expects shape [5], given [4]")
    bt = transpose(b)
    call fullshard_store_put(store, 1, 1, a, bt, c, y, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT, 'a put of a transposed array', &
               "field 'b' expects shape [2, 3], given [3, 2]")
    a8 = 0
    call fullshard_store_put(store, 1, 1, a8, b, c, y, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT, 'a put of a wrong type', &
               "field 'a' expects dtype f32, given f64")
    ai = 0
    call fullshard_store_put(store, 1, 1, ai, b, c, y, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT, 'a put of integers', 'dtype FULLSHARD_INT32')
    call fullshard_store_put(store, 1, 1, a, b, c, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT, 'a put of too few fields', &
               'put got 3 arrays for the 4 fields')
    call fullshard_store_put(store, 1, 1, a, b, f4=y, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT, 'a field skipped', 'f4 is given without f3')
    call fullshard_store_draw(store, n, ab, bb, cb, yb, steps=short, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT .and. n == 0, 'a short steps array', &
               'steps has 2 elements for a batch of 4')
    call fullshard_store_draw(store, n, ab, bb, cb, yb8, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT, 'a draw of y into float64', &
               "field 'y' gives dtype f32, the output has f64")
    call fullshard_store_draw(store, n, ab(:, 1:3), bb, cb, yb, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT, 'batches of different sizes', &
               "field 'b' expects an output of shape [3, 2, 3], given [4, 2, 3]")
    call fullshard_store_moments(store, 'nope', mine, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT, 'moments of an unknown field', "no field 'nope'")
  end subroutine

  ! Rank 0 consumes, the others produce, lossless and FIFO: every sample once, in order.
  subroutine consume_the_others()
    real(c_double) :: x(2), xb(2, nb)
    integer :: k, m, got, seen(1:3, 0:5)
    integer(c_int64_t) :: last(1:3)
    call lossless%add_field('x', [2], dtype=FULLSHARD_FLOAT64)
    lossless%policy = FULLSHARD_STORE_FIFO
    lossless%delivery = FULLSHARD_STORE_LOSSLESS
    lossless%capacity = 8
    lossless%in_flight = 2
    lossless%timeout_s = 120
    call fullshard_store_create(MPI_COMM_WORLD%MPI_VAL, merge(FULLSHARD_STORE_CONSUMER, &
                                FULLSHARD_STORE_PRODUCER, rank == 0), lossless, split)
    if (rank == 0) then
      x = 0
      call fullshard_store_put(split, 0, 0, x, status=st)
      call check(st == FULLSHARD_ERR_ARGUMENT, 'a put on a consumer', 'not a producer')
      seen = 0
      last = -1
      got = 0
      do
        call fullshard_store_draw(split, n, xb, steps=msteps, ranks=mranks)
        if (n == 0) exit
        do m = 1, n
          call check(same8(xb(1, m), real(msteps(m), c_double)) .and. &
                     same8(xb(2, m), real(mranks(m), c_double)), 'a lossless sample, exactly', '')
          call check(msteps(m) > last(mranks(m)), 'each producer''s samples in order', '')
          last(mranks(m)) = msteps(m)
          seen(mranks(m), msteps(m)) = seen(mranks(m), msteps(m)) + 1
        end do
        got = got + n
      end do
      call check(got == 6*(nranks - 1) .and. all(seen(1:nranks - 1, :) == 1), &
                 'every sample exactly once', '')
    else
      call fullshard_store_draw(split, n, xb, status=st)
      call check(st == FULLSHARD_ERR_ARGUMENT, 'a draw on a producer', 'not a consumer')
      do k = 0, 5
        x = [real(k, c_double), real(rank, c_double)]
        call fullshard_store_put(split, k, 10*rank + k, x, sent=sent)
        call check(sent, 'a lossless put is sent', '')
      end do
      call fullshard_store_end_of_stream(split)
    end if
    call fullshard_store_close(split)
    call fullshard_store_free(split)
  end subroutine

  ! Options refused at creation, on every rank.
  subroutine bad_options()
    type(fullshard_store) :: s1
    type(fullshard_store_options) :: shape0, ints, empty, differ, minimum, one_bad
    character(80) :: want
    ! The shape in Fortran order, [3, 0]; the message's is the C order.
    call shape0%add_field('x', [3, 0])
    call fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, shape0, s1, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT .and. s1%id == 0, 'a bad shape', &
               "field 'x' has shape [0, 3]: every extent must be at least 1")
    call ints%add_field('x', [3], dtype=FULLSHARD_INT32)
    call fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, ints, s1, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT, 'a bad dtype', &
               "fields[0] ('x'): dtype FULLSHARD_INT32: the sample store takes")
    call fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, empty, s1, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT, 'no fields', 'no fields')
    call minimum%add_field('x', [3])
    call check(minimum%min_samples == 1, 'min_samples defaults to 1', '')
    minimum%min_samples = 0
    call fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, minimum, s1, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT, 'min_samples 0', &
               "min_samples 0: expected 1 to the buffer's bound")
    ! Bad options on the last rank only: every rank is refused with its problem.
    call one_bad%add_field('x', [3])
    one_bad%timeout_s = 120
    if (rank == nranks - 1) one_bad%capacity = 0
    write (want, '(a, i0, a)') 'bad options on rank ', nranks - 1, ': capacity 0'
    call fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, one_bad, s1, status=st)
    call check(st == FULLSHARD_ERR_ARGUMENT .and. s1%id == 0, 'a bad capacity on one rank', &
               trim(want))
    call differ%add_field('x', [3])
    differ%capacity = merge(16, 32, rank == 0)
    differ%timeout_s = 120
    call fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, differ, s1, status=st)
    if (nranks > 1) call check(st == FULLSHARD_ERR_MISMATCH, 'capacities that differ', &
                               'rank 1 has "capacity = 32"')
    if (nranks == 1) call fullshard_store_free(s1)
  end subroutine

end program test_store
