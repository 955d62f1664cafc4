// LibTorch and doctest in one test program. LibTorch's headers define glog's (or c10's)
// CHECK macros, which would silently replace doctest's: a failing CHECK would then abort the
// program instead of failing the test, and passing ones would not be counted. Include this
// instead of <torch/torch.h> and <doctest/doctest.h>: LibTorch first, its CHECK macros
// removed, doctest's defined after.
#pragma once

#include <torch/torch.h>

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE

#include <doctest/doctest.h>
