// NCCL backend of Communicator, for device memory (built with FULLSHARD_ENABLE_NCCL).
//
// Status: nccl_bootstrap_id, the dtype/op mapping and the error translation are tested on any
// machine (test/unit/test_nccl_host.cpp). Everything that needs a GPU (communicator
// creation, the collectives, groups, non-blocking mode, asynchronous-error polling, abort,
// dup/split) is compiled and linked in every CUDA build but has NOT been run on a GPU yet:
// test/gpu/test_gpu_nccl.cpp exercises it on one rank, run by scripts/gpu-check on a machine
// with a GPU. This header does not include nccl.h, so it can be included by code built
// without the NCCL headers.
#pragma once

#include <mpi.h>

#include <array>
#include <atomic>
#include <cstdint>
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
/// messages. Also CommError when an MPI call fails. The broadcasts are bounded by `timeout_s`
/// (> 0; 0 waits forever): past it the job is aborted with the common timeout message naming
/// `name` (a rank that never reaches the bootstrap must not hang the others).
NcclUniqueId nccl_bootstrap_id(MPI_Comm comm, const std::string& name = "nccl",
                               double timeout_s = 0.0);

struct NcclCommState;  // owns the ncclComm_t (defined in lib/comm/nccl)

/// How a communicator is created.
struct NcclOptions {
  /// false (the default): a non-blocking communicator (ncclConfig_t::blocking = 0). Its
  /// creation (ncclCommInitRankConfig, ncclCommSplit) and every call that returns
  /// ncclInProgress are completed by polling ncclCommGetAsyncError under the timeout; an
  /// error or the timeout aborts the communicator (ncclCommAbort) and throws CommError naming
  /// the call, the communicator and this rank, so a peer that never joins an init cannot hang
  /// the others. true: a blocking communicator; its init is bounded by a Watchdog only (past
  /// the timeout the job is aborted with the common timeout message).
  bool blocking = false;
};

/// How reduce_scatter_divided divides by a custom factor.
enum class DivideMode {
  /// Each rank's input is multiplied by 1/factor inside the reduction
  /// (ncclRedOpCreatePreMulSum, NCCL >= 2.11; otherwise sum_then_scale).
  pre_mul_sum,
  /// ncclSum, then a divide kernel on the same stream.
  sum_then_scale,
};

/// Collectives on device memory through NCCL; one NCCL communicator per object, over the
/// ranks of an MPI communicator, on the CUDA device current at creation (the Runtime binds
/// one device per local rank). Collectives need a device stream (Stream::device) and device
/// (or managed) buffers; they return a Work whose event is recorded after the NCCL call.
/// Work::wait() polls that event and ncclCommGetAsyncError with the communicator's timeout:
/// an asynchronous error or the timeout aborts the communicator (ncclCommAbort) and throws
/// CommError naming rank, communicator and operation; every later call then throws too.
/// Work::wait(stream) orders another device stream after the operation without blocking the
/// host. Move-only; the destructor finalizes and destroys the communicator (abort if that
/// fails). See the status note at the top of this file.
class NcclCommunicator final : public Communicator {
 public:
  /// Collective over `comm`: nccl_bootstrap_id (under `timeout_s`), then ncclCommInitRankConfig on
  /// the current device (non-blocking by default, polled under `timeout_s`: NcclOptions).
  /// `comm` is only used during the call (not kept). `timeout_s` > 0 bounds the init,
  /// Work::wait and the non-blocking polls (normally Settings::timeout_s). CommError on
  /// failure or timeout (on every rank when the id cannot be created).
  static std::unique_ptr<NcclCommunicator> create(MPI_Comm comm, const std::string& name,
                                                  double timeout_s, NcclOptions options = {});
  /// ncclCommFinalize + ncclCommDestroy (ncclCommAbort if finalizing fails or times out).
  ~NcclCommunicator() override;
  NcclCommunicator(NcclCommunicator&& other) noexcept;
  NcclCommunicator& operator=(NcclCommunicator&& other) noexcept;

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  const std::string& name() const noexcept override { return name_; }
  double timeout_s() const noexcept override { return timeout_s_; }
  Traffic traffic() const noexcept override;
  bool blocking() const noexcept { return options_.blocking; }
  /// True once the communicator was aborted (after an error or a timeout).
  bool aborted() const noexcept;
  /// The ncclComm_t (as void*), for calls fullshard does not wrap; nullptr once aborted.
  void* native_handle() const noexcept;

