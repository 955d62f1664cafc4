// fullshard_init and OpenMP: prints the intra-op (OpenMP) thread count LibTorch has after
// fullshard_init. CTest runs it with OMP_NUM_THREADS=1 (the simulation's choice: kept, no
// line) and without it (fullshard sets the rank's cores and says so in one line).
#include <ATen/Parallel.h>
#include <mpi.h>

#include <cstdio>

#include "fullshard/fullshard.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  if (fullshard_init(MPI_COMM_WORLD) != FULLSHARD_OK) {
    std::fprintf(stderr, "%s\n", fullshard_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  std::printf("intra-op threads %d\n", at::get_num_threads());
  fullshard_finalize();
  MPI_Finalize();
  return 0;
}
