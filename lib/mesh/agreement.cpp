#include "fullshard/mesh/agreement.hpp"

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
  if (d == 0)
    throw RankMismatch(what + " differs across ranks: rank " + std::to_string(rank) + " has " +
                       std::to_string(items.size()) +
                       " entries, another rank a different number (every rank must make the same "
                       "declarations and calls; first entry here: " +
                       (items.empty() ? std::string("none") : clip(items.front())) + ")");
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
