/* The C API from C (C99): every call and every status of fullshard.h, on 1 to 4 ranks.
 * Numbers are checked against references computed here (the loss of a step is recomputed
 * from the model's predictions; a resumed run against the straight one); the equality with
 * the C++ front end is test/capi/test_capi_vs_cpp.cpp's. */
#define _POSIX_C_SOURCE 200112L /* setenv */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fullshard/fullshard.h"

fullshard_status fullshard_detail_last_input(fullshard_model model, const void** data);
fullshard_status fullshard_detail_raise(int kind);

static int failures = 0;
static int rank = 0, nranks = 1;

#define CHECK(cond)                                                                         \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      fprintf(stderr, "rank %d: %s:%d: CHECK(%s) failed; last error: %s\n", rank, __FILE__, \
              __LINE__, #cond, fullshard_last_error());                                     \
      ++failures;                                                                           \
    }                                                                                       \
  } while (0)

/* The call gives `want`, and the message contains `text`. */
#define CHECK_STATUS(call, want, text)                                                        \
  do {                                                                                        \
    int got_ = (call);                                                                        \
    if (got_ != (want) || strstr(fullshard_last_error(), (text)) == NULL) {                   \
      fprintf(stderr, "rank %d: %s:%d: %s gave %s (want %s), message \"%s\" (want \"%s\")\n", \
              rank, __FILE__, __LINE__, #call, fullshard_status_name(got_),                   \
              fullshard_status_name(want), fullshard_last_error(), (text));                   \
      ++failures;                                                                             \
    }                                                                                         \
  } while (0)

#define OK(call) CHECK_STATUS(call, FULLSHARD_OK, "")

enum { kIn = 6, kOut = 2, kBatch = 8 };

static const char* kConfig =
    "{\"model\": {\"type\": \"mlp\", \"inputs\": 6, \"hidden\": [16, 12], \"outputs\": 2,"
    " \"activation\": \"tanh\"},"
    " \"loss\": \"mse\", \"optimizer\": {\"type\": \"adamw\", \"lr\": 0.01,"
    " \"weight_decay\": 0.01}, \"lr_schedule\": {\"type\": \"warmup_cosine\","
    " \"warmup_steps\": 2, \"total_steps\": 40, \"min_lr\": 0.001}, \"grad_clip\": 1.0,"
    " \"seed\": 7}";

/* Deterministic data: sample s of step t; the target is a smooth function of the input. */
static void batch(int step, int r, float* x, float* y) {
  for (int i = 0; i < kBatch; ++i) {
    const int s = step * 1000 + r * kBatch + i;
    float sum = 0;
    for (int j = 0; j < kIn; ++j) {
      x[i * kIn + j] = (float)sin(0.37 * s + 1.3 * j);
      sum += x[i * kIn + j];
    }
    y[i * kOut + 0] = (float)tanh(sum / 3);
    y[i * kOut + 1] = (float)(x[i * kIn] * x[i * kIn + 1]);
  }
}

static double train(fullshard_model m, int step, int r) {
  float x[kBatch * kIn], y[kBatch * kOut];
  const int64_t xs[2] = {kBatch, kIn}, ys[2] = {kBatch, kOut};
  batch(step, r, x, y);
  fullshard_array in = fullshard_array_contiguous(x, FULLSHARD_FLOAT32, 2, xs);
  fullshard_array tg = fullshard_array_contiguous(y, FULLSHARD_FLOAT32, 2, ys);
  double loss = -1;
  OK(fullshard_train_step(m, 1, &in, 1, &tg, &loss));
  return loss;
}

static void predict(fullshard_model m, const float* x, float* out) {
  const int64_t xs[2] = {kBatch, kIn}, os[2] = {kBatch, kOut};
  fullshard_array in = fullshard_array_contiguous((void*)x, FULLSHARD_FLOAT32, 2, xs);
  fullshard_array o = fullshard_array_contiguous(out, FULLSHARD_FLOAT32, 2, os);
  OK(fullshard_predict(m, 1, &in, 1, &o));
}

static int write_file(const char* path, const char* text) {
  FILE* f = fopen(path, "w");
  if (!f) return 0;
  fputs(text, f);
  return fclose(f) == 0;
}

