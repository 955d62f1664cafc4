// What a store destroyed without close() (an error path) leaves to MPI. Its destructor must
// neither wait nor throw, yet MPI may still read a send buffer or write a receive buffer whose
// request is in flight: such a request is freed (MPI completes it on its own) and its buffer
// is kept alive until MPI_Finalize instead of being freed with the store. So is the store's
// communicator: messages its peers still send arrive there, never at a later communicator
// (MPI may give a freed communicator's context id to the next one, which would then match
// them in place of its own).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "fullshard/base/bounded_comm.hpp"

namespace fullshard::store {

/// Keeps `buffer`'s memory (moved out of it) until MPI_Finalize, which deletes the attributes
/// of MPI_COMM_SELF first and so frees it. Never throws: without memory to record it, the
/// buffer is leaked rather than freed while MPI may use it.
void keep_until_finalize(std::vector<std::byte>& buffer) noexcept;

/// Keeps `comm` (not freed) until MPI_Finalize, which frees it as it deletes MPI_COMM_SELF's
/// attributes. For a store that ends without close(): messages on their way to it (a peer's
/// samples, acknowledgements, end markers) arrive at a communicator nobody receives on. Never
/// throws: without memory to record it, it is leaked rather than freed.
void keep_until_finalize(std::unique_ptr<BoundedComm> comm) noexcept;

/// False when `request` is null or complete; otherwise frees it (MPI_Request_free) and returns
/// true: its buffer must then go to keep_until_finalize.
bool free_if_in_flight(MPI_Request& request) noexcept;

/// Receives and discards every message that has arrived on `comm` (any source, any tag), so
/// that none is matched against a freed communicator; a large one still on its way is left
/// in flight with its buffer kept.
void discard_arrived_messages(MPI_Comm comm) noexcept;

}  // namespace fullshard::store