  /// In place when send == recv + rank*count (NCCL's convention).
  Work all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                  Stream& stream) override;
  /// sum, max, min; avg through ncclAvg (NCCL >= 2.10; else sum, then divide on the stream).
  Work reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                      ReduceOp op, Stream& stream) override;
  /// Sum of every rank's chunk divided by `divide_factor` (> 0, finite), as FSDP's gradient
  /// divide factor: by `mode`.
  Work reduce_scatter_divided(const void* send, void* recv, std::size_t recv_count, DType dtype,
                              double divide_factor, Stream& stream, DivideMode mode);
  /// reduce_scatter_divided with DivideMode::pre_mul_sum.
  Work reduce_scatter_divided(const void* send, void* recv, std::size_t recv_count, DType dtype,
                              double divide_factor, Stream& stream) override {
    return reduce_scatter_divided(send, recv, recv_count, dtype, divide_factor, stream,
                                  DivideMode::pre_mul_sum);
  }
  Work all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                  Stream& stream) override;
  Work broadcast(void* buffer, std::size_t count, DType dtype, int root, Stream& stream) override;
  Work all_to_all(const void* send, void* recv, std::size_t count, DType dtype,
                  Stream& stream) override;
  /// A one-element all-reduce on a scratch device word: completes when every rank reached it.
  Work barrier(Stream& stream) override;
  /// ncclCommSplit(comm, 0, rank) (NCCL >= 2.18; CommError before). Collective.
  std::unique_ptr<Communicator> dup(const std::string& name) const override;
  /// ncclCommSplit(comm, color, key): the ranks with the same color, ordered by key; nullptr
  /// on ranks that pass color < 0 (NCCL_SPLIT_NOCOLOR). NCCL >= 2.18. Collective.
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) const override;

 private:
  friend class NcclGroup;
  NcclCommunicator(std::shared_ptr<NcclCommState> state, std::string name, int rank, int size,
                   double timeout_s, NcclOptions options);
  template <class Call>
  Work launch(const char* op, std::size_t count, DType dtype, Stream& stream, Call&& call);
  std::unique_ptr<NcclCommunicator> split_impl(int color, int key, const std::string& name) const;

  std::shared_ptr<NcclCommState> state_;
  std::string name_;
  int rank_ = 0;
  int size_ = 1;
  double timeout_s_ = 0.0;
  NcclOptions options_;
  std::uint64_t seq_ = 0;
  std::shared_ptr<std::array<std::atomic<std::uint64_t>, 5>> traffic_ =
      std::make_shared<std::array<std::atomic<std::uint64_t>, 5>>();
};

/// ncclGroupStart on construction, ncclGroupEnd on end() or destruction: collectives issued
/// in between (on any NcclCommunicator, by this thread) are launched together, e.g. one
/// all-gather per mesh dim, or an all-gather and a reduce-scatter on two communicators.
/// Their Works can be waited on only after the group ended. Non-blocking communicators used
/// in the group are polled until ncclGroupEnd's work is issued. Groups nest (NCCL counts
/// them); only the outermost end launches. Move-only.
class NcclGroup {
 public:
  NcclGroup();
  /// Ends the group if end() was not called; errors are swallowed here (call end() to see
  /// them).
  ~NcclGroup();
  NcclGroup(NcclGroup&& other) noexcept;
  NcclGroup& operator=(NcclGroup&&) = delete;
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  /// ncclGroupEnd, then records the events of the group's operations. Throws CommError
  /// (and stores it in every Work of the group) when the group fails.
  void end();
  /// Groups open on this thread (0 outside any group).
  static int depth() noexcept;

 private:
  bool open_ = false;
};

}  // namespace fullshard::comm
