#include "fullshard/mesh/agreement.hpp"

#include <mpi.h>

#include <cstdint>

#include "fullshard/base/error.hpp"
#include "fullshard/base/hash.hpp"
#include "fullshard/base/mpi_wait.hpp"

namespace fullshard {

namespace {

// MPI_MAX of each value and of its complement: every rank learns min and max at once.
void allreduce_max(std::vector<std::uint64_t>& v, MPI_Comm comm, double timeout_s,
                   const std::string& what, int rank, int size) {
  MPI_Request r = MPI_REQUEST_NULL;
  const int rc = MPI_Iallreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_UINT64_T,
                                MPI_MAX, comm, &r);
  if (rc != MPI_SUCCESS)
    throw CommError("MPI_Iallreduce (" + what + ") failed: " + mpi_error_text(rc));
  WaitSite site;
  site.operation = "MPI_Iallreduce (" + what + ")";
  site.where = "the mesh's ranks";
  site.rank = rank;
  site.size = size;
  wait_mpi(r, site, timeout_s);
}

std::string bcast_text(std::string text, MPI_Comm comm, double timeout_s, int rank, int size) {
  std::uint64_t n = text.size();
  MPI_Request r = MPI_REQUEST_NULL;
  WaitSite site;
  site.operation = "MPI_Ibcast (configuration difference)";
  site.where = "the mesh's ranks";
  site.rank = rank;
  site.size = size;
  MPI_Ibcast(&n, 1, MPI_UINT64_T, 0, comm, &r);
  wait_mpi(r, site, timeout_s);
  text.resize(static_cast<std::size_t>(n));
  MPI_Ibcast(text.data(), static_cast<int>(n), MPI_CHAR, 0, comm, &r);
  wait_mpi(r, site, timeout_s);
  return text;
}

std::string clip(const std::string& s) {
  return s.size() <= 400 ? s : s.substr(0, 400) + "...";
}

}  // namespace

void agree_across_ranks(const DeviceMesh& mesh, const std::vector<std::string>& items,
                        const std::string& what) {
  if (mesh.size() <= 1) return;
  MPI_Comm comm = mesh.control_world();
  const int rank = mesh.rank();
  const int size = mesh.size();
  const double timeout = mesh.timeout_s();
  const std::string name = what + " fingerprint";

  std::vector<std::uint64_t> count = {items.size(), ~std::uint64_t(items.size())};
  allreduce_max(count, comm, timeout, name, rank, size);
  const std::uint64_t hi = count[0];
  const std::uint64_t lo = ~count[1];
  if (lo != hi)
    throw RankMismatch(
        what + " differs across ranks: rank " + std::to_string(rank) + " has " +
        std::to_string(items.size()) + " entries, other ranks between " + std::to_string(lo) +
        " and " + std::to_string(hi) +
        " (every rank must make the same declarations and calls; first entry here: " +
        (items.empty() ? std::string("none") : clip(items.front())) + ")");

  std::vector<std::uint64_t> h(2 * items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    h[2 * i] = fnv1a64(items[i]);
    h[2 * i + 1] = ~h[2 * i];
  }
  allreduce_max(h, comm, timeout, name, rank, size);
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (h[2 * i] == ~h[2 * i + 1]) continue;
    const std::string first =
        bcast_text(rank == 0 ? items[i] : std::string(), comm, timeout, rank, size);
    const std::string mine = items[i];
    throw RankMismatch(what + " differs across ranks (found before the first collective), entry " +
                       std::to_string(i) + ": rank 0 has \"" + clip(first) + "\"; rank " +
                       std::to_string(rank) +
                       (mine == first ? " agrees with rank 0, another rank differs"
                                      : " has \"" + clip(mine) + "\"") +
                       ". Every rank must make the same declarations (" + what + ")");
  }
}

}  // namespace fullshard
