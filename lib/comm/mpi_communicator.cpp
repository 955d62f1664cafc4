#include "fullshard/comm/mpi_communicator.hpp"

#include <cmath>

#include <climits>
#include <cstring>
#include <string>

#include "fullshard/base/error.hpp"
#include "lib/comm/buffer_checks.hpp"
#include "lib/comm/mpi_error.hpp"
#include "lib/comm/mpi_reduce_ops.hpp"

namespace fullshard::comm {

const char* reduce_op_name(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
  }
  return "?";
}

namespace {

void check(int rc, const char* mpi_call, const std::string& label) {
  if (rc != MPI_SUCCESS)
    throw CommError(label + ": " + mpi_call + " failed: " + mpi_error_string(rc));
}

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, double timeout_s)
    : comm_(comm), name_(std::move(name)), timeout_s_(timeout_s) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  ops_ = std::make_shared<const MpiReduceOps>();
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::duplicate(MPI_Comm parent,
                                                            const std::string& name,
                                                            double timeout_s) {
  MPI_Comm comm = MPI_COMM_NULL;
  if (const int rc = MPI_Comm_dup(parent, &comm); rc != MPI_SUCCESS)
    throw CommError("MPI_Comm_dup for communicator '" + name + "' failed: " + mpi_error_string(rc));
  return adopt(comm, name, timeout_s);
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::adopt(MPI_Comm comm, const std::string& name,
                                                        double timeout_s) {
  if (comm == MPI_COMM_NULL)
    throw InvalidArgument("communicator '" + name + "': MPI_COMM_NULL given");
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(comm, name, timeout_s));
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

std::unique_ptr<Communicator> MpiCommunicator::dup(const std::string& name) const {
  auto d = duplicate(comm_, name, timeout_s_);
  d->ops_ = ops_;
  return d;
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key,
                                                     const std::string& name) const {
  MPI_Comm comm = MPI_COMM_NULL;
  if (const int rc = MPI_Comm_split(comm_, color, key, &comm); rc != MPI_SUCCESS)
    throw CommError("MPI_Comm_split of communicator '" + name_ + "' into '" + name +
                    "' failed: " + mpi_error_string(rc));
  auto s = adopt(comm, name, timeout_s_);
  s->ops_ = ops_;
  return std::unique_ptr<Communicator>(std::move(s));
}

void MpiCommunicator::check_count(std::size_t count, const char* op) const {
  if (count > static_cast<std::size_t>(INT_MAX))
    throw InvalidArgument(std::string(op) + " on communicator '" + name_ + "': count " +
                          std::to_string(count) + " exceeds INT_MAX elements per rank");
}

template <class Body>
Work MpiCommunicator::launch(const char* op, std::size_t count, DType dtype, Stream& stream,
                             Body&& body) {
  {
    std::lock_guard<std::mutex> lock(owner_mutex_);
    if (in_flight_->load() > 0 && owner_stream_ != stream.id())
      throw InvalidArgument(std::string(op) + " on communicator '" + name_ + "' from stream '" +
                            stream.name() + "' while operations are in flight on stream '" +
                            owner_name_ +
                            "'; use Communicator::dup() to get one communicator per stream");
    owner_stream_ = stream.id();
    owner_name_ = stream.name();
    in_flight_->fetch_add(1);
  }
  const std::string label = std::string(op) + " on communicator '" + name_ + "' (rank " +
                            std::to_string(rank_) + "/" + std::to_string(size_) + ", seq " +
                            std::to_string(++seq_) + ", " + std::to_string(count) + " x " +
                            dtype_name(dtype) + ")";
  auto in_flight = in_flight_;
  return stream.submit(
      label,
      [label, in_flight, body = std::forward<Body>(body)]() mutable {
        struct Release {
          std::atomic<int>& n;
          ~Release() { n.fetch_sub(1); }
        } release{*in_flight};
        body(label);
      },
      timeout_s_);
}

Work MpiCommunicator::all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                                 Stream& stream) {
  check_count(count, "all_gather");
  const std::size_t bytes = count * dtype_size(dtype);
  if (count > 0 && (!send || !recv))
    throw InvalidArgument("all_gather on communicator '" + name_ + "': null buffer");
  auto* slot = static_cast<char*>(recv) + static_cast<std::size_t>(rank_) * bytes;
  const bool in_place = send == slot;
  if (!in_place && count > 0 && overlaps(send, bytes, recv, bytes * size_))
    throw InvalidArgument("all_gather on communicator '" + name_ +
                          "': send overlaps recv but is not this rank's slot "
                          "(recv + rank*count) for an in-place all-gather");
  const MPI_Datatype type = mpi_datatype(dtype);
  const int n = static_cast<int>(count);
  Work w = launch("all_gather", count, dtype, stream, [=, comm = comm_](const std::string& label) {
    check(MPI_Allgather(in_place ? MPI_IN_PLACE : send, n, type, recv, n, type, comm),
          "MPI_Allgather", label);
  });
  traffic_[0].fetch_add(bytes * static_cast<std::size_t>(size_), std::memory_order_relaxed);
  return w;
}

