// A producer's side of a store: one ring of `in_flight` send slots per consumer, and the
// credits that bound it (a consumer acknowledges what it ingested, so a producer is at most
// `in_flight` samples ahead of each consumer and a ring slot is free again once its credit is
// back).
//
// A put claims the slot it will send from before it packs: the sample is packed straight into
// it, and sent from there. A sample the checks refuse is simply not sent: its slot stays the
// ring's next, claimed again by the next put to that consumer.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "lib/store/store_context.hpp"

namespace fullshard::store {

class ProducerSide {
 public:
  /// One ring per consumer of `context` (which must outlive this); no memory until a send.
  explicit ProducerSide(const StoreContext& context);

  /// Takes in the acknowledgements that arrived; never waits.
  void take_acks();

  std::size_t consumers() const noexcept { return rings_.size(); }
  int consumer_rank(std::size_t c) const noexcept { return rings_[c].rank; }

  /// Whether consumer c has fewer than `in_flight` samples from this rank unacknowledged.
  bool has_credit(std::size_t c) const noexcept;
  /// Samples sent to consumer c so far.
  std::int64_t sent_to(std::size_t c) const noexcept { return rings_[c].sent; }
  /// Consumer c's last acknowledgement (kCloseAck) arrived: it closed, no credit will come.
  bool consumer_closed(std::size_t c) const noexcept { return rings_[c].closed_by_consumer; }

  /// The slot consumer c's next sample leaves from (c must have credit): allocates the ring at
  /// its first use (zeroed, so the bytes between fields are zero on the wire), and waits
  /// (bounded) for the send that last used the slot, which was acknowledged, so received, and
  /// completes as soon as MPI sees it. Returns where the packed sample goes (sample_bytes,
  /// after the header). Until send_claimed(), claiming again gives the same slot.
  std::byte* claim_slot(std::size_t c);

  /// Sends consumer c's claimed slot, its header (step, tag, number) written in front.
  void send_claimed(std::size_t c, std::int64_t step, std::int64_t tag);

  /// Sends every consumer its end marker (the count of samples sent to it); never waits.
  void send_end_markers();

  /// close(): consumer c's last acknowledgement arrived and every send to it completed.
  bool finished_with(std::size_t c);

  /// The destructor's path: never waits. Sends still in flight are freed and their buffers
  /// kept until MPI_Finalize.
  void abandon() noexcept;

  /// The rings' bytes: in_flight x (header + sample) per consumer sent to so far.
  std::size_t bytes() const noexcept;

 private:
  struct Ring {
    int rank = -1;                      // the consumer's rank
    std::vector<std::byte> slots;       // in_flight messages (allocated at the first claim)
    std::vector<MPI_Request> requests;  // one per slot
    std::int64_t sent = 0;
    std::int64_t acked = 0;             // the consumer's last acknowledgement
    bool closed_by_consumer = false;    // its kCloseAck arrived
    std::vector<std::byte> end_marker;  // while it is sent
    MPI_Request end_request = MPI_REQUEST_NULL;
  };

  std::size_t next_slot(const Ring& ring) const noexcept;  // the slot of sample ring.sent
  std::byte* message(Ring& ring) noexcept;                 // its message: header, then sample

  const StoreContext& ctx_;
  std::vector<Ring> rings_;  // by consumer index
};

}  // namespace fullshard::store
