#include "lib/comm/shm.hpp"

#include <algorithm>

#include <cstdio>
#include <new>
#include <vector>

#include "fullshard/base/deadline.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/base/memory_ledger.hpp"
#include "lib/base/abort.hpp"

namespace fullshard::comm {

namespace {

constexpr std::size_t kLine = 64;
constexpr std::size_t kHeader = ShmWindow::kCounters * kLine;

std::size_t round_up(std::size_t n) {
  return (n + kLine - 1) / kLine * kLine;
}

bool mpi_finalized() {
  int f = 0;
  MPI_Finalized(&f);
  return f != 0;
}

void check(int rc, const std::string& what) {
  if (rc != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    throw CommError(what + " failed: " + std::string(text, static_cast<std::size_t>(len)));
  }
}

static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "shared-memory counters need lock-free 64-bit atomics");

}  // namespace

struct ShmCommState {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  std::string name;
  double timeout_s = 0.0;
  Watchdog watchdog;  // bounds the blocking window allocation and free
  std::atomic<std::uint64_t> all_gather{0}, reduce_scatter{0}, all_reduce{0}, broadcast{0};
  std::atomic<std::uint64_t> window_bytes{0};  // this rank's segments of the live windows
  ~ShmCommState() {
    if (comm != MPI_COMM_NULL && !mpi_finalized()) MPI_Comm_free(&comm);
  }
};

struct ShmWindowState {
  std::shared_ptr<ShmCommState> comm;
  MPI_Win win = MPI_WIN_NULL;
  std::size_t bytes = 0;
  std::string label;
  std::vector<std::byte*> base;  // every rank's segment (its counters first)
  MemoryCharge shards, windows;  // this rank's segment in the memory ledger
  ~ShmWindowState() {
    if (win == MPI_WIN_NULL) return;
    comm->window_bytes.fetch_sub(bytes, std::memory_order_relaxed);
    if (mpi_finalized()) return;
    const std::string what =
        "MPI_Win_free of shared-memory window '" + label + "' on communicator '" + comm->name + "'";
    comm->watchdog.arm(what, comm->timeout_s,
                       "every rank frees its shared-memory windows in the same order (destroy "
                       "the FSDP models in the same order on every rank)");
    MPI_Win_unlock_all(win);
    MPI_Win_free(&win);
    comm->watchdog.disarm();
  }
};

bool ShmComm::node_local(MPI_Comm comm) {
  int size = 0;
  int rank = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank);
  MPI_Comm node = MPI_COMM_NULL;
  check(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node),
        "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)");
  int local = 0;
  MPI_Comm_size(node, &local);
  MPI_Comm_free(&node);
  int all = local == size ? 1 : 0;
  int agreed = 0;
  check(MPI_Allreduce(&all, &agreed, 1, MPI_INT, MPI_MIN, comm), "MPI_Allreduce");
  return agreed == 1;
}

ShmComm::ShmComm(MPI_Comm comm, std::string name, double timeout_s)
    : s_(std::make_shared<ShmCommState>()) {
  check(MPI_Comm_dup(comm, &s_->comm),
        "MPI_Comm_dup for the shared-memory communicator of '" + name + "'");
  MPI_Comm_rank(s_->comm, &s_->rank);
  MPI_Comm_size(s_->comm, &s_->size);
  s_->name = std::move(name);
  s_->timeout_s = timeout_s;
}

int ShmComm::rank() const noexcept {
  return s_->rank;
}
int ShmComm::size() const noexcept {
  return s_->size;
}
const std::string& ShmComm::name() const noexcept {
  return s_->name;
}
double ShmComm::timeout_s() const noexcept {
  return s_->timeout_s;
}

void ShmComm::count(const Traffic& t) const noexcept {
  s_->all_gather.fetch_add(t.all_gather, std::memory_order_relaxed);
  s_->reduce_scatter.fetch_add(t.reduce_scatter, std::memory_order_relaxed);
  s_->all_reduce.fetch_add(t.all_reduce, std::memory_order_relaxed);
  s_->broadcast.fetch_add(t.broadcast, std::memory_order_relaxed);
}

std::uint64_t ShmComm::window_bytes() const noexcept {
  return s_->window_bytes.load(std::memory_order_relaxed);
}

Traffic ShmComm::traffic() const noexcept {
  Traffic t;
  t.all_gather = s_->all_gather.load(std::memory_order_relaxed);
  t.reduce_scatter = s_->reduce_scatter.load(std::memory_order_relaxed);
  t.all_reduce = s_->all_reduce.load(std::memory_order_relaxed);
  t.broadcast = s_->broadcast.load(std::memory_order_relaxed);
  return t;
}

