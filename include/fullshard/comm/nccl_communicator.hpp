// NCCL backend of Communicator, for device memory (built with FULLSHARD_ENABLE_NCCL).
//
// Status: host-side groundwork. nccl_bootstrap_id is implemented and tested on any machine.
// NcclCommunicator::create and the destructor are implemented but have only been compiled,
// not run: they need a GPU. The collectives, barrier, dup and split are NOT IMPLEMENTED
// YET: they throw CommError("... not implemented yet: needs a GPU session"). This header
// does not include nccl.h, so it can be included by code built without the NCCL headers.
#pragma once

#include <mpi.h>

#include <array>
#include <memory>
#include <string>

#include "fullshard/comm/communicator.hpp"

namespace fullshard::comm {

/// The bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES = 128), without nccl.h.
struct NcclUniqueId {
  std::array<char, 128> bytes{};
};

/// Collective over `comm`: rank 0 calls ncclGetUniqueId and broadcasts the id over MPI, so
/// every rank returns the same bytes. If ncclGetUniqueId fails on rank 0 (no network
/// interface, no GPU, ...) every rank throws CommError naming ncclGetUniqueId (rank 0
/// broadcasts its status before the id, so no rank is left waiting). `name` labels
/// messages. Also CommError when an MPI call fails.
NcclUniqueId nccl_bootstrap_id(MPI_Comm comm, const std::string& name = "nccl");

namespace detail {
struct NcclCommState;  // owns the ncclComm_t (defined in lib/comm/nccl)
}

/// Collectives on device memory through NCCL; one NCCL communicator per object, over the
/// ranks of an MPI communicator, on the CUDA device current at creation (the Runtime binds
/// one device per local rank). See the status note at the top of this file.
class NcclCommunicator final : public Communicator {
 public:
  /// Collective over `comm`: nccl_bootstrap_id, then ncclCommInitRank on the current
  /// device. `comm` is only used during the call (not kept). `timeout_s` > 0 is meant to
  /// bound Work::wait (normally Settings::timeout_s). Needs a GPU; CommError on failure.
  static std::unique_ptr<NcclCommunicator> create(MPI_Comm comm, const std::string& name,
                                                  double timeout_s);
  /// ncclCommFinalize + ncclCommDestroy (ncclCommAbort if finalizing fails).
  ~NcclCommunicator() override;

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  const std::string& name() const noexcept override { return name_; }
  double timeout_s() const noexcept { return timeout_s_; }

  // Not implemented yet (needs a GPU session): each throws CommError.
  Work all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                  Stream& stream) override;
  Work reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                      ReduceOp op, Stream& stream) override;
  Work all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                  Stream& stream) override;
  Work broadcast(void* buffer, std::size_t count, DType dtype, int root, Stream& stream) override;
  Work barrier(Stream& stream) override;
  /// Planned: ncclCommSplit(comm, 0, rank). Not implemented yet.
  std::unique_ptr<Communicator> dup(const std::string& name) const override;
  /// Planned: ncclCommSplit(comm, color, key). Not implemented yet.
  std::unique_ptr<NcclCommunicator> split(int color, int key, const std::string& name) const;

 private:
  NcclCommunicator(std::unique_ptr<detail::NcclCommState> state, std::string name, int rank,
                   int size, double timeout_s);
  [[noreturn]] void not_implemented(const char* op) const;

  std::unique_ptr<detail::NcclCommState> state_;
  std::string name_;
  int rank_ = 0;
  int size_ = 1;
  double timeout_s_ = 0.0;
};

}  // namespace fullshard::comm
