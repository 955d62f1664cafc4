/* TorchScript models through the C API, against PyTorch (make_torchscript.py trains the same
 * scripted models unsharded on the global batch): a scripted nn.Sequential (each child a
 * communication group), one whose type name is mangled, and a module with two inputs and two
 * outputs (one group). Each rank trains on its slice of the batch; the mean of the ranks'
 * losses is the global loss. Files that must be refused: an empty (mangled) Sequential, and an
 * archive whose tensor record is shorter than its storage. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fullshard/fullshard.h"

enum { kSteps = 6, kBatch = 12 };

static int rank = 0, nranks = 1, failures = 0;

#define OK(call)                                                                          \
  do {                                                                                    \
    if ((call) != FULLSHARD_OK) {                                                         \
      fprintf(stderr, "rank %d: %s:%d: %s failed: %s\n", rank, __FILE__, __LINE__, #call, \
              fullshard_last_error());                                                    \
      ++failures;                                                                         \
    }                                                                                     \
  } while (0)

/* The next n values of the reference file. */
static double* take(FILE* f, int n) {
  double* v = malloc(sizeof(double) * (size_t)n);
  for (int i = 0; i < n; ++i)
    if (fscanf(f, "%lf", &v[i]) != 1) {
      fprintf(stderr, "rank %d: the reference file ends early\n", rank);
      exit(1);
    }
  return v;
}

/* Rows [first, first + rows) of a (kBatch, cols) f64 array as a float array. */
static float* rows_of(const double* v, int cols, int first, int rows) {
  float* out = malloc(sizeof(float) * (size_t)(rows * cols));
  for (int i = 0; i < rows * cols; ++i)
    out[i] = (float)v[first * cols + i];
  return out;
}

/* ins[i] has in_cols[i] columns, outs[i] out_cols[i]. */
static void run(const char* dir, const char* name, int n_in, const int* in_cols, int n_out,
                const int* out_cols, fullshard_mesh mesh) {
  char path[512];
  FILE* f;
  double *in[2], *tg[2], *losses, *outs[2];
  float *x[2], *y[2], *pred[2];
  fullshard_array xa[2], ya[2], pa[2];
  fullshard_model m = {0};
  const int rows = kBatch / nranks, first = rank * rows;
  double worst = 0;

  snprintf(path, sizeof path, "%s/%s.ref", dir, name);
  f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "rank %d: cannot open %s (run make_torchscript.py)\n", rank, path);
    exit(1);
  }
  for (int i = 0; i < n_in; ++i)
    in[i] = take(f, kBatch * in_cols[i]);
  for (int i = 0; i < n_out; ++i)
    tg[i] = take(f, kBatch * out_cols[i]);
  losses = take(f, kSteps);
  for (int i = 0; i < n_out; ++i)
    outs[i] = take(f, kBatch * out_cols[i]);
  fclose(f);

  for (int i = 0; i < n_in; ++i) {
    const int64_t shape[2] = {rows, in_cols[i]};
    x[i] = rows_of(in[i], in_cols[i], first, rows);
    xa[i] = fullshard_array_contiguous(x[i], FULLSHARD_FLOAT32, 2, shape);
  }
  for (int i = 0; i < n_out; ++i) {
    const int64_t shape[2] = {rows, out_cols[i]};
    y[i] = rows_of(tg[i], out_cols[i], first, rows);
    pred[i] = calloc((size_t)(rows * out_cols[i]), sizeof(float));
    ya[i] = fullshard_array_contiguous(y[i], FULLSHARD_FLOAT32, 2, shape);
    pa[i] = fullshard_array_contiguous(pred[i], FULLSHARD_FLOAT32, 2, shape);
  }

  snprintf(path, sizeof path, "%s/%s.json", dir, name);
  OK(fullshard_model_create(mesh, path, &m));
  for (int s = 0; s < kSteps; ++s) {
    double loss = 0, mean = 0;
    OK(fullshard_train_step(m, n_in, xa, n_out, ya, &loss));
    MPI_Allreduce(&loss, &mean, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    mean /= nranks;
    if (fabs(mean - losses[s]) > 1e-5 * fabs(losses[s])) {
      fprintf(stderr, "rank %d: %s step %d: loss %.9g, PyTorch %.9g\n", rank, name, s, mean,
              losses[s]);
      ++failures;
    }
  }
  OK(fullshard_predict(m, n_in, xa, n_out, pa));
  for (int i = 0; i < n_out; ++i) {
    double scale = 0;
    for (int k = 0; k < kBatch * out_cols[i]; ++k)
      scale = fmax(scale, fabs(outs[i][k]));
    for (int k = 0; k < rows * out_cols[i]; ++k)
      worst = fmax(worst, fabs(pred[i][k] - outs[i][first * out_cols[i] + k]) / scale);
  }
  if (worst > 1e-5) {
    fprintf(stderr, "rank %d: %s: outputs differ from PyTorch's by %g (relative)\n", rank, name,
            worst);
    ++failures;
  }
  if (rank == 0)
    printf("%s: %d steps equal PyTorch's (loss %.6f -> %.6f)\n", name, kSteps, losses[0],
           losses[kSteps - 1]);
  OK(fullshard_model_free(&m));
  for (int i = 0; i < n_in; ++i) {
    free(in[i]);
    free(x[i]);
  }
  for (int i = 0; i < n_out; ++i) {
    free(tg[i]);
    free(outs[i]);
    free(y[i]);
    free(pred[i]);
  }
  free(losses);
}

