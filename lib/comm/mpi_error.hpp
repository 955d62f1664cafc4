// MPI error codes as text — private to lib/comm.
#pragma once

#include <mpi.h>

#include <string>

namespace fullshard::comm {

inline std::string mpi_error_string(int rc) {
  char msg[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(msg, static_cast<std::size_t>(len));
}

}  // namespace fullshard::comm
