// MPI requests completed by the common bounded wait (fullshard/base/deadline.hpp): for code
// that issues its own nonblocking MPI calls (the checkpoint layer's control messages, the
// apps) and must not block past FULLSHARD_TIMEOUT.
#pragma once

#include <mpi.h>

#include <string>

#include "fullshard/base/deadline.hpp"

namespace fullshard {

/// Completes `request` (MPI_Test polls with the common back-off). Past `timeout_s` (> 0; 0
/// waits forever) the job is aborted with the common timeout message naming `site` and
/// `hint`. A failing MPI_Test throws CommError naming the site and MPI's error text.
void wait_mpi(MPI_Request& request, const WaitSite& site, double timeout_s,
              const std::string& hint = kCollectiveTimeoutHint);

/// As wait_mpi, for `count` requests at once (MPI_Testall).
void wait_mpi_all(int count, MPI_Request* requests, const WaitSite& site, double timeout_s,
                  const std::string& hint = kCollectiveTimeoutHint);

/// MPI's text for an error code ("MPI_ERR_TRUNCATE: message truncated").
std::string mpi_error_text(int code);

}  // namespace fullshard
