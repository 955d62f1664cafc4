#include "lib/comm/nccl_communicator.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fullshard/base/deadline.hpp"
#include "fullshard/base/error.hpp"
#include "lib/base/mpi_wait.hpp"
#include "lib/comm/buffer_checks.hpp"
#include "lib/comm/cuda/cuda_check.hpp"
#include "lib/comm/cuda/device_divide.hpp"
#include "lib/comm/device_stream.hpp"
#include "lib/comm/mpi_error.hpp"
#include "lib/comm/nccl/nccl_error.hpp"
#include "lib/comm/nccl/nccl_poll.hpp"
#include "lib/comm/nccl/nccl_types.hpp"

namespace fullshard::comm {

static_assert(sizeof(ncclUniqueId) == sizeof(NcclUniqueId::bytes),
              "NcclUniqueId must hold exactly an ncclUniqueId");
static_assert(NCCL_UNIQUE_ID_BYTES == 128, "ncclUniqueId is expected to be 128 bytes");

namespace {

void mpi_check(int rc, const char* call, const std::string& context) {
  if (rc != MPI_SUCCESS)
    throw CommError(context + ": " + call + " failed: " + mpi_error_string(rc));
}

std::string label(const std::string& name, int rank, int size) {
  return "communicator '" + name + "' (rank " + std::to_string(rank) + "/" + std::to_string(size) +
         ")";
}

}  // namespace

// The ncclComm_t and what every Work of the communicator needs to poll it. Shared by the
// communicator and its Works' hooks; the mutex serialises NCCL calls on the communicator
// (enqueue, polls, abort) between threads.
struct NcclCommState {
  ncclComm_t comm = nullptr;
  bool blocking = true;
  double timeout_s = 0.0;
  std::string name;          // the communicator's name
  int rank = 0;              // this process's rank in it
  int size = 1;              // its number of ranks
  std::string what;          // "communicator 'x' (rank r/n)"
  std::string abort_reason;  // set once aborted
  void* scratch = nullptr;   // one device word for barrier()
  std::mutex m;

  ~NcclCommState() { destroy(); }

  void require_usable_locked(const std::string& context) const {
    if (!abort_reason.empty())
      throw CommError(context + ": the communicator was aborted earlier (" + abort_reason +
                      ") and cannot be used again");
    if (!comm) throw CommError(context + ": the communicator was destroyed");
  }
  void require_usable_locked(const LazyLabel& what) const {
    if (abort_reason.empty() && comm) return;
    require_usable_locked(what.str());
  }

  void abort_locked(const std::string& why) {
    if (abort_reason.empty()) abort_reason = why;
    if (comm) ncclCommAbort(comm);
    comm = nullptr;
  }
  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(m);
    abort_locked(why);
  }

  // The communicator as a wait site: "<operation> on communicator '<name>' (rank r/n, seq s,
  // <detail>)", the common format of timeout and error messages.
  WaitSite site(std::string operation, std::uint64_t seq = 0, std::string detail = {}) const {
    return WaitSite{std::move(operation), "communicator '" + name + "'", rank, size, seq,
                    std::move(detail)};
  }

  // Completes a call on `c` (this communicator's handle, or a child's being split from it)
  // that returned `r`: polls its asynchronous state while ncclInProgress, bounded by the
  // timeout (complete_nccl_call). On an error or the timeout aborts `c` (and nulls it) and
  // this communicator, and throws CommError.
  void complete_locked(ncclResult_t r, ncclComm_t& c, const WaitSite& at,
                       const char* hint = kCollectiveTimeoutHint) {
    if (r == ncclSuccess) return;
    complete_nccl_call(
        r, at, timeout_s, [&c] { return c ? nccl_async_state(c) : ncclInvalidUsage; },
        [&](const std::string& why) {
          if (&c != &comm) {  // a child: aborted here; this communicator below
            if (c) ncclCommAbort(c);
            c = nullptr;
          }
          abort_locked(why);
        },
        hint);
  }

