/* The sample store from C (C99), on 2 to 4 ranks (1 runs all but the checks across ranks):
 * - every rank produces and consumes: fields of 0 to 3 dims (float32, float64, a float64 kept
 *   as float32, a mask), put from contiguous and strided arrays, drawn into contiguous and
 *   strided outputs; every value is computed from (step, rank, tag, field, index), so each
 *   drawn sample is checked exactly against its metadata; the stream's end drains the buffers;
 *   the counters and the moments agree across the ranks;
 * - rank 0 consumes what the others produce, lossless and FIFO: every sample exactly once, each
 *   producer's in order;
 * - refusals, each with a message naming what was wrong: bad shapes and dtypes at creation and
 *   at put or draw, options that differ across ranks, options bad on one rank only (every rank
 *   is refused with that rank's problem: no rank waits), min_samples, roles, calls after
 *   close, freed, null and foreign handles, calls outside init. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TEST_NAME "test_capi_store"
#include "test_checks.h"

#define STEPS 8
#define PUTS 4  /* per step and rank */
#define BATCH 4 /* per draw */
#define SAMPLES 6

/* The value of element `index` (row-major) of field `field` of the sample (step, rank, tag):
 * an integer below 2^24, so exact in float32. */
static double value(int64_t step, int r, int64_t tag, int field, int index) {
  return (double)(step * 100000 + r * 10000 + tag * 100 + field * 20 + index);
}

static double mask_value(int64_t step, int r, int64_t tag, int index) {
  return (double)((step + r + tag + index) % 2);
}

/* The fields of the main store: a [5] f32, b [3, 2] f64, c [2, 3, 2] f32, y [] f64 kept as f32,
 * m [2] f32 mask. */
static fullshard_store_field fields[5] = {{"a", FULLSHARD_FLOAT32, 1, {5}, 0, 0},
                                          {"b", FULLSHARD_FLOAT64, 2, {3, 2}, 0, 0},
                                          {"c", FULLSHARD_FLOAT32, 3, {2, 3, 2}, 0, 0},
                                          {"y", FULLSHARD_FLOAT64, 0, {0}, 1, 0},
                                          {"m", FULLSHARD_FLOAT32, 1, {2}, 0, 1}};

static fullshard_store_options main_options(void) {
  fullshard_store_options o = fullshard_store_options_default();
  o.fields = fields;
  o.n_fields = 5;
  o.capacity = 64;
  o.seed = 7;
  o.timeout_s = 120;
  o.name = "main";
  return o;
}

/* One sample's arrays: b twice, row-major and column-major (strides {1, 3}). */
struct sample {
  float a[5];
  double b[6], b_cm[6];
  float c[12];
  double y;
  float m[2];
};

static void make_sample(struct sample* s, int64_t step, int64_t tag) {
  for (int i = 0; i < 5; ++i)
    s->a[i] = (float)value(step, rank, tag, 0, i);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 2; ++j) {
      s->b[i * 2 + j] = value(step, rank, tag, 1, i * 2 + j);
      s->b_cm[j * 3 + i] = s->b[i * 2 + j];
    }
  for (int i = 0; i < 12; ++i)
    s->c[i] = (float)value(step, rank, tag, 2, i);
  s->y = value(step, rank, tag, 3, 0) + 0.25; /* +0.25: exact in float32 too */
  for (int i = 0; i < 2; ++i)
    s->m[i] = (float)mask_value(step, rank, tag, i);
}

/* Puts one sample four ways, by tag: pointers (contiguous; b column-major with strides) or
 * fullshard_arrays (b strided; y given as float32). */