static void before_init(void) {
  fullshard_mesh mesh = {0};
  int shape[1] = {1};
  fullshard_model model = {0};
  CHECK(!fullshard_initialized());
  CHECK(fullshard_rank() == -1);
  CHECK_STATUS(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", &mesh),
               FULLSHARD_ERR_NOT_INITIALIZED, "fullshard_init first");
  CHECK_STATUS(fullshard_model_create(mesh, "x.json", &model), FULLSHARD_ERR_NOT_INITIALIZED,
               "not initialised");
  CHECK_STATUS(fullshard_train_step(model, 0, NULL, 0, NULL, NULL), FULLSHARD_ERR_NOT_INITIALIZED,
               "fullshard_train_step");
  CHECK_STATUS(fullshard_finalize(), FULLSHARD_ERR_NOT_INITIALIZED, "not initialised");
}

static void meshes(fullshard_mesh* mesh) {
  int shape[2] = {nranks, 1};
  fullshard_mesh bad = {0};
  CHECK_STATUS(fullshard_mesh_create(MPI_COMM_WORLD, "tpu", 1, shape, "dp", &bad),
               FULLSHARD_ERR_ARGUMENT, "tpu");
  CHECK_STATUS(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "a,b", &bad),
               FULLSHARD_ERR_ARGUMENT, "gives 2 dim names for ndim 1");
  CHECK_STATUS(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 3, shape, "a,b,c", &bad),
               FULLSHARD_ERR_ARGUMENT, "ndim is 3");
  CHECK_STATUS(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, NULL, "dp", &bad),
               FULLSHARD_ERR_ARGUMENT, "shape is NULL");
  CHECK_STATUS(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", NULL),
               FULLSHARD_ERR_ARGUMENT, "mesh is NULL");
  CHECK_STATUS(fullshard_mesh_create(MPI_COMM_NULL, "cpu", 1, shape, "dp", &bad),
               FULLSHARD_ERR_ARGUMENT, "MPI_COMM_NULL");
  shape[0] = nranks + 1;
  CHECK_STATUS(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", &bad),
               FULLSHARD_ERR_ARGUMENT, "");
  shape[0] = nranks;
  if (nranks > 1) /* the last rank names its dim differently: every rank is told */
    CHECK_STATUS(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape,
                                       rank == nranks - 1 ? "other" : "dp", &bad),
                 FULLSHARD_ERR_MISMATCH, "do not all build the same mesh");
  CHECK(bad.id == 0);
  OK(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", mesh));
  CHECK(mesh->id != 0);
  /* A 2-D (HSDP) mesh and its free. */
  if (nranks % 2 == 0) {
    fullshard_mesh hsdp = {0};
    int s2[2] = {2, nranks / 2};
    OK(fullshard_mesh_create_f(MPI_Comm_c2f(MPI_COMM_WORLD), "cpu", 2, s2, "replicate, shard",
                               &hsdp));
    OK(fullshard_mesh_free(&hsdp));
    CHECK(hsdp.id == 0);
  }
  {
    fullshard_mesh none = {0};
    OK(fullshard_mesh_free(&none)); /* the null handle */
  }
}

