// The apps' own MPI traffic under the library's one timeout mechanism
// (fullshard/base/bounded_comm.hpp): every operation is nonblocking and completed by the
// bounded wait, so a rank that stops, dies or was started with other options makes the others
// abort after FULLSHARD_TIMEOUT with the common message,
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

#include "fullshard/base/bounded_comm.hpp"

namespace fullshard::apps {

/// The hint of the apps' timeout messages.
inline constexpr const char* kAppTimeoutHint =
    "another rank is not taking part (stopped, stuck, failed, or started with other options)";

/// The library's bounded communicator (fullshard/base/bounded_comm.hpp) with the apps'
/// timeout hint.
class BoundedComm : public fullshard::BoundedComm {
 public:
  BoundedComm(MPI_Comm comm, std::string name, double timeout_s)
      : fullshard::BoundedComm(comm, std::move(name), timeout_s, kAppTimeoutHint) {}
  static MPI_Comm dup(MPI_Comm comm, const std::string& name, double timeout_s) {
    return fullshard::BoundedComm::dup(comm, name, timeout_s, kAppTimeoutHint);
  }
  static MPI_Comm split(MPI_Comm comm, int color, int key, const std::string& name,
                        double timeout_s) {
    return fullshard::BoundedComm::split(comm, color, key, name, timeout_s, kAppTimeoutHint);
  }
  static MPI_Comm split_node(MPI_Comm comm, const std::string& name, double timeout_s) {
    return fullshard::BoundedComm::split_node(comm, name, timeout_s, kAppTimeoutHint);
  }
};

/// One option as the apps compare it across ranks: the flag and its value as text.
using OptionValue = std::pair<std::string, std::string>;

/// Ranks were started with different options (thrown on every rank by agree_on_options).
struct OptionMismatch {
  std::string flag;
  std::string message;
};

/// Compares `options` (the same flags in the same order on every rank) across the ranks of
/// `world` (fullshard::first_difference, under the timeout). When any value differs, every
/// rank throws OptionMismatch naming the first differing flag and its own value. Collective.
void agree_on_options(fullshard::BoundedComm& world, const std::vector<OptionValue>& options);

}  // namespace fullshard::apps
