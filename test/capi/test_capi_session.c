/* The training session's checkpoints from C (C99):
 *   test-capi-session save DIR    asynchronous saves while training goes on, keep_last 2, the
 *                                 handles' bad uses, an unwritable checkpoint directory; writes
 *                                 the run's losses to DIR/c_losses.txt
 *                                 and non-finite data: skipped and counted, or refused
 *   test-capi-session resume DIR  on another rank count: resumes DIR/ck and compares its losses
 *                                 with a straight run's.
 * The global batch is 12 rows split over the ranks (1, 2, 3 or 4), so every rank count trains
 * the same model on the same data. The optimizer runs inside backward (its checkpoints and
 * its numbers are those of the step after backward: test/session/test_front_ends.cpp). */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TEST_NAME "test_capi_session"
#include "test_checks.h"

#define IN 6
#define OUT 2
#define GLOBAL 12
#define STEPS 8
#define SAVED 6

static void config(char* out, size_t n, const char* checkpoint) {
  snprintf(out, n,
           "{\"model\": {\"type\": \"residual_mlp\", \"inputs\": 6, \"hidden\": 16, "
           "\"outputs\": 2, \"blocks\": 3}, \"optimizer\": {\"type\": \"adamw\", \"lr\": 0.01, "
           "\"in_backward\": true}, \"seed\": 3%s%s}",
           checkpoint[0] ? ", " : "", checkpoint);
}

/* One step on this rank's rows of step s's global batch; returns the global loss. */
static double step(fullshard_model m, int s) {
  static float x[GLOBAL * IN], y[GLOBAL * OUT];
  const int rows = GLOBAL / world, first = rank * rows;
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < IN; ++j)
      x[i * IN + j] = (float)sin(0.37 * (double)((first + i) * IN + j) + 1.7 * s);
    for (int k = 0; k < OUT; ++k)
      y[i * OUT + k] = (float)cos(0.11 * (double)((first + i) * OUT + k) + 0.9 * s);
  }
  const int64_t xs[2] = {rows, IN}, ys[2] = {rows, OUT};
  fullshard_array a = fullshard_array_contiguous(x, FULLSHARD_FLOAT32, 2, xs);
  fullshard_array b = fullshard_array_contiguous(y, FULLSHARD_FLOAT32, 2, ys);
  double loss = 0;
  ok(fullshard_train_step(m, 1, &a, 1, &b, &loss), "fullshard_train_step");
  loss /= world; /* equal rows: the global mean is the mean of the ranks' */
  MPI_Allreduce(MPI_IN_PLACE, &loss, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return loss;
}

static int step_dirs(const char* dir) {
  int n = 0;
  DIR* d = opendir(dir);
  check(d != NULL, "the checkpoint directory exists");
  struct dirent* e;
  while ((e = readdir(d)) != NULL)
    n += strncmp(e->d_name, "step-", 5) == 0;
  closedir(d);
  return n;
}

/* A NaN in the last rank's input: the step is skipped on every rank (FULLSHARD_OK, loss NaN,
 * counted, the step count stays); with the stop policy it is FULLSHARD_ERR_ARGUMENT on every
 * rank naming the rank, the array and the element. */
static void non_finite(fullshard_mesh mesh) {
  static float x[GLOBAL * IN], y[GLOBAL * OUT];
  const int rows = GLOBAL / world;
  for (int i = 0; i < rows * IN; ++i)
    x[i] = (float)sin(0.3 * i);
  for (int i = 0; i < rows * OUT; ++i)
    y[i] = (float)cos(0.2 * i);
  if (rank == world - 1) x[1 * IN + 4] = NAN;
  const int64_t xs[2] = {rows, IN}, ys[2] = {rows, OUT};
  fullshard_array a = fullshard_array_contiguous(x, FULLSHARD_FLOAT32, 2, xs);
  fullshard_array b = fullshard_array_contiguous(y, FULLSHARD_FLOAT32, 2, ys);
  char text[2048], want[256];
  config(text, sizeof text, "\"non_finite\": {\"max_skipped\": 3}");
  fullshard_model m = {0};
  ok(fullshard_model_create_from_json(mesh, text, "skip.json", &m), "create (skip)");
  double loss = 0;
  int64_t skipped = 0, steps = -1;
  ok(fullshard_train_step(m, 1, &a, 1, &b, &loss), "a step with a NaN input is skipped");
  check(isnan(loss), "a skipped step's loss is NaN");
  ok(fullshard_model_skipped_steps(m, &skipped), "fullshard_model_skipped_steps");
  ok(fullshard_model_step(m, &steps), "fullshard_model_step");
  check(skipped == 1 && steps == 0, "the skipped step is counted, not taken");
  ok(fullshard_model_free(&m), "free");
  config(text, sizeof text, "\"non_finite\": {\"policy\": \"stop\"}");
  ok(fullshard_model_create_from_json(mesh, text, "stop.json", &m), "create (stop)");
  snprintf(want, sizeof want, "step 1: rank %d: input 0 holds nan at [1, 4]", world - 1);
  refused(fullshard_train_step(m, 1, &a, 1, &b, &loss), FULLSHARD_ERR_ARGUMENT, want,
          "a NaN input with the stop policy");
  ok(fullshard_model_free(&m), "free");
}