  // The result of an enqueueing call (`what`: the operation's label). Any failure aborts the
  // communicator: the other ranks may already be inside the collective. ncclInProgress (a
  // non-blocking communicator still enqueueing) is polled to its end here, before the caller
  // records the operation's event; inside a group, at ncclGroupEnd.
  void finish_call_locked(ncclResult_t r, const char* call, const LazyLabel& what, bool in_group) {
    if (r == ncclSuccess) return;
    if (r == ncclInProgress && in_group && !blocking) return;  // completed at ncclGroupEnd
    complete_locked(r, comm, WaitSite::labelled(std::string(call) + " for " + what.str()));
  }

  // Work::wait's poll: throws (after aborting) when NCCL reports an asynchronous error.
  void check(const LazyLabel& what) {
    std::lock_guard<std::mutex> lock(m);
    if (!abort_reason.empty())
      throw CommError(what.str() + ": the communicator was aborted (" + abort_reason + ")");
    if (!comm) return;  // destroyed after finalize: its operations finished
    ncclResult_t st = ncclSuccess;
    if (const ncclResult_t r = ncclCommGetAsyncError(comm, &st); r != ncclSuccess) st = r;
    if (st == ncclSuccess || st == ncclInProgress) return;
    const std::string why =
        what.str() + ": ncclCommGetAsyncError reported " + nccl_error_message(st, "async");
    abort_locked(why);
    throw CommError(why + "; the communicator was aborted (ncclCommAbort)");
  }

  // Finalize (flushes outstanding operations) and destroy; abort when finalizing fails or
  // does not finish within the timeout.
  void destroy() noexcept {
    std::lock_guard<std::mutex> lock(m);
    if (comm) {
      ncclResult_t r = ncclCommFinalize(comm);
      if (r == ncclInProgress) {
        try {
          complete_locked(r, comm, site("ncclCommFinalize"));
          r = ncclSuccess;
        } catch (...) {  // aborted inside
          r = ncclInternalError;
        }
      }
      if (comm) {
        if (r == ncclSuccess)
          ncclCommDestroy(comm);
        else
          ncclCommAbort(comm);
        comm = nullptr;
      }
    }
    if (scratch) cudaFree(scratch);
    scratch = nullptr;
  }
};

namespace {

// Operations and non-blocking communicators of the NCCL group open on this thread. NCCL
// keeps its group state per thread; so does this (no state is shared between threads).
struct GroupState {
  int depth = 0;
  std::vector<DeferredDevice> ops;
  std::vector<std::shared_ptr<NcclCommState>> comms;
};
GroupState& group_state() {
  thread_local GroupState g;
  return g;
}

}  // namespace

NcclUniqueId nccl_bootstrap_id(MPI_Comm comm, const std::string& name, double timeout_s) {
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
  // Nonblocking broadcasts under the timeout: a rank that never reaches the bootstrap is
  // reported (naming this communicator) instead of hanging the others.
  auto bcast = [&](void* buf, int n, MPI_Datatype type, const char* what) {
    MPI_Request request = MPI_REQUEST_NULL;
    mpi_check(MPI_Ibcast(buf, n, type, 0, comm, &request), what, context);
    wait_mpi(request, WaitSite::labelled(context + ": " + what), timeout_s);
  };
  bcast(&status, 1, MPI_INT, "MPI_Ibcast (status)");
  if (status != static_cast<int>(ncclSuccess)) {
    const auto r = static_cast<ncclResult_t>(status);
    const std::string where = rank == 0 ? "ncclGetUniqueId" : "ncclGetUniqueId on rank 0";
    throw CommError(context + ": " + where +
                    " failed: " + nccl_error_message(r, "ncclGetUniqueId"));
  }
  bcast(&id, static_cast<int>(sizeof(id)), MPI_BYTE, "MPI_Ibcast (id)");
  NcclUniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<NcclCommState> state, std::string name, int rank,
                                   int size, double timeout_s, NcclOptions options)
    : state_(std::move(state)),
      name_(std::move(name)),
      rank_(rank),
      size_(size),
      timeout_s_(timeout_s),
      options_(options) {}

NcclCommunicator::NcclCommunicator(NcclCommunicator&& o) noexcept
    : Communicator(),
      state_(std::move(o.state_)),
      name_(std::move(o.name_)),
      rank_(o.rank_),
      size_(o.size_),
      timeout_s_(o.timeout_s_),
      options_(o.options_),
      seq_(o.seq_) {}

