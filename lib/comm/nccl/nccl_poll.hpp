// Completing a call on a non-blocking NCCL communicator (private to the NCCL backend and its
// tests). A non-blocking communicator (ncclConfig_t::blocking = 0) returns ncclInProgress
// from ncclCommInitRankConfig, ncclCommSplit, ncclCommFinalize, ncclGroupEnd and from
// collectives whose enqueue is not finished; the caller then polls ncclCommGetAsyncError
// until it leaves ncclInProgress before using the communicator (or the stream) again. The
// poll is bounded by FULLSHARD_TIMEOUT through the one timeout mechanism (BoundedWait), so an
// init that a peer never joins ends in the common timeout message instead of a hang.
//
// The logic takes the state query and the abort as callables, so that the host tests drive it
// with fakes (test/unit/test_nccl_host.cpp); the backend passes ncclCommGetAsyncError and
// ncclCommAbort of its communicator.
#pragma once

#include <nccl.h>

#include <string>
#include <utility>

#include "fullshard/base/deadline.hpp"
#include "fullshard/base/error.hpp"
#include "lib/comm/nccl/nccl_error.hpp"

namespace fullshard::comm {

/// The hint of an init's timeout message.
inline constexpr const char* kNcclInitTimeoutHint =
    "another rank of the communicator did not join its creation (it failed before it, is "
    "stuck, or creates its communicators in another order)";

/// What an aborted communicator's error adds.
inline constexpr const char* kNcclAborted = "; the communicator was aborted (ncclCommAbort)";

/// Completes an NCCL call that returned `first` on a communicator with the asynchronous
/// state `get_state()` (ncclCommGetAsyncError: ncclInProgress while the call is still being
/// carried out, then ncclSuccess or the error). Returns when the call succeeded. Otherwise
/// calls `abort(reason)` once (the backend's ncclCommAbort) and throws CommError:
///   "<site.describe()> failed: <nccl_error_message>; the communicator was aborted ..."
/// for an error (the first result or a later state), or, when the state is still
/// ncclInProgress after `timeout_s` (> 0; 0 polls forever), the common timeout message
///   "<site.describe()> did not finish within FULLSHARD_TIMEOUT=<t> s; <hint>; the
///   communicator was aborted (ncclCommAbort)".
/// `site` names the call, the communicator, its rank and size and the operation's sequence
/// number (WaitSite). `policy` is the back-off between polls (tests shorten it).
template <class GetState, class Abort>
void complete_nccl_call(ncclResult_t first, const WaitSite& site, double timeout_s,
                        GetState&& get_state, Abort&& abort,
                        const char* hint = kCollectiveTimeoutHint, BackOff::Policy policy = {}) {
  ncclResult_t st = first;
  if (st == ncclInProgress) {
    BoundedWait wait(
        site, timeout_s,
        [&](const std::string& why) {
          abort(why);
          throw CommError(why + kNcclAborted);
        },
        policy);
    wait.hint(hint);
    wait.poll([&] {
      st = get_state();
      return st != ncclInProgress;
    });
  }
  if (st == ncclSuccess) return;
  const std::string why =
      site.describe() + " failed: " + nccl_error_message(st, site.operation.c_str());
  abort(why);
  throw CommError(why + kNcclAborted);
}

/// The state of a non-blocking communicator: ncclCommGetAsyncError's answer, or the error of
/// the query itself.
inline ncclResult_t nccl_async_state(ncclComm_t comm) noexcept {
  ncclResult_t st = ncclInProgress;
  if (const ncclResult_t r = ncclCommGetAsyncError(comm, &st); r != ncclSuccess) return r;
  return st;
}

}  // namespace fullshard::comm
