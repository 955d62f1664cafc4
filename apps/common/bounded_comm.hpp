// The apps' own MPI traffic under the library's one timeout mechanism
// (fullshard/base/deadline.hpp): every operation is nonblocking and completed by the bounded
// wait, so a rank that stops, dies or was started with other options makes the others abort
// after FULLSHARD_TIMEOUT with the common message,
//
//   fullshard[rank 1]: halo exchange (down) on communicator 'heat.sim' (rank 1/3, seq 868,
//   to rank 2, from rank 0) did not finish within FULLSHARD_TIMEOUT=3 s; another rank is
//   not taking part (stopped, stuck, failed, or started with other options). Aborting the job.
//
// instead of hanging. agree_on_options() compares the ranks' options before any other traffic.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fullshard/base/deadline.hpp"

namespace fullshard::apps {

/// The hint of the apps' timeout messages.
inline constexpr const char* kAppTimeoutHint =
    "another rank is not taking part (stopped, stuck, failed, or started with other options)";

/// A communicator (not owned) whose operations are bounded by `timeout_s` (> 0; 0: unbounded).
/// Each operation takes the next sequence number, as the library's communicators do.
class BoundedComm {
 public:
  BoundedComm(MPI_Comm comm, std::string name, double timeout_s);
  BoundedComm(const BoundedComm&) = delete;
  BoundedComm& operator=(const BoundedComm&) = delete;
  ~BoundedComm();

  MPI_Comm get() const noexcept { return comm_; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  double timeout_s() const noexcept { return timeout_s_; }
  const std::string& name() const noexcept { return name_; }

  /// Starts one nonblocking operation (`start(MPI_Request*)` returns the MPI call's error
  /// code) and waits for it: any collective, e.g. MPI_Igather.
  template <class Start>
  void run(const char* what, Start&& start) {
    MPI_Request r = MPI_REQUEST_NULL;
    check(start(&r), "starting it", what);
    wait(r, what);
  }
  /// MPI_Iallreduce in place.
  void allreduce(void* inout, int count, MPI_Datatype type, MPI_Op op, const char* what);
  /// MPI_Ibcast.
  void bcast(void* data, int count, MPI_Datatype type, int root, const char* what);
  /// MPI_Irecv from `source` and MPI_Isend to `dest` (either MPI_PROC_NULL), waited together
  /// (MPI_Sendrecv without blocking past the timeout).
  void sendrecv(const void* send, int send_count, int dest, int send_tag, void* recv,
                int recv_count, int source, int recv_tag, MPI_Datatype type, const char* what);
  /// Waits for `request` (an operation this communicator started elsewhere; `peer`: the other
  /// rank of a point-to-point operation, -1: none).
  void wait(MPI_Request& request, const char* what, int peer = -1);
  /// Waits until a message from `source` with `tag` can be received (MPI_Iprobe polls).
  MPI_Status probe(int source, int tag, const char* what);
  /// MPI_Irecv of a message known to be there (after probe), waited for.
  void recv(void* data, int count, MPI_Datatype type, int source, int tag, const char* what);

  /// A duplicate of `comm` (MPI_Comm_idup, bounded); the caller frees it.
  static MPI_Comm dup(MPI_Comm comm, const std::string& name, double timeout_s);
  /// MPI_Comm_split of `comm` (blocking in MPI: run under a Watchdog); the caller frees it.
  static MPI_Comm split(MPI_Comm comm, int color, int key, const std::string& name,
                        double timeout_s);
  /// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) of `comm`: the ranks on this node (blocking
  /// in MPI: run under a Watchdog, as split); the caller frees it.
  static MPI_Comm split_node(MPI_Comm comm, const std::string& name, double timeout_s);

 private:
  WaitSite site(const char* what, std::string detail = {});
  void check(int rc, const char* call, const char* what) const;

  MPI_Comm comm_;
  std::string name_;
  std::string where_;
  int rank_ = 0;
  int size_ = 1;
  double timeout_s_;
  std::uint64_t seq_ = 0;
};

/// One option as the apps compare it across ranks: the flag and its value as text.
using OptionValue = std::pair<std::string, std::string>;

/// Ranks were started with different options (thrown on every rank by agree_on_options).
struct OptionMismatch {
  std::string flag;
  std::string message;
};

/// Compares `options` (the same flags in the same order on every rank) across the ranks of
/// `world`: one MPI_Iallreduce (MPI_MAX) of a 64-bit hash of each value and of its complement
/// (so min and max in one operation), under the timeout. When any value differs, every rank
/// throws OptionMismatch naming the first differing flag and its own value. Collective.
void agree_on_options(BoundedComm& world, const std::vector<OptionValue>& options);

/// 64-bit FNV-1a hash of `s`.
std::uint64_t fnv1a(const std::string& s) noexcept;

}  // namespace fullshard::apps