Work MpiCommunicator::reduce_scatter(const void* send, void* recv, std::size_t recv_count,
                                     DType dtype, ReduceOp op, Stream& stream) {
  check_count(recv_count, "reduce_scatter");
  const std::size_t bytes = recv_count * dtype_size(dtype);
  if (recv_count > 0 && (!send || !recv))
    throw InvalidArgument("reduce_scatter on communicator '" + name_ + "': null buffer");
  const char* slot = static_cast<const char*>(send) + static_cast<std::size_t>(rank_) * bytes;
  const bool in_place = recv == slot;
  if (!in_place && recv_count > 0 && overlaps(send, bytes * size_, recv, bytes))
    throw InvalidArgument("reduce_scatter on communicator '" + name_ +
                          "': recv overlaps send but is not this rank's chunk "
                          "(send + rank*recv_count) for an in-place reduce-scatter");
  const MPI_Datatype type = mpi_datatype(dtype);
  const MPI_Op mpi_op = ops_->get(dtype, op);
  const int n = static_cast<int>(recv_count);
  const int rank = rank_;
  const int size = size_;
  Work w = launch("reduce_scatter", recv_count, dtype, stream,
                  [=, comm = comm_](const std::string& label) {
                    if (in_place) {
                      // MPI's in-place form leaves the result at the start of the buffer; NCCL's
                      // (ours) at this rank's chunk. Move it there: 1/size of the bytes, only when
                      // rank > 0.
                      auto* buf = const_cast<void*>(send);
                      check(MPI_Reduce_scatter_block(MPI_IN_PLACE, buf, n, type, mpi_op, comm),
                            "MPI_Reduce_scatter_block", label);
                      if (rank > 0) std::memmove(recv, buf, bytes);
                    } else {
                      check(MPI_Reduce_scatter_block(send, recv, n, type, mpi_op, comm),
                            "MPI_Reduce_scatter_block", label);
                    }
                    if (op == ReduceOp::avg) divide_in_place(recv, recv_count, dtype, size);
                  });
  traffic_[1].fetch_add(bytes * static_cast<std::size_t>(size_), std::memory_order_relaxed);
  return w;
}

Work MpiCommunicator::reduce_scatter_divided(const void* send, void* recv, std::size_t recv_count,
                                             DType dtype, double divide_factor, Stream& stream) {
  if (!(divide_factor > 0) || !std::isfinite(divide_factor))
    throw InvalidArgument("reduce_scatter_divided on communicator '" + name_ +
                          "': the divide factor must be finite and > 0, got " +
                          std::to_string(divide_factor));
  Work w = reduce_scatter(send, recv, recv_count, dtype, ReduceOp::sum, stream);
  if (divide_factor == 1.0) return w;
  return stream.submit("divide after reduce_scatter on '" + name_ + "'", [=] {
    w.test();  // the sum's error, not a division of what it did not write
    divide_in_place(recv, recv_count, dtype, divide_factor);
  });
}