static void handles(fullshard_mesh mesh) {
  fullshard_model none = {0}, as_model = {mesh.id}, made_up = {0x0200000500000009ull};
  int64_t step;
  CHECK_STATUS(fullshard_model_step(none, &step), FULLSHARD_ERR_HANDLE, "null model handle");
  CHECK_STATUS(fullshard_model_step(as_model, &step), FULLSHARD_ERR_HANDLE, "another kind");
  CHECK_STATUS(fullshard_model_step(made_up, &step), FULLSHARD_ERR_HANDLE, "made-up");
  {
    fullshard_mesh copy = mesh, tmp = {0};
    int shape[1] = {nranks};
    fullshard_model m = {0};
    OK(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", &tmp));
    copy = tmp;
    OK(fullshard_mesh_free(&tmp));
    CHECK_STATUS(fullshard_model_create_from_json(copy, kConfig, NULL, &m), FULLSHARD_ERR_HANDLE,
                 "was freed");
    CHECK_STATUS(fullshard_mesh_free(&copy), FULLSHARD_ERR_HANDLE, "was freed");
  }
}

static void configurations(fullshard_mesh mesh) {
  fullshard_model m = {0};
  char path[64];
  CHECK_STATUS(fullshard_model_create_from_json(
                   mesh,
                   "{\"model\": {\"type\": \"mlp\", \"inputs\": 2, \"hidden\": [4],"
                   " \"outputs\": 1}, \"optimiser\": {}}",
                   "bad.json", &m),
               FULLSHARD_ERR_CONFIG, "bad.json: unknown key 'optimiser'");
  CHECK_STATUS(fullshard_model_create_from_json(
                   mesh,
                   "{\"model\": {\"type\": \"mlp\", \"inputs\": \"2\", \"hidden\": [4],"
                   " \"outputs\": 1}}",
                   "t.json", &m),
               FULLSHARD_ERR_CONFIG, "t.json: model.inputs: expected an integer, got a string");
  CHECK_STATUS(fullshard_model_create_from_json(mesh, "{\"model\": {\"type\": \"rnn\"}}", NULL, &m),
               FULLSHARD_ERR_CONFIG, "<string>: model.type: unknown value \"rnn\"");
  CHECK_STATUS(fullshard_model_create_from_json(mesh, "{\"model\": ", "cut.json", &m),
               FULLSHARD_ERR_CONFIG, "cut.json");
  CHECK_STATUS(fullshard_model_create(mesh, "/nonexistent/model.json", &m), FULLSHARD_ERR_CONFIG,
               "/nonexistent/model.json: cannot read the configuration");
  CHECK_STATUS(fullshard_model_create(mesh, NULL, &m), FULLSHARD_ERR_ARGUMENT,
               "config_path is NULL");
  CHECK(m.id == 0);
  /* The file is read on every rank; one rank's different learning rate is named. */
  snprintf(path, sizeof path, "test_capi_rank%d.json", rank);
  CHECK(write_file(path, rank == nranks - 1 && nranks > 1
                             ? "{\"model\": {\"type\": \"mlp\", \"inputs\": 2, \"hidden\": [4],"
                               " \"outputs\": 1}, \"optimizer\": {\"lr\": 0.5}}"
                             : "{\"model\": {\"type\": \"mlp\", \"inputs\": 2, \"hidden\": [4],"
                               " \"outputs\": 1}, \"optimizer\": {\"lr\": 0.1}}"));
  if (nranks > 1)
    CHECK_STATUS(fullshard_model_create(mesh, path, &m), FULLSHARD_ERR_MISMATCH,
                 "optimizer.lr = 0.1");
  else
    OK(fullshard_model_create(mesh, path, &m));
  OK(fullshard_model_free(&m));
  remove(path);
  {
    fullshard_model none = {0};
    OK(fullshard_model_free(&none));
  }
}

static void training(fullshard_mesh mesh) {
  fullshard_model m = {0}, m2 = {0};
  fullshard_plan_info plan;
  int64_t n = 0, step = -1;
  double lr = 0, first = 0, last = 0;
  float x[kBatch * kIn], y[kBatch * kOut], out[kBatch * kOut];
  OK(fullshard_model_create_from_json(mesh, kConfig, "mlp.json", &m));
  OK(fullshard_model_num_params(m, &n));
  CHECK(n == (6 * 16 + 16) + (16 * 12 + 12) + (12 * 2 + 2));
  OK(fullshard_model_plan(m, &plan));
  CHECK(plan.groups == 3); /* two blocks and the root */
  CHECK(plan.step_ms > 0);
  CHECK(plan.peak_bytes > 0);
  CHECK(plan.sharded_bytes > 0 && plan.sharded_bytes <= (int64_t)n * 4);
  /* The process's resident memory at creation is in it (far more than this model's bytes). */
  CHECK(plan.process_peak_bytes > plan.sharded_bytes + plan.peak_bytes + (int64_t)n * 4);
  OK(fullshard_model_lr(m, &lr));
  CHECK(lr == 0); /* warm-up from 0 */

  /* The loss a step returns is this rank's MSE before the step: recomputed from predict. */
  batch(0, rank, x, y);
  predict(m, x, out);
  {
    double want = 0;
    for (int i = 0; i < kBatch * kOut; ++i)
      want += (double)(out[i] - y[i]) * (out[i] - y[i]);
    want /= kBatch * kOut;
    first = train(m, 0, rank);
    CHECK(fabs(first - want) <= 1e-6 * want);
  }
  for (int s = 1; s < 30; ++s)
    last = train(m, s, rank);
  {
    double sum[2] = {first, last}, tot[2];
    MPI_Allreduce(sum, tot, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) printf("mlp: loss %.6f -> %.6f\n", tot[0] / nranks, tot[1] / nranks);
    CHECK(tot[1] < 0.8 * tot[0]); /* it learns */
  }
  OK(fullshard_model_step(m, &step));
  CHECK(step == 30);
  {
    /* Calibrated after steps 2..11: the modules' measured compute, the optimizer's step and the
     * cost model scaled to the measured FSDP work are in the prediction now. */
    fullshard_plan_info after;
    OK(fullshard_model_plan(m, &after));
    CHECK(plan.calibrated_iterations == 0 && plan.optimizer_ms == 0);
    CHECK(after.calibrated_iterations == 10);
    CHECK(after.optimizer_ms > 0);
    CHECK(after.step_ms > after.optimizer_ms && after.step_ms != plan.step_ms);
    CHECK(plan.communication_scale == 1 && after.communication_scale > 0);
    CHECK(after.peak_bytes == plan.peak_bytes && after.groups == plan.groups);
  }
  OK(fullshard_model_lr(m, &lr));
  {
    const double pi = 3.14159265358979323846, p = (30.0 - 2) / (40 - 2);
    const double want = 0.001 + 0.5 * (0.01 - 0.001) * (1 + cos(pi * p));
    CHECK(fabs(lr - want) <= 1e-12);
  }

  /* Zero copy: a contiguous f32 array reaches the model at its own address. */
  {
    const void* seen = NULL;
    predict(m, x, out);
    OK(fullshard_detail_last_input(m, &seen));
    CHECK(seen == (const void*)x);
  }
  /* f64 and strided inputs are converted / gathered once, with the same result. */
  {
    double xd[kBatch * kIn];
    float wide[kBatch * kIn * 2], out2[kBatch * kOut];
    const int64_t xs[2] = {kBatch, kIn}, os[2] = {kBatch, kOut};
    const void* seen = NULL;
    fullshard_array in, o = fullshard_array_contiguous(out2, FULLSHARD_FLOAT32, 2, os);
    float worst = 0;
    for (int i = 0; i < kBatch * kIn; ++i) {
      xd[i] = x[i];
      wide[2 * i] = x[i];
      wide[2 * i + 1] = 1e30f;
    }
    in = fullshard_array_contiguous(xd, FULLSHARD_FLOAT64, 2, xs);
    OK(fullshard_predict(m, 1, &in, 1, &o));
    OK(fullshard_detail_last_input(m, &seen));
    CHECK(seen != (const void*)xd);
    for (int i = 0; i < kBatch * kOut; ++i)
      worst = fmaxf(worst, fabsf(out2[i] - out[i]));
    CHECK(worst == 0);
    in = fullshard_array_contiguous(wide, FULLSHARD_FLOAT32, 2, xs); /* every other float */
    in.strides[0] = 2 * kIn;
    in.strides[1] = 2;
    OK(fullshard_predict(m, 1, &in, 1, &o));
    for (int i = 0; i < kBatch * kOut; ++i)
      worst = fmaxf(worst, fabsf(out2[i] - out[i]));
    CHECK(worst == 0);
    /* An int32 field is converted to the model's floats: the outputs of the same values as
     * float32. */
    {
      int32_t xi[kBatch * kIn];
      float xf[kBatch * kIn], outf[kBatch * kOut];
      fullshard_array of = fullshard_array_contiguous(outf, FULLSHARD_FLOAT32, 2, os);
      for (int i = 0; i < kBatch * kIn; ++i) {
        xi[i] = (int32_t)(x[i] * 10.0f);
        xf[i] = (float)xi[i];
      }
      in = fullshard_array_contiguous(xf, FULLSHARD_FLOAT32, 2, xs);
      OK(fullshard_predict(m, 1, &in, 1, &of));
      in = fullshard_array_contiguous(xi, FULLSHARD_INT32, 2, xs);
      OK(fullshard_predict(m, 1, &in, 1, &o));
      worst = 0;
      for (int i = 0; i < kBatch * kOut; ++i)
        worst = fmaxf(worst, fabsf(out2[i] - outf[i]));
      CHECK(worst == 0 && outf[0] != out[0]);
    }
  }
  /* Bad arrays and counts, before any collective. */
  {
    const int64_t bad[2] = {kBatch, kIn + 1}, xs[2] = {kBatch, kIn}, ys[2] = {kBatch, kOut + 1};
    fullshard_array in = fullshard_array_contiguous(x, FULLSHARD_FLOAT32, 2, bad);
    fullshard_array good = fullshard_array_contiguous(x, FULLSHARD_FLOAT32, 2, xs);
    fullshard_array tg = fullshard_array_contiguous(y, FULLSHARD_FLOAT32, 2, ys);
    fullshard_array o = fullshard_array_contiguous(out, FULLSHARD_FLOAT32, 2, ys);
    CHECK_STATUS(fullshard_train_step(m, 1, &in, 1, &tg, NULL), FULLSHARD_ERR_ARGUMENT,
                 "input 0 has shape (8, 7); the mlp takes (batch, 6)");
    CHECK_STATUS(fullshard_train_step(m, 1, NULL, 1, &tg, NULL), FULLSHARD_ERR_ARGUMENT,
                 "inputs is NULL");
    {
      fullshard_array two[2];
      two[0] = good;
      two[1] = good;
      CHECK_STATUS(fullshard_train_step(m, 2, two, 0, NULL, NULL), FULLSHARD_ERR_ARGUMENT,
                   "takes 1 input, not 2");
    }
    in.dtype = 42;
    CHECK_STATUS(fullshard_predict(m, 1, &in, 1, &o), FULLSHARD_ERR_ARGUMENT,
                 "dtype 42 is not a fullshard_dtype");
    in = good;
    in.ndim = 0;
    CHECK_STATUS(fullshard_predict(m, 1, &in, 1, &o), FULLSHARD_ERR_ARGUMENT, "ndim is 0");
    in = good;
    in.data = NULL;
    CHECK_STATUS(fullshard_predict(m, 1, &in, 1, &o), FULLSHARD_ERR_ARGUMENT, "data is NULL");
    /* Output shapes are checked after the forward, which every rank ran. */
    CHECK_STATUS(fullshard_predict(m, 1, &good, 1, &o), FULLSHARD_ERR_ARGUMENT,
                 "outputs[0] has shape [8, 3] but the model's output 0 has shape [8, 2]");
    /* A target of the wrong shape: the forward ran on every rank; no backward, no step. */
    CHECK_STATUS(fullshard_train_step(m, 1, &good, 1, &tg, NULL), FULLSHARD_ERR_ARGUMENT,
                 "target 0 has shape (8, 3) but output 0 has shape (8, 2)");
  }

  /* Checkpoint: 5 steps after a save equal 5 steps after loading it (same ranks). */
  {
    double after[5], again[5];
    char dir[64], rm[96];
    snprintf(dir, sizeof dir, "test_capi_ckpt_np%d", nranks);
    snprintf(rm, sizeof rm, "rm -rf %s", dir);
    if (rank == 0) CHECK(system(rm) == 0); /* an earlier run's */
    MPI_Barrier(MPI_COMM_WORLD);
    OK(fullshard_checkpoint_save(m, dir));
    for (int s = 0; s < 5; ++s)
      after[s] = train(m, 100 + s, rank);
    OK(fullshard_checkpoint_load(m, dir));
    OK(fullshard_model_step(m, &step));
    CHECK(step == 30);
    for (int s = 0; s < 5; ++s) {
      again[s] = train(m, 100 + s, rank);
      CHECK(again[s] == after[s]);
    }
    CHECK_STATUS(fullshard_checkpoint_load(m, "/nonexistent/ckpt"), FULLSHARD_ERR_IO,
                 "checkpoint directory '/nonexistent/ckpt' does not exist");
    CHECK_STATUS(fullshard_checkpoint_save(m, "/proc/fullshard-test"), FULLSHARD_ERR_IO,
                 "/proc/fullshard-test");
    /* Another rank count: ranks 0 .. n-2 load the same checkpoint into a fresh model and
     * predict what the n-rank model predicted after its load. */
    OK(fullshard_checkpoint_load(m, dir));
    predict(m, x, out);
    if (nranks > 1) {
      MPI_Comm sub;
      MPI_Comm_split(MPI_COMM_WORLD, rank < nranks - 1 ? 0 : MPI_UNDEFINED, rank, &sub);
      if (sub != MPI_COMM_NULL) {
        fullshard_mesh small = {0};
        int shape[1] = {nranks - 1};
        float out2[kBatch * kOut];
        float worst = 0;
        OK(fullshard_mesh_create(sub, "cpu", 1, shape, "dp", &small));
        OK(fullshard_model_create_from_json(small, kConfig, "mlp.json", &m2));
        OK(fullshard_checkpoint_load(m2, dir));
        OK(fullshard_model_step(m2, &step));
        CHECK(step == 30);
        predict(m2, x, out2);
        for (int i = 0; i < kBatch * kOut; ++i)
          worst = fmaxf(worst, fabsf(out2[i] - out[i]));
        CHECK(worst <= 1e-6f);
        OK(fullshard_model_free(&m2));
        OK(fullshard_mesh_free(&small));
        MPI_Comm_free(&sub);
      }
    }
  }
  /* safetensors: rank 0 writes one file; its header length is within it. */
  {
    char path[64];
    snprintf(path, sizeof path, "test_capi_np%d.safetensors", nranks);
    OK(fullshard_export_safetensors(m, path));
    if (rank == 0) {
      FILE* f = fopen(path, "rb");
      unsigned char len[8];
      long size = 0;
      uint64_t header = 0;
      CHECK(f != NULL);
      if (f) {
        CHECK(fread(len, 1, 8, f) == 8);
        fseek(f, 0, SEEK_END);
        size = ftell(f);
        fclose(f);
        for (int i = 7; i >= 0; --i)
          header = header * 256 + len[i];
        CHECK(header > 2 && (long)(8 + header) < size);
        /* The parameters are f32: the data is 4 bytes per parameter. */
        CHECK(size - 8 - (long)header == (long)n * 4);
      }
    }
    CHECK_STATUS(fullshard_export_safetensors(m, NULL), FULLSHARD_ERR_ARGUMENT, "path is NULL");
  }
  OK(fullshard_model_free(&m));
  CHECK(m.id == 0);
}

/* The other families: a GPT on tokens (its own loss), a convolutional encoder-decoder on
 * 2-D fields, a residual MLP in float64 under HSDP and the auto policy. */
static void families(fullshard_mesh mesh) {
  fullshard_model m = {0};
  double loss = 0;
  {
    int64_t ids[4 * 9];
    const int64_t shape[2] = {4, 9};
    fullshard_array in = fullshard_array_contiguous(ids, FULLSHARD_INT64, 2, shape);
    for (int i = 0; i < 4 * 9; ++i)
      ids[i] = (i * 7 + rank) % 16;
    OK(fullshard_model_create_from_json(
        mesh,
        "{\"model\": {\"type\": \"gpt\", \"vocab\": 16, \"context\": 8, \"d_model\": 16,"
        " \"heads\": 2, \"layers\": 2, \"deferred_init\": false}, \"seed\": 3}",
        "gpt.json", &m));
    OK(fullshard_train_step(m, 1, &in, 0, NULL, &loss));
    CHECK(fabs(loss - log(16.0)) < 0.2); /* about uniform at the start */
    CHECK_STATUS(fullshard_train_step(m, 1, &in, 1, &in, &loss), FULLSHARD_ERR_ARGUMENT,
                 "pass no targets");
    /* A token outside the vocabulary, on the last rank: named on every rank. */
    if (rank == nranks - 1) ids[2 * 9 + 5] = 99;
    CHECK_STATUS(fullshard_train_step(m, 1, &in, 0, NULL, &loss), FULLSHARD_ERR_ARGUMENT,
                 "input 0 holds token 99 at [2, 5]; the gpt's vocabulary is [0, 16)");
    ids[2 * 9 + 5] = 1;
    OK(fullshard_model_free(&m));
    /* Deferred (the default): built on the meta device, each rank initialises its own
       shards. */
    OK(fullshard_model_create_from_json(
        mesh,
        "{\"model\": {\"type\": \"gpt\", \"vocab\": 16, \"context\": 8, \"d_model\": 16,"
        " \"heads\": 2, \"layers\": 2, \"deferred_init\": true}, \"seed\": 3}",
        "gpt-deferred.json", &m));
    OK(fullshard_train_step(m, 1, &in, 0, NULL, &loss));
    CHECK(fabs(loss - log(16.0)) < 0.2);
    OK(fullshard_model_free(&m));
  }
  {
    float field[2 * 1 * 8 * 8], out[2 * 1 * 8 * 8];
    const int64_t shape[4] = {2, 1, 8, 8};
    fullshard_array in = fullshard_array_contiguous(field, FULLSHARD_FLOAT32, 4, shape);
    fullshard_array o = fullshard_array_contiguous(out, FULLSHARD_FLOAT32, 4, shape);
    double l0 = 0;
    for (int i = 0; i < 2 * 64; ++i)
      field[i] = (float)sin(0.1 * i + rank);
    OK(fullshard_model_create_from_json(
        mesh,
        "{\"model\": {\"type\": \"conv_autoencoder\", \"channels\": 1, \"width\": 4,"
        " \"levels\": 2}, \"optimizer\": {\"lr\": 0.01}}",
        "conv.json", &m));
    OK(fullshard_train_step(m, 1, &in, 1, &in, &l0));
    for (int s = 0; s < 20; ++s)
      OK(fullshard_train_step(m, 1, &in, 1, &in, &loss));
    CHECK(loss < l0);
    OK(fullshard_predict(m, 1, &in, 1, &o));
    {
      const int64_t odd[4] = {2, 1, 6, 8};
      in = fullshard_array_contiguous(field, FULLSHARD_FLOAT32, 4, odd);
      CHECK_STATUS(fullshard_train_step(m, 1, &in, 1, &in, &loss), FULLSHARD_ERR_ARGUMENT,
                   "H and W multiples of 4");
    }
    OK(fullshard_model_free(&m));
  }
  if (nranks % 2 == 0) {
    fullshard_mesh hsdp = {0};
    int s2[2] = {2, nranks / 2};
    double x[kBatch * kIn], y[kBatch * kOut];
    const int64_t xs[2] = {kBatch, kIn}, ys[2] = {kBatch, kOut};
    fullshard_array in = fullshard_array_contiguous(x, FULLSHARD_FLOAT64, 2, xs);
    fullshard_array tg = fullshard_array_contiguous(y, FULLSHARD_FLOAT64, 2, ys);
    fullshard_plan_info plan;
    const void* seen = NULL;
    for (int i = 0; i < kBatch * kIn; ++i)
      x[i] = sin(i + rank);
    for (int i = 0; i < kBatch * kOut; ++i)
      y[i] = cos(i + rank);
    OK(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 2, s2, "replicate,shard", &hsdp));
    OK(fullshard_model_create_from_json(
        hsdp,
        "{\"model\": {\"type\": \"residual_mlp\", \"inputs\": 6, \"hidden\": 16,"
        " \"outputs\": 2, \"blocks\": 3}, \"dtype\": \"float64\", \"optimizer\":"
        " {\"type\": \"sgd\", \"lr\": 0.05, \"momentum\": 0.9},"
        " \"sharding\": {\"policy\": \"auto\", \"memory_budget_mb\": 64}}",
        "auto.json", &m));
    OK(fullshard_model_plan(m, &plan));
    CHECK(plan.groups >= 1);
    OK(fullshard_train_step(m, 1, &in, 1, &tg, &loss));
    OK(fullshard_detail_last_input(m, &seen));
    CHECK(seen == (const void*)x); /* f64 into a f64 model: no copy either */
    CHECK(loss > 0);
    OK(fullshard_model_free(&m));
    OK(fullshard_mesh_free(&hsdp));
  }
}

