// MPI traffic outside the library's collectives (the checkpoint layer's control messages, a
// simulation's halo exchange, an application's own agreements) under the library's one
// timeout mechanism (fullshard/base/deadline.hpp): every operation is nonblocking and
// completed by the bounded wait, so a rank that stops, dies or never calls makes the others
// abort after FULLSHARD_TIMEOUT with the common message,
//
//   fullshard[rank 1]: halo exchange (down) on communicator 'heat.sim' (rank 1/3, seq 868,
//   to rank 2, from rank 0) did not finish within FULLSHARD_TIMEOUT=3 s; <hint>. Aborting.
//
// instead of hanging. first_difference() is the ranks' one fingerprint agreement.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/base/deadline.hpp"

namespace fullshard {

/// A communicator whose operations are bounded by `timeout_s` (> 0; 0: unbounded). Each
/// operation takes the next sequence number, as the library's communicators do. `hint` ends
/// the timeout message (what the other ranks are probably doing); `where` names the
/// communicator in it (default: "communicator '<name>'").
class BoundedComm {
 public:
  /// Over `comm`, not owned.
  BoundedComm(MPI_Comm comm, std::string name, double timeout_s,
              std::string hint = kCollectiveTimeoutHint, std::string where = {});
  /// Over a private duplicate of `parent` (MPI_Comm_idup, bounded: its timeout message is the
  /// first operation's), freed on destruction (unless MPI is finalized by then). Collective
  /// over `parent`.
  static std::unique_ptr<BoundedComm> duplicate(MPI_Comm parent, std::string name, double timeout_s,
                                                std::string hint = kCollectiveTimeoutHint,
                                                std::string where = {});
  BoundedComm(const BoundedComm&) = delete;
  BoundedComm& operator=(const BoundedComm&) = delete;
  ~BoundedComm();

  MPI_Comm get() const noexcept { return comm_; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  double timeout_s() const noexcept { return timeout_s_; }
  const std::string& name() const noexcept { return name_; }
  /// How timeout messages name this communicator.
  const std::string& where() const noexcept { return where_; }

  /// Starts one nonblocking operation (`start(MPI_Request*)` returns the MPI call's error
  /// code) and waits for it, e.g. MPI_Igather. `peer`: the other rank of a point-to-point
  /// operation (named in the timeout message), -1: none.
  template <class Start>
  void run(const char* what, Start&& start, int peer = -1) {
    MPI_Request r = MPI_REQUEST_NULL;
    check(start(&r), "starting it", what);
    wait(r, what, peer);
  }
  /// MPI_Iallreduce in place.
  void allreduce(void* inout, int count, MPI_Datatype type, MPI_Op op, const char* what);
  /// MPI_Iallreduce of one int; returns the result.
  int allreduce(int value, MPI_Op op, const char* what);
  /// MPI_Ibcast.
  void bcast(void* data, int count, MPI_Datatype type, int root, const char* what);
  /// Broadcasts a string of any length from `root`.
  void bcast(std::string& s, int root, const char* what);
  /// MPI_Irecv from `source` and MPI_Isend to `dest` (either MPI_PROC_NULL), waited together
  /// (MPI_Sendrecv without blocking past the timeout).
  void sendrecv(const void* send, int send_count, int dest, int send_tag, void* recv,
                int recv_count, int source, int recv_tag, MPI_Datatype type, const char* what);
  /// Waits for `request` (an operation started on this communicator elsewhere).
  void wait(MPI_Request& request, const char* what, int peer = -1);
  /// Waits until a message from `source` with `tag` can be received (MPI_Iprobe polls).
  MPI_Status probe(int source, int tag, const char* what);
  /// MPI_Irecv of a message known to be there (after probe), waited for.
  void recv(void* data, int count, MPI_Datatype type, int source, int tag, const char* what);

  /// A duplicate of `comm` (MPI_Comm_idup, bounded); the caller frees it.
  static MPI_Comm dup(MPI_Comm comm, const std::string& name, double timeout_s,
                      const std::string& hint = kCollectiveTimeoutHint);
  /// MPI_Comm_split of `comm` (blocking in MPI: run under a Watchdog); the caller frees it.
  static MPI_Comm split(MPI_Comm comm, int color, int key, const std::string& name,
                        double timeout_s, const std::string& hint = kCollectiveTimeoutHint);
  /// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) of `comm`: the ranks on this node (under a
  /// Watchdog, as split); the caller frees it.
  static MPI_Comm split_node(MPI_Comm comm, const std::string& name, double timeout_s,
                             const std::string& hint = kCollectiveTimeoutHint);

 private:
  WaitSite site(const char* what, std::string detail = {});
  void check(int rc, const char* call, const char* what) const;

  MPI_Comm comm_;
  bool owned_ = false;
  std::string name_;
  std::string where_;
  std::string hint_;
  int rank_ = 0;
  int size_ = 1;
  double timeout_s_;
  std::uint64_t seq_ = 0;
};

inline constexpr std::size_t kNoDifference = static_cast<std::size_t>(-1);

/// The ranks' fingerprint agreement: compares `items` (one text per entry, in the same order
/// on every rank) across the ranks of `comm`: an MPI_Iallreduce (MPI_MAX) of the count and
/// then of a 64-bit hash of every entry, each with its complement (min and max at once).
/// Returns kNoDifference when every rank has the same entries, 0 when the counts differ, else
/// 1 + the index of the first differing entry; the same on every rank. Collective.
std::size_t first_difference(BoundedComm& comm, const std::vector<std::string>& items,
                             const char* what);

}  // namespace fullshard
