// MPI backend of Communicator, for host memory.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>

#include "fullshard/comm/communicator.hpp"

namespace fullshard::comm {

// Opaque: the MPI operators of the 16-bit types (lib/comm/mpi_reduce_ops.hpp).
struct MpiReduceOps;

class MpiCommunicator final : public Communicator {
 public:
  /// Duplicates `parent` (collective over parent) and names the result `name`. Errors on the
  /// new communicator are returned, not fatal (MPI_ERRORS_RETURN), and become CommError.
  /// `timeout_s` > 0 arms Work::wait's timeout (normally Settings::timeout_s).
  static std::unique_ptr<MpiCommunicator> duplicate(MPI_Comm parent, const std::string& name,
                                                    double timeout_s);
  /// Takes ownership of `comm` (freed on destruction).
  static std::unique_ptr<MpiCommunicator> adopt(MPI_Comm comm, const std::string& name,
                                                double timeout_s);
  ~MpiCommunicator() override;

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  const std::string& name() const noexcept override { return name_; }
  /// The underlying MPI communicator (owned by this object).
  MPI_Comm handle() const noexcept { return comm_; }
  double timeout_s() const noexcept override { return timeout_s_; }

  Work all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                  Stream& stream) override;
  Work reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                      ReduceOp op, Stream& stream) override;
  Work reduce_scatter_divided(const void* send, void* recv, std::size_t recv_count, DType dtype,
                              double divide_factor, Stream& stream) override;
  Work all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                  Stream& stream) override;
  Work broadcast(void* buffer, std::size_t count, DType dtype, int root, Stream& stream) override;
  Work all_to_all(const void* send, void* recv, std::size_t count, DType dtype,
                  Stream& stream) override;
  Work barrier(Stream& stream) override;
  std::unique_ptr<Communicator> dup(const std::string& name) const override;
  /// The ranks with the same `color`, ordered by `key`, as a new communicator (collective).
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) const override;
  /// Bytes issued on this communicator since its creation (one relaxed atomic add per call).
  Traffic traffic() const noexcept override;

 private:
  MpiCommunicator(MPI_Comm comm, std::string name, double timeout_s);
  // Checks arguments, claims the stream, and submits `body` with a labelled completion.
  template <class Body>
  Work launch(const char* op, std::size_t count, DType dtype, Stream& stream, Body&& body);
  void check_count(std::size_t count, const char* op) const;

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::string name_;
  int rank_ = 0;
  int size_ = 1;
  double timeout_s_ = 0.0;
  std::uint64_t seq_ = 0;
  std::shared_ptr<const MpiReduceOps> ops_;
  // Which worker stream has operations in flight on this communicator (0: none).
  std::mutex owner_mutex_;
  std::uint64_t owner_stream_ = 0;
  std::string owner_name_;
  std::shared_ptr<std::atomic<int>> in_flight_ = std::make_shared<std::atomic<int>>(0);
  // Traffic counters: all_gather, reduce_scatter, all_reduce, broadcast, all_to_all.
  std::atomic<std::uint64_t> traffic_[5] = {};
};

}  // namespace fullshard::comm
