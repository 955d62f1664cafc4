// The CBLAS interface of the BLAS the build found (BLA_VENDOR): Intel MKL names its header
// mkl_cblas.h, the others cblas.h.
#pragma once

#if defined(FULLSHARD_CBLAS_MKL)
#include <mkl_cblas.h>
#else
#include <cblas.h>
#endif