static int put(fullshard_store store, int64_t step, int64_t tag) {
  struct sample s;
  make_sample(&s, step, tag);
  int sent = -1;
  if (tag % 2 == 1) {
    const void* data[5] = {s.a, tag == 1 ? (const void*)s.b : (const void*)s.b_cm, s.c, &s.y, s.m};
    const int64_t b_strides[2] = {1, 3};
    const int64_t* strides[5] = {NULL, b_strides, NULL, NULL, NULL};
    ok(fullshard_store_put(store, step, tag, data, tag == 1 ? NULL : strides, &sent),
       "fullshard_store_put");
  } else {
    float y32 = (float)s.y;
    const int64_t a_shape[1] = {5}, b_shape[2] = {3, 2}, c_shape[3] = {2, 3, 2}, m_shape[1] = {2};
    fullshard_array arrays[5] = {
        fullshard_array_contiguous(s.a, FULLSHARD_FLOAT32, 1, a_shape),
        fullshard_array_contiguous(s.b_cm, FULLSHARD_FLOAT64, 2, b_shape),
        fullshard_array_contiguous(s.c, FULLSHARD_FLOAT32, 3, c_shape),
        fullshard_array_contiguous(tag == 2 ? (void*)&s.y : (void*)&y32,
                                   tag == 2 ? FULLSHARD_FLOAT64 : FULLSHARD_FLOAT32, 0, NULL),
        fullshard_array_contiguous(s.m, FULLSHARD_FLOAT32, 1, m_shape)};
    arrays[1].strides[0] = 1;
    arrays[1].strides[1] = 3;
    ok(fullshard_store_put_arrays(store, step, tag, 5, arrays, &sent),
       "fullshard_store_put_arrays");
  }
  check(sent == 0 || sent == 1, "sent is 0 or 1");
  return sent;
}

/* One drawn batch's buffers; b_wide: b's output with its last dim padded to 4 (strides
 * {12, 4, 1}), whose padding must stay. */
struct batch {
  float a[BATCH * 5];
  double b[BATCH * 6], b_wide[BATCH * 12];
  float c[BATCH * 12];
  float y[BATCH];
  float m[BATCH * 2];
  int64_t steps[BATCH], tags[BATCH];
  int ranks[BATCH];
};

static int64_t checked_samples = 0;

static void check_row(const struct batch* b, int row, int strided) {
  const int64_t step = b->steps[row], tag = b->tags[row];
  const int r = b->ranks[row];
  check(step >= 1 && step <= STEPS && tag >= 1 && tag <= PUTS && r >= 0 && r < world,
        "a drawn sample's metadata");
  for (int i = 0; i < 5; ++i)
    check(b->a[row * 5 + i] == (float)value(step, r, tag, 0, i), "field a, exactly");
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 2; ++j) {
      const double got = strided ? b->b_wide[row * 12 + i * 4 + j] : b->b[row * 6 + i * 2 + j];
      check(got == value(step, r, tag, 1, i * 2 + j), "field b, exactly (row-major)");
    }
  if (strided)
    for (int i = 0; i < 3; ++i)
      check(b->b_wide[row * 12 + i * 4 + 2] == -1 && b->b_wide[row * 12 + i * 4 + 3] == -1,
            "a strided output's padding is left alone");
  for (int i = 0; i < 12; ++i)
    check(b->c[row * 12 + i] == (float)value(step, r, tag, 2, i), "field c, exactly");
  check(b->y[row] == (float)(value(step, r, tag, 3, 0) + 0.25), "field y (f64 kept as f32)");
  for (int i = 0; i < 2; ++i)
    check(b->m[row * 2 + i] == (float)mask_value(step, r, tag, i), "field m (mask)");
  ++checked_samples;
}

/* Draws a batch into contiguous outputs (pointers) or, `strided`, fullshard_arrays with b's
 * padded; checks every row drawn; returns the count. */
static int64_t draw(fullshard_store store, int strided) {
  static struct batch b;
  for (int i = 0; i < BATCH * 12; ++i)
    b.b_wide[i] = -1;
  int64_t n = -1;
  if (!strided) {
    void* out[5] = {b.a, b.b, b.c, b.y, b.m};
    ok(fullshard_store_draw(store, BATCH, out, b.steps, b.ranks, b.tags, &n),
       "fullshard_store_draw");
  } else {
    const int64_t a_shape[2] = {BATCH, 5}, b_shape[3] = {BATCH, 3, 2},
                  c_shape[4] = {BATCH, 2, 3, 2}, y_shape[1] = {BATCH}, m_shape[2] = {BATCH, 2};
    fullshard_array out[5] = {fullshard_array_contiguous(b.a, FULLSHARD_FLOAT32, 2, a_shape),
                              fullshard_array_contiguous(b.b_wide, FULLSHARD_FLOAT64, 3, b_shape),
                              fullshard_array_contiguous(b.c, FULLSHARD_FLOAT32, 4, c_shape),
                              fullshard_array_contiguous(b.y, FULLSHARD_FLOAT32, 1, y_shape),
                              fullshard_array_contiguous(b.m, FULLSHARD_FLOAT32, 2, m_shape)};
    out[1].strides[0] = 12;
    out[1].strides[1] = 4;
    out[1].strides[2] = 1;
    ok(fullshard_store_draw_arrays(store, BATCH, 5, out, b.steps, b.ranks, b.tags, &n),
       "fullshard_store_draw_arrays");
  }
  check(n >= 0 && n <= BATCH, "a draw's count");
  for (int row = 0; row < n; ++row)
    check_row(&b, row, strided);
  return n;
}

