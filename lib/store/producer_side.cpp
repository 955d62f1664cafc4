#include "lib/store/producer_side.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "fullshard/base/error.hpp"
#include "lib/store/orphaned_buffers.hpp"
#include "lib/store/wire_format.hpp"

namespace fullshard::store {

ProducerSide::ProducerSide(const StoreContext& context) : ctx_(context) {
  rings_.resize(ctx_.consumers.size());
  for (std::size_t c = 0; c < rings_.size(); ++c)
    rings_[c].rank = ctx_.consumers[c];
}

void ProducerSide::take_acks() {
  for (;;) {
    int found = 0;
    MPI_Message m = MPI_MESSAGE_NULL;
    MPI_Status status{};
    ctx_.check(MPI_Improbe(MPI_ANY_SOURCE, kAckTag, ctx_.mpi(), &found, &m, &status), "MPI_Improbe",
               "receiving acknowledgements");
    if (!found) return;
    std::int64_t value = 0;
    ctx_.check(MPI_Mrecv(&value, 1, MPI_INT64_T, &m, MPI_STATUS_IGNORE), "MPI_Mrecv",
               "receiving acknowledgements");
    const int c = ctx_.consumer_index_of[static_cast<std::size_t>(status.MPI_SOURCE)];
    if (c < 0)
      throw CommError(ctx_.here() + ": an acknowledgement from rank " +
                      std::to_string(status.MPI_SOURCE) + ", which is not a consumer");
    Ring& ring = rings_[static_cast<std::size_t>(c)];
    if (value == kCloseAck)
      ring.closed_by_consumer = true;
    else
      ring.acked = std::max(ring.acked, value);
  }
}

bool ProducerSide::has_credit(std::size_t c) const noexcept {
  const Ring& ring = rings_[c];
  return ring.sent - ring.acked < ctx_.options.in_flight;
}

std::size_t ProducerSide::next_slot(const Ring& ring) const noexcept {
  return static_cast<std::size_t>(ring.sent % ctx_.options.in_flight);
}

std::byte* ProducerSide::message(Ring& ring) noexcept {
  return ring.slots.data() + next_slot(ring) * ctx_.message_bytes;
}

std::byte* ProducerSide::claim_slot(std::size_t c) {
  Ring& ring = rings_[c];
  const auto slots = static_cast<std::size_t>(ctx_.options.in_flight);
  if (ring.slots.empty()) {
    ring.slots.assign(slots * ctx_.message_bytes, std::byte{0});
    ring.requests.assign(slots, MPI_REQUEST_NULL);
  }
  MPI_Request& request = ring.requests[next_slot(ring)];
  auto complete = [&] {
    int done = 0;
    ctx_.check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test", "put");
    return done != 0;
  };
  // Mostly complete already: the bounded wait (its texts, its clock) only when it is not.
  if (!complete())
    ctx_.wait_until(ctx_.site("put (completing an earlier send)",
                              "to consumer rank " + std::to_string(ring.rank)),
                    "consumer rank " + std::to_string(ring.rank) + " stopped receiving", complete);
  return message(ring) + kHeaderBytes;
}

void ProducerSide::send_claimed(std::size_t c, std::int64_t step, std::int64_t tag) {
  Ring& ring = rings_[c];
  std::byte* m = message(ring);
  const WireHeader header{kSampleKind, step, tag, ring.sent};
  std::memcpy(m, &header, kHeaderBytes);
  ctx_.check(MPI_Isend(m, static_cast<int>(ctx_.message_bytes), MPI_BYTE, ring.rank, kSampleTag,
                       ctx_.mpi(), &ring.requests[next_slot(ring)]),
             "MPI_Isend", [&] { return "put to consumer rank " + std::to_string(ring.rank); });
  ++ring.sent;
}

void ProducerSide::send_end_markers() {
  for (Ring& ring : rings_) {
    const WireHeader end{kEndKind, 0, 0, ring.sent};
    ring.end_marker.resize(kHeaderBytes);
    std::memcpy(ring.end_marker.data(), &end, kHeaderBytes);
    ctx_.check(MPI_Isend(ring.end_marker.data(), static_cast<int>(kHeaderBytes), MPI_BYTE,
                         ring.rank, kSampleTag, ctx_.mpi(), &ring.end_request),
               "MPI_Isend",
               [&] { return "end of stream to consumer rank " + std::to_string(ring.rank); });
  }
}

bool ProducerSide::finished_with(std::size_t c) {
  Ring& ring = rings_[c];
  if (!ring.closed_by_consumer) return false;
  int done = 0;
  ctx_.check(MPI_Testall(static_cast<int>(ring.requests.size()), ring.requests.data(), &done,
                         MPI_STATUSES_IGNORE),
             "MPI_Testall", "close");
  if (!done) return false;
  ctx_.check(MPI_Test(&ring.end_request, &done, MPI_STATUS_IGNORE), "MPI_Test", "close");
  return done != 0;
}

void ProducerSide::abandon() noexcept {
  for (Ring& ring : rings_) {
    bool keep = false;
    for (MPI_Request& r : ring.requests)
      keep = free_if_in_flight(r) || keep;
    if (keep) keep_until_finalize(ring.slots);
    if (free_if_in_flight(ring.end_request)) keep_until_finalize(ring.end_marker);
  }
}

std::size_t ProducerSide::bytes() const noexcept {
  std::size_t n = 0;
  for (const Ring& ring : rings_)
    n += ring.slots.size();
  return n;
}

}  // namespace fullshard::store
