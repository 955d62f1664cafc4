#include "fullshard/base/bounded_comm.hpp"

#include <algorithm>
#include <climits>
#include <utility>

#include "fullshard/base/error.hpp"
#include "lib/base/hash.hpp"
#include "lib/base/mpi_wait.hpp"

namespace fullshard {

BoundedComm::BoundedComm(MPI_Comm comm, std::string name, double timeout_s, std::string hint,
                         std::string where)
    : comm_(comm),
      name_(std::move(name)),
      where_(where.empty() ? "communicator '" + name_ + "'" : std::move(where)),
      hint_(std::move(hint)),
      timeout_s_(timeout_s) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

std::unique_ptr<BoundedComm> BoundedComm::duplicate(MPI_Comm parent, std::string name,
                                                    double timeout_s, std::string hint,
                                                    std::string where) {
  BoundedComm from(parent, name, timeout_s, hint, where);
  MPI_Comm c = MPI_COMM_NULL;
  from.run("MPI_Comm_idup", [&](MPI_Request* r) { return MPI_Comm_idup(parent, &c, r); });
  auto out = std::make_unique<BoundedComm>(c, std::move(name), timeout_s, std::move(hint),
                                           std::move(where));
  out->owned_ = true;
  out->seq_ = from.seq_;  // the sequence goes on from the duplication
  return out;
}

BoundedComm::~BoundedComm() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owned_ && comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
}

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
  wait_mpi(r, site(what), timeout_s_, hint_);
}

int BoundedComm::allreduce(int value, MPI_Op op, const char* what) {
  allreduce(&value, 1, MPI_INT, op, what);
  return value;
}

void BoundedComm::bcast(void* data, int count, MPI_Datatype type, int root, const char* what) {
  MPI_Request r = MPI_REQUEST_NULL;
  check(MPI_Ibcast(data, count, type, root, comm_, &r), "MPI_Ibcast", what);
  wait_mpi(r, site(what, "root " + std::to_string(root)), timeout_s_, hint_);
}

void BoundedComm::bcast(std::string& s, int root, const char* what) {
  unsigned long long len = s.size();
  bcast(&len, 1, MPI_UNSIGNED_LONG_LONG, root, what);
  s.resize(static_cast<std::size_t>(len));
  for (std::size_t done = 0; done < s.size();) {
    const int n = static_cast<int>(std::min<std::size_t>(s.size() - done, INT_MAX / 2));
    bcast(s.data() + done, n, MPI_CHAR, root, what);
    done += static_cast<std::size_t>(n);
  }
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
               timeout_s_, hint_);
}

void BoundedComm::wait(MPI_Request& request, const char* what, int peer) {
  wait_mpi(request, site(what, peer >= 0 ? "with rank " + std::to_string(peer) : std::string()),
           timeout_s_, hint_);
}

MPI_Status BoundedComm::probe(int source, int tag, const char* what) {
  MPI_Status status{};
  BoundedWait wait(site(what, "from rank " + std::to_string(source)), timeout_s_);
  wait.hint(hint_).poll([&] {
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

MPI_Comm BoundedComm::dup(MPI_Comm comm, const std::string& name, double timeout_s,
                          const std::string& hint) {
  BoundedComm parent(comm, name, timeout_s, hint);
  MPI_Comm out = MPI_COMM_NULL;
  parent.run("MPI_Comm_idup", [&](MPI_Request* r) { return MPI_Comm_idup(comm, &out, r); });
  return out;
}

MPI_Comm BoundedComm::split(MPI_Comm comm, int color, int key, const std::string& name,
                            double timeout_s, const std::string& hint) {
  BoundedComm parent(comm, name, timeout_s, hint);
  MPI_Comm out = MPI_COMM_NULL;
  // No nonblocking form: a watchdog thread aborts the job if the call stays past the timeout.
  const std::string what =
      parent.site("MPI_Comm_split", "color " + std::to_string(color)).describe();
  Watchdog dog;
  dog.arm(what, timeout_s, hint.c_str());
  const int rc = MPI_Comm_split(comm, color, key, &out);
  dog.disarm();
  parent.check(rc, "MPI_Comm_split", "splitting");
  return out;
}

MPI_Comm BoundedComm::split_node(MPI_Comm comm, const std::string& name, double timeout_s,
                                 const std::string& hint) {
  BoundedComm parent(comm, name, timeout_s, hint);
  MPI_Comm out = MPI_COMM_NULL;
  const std::string what = parent.site("MPI_Comm_split_type", "shared memory").describe();
  Watchdog dog;
  dog.arm(what, timeout_s, hint.c_str());
  const int rc =
      MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, parent.rank(), MPI_INFO_NULL, &out);
  dog.disarm();
  parent.check(rc, "MPI_Comm_split_type", "splitting by node");
  return out;
}

std::size_t first_difference(BoundedComm& comm, const std::vector<std::string>& items,
                             const char* what) {
  if (comm.size() <= 1) return kNoDifference;
  // MPI_MAX of each value and of its complement: every rank learns min and max at once.
  std::uint64_t count[2] = {items.size(), ~std::uint64_t(items.size())};
  comm.allreduce(count, 2, MPI_UINT64_T, MPI_MAX, what);
  if (count[0] != ~count[1]) return 0;
  std::vector<std::uint64_t> h(2 * items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    h[2 * i] = fnv1a64(items[i]);
    h[2 * i + 1] = ~h[2 * i];
  }
  comm.allreduce(h.data(), static_cast<int>(h.size()), MPI_UINT64_T, MPI_MAX, what);
  for (std::size_t i = 0; i < items.size(); ++i)
    if (h[2 * i] != ~h[2 * i + 1]) return i + 1;
  return kNoDifference;
}

}  // namespace fullshard
