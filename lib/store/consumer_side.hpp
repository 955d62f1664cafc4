// A consumer's side of a store: what arrives from each producer is received into that
// producer's staging ring (MPI_Imrecv: a large sample completes as MPI moves it), then
// ingested into the buffer, in arrival order (nonblocking) or in the fixed order of lossless
// delivery (round robin over the producers, each in its own order), and acknowledged so that
// the producer gets its credit back.
//
// Ingestion is the one copy a sample makes on this side: staging slot -> buffer slot, in the
// pass that also adds its values to the moments (field_moments.hpp). It cannot be received
// straight into its buffer slot, because that slot is not known when the receive starts: the
// policy picks it at ingestion (the oldest sample's for a full FIFO or window, a random one for
// the reservoir), lossless delivery ingests in an order fixed after the receive, the draws in
// between move the FIFO and window heads, and the sample the slot holds stays drawable until
// the new one is ingested.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "lib/store/field_moments.hpp"
#include "lib/store/sample_buffer.hpp"
#include "lib/store/store_context.hpp"

namespace fullshard::store {

class ConsumerSide {
 public:
  /// One staging ring per producer of `context` (which must outlive this; no memory until a
  /// sample arrives from it), and the buffer (its RNG stream from the seed and this consumer's
  /// index).
  explicit ConsumerSide(const StoreContext& context);

  /// Receives every message that arrived, without waiting: a sample into the next staging
  /// slot of its producer, an end marker at once. Nonblocking delivery then ingests every
  /// sample complete; lossless keeps them staged for ingest_in_order().
  void receive();

  /// Acknowledges what was taken from staging (ingested, or discarded by close) since the last
  /// acknowledgement, to each producer still putting (one acknowledgement in flight per
  /// producer: while one is, the newer count waits for the next call, so every loop that waits
  /// calls this again).
  void flush_acks();

  /// Lossless: ingests up to `count` samples in the fixed order (round robin over the
  /// producers from where the last call stopped, each in its own order, skipping those that
  /// ended with nothing staged), waiting (bounded) for each, calling `progress` while it
  /// waits and `check_turn(p)` before and while it waits for producer p's next sample (it
  /// throws when waiting cannot help). Returns the count ingested: fewer only when the stream
  /// is over (every end marker was waited for), so that the result does not depend on timing.
  std::int64_t ingest_in_order(std::int64_t count, const std::function<void()>& progress,
                               const std::function<void(std::size_t)>& check_turn);

  /// close(): one round of a consumer that is closing: receives what arrived, discards
  /// (lossless) every staged sample there in full instead of ingesting it (counted in
  /// discarded()), and acknowledges, so that a producer still putting gets its credit.
  void close_round();
  /// Nothing is staged: every sample received was ingested or discarded.
  bool nothing_staged() const noexcept;
  /// Samples close_round() discarded.
  std::int64_t discarded() const noexcept { return discarded_; }

  /// Producer p has not ended, nothing of it is staged, and the `sent` samples it sent to
  /// this consumer were all received: only its next put can bring more.
  bool nothing_in_transit_from(std::size_t p, std::int64_t sent) const noexcept;
  /// Every producer other than p ended, with nothing staged: no more samples will come from
  /// them.
  bool others_finished(std::size_t p) const noexcept;

  /// Every producer ended and everything it sent was ingested.
  bool stream_over() const noexcept;
  /// Every producer's end marker arrived.
  bool all_ended() const noexcept;
  std::vector<int> producers_not_ended() const;

  /// close(): whether producer p's last acknowledgement was sent, so that another may go.
  bool ack_free(std::size_t p);
  /// close(): tells producer p that nothing more will be acknowledged (ack_free(p) first).
  void send_close_ack(std::size_t p);

  std::size_t producers() const noexcept { return inboxes_.size(); }
  int producer_rank(std::size_t p) const noexcept { return inboxes_[p].rank; }
  SampleBuffer& buffer() noexcept { return buffer_; }
  const SampleBuffer& buffer() const noexcept { return buffer_; }
  const RunningMoments& moments(std::size_t field) const { return moments_[field]; }

  /// The destructor's path: never waits. Receives and acknowledgements still in flight are
  /// freed and their buffers kept until MPI_Finalize.
  void abandon() noexcept;

  /// The staging rings' bytes (in_flight x (header + sample) per producer received from so
  /// far) and the buffer's.
  std::size_t bytes() const noexcept;

 private:
  struct Inbox {
    int rank = -1;                      // the producer's rank
    std::vector<std::byte> staging;     // received, not yet ingested: a ring of in_flight
    std::vector<MPI_Request> arriving;  // per slot: its MPI_Imrecv until complete
    std::int64_t head = 0;              // the oldest staged sample's slot
    std::int64_t count = 0;             // samples staged
    std::int64_t received = 0;
    std::int64_t taken = 0;              // from staging: ingested, or discarded at close
    bool ended = false;                  // its end marker arrived
    std::vector<std::byte> ack_message;  // the int64 being sent
    std::int64_t acked = 0;              // the last count sent
    MPI_Request ack_request = MPI_REQUEST_NULL;
  };

  bool head_ready(Inbox& in);
  void ingest_one(std::size_t p);
  void discard_one(std::size_t p);
  const std::byte* head_message(std::size_t p);  // its header checked
  void send_ack(Inbox& in, std::int64_t value);

  const StoreContext& ctx_;
  std::vector<Inbox> inboxes_;  // by producer index
  SampleBuffer buffer_;
  std::vector<RunningMoments> moments_;  // by field
  std::size_t cursor_ = 0;               // lossless: the producer whose turn is next
  std::int64_t discarded_ = 0;           // by close_round()
};

}  // namespace fullshard::store