NcclCommunicator& NcclCommunicator::operator=(NcclCommunicator&& o) noexcept {
  if (this != &o) {
    if (state_) state_->destroy();
    state_ = std::move(o.state_);
    name_ = std::move(o.name_);
    rank_ = o.rank_;
    size_ = o.size_;
    timeout_s_ = o.timeout_s_;
    options_ = o.options_;
    seq_ = o.seq_;
  }
  return *this;
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(MPI_Comm comm, const std::string& name,
                                                           double timeout_s, NcclOptions options) {
  const NcclUniqueId uid = nccl_bootstrap_id(comm, name, timeout_s);
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  ncclUniqueId id;
  std::memcpy(&id, uid.bytes.data(), sizeof(id));
  auto state = std::make_shared<NcclCommState>();
  state->blocking = options.blocking;
  state->timeout_s = timeout_s;
  state->name = name;
  state->rank = rank;
  state->size = size;
  state->what = label(name, rank, size);
  const std::string context = "creating " + state->what;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = options.blocking ? 1 : 0;
  {
    std::lock_guard<std::mutex> lock(state->m);
    if (options.blocking) {
      // A blocking init cannot be polled: the watchdog bounds it (the job is aborted with the
      // common timeout message when a peer never joins).
      const std::string what = state->site("ncclCommInitRankConfig (blocking)").describe();
      Watchdog watchdog;
      watchdog.arm(what, timeout_s, kNcclInitTimeoutHint);
      const ncclResult_t r = ncclCommInitRankConfig(&state->comm, size, id, rank, &config);
      watchdog.disarm();
      state->complete_locked(r, state->comm, state->site("ncclCommInitRankConfig"));
    } else {
      // Non-blocking: the call returns at once (ncclInProgress) and the init is polled
      // under the timeout; an error or the timeout aborts it (ncclCommAbort) and throws.
      const ncclResult_t r = ncclCommInitRankConfig(&state->comm, size, id, rank, &config);
      state->complete_locked(r, state->comm, state->site("ncclCommInitRankConfig"),
                             kNcclInitTimeoutHint);
    }
  }
  cuda_check(cudaMalloc(&state->scratch, sizeof(float)), "cudaMalloc", context + " (barrier word)");
  cuda_check(cudaMemset(state->scratch, 0, sizeof(float)), "cudaMemset",
             context + " (barrier word)");
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(std::move(state), name, rank, size, timeout_s, options));
}

NcclCommunicator::~NcclCommunicator() {
  if (state_) state_->destroy();  // Works still held see a destroyed (finished) communicator
}

bool NcclCommunicator::aborted() const noexcept {
  if (!state_) return false;
  std::lock_guard<std::mutex> lock(state_->m);
  return !state_->abort_reason.empty();
}

void* NcclCommunicator::native_handle() const noexcept {
  if (!state_) return nullptr;
  std::lock_guard<std::mutex> lock(state_->m);
  return state_->comm;
}

namespace {

// The label of a collective, "<op> on communicator '<name>' (rank r/n, seq s, <count> x
// <dtype>)", built only when a message needs it (LazyLabel): `count_dtype` holds the count in
// its low 56 bits and the dtype above.
constexpr int kDtypeShift = 56;
std::string op_label(const char* op, const void* state, std::uint64_t seq,
                     std::uint64_t count_dtype) {
  const auto& st = *static_cast<const NcclCommState*>(state);
  const auto dtype = static_cast<DType>(count_dtype >> kDtypeShift);
  const std::uint64_t count = count_dtype & ((std::uint64_t{1} << kDtypeShift) - 1);
  return std::string(op) + " on communicator '" + st.name + "' (rank " + std::to_string(st.rank) +
         "/" + std::to_string(st.size) + ", seq " + std::to_string(seq) + ", " +
         std::to_string(count) + " x " + dtype_name(dtype) + ")";
}

// The traffic counter of an operation (as MpiCommunicator counts it), -1 for none.
int traffic_slot(const char* op) noexcept {
  if (std::strcmp(op, "all_gather") == 0) return 0;
  if (std::strncmp(op, "reduce_scatter", 14) == 0) return 1;
  if (std::strcmp(op, "all_reduce") == 0) return 2;
  if (std::strcmp(op, "broadcast") == 0) return 3;
  if (std::strcmp(op, "all_to_all") == 0) return 4;
  return -1;
}

}  // namespace

