#include "lib/store/consumer_side.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "fullshard/base/error.hpp"
#include "lib/store/orphaned_buffers.hpp"
#include "lib/store/wire_format.hpp"

namespace fullshard::store {

namespace {

BufferOptions buffer_options(const StoreContext& ctx) {
  BufferOptions b;
  b.policy = ctx.options.policy;
  b.capacity = ctx.options.capacity;
  b.window = ctx.options.window;
  b.sample_bytes = ctx.layout.sample_bytes;
  b.seed = stream_seed(
      ctx.options.seed,
      static_cast<std::uint64_t>(ctx.consumer_index_of[static_cast<std::size_t>(ctx.rank)]));
  return b;
}

}  // namespace

ConsumerSide::ConsumerSide(const StoreContext& context)
    : ctx_(context), buffer_(buffer_options(context)), moments_(context.options.fields.size()) {
  inboxes_.resize(ctx_.producers.size());
  for (std::size_t p = 0; p < inboxes_.size(); ++p)
    inboxes_[p].rank = ctx_.producers[p];
}

void ConsumerSide::receive() {
  for (;;) {
    int found = 0;
    MPI_Message m = MPI_MESSAGE_NULL;
    MPI_Status status{};
    ctx_.check(MPI_Improbe(MPI_ANY_SOURCE, kSampleTag, ctx_.mpi(), &found, &m, &status),
               "MPI_Improbe", "receiving samples");
    if (!found) break;
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    const int p = ctx_.producer_index_of[static_cast<std::size_t>(status.MPI_SOURCE)];
    auto from = [&] { return "from rank " + std::to_string(status.MPI_SOURCE); };
    if (p < 0 || (static_cast<std::size_t>(bytes) != kHeaderBytes &&
                  static_cast<std::size_t>(bytes) != ctx_.message_bytes)) {
      std::vector<std::byte> discard(static_cast<std::size_t>(std::max(bytes, 0)));
      MPI_Mrecv(discard.data(), bytes, MPI_BYTE, &m, MPI_STATUS_IGNORE);
      throw CommError(ctx_.here() + ": a message of " + std::to_string(bytes) + " bytes " + from() +
                      (p < 0 ? ", which is not a producer"
                             : ", expected a sample of " + std::to_string(ctx_.message_bytes)));
    }
    Inbox& in = inboxes_[static_cast<std::size_t>(p)];
    if (static_cast<std::size_t>(bytes) == kHeaderBytes) {  // small: received at once
      WireHeader end{};
      ctx_.check(MPI_Mrecv(&end, static_cast<int>(kHeaderBytes), MPI_BYTE, &m, MPI_STATUS_IGNORE),
                 "MPI_Mrecv", [&] { return "receiving the end of stream " + from(); });
      if (end.kind != kEndKind || end.seq != in.received)
        throw CommError(ctx_.here() + ": the end of stream " + from() + " counts " +
                        std::to_string(end.seq) + " samples, " + std::to_string(in.received) +
                        " arrived");
      in.ended = true;
      continue;
    }
    const std::int64_t slots = ctx_.options.in_flight;  // the producer's credit bounds it
    if (in.staging.empty()) {
      in.staging.resize(static_cast<std::size_t>(slots) * ctx_.message_bytes);
      in.arriving.assign(static_cast<std::size_t>(slots), MPI_REQUEST_NULL);
    }
    if (in.count == slots)
      throw CommError(ctx_.here() + ": more samples " + from() + " than its credit (" +
                      std::to_string(slots) + ") allows");
    const auto slot = static_cast<std::size_t>((in.head + in.count) % slots);
    ctx_.check(MPI_Imrecv(in.staging.data() + slot * ctx_.message_bytes, bytes, MPI_BYTE, &m,
                          &in.arriving[slot]),
               "MPI_Imrecv", [&] { return "receiving a sample " + from(); });
    ++in.count;
    ++in.received;
  }
  if (ctx_.options.delivery == Delivery::nonblocking)
    for (std::size_t p = 0; p < inboxes_.size(); ++p)
      while (head_ready(inboxes_[p]))
        ingest_one(p);
}

bool ConsumerSide::head_ready(Inbox& in) {
  if (in.count == 0) return false;
  MPI_Request& r = in.arriving[static_cast<std::size_t>(in.head)];
  if (r == MPI_REQUEST_NULL) return true;
  int done = 0;
  ctx_.check(MPI_Test(&r, &done, MPI_STATUS_IGNORE), "MPI_Test", "receiving a sample");
  return done != 0;
}

const std::byte* ConsumerSide::head_message(std::size_t p) {
  Inbox& in = inboxes_[p];
  const std::byte* message =
      in.staging.data() + static_cast<std::size_t>(in.head) * ctx_.message_bytes;
  WireHeader header{};
  std::memcpy(&header, message, kHeaderBytes);
  if (header.kind != kSampleKind || header.seq != in.taken)
    throw CommError(ctx_.here() + ": sample " + std::to_string(header.seq) + " from rank " +
                    std::to_string(in.rank) + " arrived as number " + std::to_string(in.taken));
  return message;
}

void ConsumerSide::ingest_one(std::size_t p) {
  Inbox& in = inboxes_[p];
  const std::byte* message = head_message(p);
  WireHeader header{};
  std::memcpy(&header, message, kHeaderBytes);
  std::byte* slot = buffer_.admit(SampleMeta{header.step, in.rank, header.tag});
  copy_and_measure(ctx_.options.fields, ctx_.layout, message + kHeaderBytes, slot, moments_);
  in.head = (in.head + 1) % ctx_.options.in_flight;
  --in.count;
  ++in.taken;
}

void ConsumerSide::discard_one(std::size_t p) {
  Inbox& in = inboxes_[p];
  head_message(p);  // the same check of its number
  in.head = (in.head + 1) % ctx_.options.in_flight;
  --in.count;
  ++in.taken;
  ++discarded_;
}

void ConsumerSide::close_round() {
  receive();  // nonblocking: ingests what is there in full
  if (ctx_.options.delivery == Delivery::lossless)
    for (std::size_t p = 0; p < inboxes_.size(); ++p)
      while (head_ready(inboxes_[p]))
        discard_one(p);
  flush_acks();
}

bool ConsumerSide::nothing_staged() const noexcept {
  return std::all_of(inboxes_.begin(), inboxes_.end(),
                     [](const Inbox& in) { return in.count == 0; });
}

bool ConsumerSide::nothing_in_transit_from(std::size_t p, std::int64_t sent) const noexcept {
  const Inbox& in = inboxes_[p];
  return !in.ended && in.count == 0 && in.received == sent;
}

bool ConsumerSide::others_finished(std::size_t p) const noexcept {
  for (std::size_t q = 0; q < inboxes_.size(); ++q)
    if (q != p && (!inboxes_[q].ended || inboxes_[q].count > 0)) return false;
  return true;
}

void ConsumerSide::flush_acks() {
  for (std::size_t p = 0; p < inboxes_.size(); ++p) {
    Inbox& in = inboxes_[p];
    // A producer that ended needs no more credit.
    if (in.ended || in.taken == in.acked || !ack_free(p)) continue;
    send_ack(in, in.taken);
  }
}

bool ConsumerSide::ack_free(std::size_t p) {
  Inbox& in = inboxes_[p];
  if (in.ack_request == MPI_REQUEST_NULL) return true;
  int done = 0;
  ctx_.check(MPI_Test(&in.ack_request, &done, MPI_STATUS_IGNORE), "MPI_Test", "acknowledging");
  return done != 0;
}

void ConsumerSide::send_close_ack(std::size_t p) {
  send_ack(inboxes_[p], kCloseAck);
}

void ConsumerSide::send_ack(Inbox& in, std::int64_t value) {
  in.ack_message.resize(sizeof value);
  std::memcpy(in.ack_message.data(), &value, sizeof value);
  if (value != kCloseAck) in.acked = value;
  ctx_.check(MPI_Isend(in.ack_message.data(), 1, MPI_INT64_T, in.rank, kAckTag, ctx_.mpi(),
                       &in.ack_request),
             "MPI_Isend",
             [&] { return "acknowledging to producer rank " + std::to_string(in.rank); });
}

bool ConsumerSide::stream_over() const noexcept {
  for (const Inbox& in : inboxes_)
    if (!in.ended || in.count > 0) return false;
  return true;
}

bool ConsumerSide::all_ended() const noexcept {
  return std::all_of(inboxes_.begin(), inboxes_.end(), [](const Inbox& in) { return in.ended; });
}

std::vector<int> ConsumerSide::producers_not_ended() const {
  std::vector<int> r;
  for (const Inbox& in : inboxes_)
    if (!in.ended) r.push_back(in.rank);
  return r;
}

std::int64_t ConsumerSide::ingest_in_order(std::int64_t count,
                                           const std::function<void()>& progress,
                                           const std::function<void(std::size_t)>& check_turn) {
  const std::size_t P = inboxes_.size();
  std::int64_t done = 0;
  while (done < count && !stream_over()) {
    const std::size_t p = cursor_;
    Inbox& in = inboxes_[p];
    if (in.count == 0 && in.ended) {
      cursor_ = (cursor_ + 1) % P;
      continue;
    }
    // Its next sample there in full, or its end: the turn can be decided.
    auto decided = [&] { return head_ready(in) || (in.count == 0 && in.ended); };
    if (!decided()) {
      progress();
      if (!decided()) check_turn(p);
      if (!decided())
        ctx_.wait_until(ctx_.site("draw (lossless: waiting for the next sample in order)",
                                  "from producer rank " + std::to_string(in.rank)),
                        "producer rank " + std::to_string(in.rank) +
                            " has not put its next sample for this consumer: with lossless "
                            "delivery a consumer ingests round robin over the producers, so each "
                            "must keep putting (or call end_of_stream), or it is stopped",
                        [&] {
                          progress();
                          if (decided()) return true;
                          check_turn(p);
                          return false;
                        });
      continue;  // decide again
    }
    ingest_one(p);
    cursor_ = (cursor_ + 1) % P;
    ++done;
  }
  return done;
}

void ConsumerSide::abandon() noexcept {
  for (Inbox& in : inboxes_) {
    if (free_if_in_flight(in.ack_request)) keep_until_finalize(in.ack_message);
    bool keep = false;
    for (MPI_Request& r : in.arriving)
      keep = free_if_in_flight(r) || keep;
    if (keep) keep_until_finalize(in.staging);
  }
}

std::size_t ConsumerSide::bytes() const noexcept {
  std::size_t n = buffer_.bytes();
  for (const Inbox& in : inboxes_)
    n += in.staging.size();
  return n;
}

}  // namespace fullshard::store
