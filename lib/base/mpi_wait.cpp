#include "lib/base/mpi_wait.hpp"

#include "fullshard/base/error.hpp"

namespace fullshard {
namespace {

void check(int rc, const char* call, const WaitSite& site) {
  if (rc != MPI_SUCCESS)
    throw CommError(site.describe() + ": " + call + " failed: " + mpi_error_text(rc));
}

}  // namespace

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(len));
}

void wait_mpi(MPI_Request& request, const WaitSite& site, double timeout_s,
              const std::string& hint) {
  BoundedWait wait(site, timeout_s);
  wait.hint(hint).poll([&] {
    int done = 0;
    check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test", site);
    return done != 0;
  });
}

void wait_mpi_all(int count, MPI_Request* requests, const WaitSite& site, double timeout_s,
                  const std::string& hint) {
  BoundedWait wait(site, timeout_s);
  wait.hint(hint).poll([&] {
    int done = 0;
    check(MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE), "MPI_Testall", site);
    return done != 0;
  });
}

}  // namespace fullshard
