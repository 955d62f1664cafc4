// What both sides of a store share: its options and sample layout, its private communicator,
// who produces and who consumes, and the two ways it fails (an MPI error, a bounded wait that
// expires), each naming the store and the rank.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fullshard/base/bounded_comm.hpp"
#include "fullshard/base/deadline.hpp"
#include "fullshard/store/sample_store.hpp"
#include "lib/store/sample_layout.hpp"

namespace fullshard::store {

struct StoreContext {
  StoreOptions options;
  std::string label;  // "sample store 'name'"
  double timeout_s = 0;
  std::unique_ptr<BoundedComm> comm;
  int rank = 0;
  int size = 1;
  std::vector<int> producers, consumers;                  // ranks, ascending
  std::vector<int> producer_index_of, consumer_index_of;  // by rank; -1: none
  SampleLayout layout;
  std::size_t message_bytes = 0;  // header + sample

  MPI_Comm mpi() const noexcept { return comm->get(); }

  /// "sample store 'name' on rank r".
  std::string here() const { return label + " on rank " + std::to_string(rank); }

  /// Nothing when `rc` is MPI_SUCCESS (the hot path: no text is built); otherwise CommError
  /// naming the store, what was being done (`what`: a text, or a callable that gives one, so
  /// that a computed text costs nothing until it is needed), the MPI call and MPI's text.
  template <class What>
  void check(int rc, const char* call, const What& what) const {
    if (rc == MPI_SUCCESS) return;
    if constexpr (std::is_invocable_v<const What&>)
      fail(rc, call, what());
    else
      fail(rc, call, std::string(what));
  }
  [[noreturn]] void fail(int rc, const char* call, const std::string& what) const;

  WaitSite site(const std::string& operation, std::string detail) const {
    return WaitSite{operation, label, rank, size, 0, std::move(detail)};
  }

  /// Polls `done` until true; past the timeout, CommError with the common message
  /// ("<operation> on sample store 'name' (rank r/n, <detail>) did not finish within
  /// FULLSHARD_TIMEOUT=<t> s; <hint>").
  template <class Done>
  void wait_until(const WaitSite& where, const std::string& hint, Done&& done) const {
    BoundedWait wait(where, timeout_s, [](const std::string&) {});
    wait.hint(hint).poll(std::forward<Done>(done));
  }
};

}  // namespace fullshard::store
