#include "lib/store/store_context.hpp"

#include "fullshard/base/error.hpp"
#include "lib/base/mpi_wait.hpp"

namespace fullshard::store {

void StoreContext::fail(int rc, const char* call, const std::string& what) const {
  throw CommError(label + ": " + what + ": " + call + " failed: " + mpi_error_text(rc));
}

}  // namespace fullshard::store