// Checks the stream and submits `call(comm, stream, label, in_group)` (which enqueues the
// NCCL call and completes its result) to the device stream with the hooks Work::wait polls.
// No string is built unless an error needs one (the label is a LazyLabel).
template <class Call>
Work NcclCommunicator::launch(const char* op, std::size_t count, DType dtype, Stream& stream,
                              Call&& call) {
  ++seq_;
  if (!state_)
    throw InvalidArgument(std::string(op) + " on communicator '" + name_ +
                          "': the communicator was moved from");
  const LazyLabel what(
      &op_label, op, state_, seq_,
      (static_cast<std::uint64_t>(dtype) << kDtypeShift) | static_cast<std::uint64_t>(count));
  if (const int slot = traffic_slot(op); slot >= 0) {
    const std::uint64_t bytes = count * dtype_size(dtype);
    const std::uint64_t mult = (slot <= 1 || slot == 4) ? static_cast<std::uint64_t>(size_) : 1;
    (*traffic_)[static_cast<std::size_t>(slot)].fetch_add(bytes * mult);
  }
  if (!stream.is_device())
    throw InvalidArgument(what.str() + ": stream '" + stream.name() + "' is a " +
                          stream_type_name(stream.kind()) +
                          " stream; NCCL collectives need a device stream (Stream::device)");
  auto state = state_;
  DeviceWatch watch;
  watch.check = [state, what] { state->check(what); };
  watch.on_timeout = [state](const std::string& why) { state->abort(why); };
  GroupState& group = group_state();
  const bool in_group = group.depth > 0;
  if (in_group) {  // polled (non-blocking) or aborted (on failure) at the group's end
    bool known = false;
    for (const auto& c : group.comms)
      known = known || c == state;
    if (!known) group.comms.push_back(state);
  }
  void* native = stream.native_handle();
  return StreamAccess::submit_device(
      stream, what,
      [&] {
        std::lock_guard<std::mutex> lock(state->m);
        state->require_usable_locked(what);
        call(state->comm, static_cast<cudaStream_t>(native), what, in_group);
      },
      timeout_s_, std::move(watch), in_group ? &group.ops : nullptr);
}

namespace {

void require_buffers(bool ok, const std::string& op, const std::string& name) {
  if (!ok) throw InvalidArgument(op + " on communicator '" + name + "': null buffer");
}

}  // namespace

Work NcclCommunicator::all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                                  Stream& stream) {
  const std::size_t bytes = count * dtype_size(dtype);
  require_buffers(count == 0 || (send && recv), "all_gather", name_);
  const auto* slot = static_cast<const char*>(recv) + static_cast<std::size_t>(rank_) * bytes;
  if (send != slot && count > 0 && overlaps(send, bytes, recv, bytes * size_))
    throw InvalidArgument("all_gather on communicator '" + name_ +
                          "': send overlaps recv but is not this rank's slot "
                          "(recv + rank*count) for an in-place all-gather");
  const ncclDataType_t t = nccl_dtype(dtype);
  auto state = state_;
  return launch("all_gather", count, dtype, stream,
                [=](ncclComm_t c, cudaStream_t s, const LazyLabel& what, bool in_group) {
                  state->finish_call_locked(ncclAllGather(send, recv, count, t, c, s),
                                            "ncclAllGather", what, in_group);
                });
}

namespace {

// The reduce-scatter argument checks (NCCL's in-place convention: recv == send + rank*chunk).
void check_reduce_scatter(const void* send, const void* recv, std::size_t recv_count, DType dtype,
                          int rank, int size, const std::string& name) {
  const std::size_t bytes = recv_count * dtype_size(dtype);
  require_buffers(recv_count == 0 || (send && recv), "reduce_scatter", name);
  const char* slot = static_cast<const char*>(send) + static_cast<std::size_t>(rank) * bytes;
  if (recv != slot && recv_count > 0 &&
      overlaps(send, bytes * static_cast<std::size_t>(size), recv, bytes))
    throw InvalidArgument("reduce_scatter on communicator '" + name +
                          "': recv overlaps send but is not this rank's chunk "
                          "(send + rank*recv_count) for an in-place reduce-scatter");
}

void require_no_group(bool in_group, const std::string& what) {
  if (in_group)
    throw InvalidArgument(what +
                          ": the sum-then-divide path cannot run inside an NCCL group (its "
                          "divide kernel would run before the group's collectives); issue it "
                          "outside the group or use DivideMode::pre_mul_sum");
}

}  // namespace

