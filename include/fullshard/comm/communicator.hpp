// The communicator interface: one group of ranks, collectives returning Work handles.
// Backends: MPI for host memory (mpi_communicator.hpp), NCCL for device memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "fullshard/base/dtype.hpp"
#include "fullshard/comm/stream.hpp"

namespace fullshard::comm {

enum class ReduceOp { sum, avg, max, min };
const char* reduce_op_name(ReduceOp op) noexcept;

/// Bytes that went through a communicator's collectives, counted as the size of the whole
/// collective buffer: all_gather and reduce_scatter size x count elements (the unsharded
/// tensor), all_reduce and broadcast count elements. What FSDP's "3x the parameter bytes per
/// step" refers to.
struct Traffic {
  std::uint64_t all_gather = 0;
  std::uint64_t reduce_scatter = 0;
  std::uint64_t all_reduce = 0;
  std::uint64_t broadcast = 0;
  std::uint64_t all_to_all = 0;  ///< size x count elements (what this rank sends)
  std::uint64_t total() const noexcept {
    return all_gather + reduce_scatter + all_reduce + broadcast + all_to_all;
  }
  Traffic& operator+=(const Traffic& o) noexcept;
};

/// Collectives over a fixed group of ranks. Buffers are raw pointers with an element count
/// and a dtype, as in MPI and NCCL. Every call is collective: all ranks of the group must
/// issue the same operations in the same order with the same counts.
///
/// In place, NCCL's convention: all_gather is in place when `send == recv + rank*count`
/// (elements), reduce_scatter when `recv == send + rank*recv_count`, all_reduce when
/// `send == recv`.
///
/// 16-bit reductions (f16, bf16): each pairwise combine converts both operands to f32,
/// combines, and rounds to nearest even (what NCCL does); avg divides the final sum by the
/// group size in f32 and rounds once more. The error of a sum over W ranks is therefore at
/// most (W-1) roundings of partial sums plus one: |err| <= W * u * sum(|x|), u = 2^-8 (bf16)
/// or 2^-11 (f16).
///
/// Operations of one communicator run in issue order. Operations on one communicator must
/// not be in flight on two different worker streams at once (that would let MPI match
/// them in different orders on different ranks): use dup() to get a communicator per
/// stream; a violation is reported as InvalidArgument.
class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  virtual const std::string& name() const noexcept = 0;
  /// Bound of Work::wait on this communicator's operations (seconds; 0 = none).
  virtual double timeout_s() const noexcept = 0;
  /// Bytes issued on this communicator since its creation.
  virtual Traffic traffic() const noexcept = 0;

  /// recv (size*count) <- concatenation of every rank's send (count), rank-major.
  virtual Work all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                          Stream& stream) = 0;
  /// recv (recv_count) <- op over ranks of chunk `rank` of send (size*recv_count).
  virtual Work reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                              ReduceOp op, Stream& stream) = 0;
  /// recv <- (sum over ranks of chunk `rank` of send) / divide_factor: FSDP's gradient
  /// reduction (NCCL: pre-multiplied sum; MPI: sum, then the division on the stream).
  virtual Work reduce_scatter_divided(const void* send, void* recv, std::size_t recv_count,
                                      DType dtype, double divide_factor, Stream& stream) = 0;
  virtual Work all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                          Stream& stream) = 0;
  virtual Work broadcast(void* buffer, std::size_t count, DType dtype, int root,
                         Stream& stream) = 0;
  /// recv (size*count) <- chunk `rank` of every rank's send (size*count): the chunk from rank
  /// q lands at recv + q*count. send and recv must not overlap.
  virtual Work all_to_all(const void* send, void* recv, std::size_t count, DType dtype,
                          Stream& stream) = 0;
  virtual Work barrier(Stream& stream) = 0;

  /// A new communicator over the same ranks (collective), e.g. one per stream.
  virtual std::unique_ptr<Communicator> dup(const std::string& name) const = 0;
  /// The ranks with the same `color`, ordered by `key`, as a new communicator (collective).
  virtual std::unique_ptr<Communicator> split(int color, int key,
                                              const std::string& name) const = 0;

 protected:
  Communicator() = default;
};

}  // namespace fullshard::comm
