// Ending the whole job where a blocked collective cannot be cancelled (the timeouts), and the
// world rank the error messages name.
#pragma once

#include <string>

namespace fullshard {

namespace detail {

/// World rank of this process, or -1 when MPI is not (or no longer) initialised.
int world_rank_or_minus_one() noexcept;

/// Prints `message` to stderr and ends the whole job (MPI_Abort when MPI is up, else abort).
/// Used where a blocked collective cannot be cancelled (timeouts); never returns.
[[noreturn]] void abort_job(const std::string& message, int code = 3) noexcept;

}  // namespace detail

}  // namespace fullshard
