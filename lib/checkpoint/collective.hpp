// The collective plumbing of the checkpoint layer (private to lib/checkpoint): a private
// duplicate communicator whose every operation is nonblocking and bounded by the mesh's
// timeout, and agree(), which turns one rank's failure into the same exception on every rank.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <exception>
#include <string>
#include <utility>

#include "fullshard/base/error.hpp"
#include "fullshard/base/mpi_wait.hpp"

namespace fullshard::checkpoint::detail {

/// CommError naming the checkpoint operation `op` unless rc is MPI_SUCCESS.
void check_mpi(int rc, const char* op);

/// A private duplicate of a mesh communicator (so checkpoint traffic never meets a stream's).
/// Its operations are nonblocking MPI calls completed by wait() (fullshard::wait_mpi, the
/// library's one bounded wait): past `timeout_s` (> 0; 0 waits forever) it aborts the job like
/// the library's other collectives, naming the operation, `what`, this rank and the sequence
/// number.
class Comm {
 public:
  Comm(MPI_Comm parent, double timeout_s, std::string what);
  /// Frees the duplicate (unless MPI is already finalized: a save still in flight at exit).
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  MPI_Comm get() const noexcept { return c_; }
  const std::string& what() const noexcept { return what_; }

  /// Starts one nonblocking operation (`start` gets the request to fill) and waits for it.
  /// `peer`: the other rank of a point-to-point operation, for the timeout message.
  template <class Start>
  void run(const char* op, Start&& start, int peer = -1) const {
    MPI_Request r = MPI_REQUEST_NULL;
    check_mpi(start(&r), op);
    wait(r, op, peer);
  }

  int allreduce(int x, MPI_Op op, const char* name) const;
  void bcast(void* data, int count, MPI_Datatype type, int root) const;

  int rank = 0;
  int size = 1;

 private:
  void wait(MPI_Request& r, const char* op, int peer) const;

  MPI_Comm c_ = MPI_COMM_NULL;
  mutable std::uint64_t seq_ = 0;  // operations so far, for the timeout message
  double timeout_s_ = 0;
  std::string what_;
};

/// Broadcasts a string of any length from `root`.
void bcast_string(const Comm& c, std::string& s, int root);

/// Every rank throws if any rank has `err`: the first failing rank (lowest rank) its own
/// exception, every other rank the same type with that rank's message (so that all ranks
/// report the same problem, whatever else failed after it). `what` starts the message.
void agree(const Comm& c, const std::exception_ptr& err, const char* what);

/// Runs f and returns what it threw (null when nothing).
template <class F>
std::exception_ptr attempt(F&& f) {
  try {
    f();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

}  // namespace fullshard::checkpoint::detail