/* Refusals of a live store (before its close): nothing is sent or drawn. */
static void refusals(fullshard_store store) {
  float a4[4] = {0}, c[12] = {0}, m[2] = {0}, y = 0;
  double a8[5] = {0}, b[6] = {0};
  int32_t ai[5] = {0};
  const int64_t a_shape[1] = {5}, a4_shape[1] = {4}, b_shape[2] = {3, 2}, c_shape[3] = {2, 3, 2},
                m_shape[1] = {2};
  fullshard_array arrays[5] = {fullshard_array_contiguous(a4, FULLSHARD_FLOAT32, 1, a4_shape),
                               fullshard_array_contiguous(b, FULLSHARD_FLOAT64, 2, b_shape),
                               fullshard_array_contiguous(c, FULLSHARD_FLOAT32, 3, c_shape),
                               fullshard_array_contiguous(&y, FULLSHARD_FLOAT32, 0, NULL),
                               fullshard_array_contiguous(m, FULLSHARD_FLOAT32, 1, m_shape)};
  int sent = -1;
  refused(fullshard_store_put_arrays(store, 1, 0, 5, arrays, &sent), FULLSHARD_ERR_ARGUMENT,
          "field 'a' expects shape [5], given [4]", "a put of a wrong shape");
  check(sent == 0, "a refused put is not sent");
  arrays[0] = fullshard_array_contiguous(a8, FULLSHARD_FLOAT64, 1, a_shape);
  refused(fullshard_store_put_arrays(store, 1, 0, 5, arrays, &sent), FULLSHARD_ERR_ARGUMENT,
          "field 'a' expects dtype f32, given f64", "a put of a wrong dtype");
  arrays[0] = fullshard_array_contiguous(ai, FULLSHARD_INT32, 1, a_shape);
  refused(fullshard_store_put_arrays(store, 1, 0, 5, arrays, &sent), FULLSHARD_ERR_ARGUMENT,
          "fields[0]: dtype FULLSHARD_INT32: the sample store takes", "a put of int32");
  arrays[0] = fullshard_array_contiguous(a8, FULLSHARD_FLOAT32, 1, a_shape);
  refused(fullshard_store_put_arrays(store, 1, 0, 4, arrays, &sent), FULLSHARD_ERR_ARGUMENT,
          "put got 4 arrays for the 5 fields", "a put of too few fields");
  m[0] = 0.5f;
  refused(fullshard_store_put_arrays(store, 1, 0, 5, arrays, &sent), FULLSHARD_ERR_ARGUMENT,
          "mask field 'm' element 0", "a mask of 0.5");
  refused(fullshard_store_put(store, 1, 0, NULL, NULL, &sent), FULLSHARD_ERR_ARGUMENT,
          "data is NULL", "a put of no data");

  struct batch out;
  int64_t n = -1;
  void* ptrs[5] = {out.a, out.b, out.c, out.y, out.m};
  refused(fullshard_store_draw(store, 0, ptrs, NULL, NULL, NULL, &n), FULLSHARD_ERR_ARGUMENT,
          "draw of 0 samples", "a draw of 0");
  refused(fullshard_store_draw(store, BATCH, ptrs, NULL, NULL, NULL, NULL), FULLSHARD_ERR_ARGUMENT,
          "drawn is NULL", "a draw without its count");
  const int64_t y_shape[1] = {BATCH}, a_out[2] = {BATCH, 5}, b_out[3] = {BATCH, 3, 2},
                c_out[4] = {BATCH, 2, 3, 2}, m_out[2] = {BATCH, 2};
  fullshard_array outs[5] = {fullshard_array_contiguous(out.a, FULLSHARD_FLOAT32, 2, a_out),
                             fullshard_array_contiguous(out.b, FULLSHARD_FLOAT64, 3, b_out),
                             fullshard_array_contiguous(out.c, FULLSHARD_FLOAT32, 4, c_out),
                             fullshard_array_contiguous(out.b, FULLSHARD_FLOAT64, 1, y_shape),
                             fullshard_array_contiguous(out.m, FULLSHARD_FLOAT32, 2, m_out)};
  refused(fullshard_store_draw_arrays(store, BATCH, 5, outs, NULL, NULL, NULL, &n),
          FULLSHARD_ERR_ARGUMENT, "field 'y' gives dtype f32, the output has f64",
          "a draw into a wrong dtype (y is kept as float32)");
  outs[3] = fullshard_array_contiguous(out.y, FULLSHARD_FLOAT32, 1, y_shape);
  outs[2].shape[3] = 3;
  refused(fullshard_store_draw_arrays(store, BATCH, 5, outs, NULL, NULL, NULL, &n),
          FULLSHARD_ERR_ARGUMENT, "field 'c' expects an output of shape [4, 2, 3, 2], given",
          "a draw into a wrong shape");
  check(n == 0, "a refused draw draws nothing");

  fullshard_field_moments mo;
  refused(fullshard_store_moments(store, "m", &mo), FULLSHARD_ERR_ARGUMENT, "field 'm' is a mask",
          "moments of a mask");
  refused(fullshard_store_moments(store, "zz", &mo), FULLSHARD_ERR_ARGUMENT, "no field 'zz'",
          "moments of an unknown field");
  refused(fullshard_store_moments(store, NULL, &mo), FULLSHARD_ERR_ARGUMENT, "field is NULL",
          "moments of NULL");
}

