/* fullshard on part of the job: only the training ranks (all but the last) call
 * fullshard_init with their communicator and train; the last rank, a simulation rank, never
 * calls fullshard. Nothing of fullshard may be collective over MPI_COMM_WORLD. */
#include <stdio.h>

#include "fullshard/fullshard.h"

int main(int argc, char** argv) {
  int rank, nranks, failures = 0, all = 0;
  MPI_Comm train;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  MPI_Comm_split(MPI_COMM_WORLD, rank < nranks - 1 ? 0 : MPI_UNDEFINED, rank, &train);
  if (train != MPI_COMM_NULL) {
    int ntrain = 0;
    float x[8 * 4], y[8 * 2];
    const int64_t xs[2] = {8, 4}, ys[2] = {8, 2};
    fullshard_mesh mesh = {0};
    fullshard_model model = {0};
    fullshard_array in, tg;
    double loss = 0;
    MPI_Comm_size(train, &ntrain);
    for (int i = 0; i < 8 * 4; ++i)
      x[i] = (float)((i * 5 + rank) % 7) / 7;
    for (int i = 0; i < 8 * 2; ++i)
      y[i] = x[2 * i] - x[2 * i + 1];
    in = fullshard_array_contiguous(x, FULLSHARD_FLOAT32, 2, xs);
    tg = fullshard_array_contiguous(y, FULLSHARD_FLOAT32, 2, ys);
    if (fullshard_init(train) != FULLSHARD_OK || fullshard_rank() != rank ||
        fullshard_mesh_create(train, "cpu", 1, &ntrain, "dp", &mesh) != FULLSHARD_OK ||
        fullshard_model_create_from_json(
            mesh,
            "{\"model\": {\"type\": \"mlp\", \"inputs\": 4, \"hidden\": [8], \"outputs\": 2}}",
            NULL, &model) != FULLSHARD_OK) {
      fprintf(stderr, "rank %d: %s\n", rank, fullshard_last_error());
      ++failures;
    } else {
      for (int s = 0; s < 3; ++s)
        if (fullshard_train_step(model, 1, &in, 1, &tg, &loss) != FULLSHARD_OK) {
          fprintf(stderr, "rank %d: %s\n", rank, fullshard_last_error());
          ++failures;
        }
      fullshard_model_free(&model);
      fullshard_mesh_free(&mesh);
    }
    if (fullshard_finalize() != FULLSHARD_OK) ++failures;
    MPI_Comm_free(&train);
  }
  MPI_Allreduce(&failures, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0)
    printf("test_capi_subcomm: %s (%d training ranks of %d)\n", all ? "FAIL" : "pass", nranks - 1,
           nranks);
  MPI_Finalize();
  return all ? 1 : 0;
}
