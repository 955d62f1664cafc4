#include "fullshard/base/error.hpp"
#include "lib/base/abort.hpp"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>

namespace fullshard {
namespace detail {

int world_rank_or_minus_one() noexcept {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return -1;
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

namespace {
std::string prefixed(int rank, const std::string& what) {
  return "fullshard[rank " + (rank < 0 ? std::string("-") : std::to_string(rank)) + "]: " + what;
}
}  // namespace

void abort_job(const std::string& message, int code) noexcept {
  const int rank = world_rank_or_minus_one();
  std::fprintf(stderr, "%s\n", prefixed(rank, message).c_str());
  std::fflush(stderr);
  if (rank >= 0) MPI_Abort(MPI_COMM_WORLD, code);
  std::abort();
}

}  // namespace detail

Error::Error(const std::string& what)
    : std::runtime_error(detail::prefixed(detail::world_rank_or_minus_one(), what)),
      rank_(detail::world_rank_or_minus_one()),
      prefix_(detail::prefixed(rank_, std::string()).size()) {}

}  // namespace fullshard
