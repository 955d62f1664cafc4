! Without a status argument, an error prints its message and aborts the job on the
! communicator given to fullshard_init (no rank is left waiting).
program test_fortran_abort
  use mpi_f08
  use fullshard
  implicit none
  type(fullshard_mesh) :: mesh
  type(fullshard_model) :: model
  integer :: nranks
  call MPI_Init()
  call MPI_Comm_size(MPI_COMM_WORLD, nranks)
  call fullshard_init(MPI_COMM_WORLD)
  call fullshard_mesh_create(MPI_COMM_WORLD, [nranks], 'dp', mesh)
  call fullshard_model_create(mesh, 'test_fortran_abort_missing.json', model)
  print '(a)', 'test_fortran_abort: still running after an error without status'
  call MPI_Finalize()
end program test_fortran_abort
