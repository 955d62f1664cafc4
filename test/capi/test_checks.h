/* The checks the C API's tests share (C99). Define TEST_NAME (the program, in messages) before
 * including it: every failure names the program, the rank and the library's last error, and
 * aborts the job (the other ranks may be inside a collective). */
#ifndef FULLSHARD_TEST_CAPI_CHECKS_H
#define FULLSHARD_TEST_CAPI_CHECKS_H

#include <stdio.h>
#include <string.h>

#include "fullshard/fullshard.h"

static int rank = 0, world = 1;

static void fail(const char* what, fullshard_status s) {
  fprintf(stderr, TEST_NAME "[rank %d]: FAIL: %s: %s (%s)\n", rank, what, fullshard_status_name(s),
          fullshard_last_error());
  MPI_Abort(MPI_COMM_WORLD, 1);
}

static void ok(fullshard_status s, const char* what) {
  if (s != FULLSHARD_OK) fail(what, s);
}

static void check(int cond, const char* what) {
  if (!cond) {
    fprintf(stderr, TEST_NAME "[rank %d]: FAIL: %s (last error: %s)\n", rank, what,
            fullshard_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

/* A call expected to fail with `want` and a message containing `text`. */
static void refused(fullshard_status s, fullshard_status want, const char* text, const char* what) {
  if (s != want || !strstr(fullshard_last_error(), text)) {
    fprintf(stderr, TEST_NAME "[rank %d]: FAIL: %s: got %s (%s); want %s with '%s'\n", rank, what,
            fullshard_status_name(s), fullshard_last_error(), fullshard_status_name(want), text);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

#endif
