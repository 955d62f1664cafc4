// fullshard dtypes and reduce ops as NCCL's (private to the NCCL backend and its tests).
#pragma once

#include <nccl.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>

#include "fullshard/base/dtype.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/comm/communicator.hpp"

// ncclAvg appeared in NCCL 2.10, ncclRedOpCreatePreMulSum in 2.11, ncclCommSplit in 2.18.
#define FULLSHARD_NCCL_AT_LEAST(maj, min) (NCCL_VERSION_CODE >= NCCL_VERSION(maj, min, 0))
#define FULLSHARD_NCCL_HAS_AVG FULLSHARD_NCCL_AT_LEAST(2, 10)
#define FULLSHARD_NCCL_HAS_PREMULSUM FULLSHARD_NCCL_AT_LEAST(2, 11)
#define FULLSHARD_NCCL_HAS_SPLIT FULLSHARD_NCCL_AT_LEAST(2, 18)

namespace fullshard::comm {

inline ncclDataType_t nccl_dtype(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::f16:
      return ncclFloat16;
    case DType::bf16:
      return ncclBfloat16;
  }
  throw InvalidArgument("NCCL: unknown dtype " + std::to_string(static_cast<int>(t)));
}

/// The NCCL op of a fullshard op. avg is ncclAvg where NCCL has it; `native_avg` says whether
/// it did (otherwise ncclSum is returned and the caller divides by the group size).
inline ncclRedOp_t nccl_op(ReduceOp op, bool* native_avg = nullptr) {
  if (native_avg) *native_avg = false;
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
    case ReduceOp::avg:
#if FULLSHARD_NCCL_HAS_AVG
      if (native_avg) *native_avg = true;
      return ncclAvg;
#else
      return ncclSum;
#endif
  }
  throw InvalidArgument("NCCL: unknown reduce op " + std::to_string(static_cast<int>(op)));
}

/// The scalar of ncclRedOpCreatePreMulSum for multiplying by `factor`, as the bytes of one
/// element of `t` (host memory, ncclScalarHostImmediate); 16-bit types rounded to nearest
/// even.
inline std::array<unsigned char, 8> nccl_scalar(DType t, double factor) {
  std::array<unsigned char, 8> out{};
  switch (t) {
    case DType::f64:
      std::memcpy(out.data(), &factor, 8);
      break;
    case DType::f32: {
      const float f = static_cast<float>(factor);
      std::memcpy(out.data(), &f, 4);
      break;
    }
    case DType::f16: {
      const std::uint16_t h = float_to_f16(static_cast<float>(factor));
      std::memcpy(out.data(), &h, 2);
      break;
    }
    case DType::bf16: {
      const std::uint16_t h = float_to_bf16(static_cast<float>(factor));
      std::memcpy(out.data(), &h, 2);
      break;
    }
  }
  return out;
}

}  // namespace fullshard::comm