Work NcclCommunicator::reduce_scatter(const void* send, void* recv, std::size_t recv_count,
                                      DType dtype, ReduceOp op, Stream& stream) {
  check_reduce_scatter(send, recv, recv_count, dtype, rank_, size_, name_);
  bool native_avg = false;
  const ncclRedOp_t nop = nccl_op(op, &native_avg);
  const bool divide = op == ReduceOp::avg && !native_avg;
  if (divide) require_no_group(NcclGroup::depth() > 0, "reduce_scatter(avg) on '" + name_ + "'");
  const ncclDataType_t t = nccl_dtype(dtype);
  auto state = state_;
  const int size = size_;
  return launch("reduce_scatter", recv_count, dtype, stream,
                [=](ncclComm_t c, cudaStream_t s, const LazyLabel& what, bool in_group) {
                  state->finish_call_locked(ncclReduceScatter(send, recv, recv_count, t, nop, c, s),
                                            "ncclReduceScatter", what, in_group);
                  if (divide) device_divide(recv, recv_count, dtype, size, s);
                });
}

Work NcclCommunicator::reduce_scatter_divided(const void* send, void* recv, std::size_t recv_count,
                                              DType dtype, double divide_factor, Stream& stream,
                                              DivideMode mode) {
  if (!(divide_factor > 0.0) || !std::isfinite(divide_factor))
    throw InvalidArgument("reduce_scatter on communicator '" + name_ + "': divide factor " +
                          std::to_string(divide_factor) + " is not a positive finite number");
  check_reduce_scatter(send, recv, recv_count, dtype, rank_, size_, name_);
  const ncclDataType_t t = nccl_dtype(dtype);
  auto state = state_;
#if FULLSHARD_NCCL_HAS_PREMULSUM
  const bool pre_mul = mode == DivideMode::pre_mul_sum;
#else
  const bool pre_mul = false;  // NCCL < 2.11: no ncclRedOpCreatePreMulSum
  (void)mode;
#endif
  if (!pre_mul)
    require_no_group(NcclGroup::depth() > 0, "reduce_scatter(sum_then_scale) on '" + name_ + "'");
  const auto scalar = nccl_scalar(dtype, 1.0 / divide_factor);
  return launch(
      pre_mul ? "reduce_scatter(pre_mul_sum)" : "reduce_scatter(sum_then_scale)", recv_count, dtype,
      stream, [=](ncclComm_t c, cudaStream_t s, const LazyLabel& what, bool in_group) {
#if FULLSHARD_NCCL_HAS_PREMULSUM
        if (pre_mul) {
          ncclRedOp_t op;
          auto value = scalar;  // ncclScalarHostImmediate: read during the call
          state->finish_call_locked(
              ncclRedOpCreatePreMulSum(&op, value.data(), t, ncclScalarHostImmediate, c),
              "ncclRedOpCreatePreMulSum", what, false);
          const ncclResult_t r = ncclReduceScatter(send, recv, recv_count, t, op, c, s);
          if (r != ncclSuccess && r != ncclInProgress) ncclRedOpDestroy(op, c);
          // A non-blocking enqueue still in progress reads the op: destroyed once it is done.
          state->finish_call_locked(r, "ncclReduceScatter", what, in_group);
          if (state->comm) ncclRedOpDestroy(op, state->comm);
          return;
        }
#endif
        state->finish_call_locked(ncclReduceScatter(send, recv, recv_count, t, ncclSum, c, s),
                                  "ncclReduceScatter", what, in_group);
        device_divide(recv, recv_count, dtype, divide_factor, s);
      });
}

