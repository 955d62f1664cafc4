#include "lib/checkpoint/collective.hpp"

#include <algorithm>
#include <climits>

namespace fullshard::checkpoint::detail {

void check_mpi(int rc, const char* op) {
  if (rc != MPI_SUCCESS)
    throw CommError(std::string("checkpoint: ") + op + " failed: " + mpi_error_text(rc));
}

Comm::Comm(MPI_Comm parent, double timeout_s, std::string what)
    : timeout_s_(timeout_s), what_(std::move(what)) {
  MPI_Comm_rank(parent, &rank);
  MPI_Comm_size(parent, &size);
  run("MPI_Comm_idup", [&](MPI_Request* r) { return MPI_Comm_idup(parent, &c_, r); });
}

Comm::~Comm() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (c_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&c_);
}

int Comm::allreduce(int x, MPI_Op op, const char* name) const {
  int out = 0;
  run(name, [&](MPI_Request* r) { return MPI_Iallreduce(&x, &out, 1, MPI_INT, op, c_, r); });
  return out;
}

void Comm::bcast(void* data, int count, MPI_Datatype type, int root) const {
  run("MPI_Ibcast", [&](MPI_Request* r) { return MPI_Ibcast(data, count, type, root, c_, r); });
}

void Comm::wait(MPI_Request& r, const char* op, int peer) const {
  WaitSite site{op,   what_,  rank,
                size, ++seq_, peer >= 0 ? "with rank " + std::to_string(peer) : std::string()};
  wait_mpi(r, site, timeout_s_,
           "another rank is not taking part (it never called the checkpoint function, failed "
           "outside it, or is stuck)");
}

void bcast_string(const Comm& c, std::string& s, int root) {
  unsigned long long len = s.size();
  c.bcast(&len, 1, MPI_UNSIGNED_LONG_LONG, root);
  s.resize(static_cast<std::size_t>(len));
  for (std::size_t done = 0; done < s.size();) {
    const int n = static_cast<int>(std::min<std::size_t>(s.size() - done, INT_MAX / 2));
    c.bcast(s.data() + done, n, MPI_CHAR, root);
    done += static_cast<std::size_t>(n);
  }
}

void agree(const Comm& c, const std::exception_ptr& err, const char* what) {
  const int first =
      c.allreduce(err ? c.rank : c.size, MPI_MIN, "MPI_Iallreduce (agreeing on errors)");
  if (first == c.size) return;
  int type = 0;
  std::string msg;
  if (c.rank == first) {
    try {
      std::rethrow_exception(err);
    } catch (const InvalidArgument& e) {
      type = 1, msg = e.what();
    } catch (const ConfigError& e) {
      type = 2, msg = e.what();
    } catch (const CommError& e) {
      type = 3, msg = e.what();
    } catch (const std::exception& e) {
      msg = e.what();
    } catch (...) {
      msg = "unknown exception";
    }
  }
  c.bcast(&type, 1, MPI_INT, first);
  bcast_string(c, msg, first);
  if (c.rank == first) std::rethrow_exception(err);
  const std::string text = std::string(what) + " failed on another rank: " + msg;
  switch (type) {
    case 1:
      throw InvalidArgument(text);
    case 2:
      throw ConfigError(text);
    case 3:
      throw CommError(text);
    default:
      throw Error(text);
  }
}

}  // namespace fullshard::checkpoint::detail
