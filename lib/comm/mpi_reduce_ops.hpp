// MPI reduction operators for the 16-bit float types (MPI has none) — private to lib/comm.
#pragma once

#include <mpi.h>

#include "fullshard/base/dtype.hpp"
#include "fullshard/comm/communicator.hpp"

namespace fullshard::comm {

/// MPI datatype that carries `t` (f16 and bf16 travel as MPI_UINT16_T).
MPI_Datatype mpi_datatype(DType t) noexcept;

/// Owns the user-defined MPI_Ops for f16/bf16 sum, max and min; shared by a communicator
/// and its duplicates; freed while MPI is still initialised.
struct MpiReduceOps {
  MpiReduceOps();
  ~MpiReduceOps();
  MpiReduceOps(const MpiReduceOps&) = delete;
  MpiReduceOps& operator=(const MpiReduceOps&) = delete;

  /// The MPI_Op for combining `t` with `op` (avg combines with sum).
  MPI_Op get(DType t, ReduceOp op) const noexcept;

 private:
  MPI_Op f16_[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  MPI_Op bf16_[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
};

/// Divides `count` elements of `data` by `divisor` in place (16-bit: in f32, rounded once).
void divide_in_place(void* data, std::size_t count, DType t, double divisor) noexcept;

}  // namespace fullshard::comm
