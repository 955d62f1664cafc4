// Helpers shared by the test programs.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "fullshard/runtime/runtime.hpp"
#include "fullshard/tensor/sharding.hpp"

namespace fullshard::test {

/// The Runtime created by the test main.
const Runtime& runtime();

inline int world_rank() {
  return runtime().rank();
}
inline int world_size() {
  return runtime().world_size();
}

/// True on every rank if `ok` is true on every rank (so all ranks take the same branch).
inline bool all_ranks(bool ok) {
  int v = ok ? 1 : 0;
  int all = 0;
  MPI_Allreduce(&v, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

/// A salt for sample() from a name (a parameter's FQN): different names, different values.
inline int name_salt(const std::string& name) {
  int h = 7;
  for (char c : name)
    h = (h * 31 + static_cast<unsigned char>(c)) % 1000;
  return h;
}

/// A deterministic, non-trivial value for (rank, index, salt): integers in [-64, 64) scaled by
/// a power of two, so sums over a few ranks are exact in every dtype when `exact` is true,
/// and spread-out non-integers otherwise.
inline double sample(int rank, std::size_t i, int salt, bool exact) {
  std::uint64_t x = (static_cast<std::uint64_t>(rank) + 1) * 0x9E3779B97F4A7C15ull ^
                    (static_cast<std::uint64_t>(i) + 17) * 0xBF58476D1CE4E5B9ull ^
                    static_cast<std::uint64_t>(salt) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 29;
  const double v = static_cast<double>(static_cast<std::int64_t>(x % 128) - 64);
  return exact ? v * 0.25 : v * 0.37 + static_cast<double>(x % 1000) * 1e-3;
}

/// Row-major index in the full tensor of element `e` of a rank's shard with layout `l`.
inline std::int64_t global_index(const ShardLayout& l, std::int64_t e) {
  const std::size_t n = l.local_shape.size();
  std::vector<std::int64_t> idx(n);
  for (std::size_t d = n; d-- > 0;) {
    idx[d] = e % l.local_shape[d];
    e /= l.local_shape[d];
  }
  std::int64_t g = 0;
  for (std::size_t d = 0; d < n; ++d)
    g = g * l.global_shape[d] + idx[d] + l.global_offset[d];
  return g;
}

/// A directory every rank of MPI_COMM_WORLD shares (made by rank 0 under /tmp, its name
/// broadcast), removed at the end. Collective: every rank constructs and destroys it.
class SharedTempDir {
 public:
  explicit SharedTempDir(const std::string& prefix) {
    char buf[256] = {};
    if (world_rank() == 0) {
      std::string tmpl = "/tmp/" + prefix + "-XXXXXX";
      if (mkdtemp(tmpl.data())) tmpl.copy(buf, sizeof buf - 1);
    }
    MPI_Bcast(buf, sizeof buf, MPI_CHAR, 0, MPI_COMM_WORLD);
    path = buf;
    if (path.empty()) throw std::runtime_error("SharedTempDir: mkdtemp failed under /tmp");
  }
  SharedTempDir(const SharedTempDir&) = delete;
  SharedTempDir& operator=(const SharedTempDir&) = delete;
  ~SharedTempDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    std::error_code ec;
    if (world_rank() == 0) std::filesystem::remove_all(path, ec);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  std::string path;
};

}  // namespace fullshard::test