/* A budget nothing fits; mixed precision (bf16 parameters, f32 reduction); the run-time
 * failures no call can be made to show on purpose (an MPI failure, a bug) through the test
 * hook of the status mapping. */
static void statuses(fullshard_mesh mesh) {
  fullshard_model m = {0};
  double first = 0, loss = 0;
  CHECK_STATUS(fullshard_model_create_from_json(
                   mesh,
                   "{\"model\": {\"type\": \"residual_mlp\", \"inputs\": 6, \"hidden\":"
                   " 256, \"outputs\": 2, \"blocks\": 3}, \"sharding\": {\"policy\":"
                   " \"auto\", \"memory_budget_mb\": 0.001}}",
                   "tiny.json", &m),
               FULLSHARD_ERR_INFEASIBLE, "");
  CHECK(m.id == 0);
  OK(fullshard_model_create_from_json(
      mesh,
      "{\"model\": {\"type\": \"mlp\", \"inputs\": 6, \"hidden\": [16], \"outputs\": 2},"
      " \"optimizer\": {\"lr\": 0.01},"
      " \"mixed_precision\": {\"param_dtype\": \"bf16\", \"reduce_dtype\": \"f32\"}}",
      "bf16.json", &m));
  first = train(m, 0, rank);
  for (int s = 1; s < 30; ++s)
    loss = train(m, s, rank);
  CHECK(isfinite(first) && isfinite(loss) && loss > 0);
  {
    double sum[2] = {first, loss}, tot[2];
    MPI_Allreduce(sum, tot, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    CHECK(tot[1] < tot[0]); /* bf16 compute still learns */
  }
  OK(fullshard_model_free(&m));
  CHECK_STATUS(fullshard_detail_raise(0), FULLSHARD_ERR_COMM, "MPI_Iallreduce failed");
  CHECK_STATUS(fullshard_detail_raise(1), FULLSHARD_ERR_INTERNAL, "an internal error");
}

int main(int argc, char** argv) {
  fullshard_mesh mesh = {0};
  MPI_Init(&argc, &argv); /* plain MPI_Init, as most simulations do */
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);

  before_init();
  /* MPI_Init gives MPI_THREAD_SINGLE here: channel streams on threads of their own are
   * refused, the default (inline) works. */
  setenv("FULLSHARD_HOST_PROGRESS", "thread", 1);
  CHECK_STATUS(fullshard_init(MPI_COMM_WORLD), FULLSHARD_ERR_CONFIG,
               "FULLSHARD_HOST_PROGRESS=thread needs MPI_THREAD_MULTIPLE");
  unsetenv("FULLSHARD_HOST_PROGRESS");
  OK(fullshard_init(MPI_COMM_WORLD));
  CHECK(fullshard_initialized());
  CHECK(fullshard_rank() == rank);
  CHECK_STATUS(fullshard_init(MPI_COMM_WORLD), FULLSHARD_ERR_ARGUMENT, "already initialised");
  meshes(&mesh);
  handles(mesh);
  configurations(mesh);
  training(mesh);
  families(mesh);
  statuses(mesh);
  OK(fullshard_mesh_free(&mesh));
  OK(fullshard_finalize());
  CHECK(!fullshard_initialized());
  CHECK_STATUS(fullshard_model_step((fullshard_model){1}, NULL), FULLSHARD_ERR_NOT_INITIALIZED,
               "after fullshard_finalize");
  CHECK(strcmp(fullshard_status_name(FULLSHARD_ERR_IO), "FULLSHARD_ERR_IO") == 0);
  CHECK(strcmp(fullshard_status_name(99), "unknown status") == 0);

  {
    int all = 0;
    MPI_Allreduce(&failures, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
      printf("test_capi: %s (%d ranks, %d failed checks)\n", all ? "FAIL" : "pass", nranks, all);
    MPI_Finalize();
    return all ? 1 : 0;
  }
}