ShmWindow ShmComm::allocate(std::size_t bytes, const std::string& label,
                            std::size_t shard_bytes) const {
  auto w = std::make_shared<ShmWindowState>();
  w->comm = s_;
  w->bytes = bytes;
  w->label = label;
  const std::string what =
      "MPI_Win_allocate_shared of window '" + label + "' on communicator '" + s_->name + "'";
  MPI_Info info = MPI_INFO_NULL;
  MPI_Info_create(&info);
  // Each rank's segment in pages of its own (first touch places it near its rank).
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  void* mine = nullptr;
  s_->watchdog.arm(what, s_->timeout_s);
  const int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(kHeader + round_up(bytes)), 1, info,
                                         s_->comm, &mine, &w->win);
  MPI_Info_free(&info);
  if (rc != MPI_SUCCESS) {
    s_->watchdog.disarm();
    w->win = MPI_WIN_NULL;
    check(rc, what);
  }
  // Passive-target epoch for the window's lifetime: peers' segments are read and written
  // with loads and stores, ordered by the counters' atomics.
  MPI_Win_lock_all(MPI_MODE_NOCHECK, w->win);
  s_->window_bytes.fetch_add(bytes, std::memory_order_relaxed);  // the destructor takes it back
  shard_bytes = std::min(shard_bytes, bytes);
  w->shards = MemoryCharge(MemoryPart::shards, shard_bytes);
  w->windows = MemoryCharge(MemoryPart::windows, bytes - shard_bytes);
  auto* own = static_cast<std::byte*>(mine);
  for (int c = 0; c < ShmWindow::kCounters; ++c)
    new (own + static_cast<std::size_t>(c) * kLine) std::atomic<std::uint64_t>(0);
  w->base.resize(static_cast<std::size_t>(s_->size));
  for (int r = 0; r < s_->size; ++r) {
    MPI_Aint size = 0;
    int disp = 0;
    void* p = nullptr;
    check(MPI_Win_shared_query(w->win, r, &size, &disp, &p), what + ": MPI_Win_shared_query");
    w->base[static_cast<std::size_t>(r)] = static_cast<std::byte*>(p);
  }
  // Every rank's counters are initialised before any rank reads them.
  const int brc = MPI_Barrier(s_->comm);
  s_->watchdog.disarm();
  check(brc, what + ": MPI_Barrier");
  return ShmWindow(std::move(w));
}

int ShmWindow::rank() const noexcept {
  return s_->comm->rank;
}
int ShmWindow::size() const noexcept {
  return s_->comm->size;
}
std::size_t ShmWindow::bytes() const noexcept {
  return s_->bytes;
}
std::byte* ShmWindow::segment(int r) const noexcept {
  return s_->base[static_cast<std::size_t>(r)] + kHeader;
}
std::shared_ptr<void> ShmWindow::owner() const noexcept {
  return s_;
}

std::atomic<std::uint64_t>& ShmWindow::counter(int r, int c) const noexcept {
  return *std::launder(reinterpret_cast<std::atomic<std::uint64_t>*>(
      s_->base[static_cast<std::size_t>(r)] + static_cast<std::size_t>(c) * kLine));
}

void ShmWindow::publish(int c, std::uint64_t v) const noexcept {
  counter(rank(), c).store(v, std::memory_order_release);
}

void ShmWindow::wait_all(int c, std::uint64_t v, const std::string& operation,
                         const std::string& about, bool include_self) const {
  const int n = size();
  const int me = include_self ? -1 : rank();
  // The peer to look at next: peers that were ready stay ready (counters only grow).
  // Deadline and back-off are made only when the first look finds a peer not ready.
  int q = 0;
  auto ready = [&] {
    for (; q < n; ++q)
      if (q != me && counter(q, c).load(std::memory_order_acquire) < v) return false;
    return true;
  };
  if (ready()) return;
  const ShmCommState& cs = *s_->comm;
  Deadline deadline(cs.timeout_s);
  // Peers are usually microseconds apart: spin, then yield the core for a few milliseconds
  // (an oversubscribed or busy node runs the peer meanwhile), then sleep (1-50 us). With
  // the default 64 yields, waits under load went to sleep at once and each wake-up cost
  // a scheduler time slice: the FSDP test steps ran 5-100x slower than on MPI.
  BackOff::Policy policy;
  policy.yields = 4096;
  BackOff back_off(policy);
  while (!ready()) {
    if (deadline.expired()) {
      WaitSite site;
      site.operation = operation;
      site.where = "shared memory of communicator '" + cs.name + "'";
      site.rank = rank();
      site.size = n;
      site.seq = v;
      site.detail = about + (about.empty() ? "" : ", ") + "waiting for rank " + std::to_string(q);
      fullshard::expire(site, cs.timeout_s, [](const std::string& message) {
        const int rank = fullshard::detail::world_rank_or_minus_one();
        std::fprintf(stderr, "fullshard[rank %d]: %s\n", rank, message.c_str());
        std::fflush(stderr);
      });
    }
    back_off.pause();
  }
}

}  // namespace fullshard::comm
