#include "lib/store/orphaned_buffers.hpp"

#include <algorithm>
#include <mutex>
#include <new>
#include <utility>

namespace fullshard::store {

namespace {

struct Orphans {
  std::mutex mutex;  // stores of several threads (each its own) may be destroyed at once
  std::vector<std::vector<std::byte>> buffers;
  std::vector<std::unique_ptr<BoundedComm>> comms;
  int keyval = MPI_KEYVAL_INVALID;
};

Orphans& orphans() {
  static Orphans* o = new Orphans;  // never destroyed: MPI_Finalize may run after static exit
  return *o;
}

int release_orphans(MPI_Comm, int, void*, void*) {
  Orphans& o = orphans();
  std::vector<std::unique_ptr<BoundedComm>> comms;
  {
    std::lock_guard<std::mutex> lock(o.mutex);
    std::vector<std::vector<std::byte>>().swap(o.buffers);
    comms.swap(o.comms);
  }
  comms.clear();  // MPI_Comm_free each (MPI is not finalized yet), outside the lock
  return MPI_SUCCESS;
}

// The attribute whose deletion at MPI_Finalize releases the orphans (o.mutex held).
void ensure_release_at_finalize(Orphans& o) {
  if (o.keyval == MPI_KEYVAL_INVALID &&
      MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, release_orphans, &o.keyval, nullptr) ==
          MPI_SUCCESS)
    MPI_Comm_set_attr(MPI_COMM_SELF, o.keyval, nullptr);
}

}  // namespace

void keep_until_finalize(std::vector<std::byte>& buffer) noexcept {
  Orphans& o = orphans();
  try {
    std::lock_guard<std::mutex> lock(o.mutex);
    ensure_release_at_finalize(o);
    o.buffers.push_back(std::move(buffer));
  } catch (...) {
    // No memory to record it: leak it rather than free memory MPI may read.
    new (std::nothrow) std::vector<std::byte>(std::move(buffer));
  }
}

void keep_until_finalize(std::unique_ptr<BoundedComm> comm) noexcept {
  if (!comm) return;
  Orphans& o = orphans();
  try {
    std::lock_guard<std::mutex> lock(o.mutex);
    ensure_release_at_finalize(o);
    o.comms.push_back(std::move(comm));
  } catch (...) {
    // No memory to record it: leak it rather than let MPI reuse its context id.
    static_cast<void>(comm.release());
  }
}

bool free_if_in_flight(MPI_Request& request) noexcept {
  if (request == MPI_REQUEST_NULL) return false;
  int done = 0;
  if (MPI_Test(&request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) return false;
  MPI_Request_free(&request);
  return true;
}

void discard_arrived_messages(MPI_Comm comm) noexcept {
  try {
    for (;;) {
      int found = 0;
      MPI_Message message = MPI_MESSAGE_NULL;
      MPI_Status status{};
      if (MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &found, &message, &status) !=
              MPI_SUCCESS ||
          !found)
        return;
      int bytes = 0;
      MPI_Get_count(&status, MPI_BYTE, &bytes);
      std::vector<std::byte> discard(static_cast<std::size_t>(std::max(bytes, 1)));
      MPI_Request r = MPI_REQUEST_NULL;
      if (MPI_Imrecv(discard.data(), bytes, MPI_BYTE, &message, &r) != MPI_SUCCESS) return;
      if (free_if_in_flight(r)) keep_until_finalize(discard);
    }
  } catch (...) {  // no memory for a discard buffer: leave the rest to MPI
  }
}

}  // namespace fullshard::store
