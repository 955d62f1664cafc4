#include "bounded_comm.hpp"

#include "fullshard/base/hash.hpp"

#include "fullshard/base/error.hpp"
#include "fullshard/base/mpi_wait.hpp"

namespace fullshard::apps {

BoundedComm::BoundedComm(MPI_Comm comm, std::string name, double timeout_s)
    : comm_(comm),
      name_(std::move(name)),
      where_("communicator '" + name_ + "'"),
      timeout_s_(timeout_s) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

BoundedComm::~BoundedComm() = default;

WaitSite BoundedComm::site(const char* what, std::string detail) {
  return WaitSite{what, where_, rank_, size_, ++seq_, std::move(detail)};
}

void BoundedComm::check(int rc, const char* call, const char* what) const {
  if (rc != MPI_SUCCESS)
    throw CommError(std::string(what) + " on " + where_ + ": " + call +
                    " failed: " + mpi_error_text(rc));
}

void BoundedComm::allreduce(void* inout, int count, MPI_Datatype type, MPI_Op op,
                            const char* what) {
  MPI_Request r = MPI_REQUEST_NULL;
  check(MPI_Iallreduce(MPI_IN_PLACE, inout, count, type, op, comm_, &r), "MPI_Iallreduce", what);
  wait_mpi(r, site(what), timeout_s_, kAppTimeoutHint);
}

void BoundedComm::bcast(void* data, int count, MPI_Datatype type, int root, const char* what) {
  MPI_Request r = MPI_REQUEST_NULL;
  check(MPI_Ibcast(data, count, type, root, comm_, &r), "MPI_Ibcast", what);
  wait_mpi(r, site(what, "root " + std::to_string(root)), timeout_s_, kAppTimeoutHint);
}

void BoundedComm::sendrecv(const void* send, int send_count, int dest, int send_tag, void* recv,
                           int recv_count, int source, int recv_tag, MPI_Datatype type,
                           const char* what) {
  MPI_Request r[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  check(MPI_Irecv(recv, recv_count, type, source, recv_tag, comm_, &r[0]), "MPI_Irecv", what);
  const int rc = MPI_Isend(send, send_count, type, dest, send_tag, comm_, &r[1]);
  if (rc != MPI_SUCCESS) {
    MPI_Cancel(&r[0]);
    MPI_Request_free(&r[0]);
    check(rc, "MPI_Isend", what);
  }
  auto peer = [](int p) { return p == MPI_PROC_NULL ? std::string("none") : std::to_string(p); };
  wait_mpi_all(2, r, site(what, "to rank " + peer(dest) + ", from rank " + peer(source)),
               timeout_s_, kAppTimeoutHint);
}

void BoundedComm::wait(MPI_Request& request, const char* what, int peer) {
  wait_mpi(request, site(what, peer >= 0 ? "with rank " + std::to_string(peer) : std::string()),
           timeout_s_, kAppTimeoutHint);
}

MPI_Status BoundedComm::probe(int source, int tag, const char* what) {
  MPI_Status status{};
  BoundedWait wait(site(what, "from rank " + std::to_string(source)), timeout_s_);
  wait.hint(kAppTimeoutHint).poll([&] {
    int found = 0;
    check(MPI_Iprobe(source, tag, comm_, &found, &status), "MPI_Iprobe", what);
    return found != 0;
  });
  return status;
}

void BoundedComm::recv(void* data, int count, MPI_Datatype type, int source, int tag,
                       const char* what) {
  MPI_Request r = MPI_REQUEST_NULL;
  check(MPI_Irecv(data, count, type, source, tag, comm_, &r), "MPI_Irecv", what);
  wait(r, what, source);
}

MPI_Comm BoundedComm::dup(MPI_Comm comm, const std::string& name, double timeout_s) {
  BoundedComm parent(comm, name, timeout_s);
  MPI_Comm out = MPI_COMM_NULL;
  MPI_Request r = MPI_REQUEST_NULL;
  parent.check(MPI_Comm_idup(comm, &out, &r), "MPI_Comm_idup", "duplicating");
  wait_mpi(r, parent.site("MPI_Comm_idup"), timeout_s, kAppTimeoutHint);
  return out;
}

MPI_Comm BoundedComm::split(MPI_Comm comm, int color, int key, const std::string& name,
                            double timeout_s) {
  BoundedComm parent(comm, name, timeout_s);
  MPI_Comm out = MPI_COMM_NULL;
  // No nonblocking form: a watchdog thread aborts the job if the call stays past the timeout.
  const std::string what =
      parent.site("MPI_Comm_split", "color " + std::to_string(color)).describe();
  Watchdog dog;
  dog.arm(what, timeout_s, kAppTimeoutHint);
  const int rc = MPI_Comm_split(comm, color, key, &out);
  dog.disarm();
  parent.check(rc, "MPI_Comm_split", "splitting");
  return out;
}

MPI_Comm BoundedComm::split_node(MPI_Comm comm, const std::string& name, double timeout_s) {
  BoundedComm parent(comm, name, timeout_s);
  MPI_Comm out = MPI_COMM_NULL;
  const std::string what = parent.site("MPI_Comm_split_type", "shared memory").describe();
  Watchdog dog;
  dog.arm(what, timeout_s, kAppTimeoutHint);
  const int rc =
      MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, parent.rank(), MPI_INFO_NULL, &out);
  dog.disarm();
  parent.check(rc, "MPI_Comm_split_type", "splitting by node");
  return out;
}

std::uint64_t fnv1a(const std::string& s) noexcept {
  return fullshard::fnv1a64(s);
}

void agree_on_options(BoundedComm& world, const std::vector<OptionValue>& options) {
  // [count, hash..., ~count, ~hash...] under MPI_MAX: the max of each entry and the complement
  // of its min. (One program gives the same number of options on every rank.)
  const std::size_t n = options.size() + 1;
  std::vector<std::uint64_t> v(2 * n);
  v[0] = options.size();
  for (std::size_t i = 0; i < options.size(); ++i)
    v[i + 1] = fnv1a(options[i].first + '\0' + options[i].second);
  for (std::size_t i = 0; i < n; ++i)
    v[n + i] = ~v[i];
  world.allreduce(v.data(), static_cast<int>(v.size()), MPI_UINT64_T, MPI_MAX,
                  "comparing the options of every rank");
  for (std::size_t i = 0; i < n; ++i) {
    if (v[i] == ~v[n + i]) continue;  // max == min: the same on every rank
    if (i == 0)
      throw OptionMismatch{"", "the ranks were started with different numbers of options"};
    const OptionValue& o = options[i - 1];
    throw OptionMismatch{o.first, o.first + " differs between ranks (this rank: " + o.first + " " +
                                      o.second + "); start every rank with the same options"};
  }
}

}  // namespace fullshard::apps