Work NcclCommunicator::all_reduce(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op, Stream& stream) {
  const std::size_t bytes = count * dtype_size(dtype);
  require_buffers(count == 0 || (send && recv), "all_reduce", name_);
  if (send != recv && count > 0 && overlaps(send, bytes, recv, bytes))
    throw InvalidArgument("all_reduce on communicator '" + name_ +
                          "': send and recv overlap without being equal");
  bool native_avg = false;
  const ncclRedOp_t nop = nccl_op(op, &native_avg);
  const bool divide = op == ReduceOp::avg && !native_avg;
  if (divide) require_no_group(NcclGroup::depth() > 0, "all_reduce(avg) on '" + name_ + "'");
  const ncclDataType_t t = nccl_dtype(dtype);
  auto state = state_;
  const int size = size_;
  return launch("all_reduce", count, dtype, stream,
                [=](ncclComm_t c, cudaStream_t s, const LazyLabel& what, bool in_group) {
                  state->finish_call_locked(ncclAllReduce(send, recv, count, t, nop, c, s),
                                            "ncclAllReduce", what, in_group);
                  if (divide) device_divide(recv, count, dtype, size, s);
                });
}

Work NcclCommunicator::broadcast(void* buffer, std::size_t count, DType dtype, int root,
                                 Stream& stream) {
  if (root < 0 || root >= size_)
    throw InvalidArgument("broadcast on communicator '" + name_ + "': root " +
                          std::to_string(root) + " is not in [0, " + std::to_string(size_) + ")");
  require_buffers(count == 0 || buffer, "broadcast", name_);
  const ncclDataType_t t = nccl_dtype(dtype);
  auto state = state_;
  return launch("broadcast", count, dtype, stream,
                [=](ncclComm_t c, cudaStream_t s, const LazyLabel& what, bool in_group) {
                  state->finish_call_locked(ncclBroadcast(buffer, buffer, count, t, root, c, s),
                                            "ncclBroadcast", what, in_group);
                });
}

// A send and a receive per peer in one NCCL group (NCCL has no all-to-all call).
Work NcclCommunicator::all_to_all(const void* send, void* recv, std::size_t count, DType dtype,
                                  Stream& stream) {
  const std::size_t bytes = count * dtype_size(dtype);
  require_buffers(count == 0 || (send && recv), "all_to_all", name_);
  if (count > 0 && overlaps(send, bytes * static_cast<std::size_t>(size_), recv,
                            bytes * static_cast<std::size_t>(size_)))
    throw InvalidArgument("all_to_all on communicator '" + name_ + "': send and recv overlap");
  const ncclDataType_t t = nccl_dtype(dtype);
  const int size = size_;
  auto state = state_;
  return launch("all_to_all", count, dtype, stream,
                [=](ncclComm_t c, cudaStream_t s, const LazyLabel& what, bool in_group) {
                  ncclResult_t r = ncclGroupStart();
                  for (int q = 0; q < size && r == ncclSuccess; ++q) {
                    const std::size_t at = static_cast<std::size_t>(q) * bytes;
                    r = ncclSend(static_cast<const char*>(send) + at, count, t, q, c, s);
                    if (r == ncclSuccess)
                      r = ncclRecv(static_cast<char*>(recv) + at, count, t, q, c, s);
                  }
                  const ncclResult_t end = ncclGroupEnd();
                  state->finish_call_locked(r != ncclSuccess ? r : end,
                                            r != ncclSuccess ? "ncclSend/ncclRecv" : "ncclGroupEnd",
                                            what, in_group);
                });
}