/* A file the C API must refuse at creation with `want` and a message holding `text`. */
static void refused(const char* dir, const char* name, fullshard_mesh mesh, fullshard_status want,
                    const char* text) {
  char path[512];
  fullshard_model m = {0};
  fullshard_status got;
  snprintf(path, sizeof path, "%s/%s.json", dir, name);
  got = fullshard_model_create(mesh, path, &m);
  if (got != want || strstr(fullshard_last_error(), text) == NULL) {
    fprintf(stderr, "rank %d: %s: %s, \"%s\" (want %s with \"%s\")\n", rank, name,
            fullshard_status_name(got), fullshard_last_error(), fullshard_status_name(want), text);
    ++failures;
  } else if (rank == 0) {
    printf("%s: refused: %s\n", name, fullshard_last_error());
  }
  if (got == FULLSHARD_OK) OK(fullshard_model_free(&m));
}

int main(int argc, char** argv) {
  fullshard_mesh mesh = {0};
  int shape[1];
  const int seq_in[1] = {5}, seq_out[1] = {5}, multi_in[2] = {4, 3}, multi_out[2] = {2, 1};
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  if (argc < 2) {
    fprintf(stderr, "usage: test_torchscript DIR (make_torchscript.py's output)\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  shape[0] = nranks;
  OK(fullshard_init(MPI_COMM_WORLD));
  OK(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", &mesh));
  run(argv[1], "seq", 1, seq_in, 1, seq_out, mesh);
  run(argv[1], "multi", 2, multi_in, 2, multi_out, mesh);
  /* A mangled type name (a second Sequential scripted in one process) is still a Sequential:
   * trained as PyTorch trains it, one group per block and the root. */
  run(argv[1], "mangled", 1, seq_in, 1, seq_out, mesh);
  {
    char path[512];
    fullshard_model m = {0};
    fullshard_plan_info info;
    snprintf(path, sizeof path, "%s/mangled.json", argv[1]);
    OK(fullshard_model_create(mesh, path, &m));
    OK(fullshard_model_plan(m, &info));
    if (info.groups != 3) {
      fprintf(stderr, "rank %d: mangled: %lld groups, want 3 (2 blocks and the root)\n", rank,
              (long long)info.groups);
      ++failures;
    }
    OK(fullshard_model_free(&m));
  }
  refused(argv[1], "mangled_empty", mesh, FULLSHARD_ERR_CONFIG, "is an empty Sequential");
  /* A tensor record shorter than its storage: refused before LibTorch reads past it. */
  refused(argv[1], "short_record", mesh, FULLSHARD_ERR_IO,
          "record 'seq/data/0' holds 4 bytes, but its storage declares 100 (torch.FloatStorage x "
          "25)");
  OK(fullshard_mesh_free(&mesh));
  OK(fullshard_finalize());
  {
    int all = 0;
    MPI_Allreduce(&failures, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) printf("test_torchscript: %s (%d ranks)\n", all ? "FAIL" : "pass", nranks);
    MPI_Finalize();
    return all ? 1 : 0;
  }
}
