/* The Fortran module's view of a Fortran array: a C descriptor (ISO_Fortran_binding.h, the
 * Fortran compiler's own layout: compiled with the C compiler of the same toolchain) becomes
 * a fullshard_array over the same memory, dims reversed (column-major x(f, n) is the
 * row-major (n, f) array) and strides in elements, so sections are used in place. A scalar
 * (rank 0) is taken only where a sample store's field may be one (describe_sample). */
#include <ISO_Fortran_binding.h>
#include <stdio.h>

#include "fullshard/fullshard.h"

/* In lib/capi (not in fullshard.h): records a failed call's message. */
fullshard_status fullshard_detail_fail(fullshard_status status, const char* message);

static fullshard_status describe(const CFI_cdesc_t* d, const char* what, int min_rank,
                                 fullshard_array* out) {
  char msg[256];
  int32_t dtype = -1;
  size_t size = 0;
  switch (d->type) {
    case CFI_type_float:
      dtype = FULLSHARD_FLOAT32;
      size = 4;
      break;
    case CFI_type_double:
      dtype = FULLSHARD_FLOAT64;
      size = 8;
      break;
    case CFI_type_int32_t:
      dtype = FULLSHARD_INT32;
      size = 4;
      break;
    case CFI_type_int64_t:
      dtype = FULLSHARD_INT64;
      size = 8;
      break;
    default:
      snprintf(msg, sizeof msg,
               "%s: the array's type is not one fullshard takes (real(c_float), "
               "real(c_double), integer(c_int32_t) or integer(c_int64_t))",
               what);
      return fullshard_detail_fail(FULLSHARD_ERR_ARGUMENT, msg);
  }
  if (d->rank < min_rank || d->rank > FULLSHARD_MAX_DIMS) {
    snprintf(msg, sizeof msg, "%s: the array has rank %d; fullshard takes rank %d to %d", what,
             (int)d->rank, min_rank, FULLSHARD_MAX_DIMS);
    return fullshard_detail_fail(FULLSHARD_ERR_ARGUMENT, msg);
  }
  out->data = d->base_addr;
  out->dtype = dtype;
  out->ndim = d->rank;
  for (int i = 0; i < FULLSHARD_MAX_DIMS; ++i) {
    out->shape[i] = 0;
    out->strides[i] = 0;
  }
  for (int i = 0; i < d->rank; ++i) {
    const CFI_dim_t* dim = &d->dim[d->rank - 1 - i];
    if (dim->sm <= 0 || (size_t)dim->sm % size != 0) {
      snprintf(msg, sizeof msg,
               "%s: dim %d of the array has a stride of %ld bytes (reversed or not a multiple "
               "of its %zu-byte elements); pass a contiguous copy",
               what, (int)(d->rank - i), (long)dim->sm, size);
      return fullshard_detail_fail(FULLSHARD_ERR_ARGUMENT, msg);
    }
    out->shape[i] = (int64_t)dim->extent;
    out->strides[i] = (int64_t)((size_t)dim->sm / size);
  }
  return FULLSHARD_OK;
}

fullshard_status fullshard_fortran_describe(const CFI_cdesc_t* d, const char* what,
                                            fullshard_array* out) {
  return describe(d, what, 1, out);
}

/* The same, a scalar included (ndim 0): a sample of a store's field of shape []. */
fullshard_status fullshard_fortran_describe_sample(const CFI_cdesc_t* d, const char* what,
                                                   fullshard_array* out) {
  return describe(d, what, 0, out);
}