static void save_mode(fullshard_mesh mesh, const char* dir) {
  char ck[1024], text[2048], path[1200];
  snprintf(ck, sizeof ck, "\"checkpoint\": {\"dir\": \"%s/ck\", \"keep_last\": 2}", dir);
  config(text, sizeof text, ck);
  fullshard_model m = {0};
  ok(fullshard_model_create_from_json(mesh, text, "save.json", &m), "create");
  double losses[SAVED];
  fullshard_save h = {0}, copy = {0};
  for (int s = 0; s < SAVED; ++s) {
    losses[s] = step(m, s);
    if (h.id) { /* training goes on while the files are written */
      int done = 0;
      ok(fullshard_save_test(&h, &done), "fullshard_save_test");
      check(done == (h.id == 0), "a done save's handle is reset");
    }
    if (s == 1 || s == 3) {
      if (h.id) ok(fullshard_save_wait(&h), "fullshard_save_wait");
      ok(fullshard_checkpoint_save_async(m, NULL, &h), "fullshard_checkpoint_save_async");
      check(h.id != 0, "a save handle");
      copy = h;
      fullshard_save second = {0};
      refused(fullshard_checkpoint_save_async(m, NULL, &second), FULLSHARD_ERR_ARGUMENT,
              "is still in flight", "a second save while one is in flight");
      check(second.id == 0, "no handle for a refused save");
    }
  }
  if (h.id) ok(fullshard_save_wait(&h), "fullshard_save_wait");
  check(h.id == 0, "a waited handle is reset");
  refused(fullshard_save_wait(&copy), FULLSHARD_ERR_HANDLE, "was finished",
          "waiting on a finished save handle");
  refused(fullshard_save_wait(&h), FULLSHARD_ERR_HANDLE, "the null save handle",
          "waiting on the null save handle");
  int done = 0;
  refused(fullshard_save_test(&copy, &done), FULLSHARD_ERR_HANDLE, "was finished",
          "testing a finished save handle");
  ok(fullshard_checkpoint_save(m, NULL), "fullshard_checkpoint_save"); /* step 6 */
  int64_t n = 0;
  ok(fullshard_model_step(m, &n), "fullshard_model_step");
  check(n == SAVED, "steps taken");
  snprintf(path, sizeof path, "%s/ck", dir);
  if (rank == 0) check(step_dirs(path) == 2, "keep_last 2 keeps two step directories");
  ok(fullshard_model_free(&m), "free");
  if (rank == 0) {
    snprintf(path, sizeof path, "%s/c_losses.txt", dir);
    FILE* f = fopen(path, "w");
    check(f != NULL, "the losses file opens");
    for (int s = 0; s < SAVED; ++s)
      fprintf(f, "%.17g\n", losses[s]);
    fclose(f);
  }

  /* A directory the ranks cannot write: refused at creation, naming the path. */
  config(text, sizeof text, "\"checkpoint\": {\"dir\": \"/proc/fullshard-capi-session\"}");
  refused(fullshard_model_create_from_json(mesh, text, "unwritable.json", &m), FULLSHARD_ERR_CONFIG,
          "checkpoint directory '/proc/fullshard-capi-session'",
          "an unwritable checkpoint directory");
  check(m.id == 0, "no model for a refused configuration");
  non_finite(mesh);
}

static void resume_mode(fullshard_mesh mesh, const char* dir) {
  char ck[1024], text[2048];
  config(text, sizeof text, "");
  fullshard_model straight = {0};
  ok(fullshard_model_create_from_json(mesh, text, "straight.json", &straight), "create");
  double want[STEPS];
  for (int s = 0; s < STEPS; ++s)
    want[s] = step(straight, s);
  ok(fullshard_model_free(&straight), "free");

  snprintf(ck, sizeof ck, "\"checkpoint\": {\"dir\": \"%s/ck\", \"resume\": true}", dir);
  config(text, sizeof text, ck);
  fullshard_model m = {0};
  ok(fullshard_model_create_from_json(mesh, text, "resume.json", &m), "create (resume)");
  int64_t n = 0;
  ok(fullshard_model_step(m, &n), "fullshard_model_step");
  check(n == SAVED, "resumed at the saved step");
  for (int s = SAVED; s < STEPS; ++s) {
    const double got = step(m, s);
    const double rel = fabs(got - want[s]) / fabs(want[s]);
    if (rank == 0) printf("step %d: resumed %.9g straight %.9g (rel %.2e)\n", s, got, want[s], rel);
    check(rel <= 1e-5, "the resumed run's loss is the straight run's");
  }
  ok(fullshard_model_free(&m), "free");
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  check(argc == 3 && (!strcmp(argv[1], "save") || !strcmp(argv[1], "resume")),
        "usage: test-capi-session save|resume DIR");
  check(GLOBAL % world == 0, "the ranks divide the global batch");
  ok(fullshard_init(MPI_COMM_WORLD), "fullshard_init");
  fullshard_mesh mesh = {0};
  const int shape[1] = {world};
  ok(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", &mesh), "mesh");
  if (!strcmp(argv[1], "save"))
    save_mode(mesh, argv[2]);
  else
    resume_mode(mesh, argv[2]);
  ok(fullshard_mesh_free(&mesh), "mesh free");
  ok(fullshard_finalize(), "fullshard_finalize");
  if (rank == 0) printf("test_capi_session %s: pass\n", argv[1]);
  MPI_Finalize();
  return 0;
}