/* Every rank produces and consumes. */
static void both(void) {
  fullshard_store_options o = main_options();
  fullshard_store store = {0};
  ok(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &store),
     "fullshard_store_create");
  check(store.id != 0, "a store handle");
  int64_t bytes = 0, sample_bytes = 0;
  ok(fullshard_store_bytes(store, &bytes, &sample_bytes), "fullshard_store_bytes");
  /* a 20 -> 24, b 48 -> 72, c 48 -> 120, y 4 -> 124, m at 128 + 8 = 136 */
  check(sample_bytes == 136, "a sample's bytes: each field 8-byte aligned");
  check(bytes == 0, "the store's bytes: nothing allocated before the first sample");
  refusals(store);

  int64_t sent = 0, drawn = 0;
  for (int64_t step = 1; step <= STEPS; ++step) {
    for (int64_t tag = 1; tag <= PUTS; ++tag)
      sent += put(store, step, tag);
    ok(fullshard_store_progress(store), "fullshard_store_progress");
    const int64_t n = draw(store, (int)(step % 2));
    check(n == BATCH, "a draw before the stream's end is a full batch");
    drawn += n;
  }
  ok(fullshard_store_end_of_stream(store), "fullshard_store_end_of_stream");
  ok(fullshard_store_end_of_stream(store), "a second end_of_stream does nothing");
  int64_t n = 0, drained = 0, partial = 0;
  do {
    n = draw(store, (int)(drained % 2));
    partial += n > 0 && n < BATCH;
    drained += n;
  } while (n > 0);
  check(partial <= 1, "only the last drained batch is partial");
  int ended = 0;
  ok(fullshard_store_ended(store, &ended), "fullshard_store_ended");
  check(ended == 1, "ended after the drain");

  fullshard_store_stats_info st;
  ok(fullshard_store_stats(store, &st), "fullshard_store_stats");
  check(st.produced == sent && st.produced + st.dropped == STEPS * PUTS,
        "produced + dropped = puts");
  check(st.drawn == drawn + drained, "drawn counts every drawn sample");
  check(st.non_finite == 0 && st.bytes > 0, "no non-finite puts; the bytes");
  check(st.mean_staleness >= 0 && st.mean_staleness <= STEPS - 1,
        "staleness: between 0 and the steps put (1 to STEPS)");
  check(st.discarded_at_close == 0, "nothing discarded before close");
  fullshard_field_moments mine, all;
  ok(fullshard_store_moments(store, "a", &mine), "fullshard_store_moments");
  check(mine.count == st.ingested * 5, "the moments count every element ingested");
  ok(fullshard_store_global_moments(store, "a", &all), "fullshard_store_global_moments");
  int64_t sums[4] = {st.produced, st.ingested, mine.count, st.reused}, total[4];
  MPI_Allreduce(sums, total, 4, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  check(total[1] == total[0], "every sample sent was ingested");
  check(total[3] > 0, "reservoir draws are with replacement (a FIFO never reuses)");
  check(all.count == total[2] && all.mean > 100000 && all.stddev > 0, "the global moments");
  if (rank == 0)
    printf("test_capi_store: %d ranks: %lld samples sent, %lld checked exactly\n", world,
           (long long)total[0], (long long)checked_samples);

  ok(fullshard_store_close(store), "fullshard_store_close");
  int sent_after = -1;
  struct sample s;
  make_sample(&s, 1, 1);
  const void* data[5] = {s.a, s.b, s.c, &s.y, s.m};
  refused(fullshard_store_put(store, 1, 1, data, NULL, &sent_after), FULLSHARD_ERR_ARGUMENT,
          "put after close()", "a put after close");
  ok(fullshard_store_stats(store, &st), "stats after close");
  check(st.discarded_at_close == 0, "nonblocking: close ingests, it discards nothing");
  ok(fullshard_store_ended(store, &ended), "ended after close");

  fullshard_store copy = store;
  ok(fullshard_store_free(&store), "fullshard_store_free");
  check(store.id == 0, "free resets the handle");
  ok(fullshard_store_free(&store), "freeing the null handle");
  refused(fullshard_store_put(copy, 1, 1, data, NULL, NULL), FULLSHARD_ERR_HANDLE,
          "store is a store handle that was freed", "a freed handle");
  refused(fullshard_store_stats(copy, &st), FULLSHARD_ERR_HANDLE, "was freed",
          "stats of a freed handle");
  refused(fullshard_store_free(&copy), FULLSHARD_ERR_HANDLE, "was freed", "a second free");
  fullshard_store none = {0};
  refused(fullshard_store_draw(none, 1, NULL, NULL, NULL, NULL, &n), FULLSHARD_ERR_HANDLE,
          "store is the null store handle", "the null handle");
  fullshard_store made_up = {12345};
  refused(fullshard_store_progress(made_up), FULLSHARD_ERR_HANDLE, "never returned",
          "a made-up handle");
  refused(fullshard_store_free(NULL), FULLSHARD_ERR_ARGUMENT, "store is NULL", "free(NULL)");
  fullshard_mesh mesh = {0};
  const int shape[1] = {world};
  ok(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", &mesh), "a mesh");
  fullshard_store foreign = {mesh.id};
  refused(fullshard_store_end_of_stream(foreign), FULLSHARD_ERR_HANDLE,
          "store is not a store handle (it is a handle of another kind)", "a mesh handle");
  ok(fullshard_mesh_free(&mesh), "mesh free");
}

/* Rank 0 consumes what the others produce, lossless and FIFO: each sample exactly once. */
static void split(void) {
  fullshard_store_field v = {"v", FULLSHARD_FLOAT64, 1, {2}, 0, 0};
  fullshard_store_options o = fullshard_store_options_default();
  o.fields = &v;
  o.n_fields = 1;
  o.policy = FULLSHARD_STORE_FIFO;
  o.delivery = FULLSHARD_STORE_LOSSLESS;
  o.capacity = 8;
  o.in_flight = 2;
  o.timeout_s = 120;
  fullshard_store store = {0};
  const fullshard_store_role role = rank == 0 ? FULLSHARD_STORE_CONSUMER : FULLSHARD_STORE_PRODUCER;
  ok(fullshard_store_create_f(MPI_Comm_c2f(MPI_COMM_WORLD), role, &o, &store),
     "fullshard_store_create_f");
  if (rank == 0) {
    double x[2] = {0, 0};
    const void* data[1] = {x};
    refused(fullshard_store_put(store, 0, 0, data, NULL, NULL), FULLSHARD_ERR_ARGUMENT,
            "not a producer", "a put on a consumer");
    double out[BATCH * 2];
    void* ptrs[1] = {out};
    int64_t steps[BATCH], tags[BATCH], n = 0, total = 0;
    int ranks[BATCH], seen[4][SAMPLES] = {{0}};
    int64_t last[4] = {-1, -1, -1, -1};
    do {
      ok(fullshard_store_draw(store, BATCH, ptrs, steps, ranks, tags, &n), "a lossless draw");
      for (int i = 0; i < n; ++i) {
        check(ranks[i] >= 1 && ranks[i] < world && steps[i] >= 0 && steps[i] < SAMPLES,
              "lossless metadata");
        check(out[2 * i] == (double)steps[i] && out[2 * i + 1] == (double)ranks[i] &&
                  tags[i] == 10 * ranks[i] + steps[i],
              "a lossless sample, exactly");
        check(steps[i] > last[ranks[i]], "each producer's samples in its order");
        last[ranks[i]] = steps[i];
        ++seen[ranks[i]][steps[i]];
      }
      total += n;
    } while (n > 0);
    check(total == (int64_t)(world - 1) * SAMPLES, "every sample drawn");
    for (int r = 1; r < world; ++r)
      for (int k = 0; k < SAMPLES; ++k)
        check(seen[r][k] == 1, "each sample exactly once");
  } else {
    double out[2];
    void* ptrs[1] = {out};
    int64_t n = -1;
    refused(fullshard_store_draw(store, 1, ptrs, NULL, NULL, NULL, &n), FULLSHARD_ERR_ARGUMENT,
            "not a consumer", "a draw on a producer");
    for (int k = 0; k < SAMPLES; ++k) {
      double x[2] = {(double)k, (double)rank};
      const void* data[1] = {x};
      int sent = 0;
      ok(fullshard_store_put(store, k, 10 * rank + k, data, NULL, &sent), "a lossless put");
      check(sent == 1, "a lossless put is sent");
    }
    ok(fullshard_store_end_of_stream(store), "end_of_stream");
    fullshard_store_stats_info st;
    ok(fullshard_store_stats(store, &st), "stats");
    check(st.produced == SAMPLES && st.dropped == 0, "lossless: nothing dropped");
  }
  ok(fullshard_store_close(store), "close (split)");
  ok(fullshard_store_free(&store), "free (split)");
}

/* Options refused at creation, on every rank (collective refusals: no rank is left waiting). */
static void bad_options(void) {
  fullshard_store_field f[2] = {{"x", FULLSHARD_FLOAT32, 2, {3, 0}, 0, 0},
                                {"y", FULLSHARD_FLOAT32, 0, {0}, 0, 0}};
  fullshard_store_options o = fullshard_store_options_default();
  o.fields = f;
  o.n_fields = 2;
  o.timeout_s = 120;
  fullshard_store s = {0};
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &s),
          FULLSHARD_ERR_ARGUMENT, "field 'x' has shape [3, 0]: every extent must be at least 1",
          "a bad shape");
  check(s.id == 0, "a refused creation leaves the null handle");
  f[0].shape[1] = 2;
  f[0].ndim = 9;
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &s),
          FULLSHARD_ERR_ARGUMENT, "options->fields[0] ('x'): ndim is 9", "a bad ndim");
  f[0].ndim = 2;
  f[1].dtype = FULLSHARD_INT32;
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &s),
          FULLSHARD_ERR_ARGUMENT,
          "options->fields[1] ('y'): dtype FULLSHARD_INT32: the sample store takes "
          "FULLSHARD_FLOAT32 and FULLSHARD_FLOAT64",
          "a bad dtype");
  f[1].dtype = 42;
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &s),
          FULLSHARD_ERR_ARGUMENT, "dtype 42 (not a fullshard_dtype)", "an unknown dtype");
  f[1].dtype = FULLSHARD_FLOAT32;
  f[1].store_as_f32 = 1;
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &s),
          FULLSHARD_ERR_ARGUMENT, "store_as_f32 keeps an f64 field as f32", "store_as_f32 on f32");
  f[1].store_as_f32 = 0;
  f[1].name = "x";
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &s),
          FULLSHARD_ERR_ARGUMENT, "two fields named 'x'", "a repeated name");
  f[1].name = "y";
  o.policy = 9;
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &s),
          FULLSHARD_ERR_ARGUMENT, "policy 9: unknown", "an unknown policy");
  o.policy = FULLSHARD_STORE_RESERVOIR;
  check(fullshard_store_options_default().min_samples == 1, "min_samples defaults to 1");
  o.min_samples = 0;
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &s),
          FULLSHARD_ERR_ARGUMENT, "min_samples 0: expected 1 to the buffer's bound",
          "min_samples 0");
  o.min_samples = o.capacity + 1;
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &s),
          FULLSHARD_ERR_ARGUMENT, "expected 1 to the buffer's bound (the capacity 1024)",
          "min_samples above the capacity");
  o.min_samples = 1;
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, NULL, &s),
          FULLSHARD_ERR_ARGUMENT, "bad options on rank 0: options is NULL", "no options");
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_PRODUCER, &o, &s),
          FULLSHARD_ERR_ARGUMENT, "no consumer among its", "no consumer");
  refused(fullshard_store_create(MPI_COMM_NULL, FULLSHARD_STORE_BOTH, &o, &s),
          FULLSHARD_ERR_ARGUMENT, "MPI_COMM_NULL", "a null communicator");
  if (world < 2) return;
  /* Options that differ across ranks: every rank is told, naming the entry and the rank. */
  o.capacity = rank == 1 ? 32 : 16;
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &s),
          FULLSHARD_ERR_MISMATCH, "rank 1 has \"capacity = 32\"", "a capacity on one rank");
  o.capacity = 16;
  /* Bad options on the last rank only (a refusal of the binding's own, before the store's
   * checks): every rank is told what is wrong there, with its text. */
  char want[256];
  snprintf(want, sizeof want,
           "sample store 'store': bad options on rank %d: options->fields[1] ('y'): dtype "
           "FULLSHARD_INT64: the sample store takes FULLSHARD_FLOAT32 and FULLSHARD_FLOAT64",
           world - 1);
  f[1].dtype = rank == world - 1 ? FULLSHARD_INT64 : FULLSHARD_FLOAT32;
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &s),
          FULLSHARD_ERR_ARGUMENT, want, "a bad dtype on one rank, on every rank");
  f[1].dtype = FULLSHARD_FLOAT32;
  /* No options on rank 0 and a bad option on the last rank: rank 0's problem, everywhere. */
  o.capacity = rank == world - 1 ? 0 : 16;
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, rank == 0 ? NULL : &o, &s),
          FULLSHARD_ERR_ARGUMENT, "bad options on rank 0: options is NULL",
          "NULL options on rank 0, on every rank");
  /* Only the last rank's capacity: its problem, not a mismatch, on every rank. */
  snprintf(want, sizeof want, "bad options on rank %d: capacity 0", world - 1);
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &s),
          FULLSHARD_ERR_ARGUMENT, want, "a capacity of 0 on one rank, on every rank");
  check(s.id == 0, "a refused creation leaves the null handle");
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  check(world <= 4, "at most 4 ranks");

  fullshard_store_options o = main_options();
  fullshard_store s = {0};
  refused(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &s),
          FULLSHARD_ERR_NOT_INITIALIZED, "not initialised", "a store before init");
  ok(fullshard_init(MPI_COMM_WORLD), "fullshard_init");

  both();
  if (world >= 2) split();
  bad_options();

  /* finalize frees a store still alive; its handle is then refused. */
  ok(fullshard_store_create(MPI_COMM_WORLD, FULLSHARD_STORE_BOTH, &o, &s), "a store left alive");
  ok(fullshard_store_close(s), "close");
  ok(fullshard_finalize(), "fullshard_finalize");
  refused(fullshard_store_progress(s), FULLSHARD_ERR_NOT_INITIALIZED, "not initialised",
          "a store call after finalize");
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) printf("test_capi_store: pass\n");
  MPI_Finalize();
  return 0;
}
