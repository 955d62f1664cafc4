// The collective plumbing of the checkpoint layer (private to lib/checkpoint): a private
// duplicate communicator whose every operation is nonblocking and bounded by the mesh's
// timeout (the library's BoundedComm), and agree(), which turns one rank's failure into the
// same exception on every rank.
#pragma once

#include <mpi.h>

#include <exception>
#include <memory>
#include <string>

#include "fullshard/base/bounded_comm.hpp"

namespace fullshard::checkpoint::detail {

using Comm = ::fullshard::BoundedComm;

/// A private duplicate of `parent` (so checkpoint traffic never meets a stream's) for the
/// checkpoint operation `what` (e.g. "checkpoint save of 'DIR'", named in timeout messages),
/// bounded by `timeout_s`. Collective over `parent`.
std::unique_ptr<Comm> checkpoint_comm(MPI_Comm parent, double timeout_s, const std::string& what);

/// Broadcasts a string of any length from `root`.
inline void bcast_string(Comm& c, std::string& s, int root) {
  c.bcast(s, root, "MPI_Ibcast");
}

/// Every rank throws if any rank has `err`: the first failing rank (lowest rank) its own
/// exception, every other rank the same type with that rank's message (so that all ranks
/// report the same problem, whatever else failed after it). `what` starts the message.
void agree(Comm& c, const std::exception_ptr& err, const char* what);

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
