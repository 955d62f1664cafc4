// NCCL result codes as fullshard errors (private to the NCCL backend and its tests).
#pragma once

#include <nccl.h>

#include <string>

#include "fullshard/base/error.hpp"

namespace fullshard::comm {

/// The enumerator name of `r` ("ncclSystemError"), or "ncclResult_t(N)" for an unknown code.
inline const char* nccl_result_name(ncclResult_t r) noexcept {
  switch (r) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidArgument:
      return "ncclInvalidArgument";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
    case ncclInProgress:
      return "ncclInProgress";
    default:
      return nullptr;
  }
}

/// What a result class usually means, for the reader of an error message.
inline const char* nccl_result_hint(ncclResult_t r) noexcept {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "a CUDA call failed (no GPU, or a device error)";
    case ncclSystemError:
      return "a system call failed (network, sockets, shared memory or file limits)";
    case ncclInternalError:
      return "internal NCCL error (a bug in NCCL, or memory corruption)";
    case ncclInvalidArgument:
      return "a bad argument (pointer, count, datatype, op or rank)";
    case ncclInvalidUsage:
      return "the API was used incorrectly (mismatched collectives, or a destroyed communicator)";
    case ncclRemoteError:
      return "another rank failed or left";
    case ncclInProgress:
      return "non-blocking operation still in progress";
    default:
      return "unknown NCCL result code";
  }
}

/// "<name> (<ncclGetErrorString>): <hint>", e.g.
/// "ncclRemoteError (remote process exited or there was a network error): another rank
/// failed or left".
inline std::string nccl_error_message(ncclResult_t r, const char* call) {
  (void)call;  // the caller names the call in its own context; kept for symmetry with checks
  const char* name = nccl_result_name(r);
  std::string out =
      name ? std::string(name) : "ncclResult_t(" + std::to_string(static_cast<int>(r)) + ")";
  const char* text = ncclGetErrorString(r);
  if (text && *text) out += std::string(" (") + text + ")";
  out += ": ";
  out += nccl_result_hint(r);
  return out;
}

/// Throws CommError("<context>: <call> failed: <nccl_error_message>") unless `r` is
/// ncclSuccess. ncclInProgress is a failure here by default (blocking communicators never
/// return it); a caller using the non-blocking API (ncclConfig_t::blocking = 0) passes
/// `in_progress_ok = true`, and then ncclInProgress is treated as success: the caller
/// must poll ncclCommGetAsyncError until the operation has finished.
inline void nccl_check(ncclResult_t r, const char* call, const std::string& context,
                       bool in_progress_ok = false) {
  if (r == ncclSuccess || (in_progress_ok && r == ncclInProgress)) return;
  throw CommError(context + ": " + call + " failed: " + nccl_error_message(r, call));
}

}  // namespace fullshard::comm