Work MpiCommunicator::all_reduce(const void* send, void* recv, std::size_t count, DType dtype,
                                 ReduceOp op, Stream& stream) {
  check_count(count, "all_reduce");
  const std::size_t bytes = count * dtype_size(dtype);
  if (count > 0 && (!send || !recv))
    throw InvalidArgument("all_reduce on communicator '" + name_ + "': null buffer");
  const bool in_place = send == recv;
  if (!in_place && count > 0 && overlaps(send, bytes, recv, bytes))
    throw InvalidArgument("all_reduce on communicator '" + name_ +
                          "': send and recv overlap without being equal");
  const MPI_Datatype type = mpi_datatype(dtype);
  const MPI_Op mpi_op = ops_->get(dtype, op);
  const int n = static_cast<int>(count);
  const int size = size_;
  Work w = launch("all_reduce", count, dtype, stream, [=, comm = comm_](const std::string& label) {
    check(MPI_Allreduce(in_place ? MPI_IN_PLACE : send, recv, n, type, mpi_op, comm),
          "MPI_Allreduce", label);
    if (op == ReduceOp::avg) divide_in_place(recv, count, dtype, size);
  });
  traffic_[2].fetch_add(bytes, std::memory_order_relaxed);
  return w;
}

Work MpiCommunicator::broadcast(void* buffer, std::size_t count, DType dtype, int root,
                                Stream& stream) {
  check_count(count, "broadcast");
  if (root < 0 || root >= size_)
    throw InvalidArgument("broadcast on communicator '" + name_ + "': root " +
                          std::to_string(root) + " is not in [0, " + std::to_string(size_) + ")");
  if (count > 0 && !buffer)
    throw InvalidArgument("broadcast on communicator '" + name_ + "': null buffer");
  const MPI_Datatype type = mpi_datatype(dtype);
  const int n = static_cast<int>(count);
  Work w = launch("broadcast", count, dtype, stream, [=, comm = comm_](const std::string& label) {
    check(MPI_Bcast(buffer, n, type, root, comm), "MPI_Bcast", label);
  });
  traffic_[3].fetch_add(count * dtype_size(dtype), std::memory_order_relaxed);
  return w;
}

Work MpiCommunicator::all_to_all(const void* send, void* recv, std::size_t count, DType dtype,
                                 Stream& stream) {
  check_count(count, "all_to_all");
  const std::size_t bytes = count * dtype_size(dtype) * static_cast<std::size_t>(size_);
  if (count > 0 && (!send || !recv))
    throw InvalidArgument("all_to_all on communicator '" + name_ + "': null buffer");
  if (count > 0 && overlaps(send, bytes, recv, bytes))
    throw InvalidArgument("all_to_all on communicator '" + name_ + "': send and recv overlap");
  const MPI_Datatype type = mpi_datatype(dtype);
  const int n = static_cast<int>(count);
  Work w = launch("all_to_all", count, dtype, stream, [=, comm = comm_](const std::string& label) {
    check(MPI_Alltoall(send, n, type, recv, n, type, comm), "MPI_Alltoall", label);
  });
  traffic_[4].fetch_add(bytes, std::memory_order_relaxed);
  return w;
}

Traffic MpiCommunicator::traffic() const noexcept {
  Traffic t;
  t.all_gather = traffic_[0].load(std::memory_order_relaxed);
  t.reduce_scatter = traffic_[1].load(std::memory_order_relaxed);
  t.all_reduce = traffic_[2].load(std::memory_order_relaxed);
  t.broadcast = traffic_[3].load(std::memory_order_relaxed);
  t.all_to_all = traffic_[4].load(std::memory_order_relaxed);
  return t;
}

Traffic& Traffic::operator+=(const Traffic& o) noexcept {
  all_gather += o.all_gather;
  reduce_scatter += o.reduce_scatter;
  all_reduce += o.all_reduce;
  broadcast += o.broadcast;
  all_to_all += o.all_to_all;
  return *this;
}

Work MpiCommunicator::barrier(Stream& stream) {
  return launch("barrier", 0, DType::f32, stream, [=, comm = comm_](const std::string& label) {
    check(MPI_Barrier(comm), "MPI_Barrier", label);
  });
}

}  // namespace fullshard::comm
