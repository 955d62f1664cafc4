#include "lib/mesh/agreement.hpp"

#include "fullshard/base/bounded_comm.hpp"
#include "fullshard/base/error.hpp"

namespace fullshard {

namespace {

std::string clip(const std::string& s) {
  return s.size() <= 400 ? s : s.substr(0, 400) + "...";
}

}  // namespace

void agree_across_ranks(const DeviceMesh& mesh, const std::vector<std::string>& items,
                        const std::string& what) {
  if (mesh.size() <= 1) return;
  BoundedComm c(mesh.control_world(), "mesh", mesh.timeout_s(), kCollectiveTimeoutHint,
                "the mesh's ranks");
  const std::string name = "MPI_Iallreduce (" + what + " fingerprint)";
  const std::size_t d = first_difference(c, items, name.c_str());
  if (d == kNoDifference) return;
  const int rank = mesh.rank();
  if (d == 0) {
    // The ranks have different numbers of entries (a rank that could not read a file has
    // only its refusal): rank 0's count and first entry against the first rank that differs,
    // the same message on every rank.
    auto summary = [&] {
      return std::to_string(items.size()) + (items.size() == 1 ? " entry" : " entries") +
             ", the first \"" + (items.empty() ? std::string("none") : clip(items.front())) + "\"";
    };
    const std::string mine = summary();
    std::string first = rank == 0 ? mine : std::string();
    c.bcast(first, 0, "MPI_Ibcast (configuration difference)");
    const int other = c.allreduce(mine != first ? rank : mesh.size(), MPI_MIN,
                                  "MPI_Iallreduce (configuration difference)");
    std::string theirs = rank == other ? mine : std::string();
    if (other < mesh.size()) c.bcast(theirs, other, "MPI_Ibcast (configuration difference)");
    throw RankMismatch(what +
                       " differs across ranks (found before the first collective): rank 0 has " +
                       first + "; rank " + std::to_string(other) + " has " + theirs +
                       " (the first rank that differs). Every rank must make the same "
                       "declarations (" +
                       what + ")");
  }
  const std::size_t i = d - 1;
  std::string first = rank == 0 ? items[i] : std::string();
  c.bcast(first, 0, "MPI_Ibcast (configuration difference)");
  // The first rank that differs from rank 0 there, and its entry: the same message everywhere.
  const int other = c.allreduce(items[i] != first ? rank : mesh.size(), MPI_MIN,
                                "MPI_Iallreduce (configuration difference)");
  if (other >= mesh.size())  // the hashes differ but the texts do not (a hash collision)
    return;
  std::string theirs = rank == other ? items[i] : std::string();
  c.bcast(theirs, other, "MPI_Ibcast (configuration difference)");
  throw RankMismatch(what + " differs across ranks (found before the first collective), entry " +
                     std::to_string(i) + ": rank 0 has \"" + clip(first) + "\"; rank " +
                     std::to_string(other) + " has \"" + clip(theirs) +
                     "\" (the first rank that differs). Every rank must make the same "
                     "declarations (" +
                     what + ")");
}

}  // namespace fullshard
