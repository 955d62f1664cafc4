! The checks the Fortran tests share: check() counts a failed check on this rank and prints
! the rank, what failed and the module's last error. The programs set `rank` and sum
! `failures` over the ranks at the end.
module test_checks
  use mpi_f08
  use fullshard, only: fullshard_last_error
  implicit none
  private
  integer, public :: rank = 0, failures = 0
  public :: check, finish

contains

  !> Fails unless `ok` and, when `message` is not empty, the last error contains it.
  subroutine check(ok, what, message)
    logical, intent(in) :: ok
    character(*), intent(in) :: what, message
    character(:), allocatable :: err
    err = fullshard_last_error()
    if (ok .and. (len(message) == 0 .or. index(err, message) > 0)) return
    failures = failures + 1
    print '(a, i0, 4a)', 'rank ', rank, ': FAILED ', what, '; last error: ', err
  end subroutine

  !> Ends the program (after fullshard_finalize): sums the ranks' failures, rank 0 prints
  !> `pass_line`, or "<program>: FAIL (n failed checks)", then MPI_Finalize; a failure stops
  !> with status 1.
  subroutine finish(program, pass_line)
    character(*), intent(in) :: program, pass_line
    integer :: total
    call MPI_Allreduce(failures, total, 1, MPI_INTEGER, MPI_SUM, MPI_COMM_WORLD)
    if (rank == 0) then
      if (total == 0) then
        print '(a)', pass_line
      else
        print '(2a, i0, a)', program, ': FAIL (', total, ' failed checks)'
      end if
    end if
    call MPI_Finalize()
    if (total /= 0) error stop 1
  end subroutine

end module test_checks