Work NcclCommunicator::barrier(Stream& stream) {
  auto state = state_;
  void* word = state_ ? state_->scratch : nullptr;
  return launch("barrier", 1, DType::f32, stream,
                [=](ncclComm_t c, cudaStream_t s, const LazyLabel& what, bool in_group) {
                  state->finish_call_locked(
                      ncclAllReduce(word, word, 1, ncclFloat32, ncclSum, c, s),
                      "ncclAllReduce (barrier)", what, in_group);
                });
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::split_impl(int color, int key,
                                                               const std::string& name) const {
  const std::string context = "splitting " + (state_ ? state_->what : name_) + " into '" + name +
                              "' (color " + std::to_string(color) + ", key " + std::to_string(key) +
                              ")";
  if (!state_) throw InvalidArgument(context + ": the communicator was moved from");
  if (group_state().depth > 0)
    throw InvalidArgument(context + ": not allowed inside an NCCL group");
#if FULLSHARD_NCCL_HAS_SPLIT
  auto child = std::make_shared<NcclCommState>();
  child->blocking = options_.blocking;
  child->timeout_s = timeout_s_;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = options_.blocking ? 1 : 0;
  {
    std::lock_guard<std::mutex> lock(state_->m);
    state_->require_usable_locked(context);
    const ncclResult_t r = ncclCommSplit(state_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key,
                                         &child->comm, &config);
    // Non-blocking: both the parent and the child are in progress until the split finished.
    const WaitSite at = state_->site("ncclCommSplit", 0, "into '" + name + "'");
    try {
      if (r == ncclInProgress && child->comm)
        state_->complete_locked(r, child->comm, at, kNcclInitTimeoutHint);
      state_->complete_locked(r, state_->comm, at, kNcclInitTimeoutHint);
    } catch (...) {  // the parent was aborted: so is the child
      if (child->comm) ncclCommAbort(child->comm);
      child->comm = nullptr;
      throw;
    }
  }
  if (color < 0 || !child->comm) return nullptr;
  int rank = 0;
  int size = 1;
  nccl_check(ncclCommUserRank(child->comm, &rank), "ncclCommUserRank", context);
  nccl_check(ncclCommCount(child->comm, &size), "ncclCommCount", context);
  child->name = name;
  child->rank = rank;
  child->size = size;
  child->what = label(name, rank, size);
  cuda_check(cudaMalloc(&child->scratch, sizeof(float)), "cudaMalloc", context + " (barrier word)");
  cuda_check(cudaMemset(child->scratch, 0, sizeof(float)), "cudaMemset",
             context + " (barrier word)");
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(std::move(child), name, rank, size, timeout_s_, options_));
#else
  throw CommError(context + ": needs ncclCommSplit (NCCL >= 2.18); this build has NCCL " +
                  std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR));
#endif
}

std::unique_ptr<Communicator> NcclCommunicator::dup(const std::string& name) const {
  return split_impl(0, rank_, name);
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key,
                                                      const std::string& name) const {
  return split_impl(color, key, name);
}

Traffic NcclCommunicator::traffic() const noexcept {
  Traffic t;
  t.all_gather = (*traffic_)[0].load();
  t.reduce_scatter = (*traffic_)[1].load();
  t.all_reduce = (*traffic_)[2].load();
  t.broadcast = (*traffic_)[3].load();
  t.all_to_all = (*traffic_)[4].load();
  return t;
}

// ---- NcclGroup --------------------------------------------------------------------------------

NcclGroup::NcclGroup() {
  nccl_check(ncclGroupStart(), "ncclGroupStart", "opening an NCCL group");
  ++group_state().depth;
  open_ = true;
}

NcclGroup::NcclGroup(NcclGroup&& other) noexcept : open_(other.open_) {
  other.open_ = false;
}

NcclGroup::~NcclGroup() {
  try {
    end();
  } catch (...) {  // stored in the group's Works; end() reports it to callers who ask
  }
}

int NcclGroup::depth() noexcept {
  return group_state().depth;
}

void NcclGroup::end() {
  if (!open_) return;
  open_ = false;
  GroupState& g = group_state();
  const ncclResult_t r = ncclGroupEnd();
  --g.depth;
  if (g.depth > 0) {  // an inner group: NCCL launches at the outermost end
    nccl_check(r, "ncclGroupEnd", "closing a nested NCCL group", true);
    return;
  }
  std::vector<DeferredDevice> ops = std::move(g.ops);
  std::vector<std::shared_ptr<NcclCommState>> comms = std::move(g.comms);
  g.ops.clear();
  g.comms.clear();
  const std::string context = "NCCL group of " + std::to_string(ops.size()) + " operations";
  std::exception_ptr error;
  try {
    if (r == ncclInProgress) {
      for (const auto& c : comms) {
        std::lock_guard<std::mutex> lock(c->m);
        if (c->comm && !c->blocking)
          c->complete_locked(r, c->comm, c->site("ncclGroupEnd", 0, context));
      }
    } else if (r != ncclSuccess) {
      const std::string why =
          context + ": ncclGroupEnd failed: " + nccl_error_message(r, "ncclGroupEnd");
      for (const auto& c : comms)
        c->abort(why);
      throw CommError(why);
    }
  } catch (...) {
    error = std::current_exception();
  }
  for (auto& op : ops)
    StreamAccess::finish_deferred(op, error);
  if (error) std::rethrow_exception(error);
}

}  // namespace fullshard::comm
