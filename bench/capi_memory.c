/* The C API's memory against its plan (bench/memory's capi arm; bench/README.md, "Memory"):
 * fullshard-train's residual MLP (--inputs 32 --hidden H --layers L --outputs 8, the same
 * model as bench/peers/fsdp2_train.py) built by the C API's residual_mlp family, trained for
 * --steps steps on a global batch of --batch rows split over the ranks, then rank 0 prints
 * fullshard_model_memory's parts planned and measured, as fullshard-train does:
 *
 *   mpirun -n 4 fullshard-bench-capi-memory --layers 8 --hidden 4096 --batch 8 --steps 3
 *       [--optimizer sgd|adamw] [--optimizer-in-backward] [--inputs N] [--outputs N]
 */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fullshard/fullshard.h"

static void check(fullshard_status s, const char* what) {
  if (s == FULLSHARD_OK) return;
  fprintf(stderr, "fullshard-bench-capi-memory: %s: %s\n", what, fullshard_last_error());
  MPI_Abort(MPI_COMM_WORLD, 2);
}

static long option(int argc, char** argv, const char* name, long fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (strcmp(argv[i], name) == 0) {
      char* end = NULL;
      const long v = strtol(argv[i + 1], &end, 10);
      if (*end != '\0' || v <= 0) {
        fprintf(stderr, "fullshard-bench-capi-memory: %s %s: a positive integer is needed\n",
                name, argv[i + 1]);
        exit(2);
      }
      return v;
    }
  return fallback;
}

static const char* text_option(int argc, char** argv, const char* name, const char* fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (strcmp(argv[i], name) == 0) return argv[i + 1];
  return fallback;
}

static int flag(int argc, char** argv, const char* name) {
  for (int i = 1; i < argc; ++i)
    if (strcmp(argv[i], name) == 0) return 1;
  return 0;
}

static void row(const char* part, int64_t planned, int64_t measured) {
  const double mib = 1024.0 * 1024.0;
  if (planned > 0)
    printf("  %-16s %10.1f %10.1f %7.3f\n", part, (double)planned / mib, (double)measured / mib,
           (double)measured / (double)planned);
  else
    printf("  %-16s %10.1f %10.1f %7s\n", part, (double)planned / mib, (double)measured / mib, "-");
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const long layers = option(argc, argv, "--layers", 8), hidden = option(argc, argv, "--hidden", 1024);
  const long batch = option(argc, argv, "--batch", 256), steps = option(argc, argv, "--steps", 3);
  const long inputs = option(argc, argv, "--inputs", 32), outputs = option(argc, argv, "--outputs", 8);
  const char* optimizer = text_option(argc, argv, "--optimizer", "adamw");
  const int in_backward = flag(argc, argv, "--optimizer-in-backward");
  if (batch % world != 0) {
    if (rank == 0)
      fprintf(stderr, "fullshard-bench-capi-memory: --batch %ld must be divisible by the %d ranks\n",
              batch, world);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  char json[512];
  snprintf(json, sizeof json,
           "{\"model\": {\"type\": \"residual_mlp\", \"inputs\": %ld, \"hidden\": %ld, "
           "\"outputs\": %ld, \"blocks\": %ld}, \"optimizer\": {\"type\": \"%s\", \"lr\": 0.001, "
           "\"in_backward\": %s}, \"grad_clip\": 0, \"seed\": 1}",
           inputs, hidden, outputs, layers, optimizer, in_backward ? "true" : "false");
  check(fullshard_init(MPI_COMM_WORLD), "fullshard_init");
  fullshard_mesh mesh = {0};
  const int shape[1] = {world};
  check(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", &mesh), "fullshard_mesh_create");
  fullshard_model model = {0};
  check(fullshard_model_create_from_json(mesh, json, "fullshard-bench-capi-memory", &model),
        "fullshard_model_create");

  const long rows = batch / world;
  float* x = malloc(sizeof(float) * (size_t)(rows * inputs));
  float* y = malloc(sizeof(float) * (size_t)(rows * outputs));
  double first = 0, last = 0;
  for (long s = 0; s < steps; ++s) {
    for (long i = 0; i < rows * inputs; ++i)
      x[i] = (float)sin(0.37 * (double)(rank * rows * inputs + i) + 1.7 * (double)s);
    for (long i = 0; i < rows * outputs; ++i)
      y[i] = (float)cos(0.11 * (double)(rank * rows * outputs + i) + 0.9 * (double)s);
    const int64_t xs[2] = {rows, inputs}, ys[2] = {rows, outputs};
    const fullshard_array in = fullshard_array_contiguous(x, FULLSHARD_FLOAT32, 2, xs);
    const fullshard_array target = fullshard_array_contiguous(y, FULLSHARD_FLOAT32, 2, ys);
    double loss = 0;
    check(fullshard_train_step(model, 1, &in, 1, &target, &loss), "fullshard_train_step");
    if (s == 0) first = loss;
    last = loss;
  }
  free(x);
  free(y);

  fullshard_memory_parts planned, measured;
  check(fullshard_model_memory(model, &planned, &measured), "fullshard_model_memory");
  if (rank == 0) {
    printf("memory (rank 0, MiB)    planned   measured   ratio\n");
    row("baseline", planned.baseline, measured.baseline);
    row("shards", planned.shards, measured.shards);
    row("gradients", planned.gradients, measured.gradients);
    row("optimizer state", planned.optimizer_state, measured.optimizer_state);
    row("pool", planned.pool, measured.pool);
    row("windows", planned.windows, measured.windows);
    row("activations", planned.activations, measured.activations);
    row("untracked", planned.untracked, measured.untracked);
    row("process peak", planned.process_peak, measured.process_peak);
    printf("summary: %ld steps on %d ranks, loss %.6g -> %.6g (rank 0)\n", steps, world, first,
           last);
  }
  check(fullshard_model_free(&model), "fullshard_model_free");
  check(fullshard_mesh_free(&mesh), "fullshard_mesh_free");
  check(fullshard_finalize(), "fullshard_finalize");
  MPI_Finalize();
  return 0;
}
