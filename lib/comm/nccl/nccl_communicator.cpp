#include "fullshard/comm/nccl_communicator.hpp"

#include <nccl.h>

#include <cstring>
#include <string>
#include <utility>

#include "fullshard/base/error.hpp"
#include "lib/comm/mpi_error.hpp"
#include "lib/comm/nccl/nccl_error.hpp"

namespace fullshard::comm {

static_assert(sizeof(ncclUniqueId) == sizeof(NcclUniqueId::bytes),
              "NcclUniqueId must hold exactly an ncclUniqueId");
static_assert(NCCL_UNIQUE_ID_BYTES == 128, "ncclUniqueId is expected to be 128 bytes");

namespace {

using detail::mpi_error_string;

void mpi_check(int rc, const char* call, const std::string& context) {
  if (rc != MPI_SUCCESS)
    throw CommError(context + ": " + call + " failed: " + mpi_error_string(rc));
}

std::string label(const std::string& name, int rank, int size) {
  return "communicator '" + name + "' (rank " + std::to_string(rank) + "/" + std::to_string(size) +
         ")";
}

}  // namespace

namespace detail {
struct NcclCommState {
  ncclComm_t comm = nullptr;
};
}  // namespace detail

NcclUniqueId nccl_bootstrap_id(MPI_Comm comm, const std::string& name) {
  if (comm == MPI_COMM_NULL)
    throw InvalidArgument("nccl_bootstrap_id for communicator '" + name + "': MPI_COMM_NULL given");
  int rank = 0;
  int size = 1;
  mpi_check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", "nccl_bootstrap_id for '" + name + "'");
  mpi_check(MPI_Comm_size(comm, &size), "MPI_Comm_size", "nccl_bootstrap_id for '" + name + "'");
  const std::string context = "nccl_bootstrap_id on " + label(name, rank, size);

  // Rank 0's status goes first, so that a failure reaches every rank instead of leaving the
  // others blocked in the broadcast of an id that never comes.
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  int status = static_cast<int>(ncclSuccess);
  if (rank == 0) status = static_cast<int>(ncclGetUniqueId(&id));
  mpi_check(MPI_Bcast(&status, 1, MPI_INT, 0, comm), "MPI_Bcast (status)", context);
  if (status != static_cast<int>(ncclSuccess)) {
    const auto r = static_cast<ncclResult_t>(status);
    const std::string where = rank == 0 ? "ncclGetUniqueId" : "ncclGetUniqueId on rank 0";
    throw CommError(context + ": " + where +
                    " failed: " + detail::nccl_error_message(r, "ncclGetUniqueId"));
  }
  mpi_check(MPI_Bcast(&id, static_cast<int>(sizeof(id)), MPI_BYTE, 0, comm), "MPI_Bcast (id)",
            context);
  NcclUniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<detail::NcclCommState> state, std::string name,
                                   int rank, int size, double timeout_s)
    : state_(std::move(state)),
      name_(std::move(name)),
      rank_(rank),
      size_(size),
      timeout_s_(timeout_s) {}

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(MPI_Comm comm, const std::string& name,
                                                           double timeout_s) {
  const NcclUniqueId uid = nccl_bootstrap_id(comm, name);
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  ncclUniqueId id;
  std::memcpy(&id, uid.bytes.data(), sizeof(id));
  auto state = std::make_unique<detail::NcclCommState>();
  detail::nccl_check(ncclCommInitRank(&state->comm, size, id, rank), "ncclCommInitRank",
                     "creating " + label(name, rank, size));
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(std::move(state), name, rank, size, timeout_s));
}

NcclCommunicator::~NcclCommunicator() {
  if (!state_ || !state_->comm) return;
  // Finalize flushes outstanding work; if it fails the communicator is aborted instead.
  if (ncclCommFinalize(state_->comm) == ncclSuccess)
    ncclCommDestroy(state_->comm);
  else
    ncclCommAbort(state_->comm);
  state_->comm = nullptr;
}

void NcclCommunicator::not_implemented(const char* op) const {
  throw CommError(std::string(op) + " on " + label(name_, rank_, size_) +
                  ": not implemented yet: needs a GPU session");
}

Work NcclCommunicator::all_gather(const void*, void*, std::size_t, DType, Stream&) {
  not_implemented("all_gather");
}
Work NcclCommunicator::reduce_scatter(const void*, void*, std::size_t, DType, ReduceOp, Stream&) {
  not_implemented("reduce_scatter");
}
Work NcclCommunicator::all_reduce(const void*, void*, std::size_t, DType, ReduceOp, Stream&) {
  not_implemented("all_reduce");
}
Work NcclCommunicator::broadcast(void*, std::size_t, DType, int, Stream&) {
  not_implemented("broadcast");
}
Work NcclCommunicator::barrier(Stream&) {
  not_implemented("barrier");
}
std::unique_ptr<Communicator> NcclCommunicator::dup(const std::string&) const {
  not_implemented("dup");
}
std::unique_ptr<NcclCommunicator> NcclCommunicator::split(int, int, const std::string&) const {
  not_implemented("split");
}

}  // namespace fullshard::comm
