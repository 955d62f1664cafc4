// The C API's error boundary, shared by its files (lib/capi/*.cpp): every extern "C" function
// runs its body through `guarded`, which turns every exception into a fullshard_status and the
// thread's last-error message (fullshard_last_error); no exception crosses the boundary.
// Private to lib/capi.
#pragma once

#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/fullshard.h"

namespace fullshard::capi {

/// Not a call's fault: the library's state (before init, after finalize).
class NotInitialized : public Error {
 public:
  using Error::Error;
};

/// The status of the exception being handled (only inside a catch block), whose message is
/// recorded as this thread's last error: "<call>: <message>", prefixed by this rank in init's
/// communicator. `plain`: the status of a fullshard::Error of no subclass (lib/capi/c_api.cpp).
fullshard_status fail_current(const char* call, fullshard_status plain) noexcept;

/// Runs `body`; FULLSHARD_OK, or the status of what it threw (fail_current).
template <class F>
fullshard_status guarded(const char* call, F&& body,
                         fullshard_status plain = FULLSHARD_ERR_INTERNAL) noexcept {
  try {
    body();
    return FULLSHARD_OK;
  } catch (...) {
    return fail_current(call, plain);
  }
}

/// Throws NotInitialized before fullshard_init and after fullshard_finalize.
void require_initialized();

/// Frees every sample store still alive, without its close (fullshard_finalize; the stores'
/// table is lib/capi/store_api.cpp's).
void free_stores() noexcept;

}  // namespace fullshard::capi
