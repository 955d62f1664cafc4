#include "lib/comm/mpi_reduce_ops.hpp"

#include <algorithm>
#include <cstdint>

namespace fullshard::comm {
namespace {

struct F16 {
  static float load(std::uint16_t h) { return f16_to_float(h); }
  static std::uint16_t store(float f) { return float_to_f16(f); }
};
struct BF16 {
  static float load(std::uint16_t h) { return bf16_to_float(h); }
  static std::uint16_t store(float f) { return float_to_bf16(f); }
};
struct Sum {
  static float apply(float a, float b) { return a + b; }
};
struct Max {
  // NaN propagates, as in NCCL.
  static float apply(float a, float b) { return (a != a || a > b) ? a : b; }
};
struct Min {
  static float apply(float a, float b) { return (a != a || a < b) ? a : b; }
};

template <class T, class Op>
void combine(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  const int n = *len;
  for (int i = 0; i < n; ++i)
    b[i] = T::store(Op::apply(T::load(a[i]), T::load(b[i])));
}

int slot(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::max:
      return 1;
    case ReduceOp::min:
      return 2;
    default:
      return 0;  // sum, avg
  }
}

}  // namespace

MPI_Datatype mpi_datatype(DType t) noexcept {
  switch (t) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    default:
      return MPI_UINT16_T;
  }
}

MpiReduceOps::MpiReduceOps() {
  MPI_Op_create(&combine<F16, Sum>, 1, &f16_[0]);
  MPI_Op_create(&combine<F16, Max>, 1, &f16_[1]);
  MPI_Op_create(&combine<F16, Min>, 1, &f16_[2]);
  MPI_Op_create(&combine<BF16, Sum>, 1, &bf16_[0]);
  MPI_Op_create(&combine<BF16, Max>, 1, &bf16_[1]);
  MPI_Op_create(&combine<BF16, Min>, 1, &bf16_[2]);
}

MpiReduceOps::~MpiReduceOps() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  for (MPI_Op* op : {&f16_[0], &f16_[1], &f16_[2], &bf16_[0], &bf16_[1], &bf16_[2]})
    if (*op != MPI_OP_NULL) MPI_Op_free(op);
}

MPI_Op MpiReduceOps::get(DType t, ReduceOp op) const noexcept {
  if (t == DType::f16) return f16_[slot(op)];
  if (t == DType::bf16) return bf16_[slot(op)];
  switch (op) {
    case ReduceOp::max:
      return MPI_MAX;
    case ReduceOp::min:
      return MPI_MIN;
    default:
      return MPI_SUM;
  }
}

void divide_in_place(void* data, std::size_t count, DType t, double divisor) noexcept {
  switch (t) {
    case DType::f32: {
      auto* p = static_cast<float*>(data);
      const float d = static_cast<float>(divisor);
      for (std::size_t i = 0; i < count; ++i)
        p[i] /= d;
      break;
    }
    case DType::f64: {
      auto* p = static_cast<double*>(data);
      for (std::size_t i = 0; i < count; ++i)
        p[i] /= divisor;
      break;
    }
    case DType::f16: {
      auto* p = static_cast<std::uint16_t*>(data);
      const float d = static_cast<float>(divisor);
      for (std::size_t i = 0; i < count; ++i)
        p[i] = float_to_f16(f16_to_float(p[i]) / d);
      break;
    }
    case DType::bf16: {
      auto* p = static_cast<std::uint16_t*>(data);
      const float d = static_cast<float>(divisor);
      for (std::size_t i = 0; i < count; ++i)
        p[i] = float_to_bf16(bf16_to_float(p[i]) / d);
      break;
    }
  }
}

}  // namespace fullshard::comm
