! The checks the Fortran tests share: check() counts a failed check on this rank and prints
! the rank, what failed and the module's last error. The programs set `rank` and sum
! `failures` over the ranks at the end.
module test_checks
  use fullshard, only: fullshard_last_error
  implicit none
  private
  integer, public :: rank = 0, failures = 0
  public :: check

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

end module test_checks
