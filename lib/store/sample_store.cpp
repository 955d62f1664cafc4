// The public SampleStore: construction (option agreement, role exchange, layout), put, draw,
// close and the counters, over the producer side (producer_side.hpp: send rings and credits)
// and the consumer side (consumer_side.hpp: staging, ordered ingestion, buffer). The message
// format is in wire_format.hpp.
//
// Copies per sample: a put packs the caller's arrays straight into the ring slot the sample is
// sent from (pack.hpp: gather, conversion and checks in that one pass); a consumer copies it
// once, staging slot -> buffer slot (consumer_side.hpp says why it cannot be received into the
// buffer slot), and a draw copies it into the caller's batch.
#include "fullshard/store/sample_store.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fullshard/base/bounded_comm.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/runtime/settings.hpp"
#include "lib/store/consumer_side.hpp"
#include "lib/store/describe.hpp"
#include "lib/store/orphaned_buffers.hpp"
#include "lib/store/pack.hpp"
#include "lib/store/producer_side.hpp"
#include "lib/store/store_context.hpp"
#include "lib/store/store_options.hpp"
#include "lib/store/wire_format.hpp"

namespace fullshard::store {

struct StoreState {
  StoreContext ctx;  // before the sides, which keep a reference to it
  Role role = Role::both;
  bool closed = false;

  std::optional<ProducerSide> producer;
  std::size_t producer_index = 0;  // this rank's, among the producers
  std::int64_t rotation = 0;       // puts that went to a consumer (sent or dropped for credit)
  bool stream_ended = false;
  std::int64_t produced = 0;
  std::int64_t dropped = 0;
  std::int64_t non_finite = 0;

  std::optional<ConsumerSide> consumer;

  ~StoreState() { release(); }

  /// One round of every side's nonblocking work.
  void step_all() {
    if (producer) producer->take_acks();
    if (consumer) {
      consumer->receive();
      consumer->flush_acks();
    }
  }

  /// Whether only this rank's own later puts could bring producer p's next sample to this
  /// rank's consumer: p is this rank, its stream is not ended, and everything it sent itself
  /// was received (nothing in transit).
  bool only_own_puts_supply(std::size_t p) const {
    if (!producer || !consumer || stream_ended || p != producer_index) return false;
    const auto self =
        static_cast<std::size_t>(ctx.consumer_index_of[static_cast<std::size_t>(ctx.rank)]);
    return consumer->nothing_in_transit_from(p, producer->sent_to(self));
  }

  /// Whether no sample can reach this rank's consumer but from this rank's own later puts: the
  /// other producers ended with nothing staged (or there are none) and only_own_puts_supply.
  bool only_own_puts_supply_any() const {
    return producer && consumer && consumer->others_finished(producer_index) &&
           only_own_puts_supply(producer_index);
  }

  /// Ends without the close protocol (the destructor): never throws, never waits.
  void release() noexcept {
    if (!ctx.comm) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      if (producer) producer->abandon();
      if (consumer) consumer->abandon();
      discard_arrived_messages(ctx.mpi());
      // Not freed: the peers may still send (they have not closed either), and MPI may give a
      // freed communicator's context id to a later one, which would match those messages.
      keep_until_finalize(std::move(ctx.comm));
    }
    ctx.comm.reset();  // nothing once MPI is finalized
  }
};

namespace {

StoreState& live(const std::unique_ptr<StoreState>& s, const char* call) {
  if (!s) throw InvalidArgument(std::string("sample store: ") + call + " on a moved-from store");
  if (s->closed) throw InvalidArgument(s->ctx.here() + ": " + call + " after close()");
  return *s;
}

}  // namespace

SampleStore::SampleStore(MPI_Comm comm, Role role, StoreOptions options)
    : s_(std::make_unique<StoreState>()) {
  StoreState& s = *s_;
  StoreContext& ctx = s.ctx;
  ctx.options = std::move(options);
  ctx.label = "sample store '" + ctx.options.name + "'";
  s.role = role;
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw InvalidArgument(ctx.label + ": MPI is not initialised");
  if (comm == MPI_COMM_NULL)
    throw InvalidArgument(ctx.label + ": the communicator is MPI_COMM_NULL");
  // A binding's refusal (options it could not even convert) first: it is the real problem.
  const std::string problem = !ctx.options.binding_refusal.empty()
                                  ? ctx.options.binding_refusal
                                  : options_problem(ctx.options, role);
  ctx.timeout_s = ctx.options.timeout_s > 0 && std::isfinite(ctx.options.timeout_s)
                      ? ctx.options.timeout_s
                      : Settings::from_environment().timeout_s;
  ctx.comm = BoundedComm::duplicate(comm, ctx.options.name, ctx.timeout_s, kCollectiveTimeoutHint,
                                    ctx.label);
  ctx.rank = ctx.comm->rank();
  ctx.size = ctx.comm->size();
  // Bad options on any rank: InvalidArgument on every rank, with the first bad rank's problem.
  // Only good options are compared (RankMismatch names the first difference).
  refuse_bad_options(*ctx.comm, problem, ctx.label);
  agree_on_options(*ctx.comm, canonical_lines(ctx.options), ctx.label);

  int mine = static_cast<int>(role);
  std::vector<int> roles(static_cast<std::size_t>(ctx.size));
  ctx.comm->run("MPI_Iallgather (roles)", [&](MPI_Request* r) {
    return MPI_Iallgather(&mine, 1, MPI_INT, roles.data(), 1, MPI_INT, ctx.mpi(), r);
  });
  ctx.producer_index_of.assign(roles.size(), -1);
  ctx.consumer_index_of.assign(roles.size(), -1);
  for (int r = 0; r < ctx.size; ++r) {
    const auto x = static_cast<Role>(roles[static_cast<std::size_t>(r)]);
    if (x == Role::producer || x == Role::both) {
      ctx.producer_index_of[static_cast<std::size_t>(r)] = static_cast<int>(ctx.producers.size());
      ctx.producers.push_back(r);
    }
    if (x == Role::consumer || x == Role::both) {
      ctx.consumer_index_of[static_cast<std::size_t>(r)] = static_cast<int>(ctx.consumers.size());
      ctx.consumers.push_back(r);
    }
  }
  if (ctx.producers.empty() || ctx.consumers.empty())
    throw InvalidArgument(ctx.label + ": no " + (ctx.producers.empty() ? "producer" : "consumer") +
                          " among its " + std::to_string(ctx.size) +
                          " ranks: at least one rank must produce and one consume (Role)");
  ctx.layout = layout_of(ctx.options.fields);
  ctx.message_bytes = message_bytes_of(ctx.layout.sample_bytes);

  if (role == Role::producer || role == Role::both) {
    s.producer.emplace(ctx);
    s.producer_index =
        static_cast<std::size_t>(ctx.producer_index_of[static_cast<std::size_t>(ctx.rank)]);
  }
  if (role == Role::consumer || role == Role::both) s.consumer.emplace(ctx);
}

SampleStore::~SampleStore() = default;  // StoreState::~StoreState releases
SampleStore::SampleStore(SampleStore&&) noexcept = default;
SampleStore& SampleStore::operator=(SampleStore&&) noexcept = default;

bool SampleStore::put(std::int64_t step, std::int64_t tag, const std::vector<ArrayView>& fields) {
  StoreState& s = live(s_, "put");
  const StoreContext& ctx = s.ctx;
  if (!s.producer)
    throw InvalidArgument(ctx.here() + ": put on a rank whose role is " + role_name(s.role) +
                          ", not a producer");
  if (s.stream_ended) throw InvalidArgument(ctx.here() + ": put after end_of_stream()");
  check_views(ctx.label, ctx.options.fields, fields);
  ProducerSide& out = *s.producer;
  out.take_acks();
  const std::size_t C = out.consumers();
  const std::size_t c = (s.producer_index + static_cast<std::size_t>(s.rotation) % C) % C;
  const int target = out.consumer_rank(c);

  // Credit first, so that a sample with nowhere to go costs nothing: nonblocking drops it
  // before any pass over it (its values are not even checked), lossless waits.
  if (!out.has_credit(c)) {
    if (ctx.options.delivery == Delivery::nonblocking) {
      ++s.rotation;  // the next put goes to the next consumer, not to this full one again
      ++s.dropped;
      return false;
    }
    if (target == ctx.rank) {
      // Credit from this rank's own buffer comes only from its draws: acknowledge what it
      // ingested, then look again (twice: an earlier acknowledgement still in flight holds the
      // newer count back until this rank has received it).
      for (int round = 0; round < 2 && !out.has_credit(c); ++round) {
        s.consumer->flush_acks();
        out.take_acks();
      }
      if (!out.has_credit(c))
        throw InvalidArgument(
            ctx.here() + ": a lossless put to this rank's own buffer, which has " +
            std::to_string(ctx.options.in_flight) +
            " samples from it not yet ingested: a consumer ingests in its draws, so this rank "
            "must draw before it puts more (at most in_flight samples per consumer ahead)");
    } else {
      ctx.wait_until(ctx.site("put (lossless: waiting for credit)",
                              "for consumer rank " + std::to_string(target)),
                     "consumer rank " + std::to_string(target) +
                         " is not ingesting: with lossless delivery a producer is at most "
                         "in_flight samples ahead of each consumer, which ingests in its draws "
                         "(or the consumer is stopped)",
                     [&] {
                       s.step_all();
                       if (out.has_credit(c)) return true;
                       // A consumer in close() acknowledges what arrives, and closes only after
                       // this rank's end of stream: its last acknowledgement now means that the
                       // ranks disagree on the protocol. No credit will come.
                       if (out.consumer_closed(c))
                         throw CommError(ctx.here() + ": consumer rank " + std::to_string(target) +
                                         " closed the store while this put waited for room");
                       return false;
                     });
    }
  }

  // Packed and checked in one pass, straight into the slot it is sent from. A refused sample
  // leaves the slot unsent (the next put claims it again) and the rotation where it was.
  std::byte* sample = out.claim_slot(c);
  const PackOutcome packed = pack_sample(ctx.options.fields, ctx.layout, fields, sample);
  if (packed.non_finite) {
    ++s.non_finite;
    if (ctx.options.non_finite == NonFinite::refuse)
      throw InvalidArgument(
          non_finite_text(ctx.label, ctx.options.fields, *packed.non_finite, step, ctx.rank) +
          " (NonFinite::refuse; NonFinite::drop drops such samples)");
    ++s.dropped;
    return false;
  }
  if (packed.not_mask)
    throw InvalidArgument(
        not_mask_text(ctx.label, ctx.options.fields, *packed.not_mask, step, ctx.rank));
  out.send_claimed(c, step, tag);
  ++s.rotation;
  ++s.produced;
  return true;
}

void SampleStore::end_of_stream() {
  StoreState& s = live(s_, "end_of_stream");
  if (!s.producer)
    throw InvalidArgument(s.ctx.here() + ": end_of_stream on a rank whose role is " +
                          role_name(s.role) + ", not a producer");
  if (s.stream_ended) return;
  s.stream_ended = true;
  s.producer->send_end_markers();
}

std::int64_t SampleStore::draw(std::int64_t batch, const std::vector<MutableArrayView>& out,
                               std::vector<SampleMeta>* meta) {
  StoreState& s = live(s_, "draw");
  const StoreContext& ctx = s.ctx;
  if (!s.consumer)
    throw InvalidArgument(ctx.here() + ": draw on a rank whose role is " + role_name(s.role) +
                          ", not a consumer");
  if (batch < 1)
    throw InvalidArgument(ctx.here() + ": draw of " + std::to_string(batch) + " samples");
  if (ctx.options.policy == Policy::fifo && batch > ctx.options.capacity)
    throw InvalidArgument(ctx.here() + ": a FIFO draw of " + std::to_string(batch) +
                          " samples from a buffer of capacity " +
                          std::to_string(ctx.options.capacity) + ", which never holds that many");
  const std::vector<FieldLayout>& layout = ctx.layout.fields;
  if (out.size() != layout.size())
    throw InvalidArgument(ctx.here() + ": draw got " + std::to_string(out.size()) +
                          " arrays for the " + std::to_string(layout.size()) + " fields");
  for (std::size_t f = 0; f < out.size(); ++f) {
    const Field& field = ctx.options.fields[f];
    // Texts and the expected shape built only for an error: this runs on every draw.
    auto name = [&] { return ctx.label + ": draw: field '" + field.name + "'"; };
    const std::vector<std::int64_t>& given = out[f].shape;
    if (out[f].dtype != layout[f].stored)
      throw InvalidArgument(name() + " gives dtype " + dtype_name(layout[f].stored) +
                            ", the output has " + dtype_name(out[f].dtype));
    if (given.size() != field.shape.size() + 1 || given[0] != batch ||
        !std::equal(field.shape.begin(), field.shape.end(), given.begin() + 1)) {
      std::vector<std::int64_t> shape{batch};
      shape.insert(shape.end(), field.shape.begin(), field.shape.end());
      throw InvalidArgument(name() + " expects an output of shape " + shape_text(shape) +
                            ", given " + shape_text(given));
    }
    if (out[f].data == nullptr) throw InvalidArgument(name() + ": no output (a null pointer)");
  }

  ConsumerSide& in = *s.consumer;
  SampleBuffer& buffer = in.buffer();
  // FIFO: the whole batch, each sample once. Reservoir and window: min_samples, then the batch
  // with replacement from what is held (the trainer replays rather than waits).
  const bool fifo = ctx.options.policy == Policy::fifo;
  const std::int64_t need = fifo ? batch : ctx.options.min_samples;
  s.step_all();
  bool drain = false;
  if (ctx.options.delivery == Delivery::nonblocking) {
    // Refused at once when only this rank's own later puts could bring what it waits for.
    auto refuse_waiting_for_itself = [&] {
      if (!s.only_own_puts_supply_any()) return;
      throw InvalidArgument(
          ctx.here() + ": a draw waits for " + std::to_string(need) +
          (fifo ? " samples (FIFO: its whole batch)" : " samples (min_samples)") +
          " and the buffer holds " + std::to_string(buffer.size()) +
          "; only this rank's own puts could bring more (" +
          (ctx.producers.size() == 1 ? "it is the store's only producer"
                                     : "every other producer ended") +
          ", and everything it put has arrived): put before drawing, or call end_of_stream()");
    };
    if (buffer.size() < need && !in.stream_over()) {
      refuse_waiting_for_itself();
      ctx.wait_until(ctx.site("draw (waiting for samples)",
                              "from producer ranks " + ranks_text(in.producers_not_ended())),
                     "the producers have not sent " + std::to_string(need) +
                         " samples to this consumer: they are not putting (or not calling "
                         "end_of_stream), or are stopped",
                     [&] {
                       s.step_all();
                       if (buffer.size() >= need || in.stream_over()) return true;
                       refuse_waiting_for_itself();
                       return false;
                     });
    }
    drain = in.stream_over();
  } else {
    // Drains only once an ingestion came up short (the stream is over: every end marker was
    // waited for), never because an end marker happened to arrive early: the same batches in
    // every run.
    const std::function<void()> progress = [&] { s.step_all(); };
    const std::function<void(std::size_t)> check_turn = [&](std::size_t p) {
      if (!s.only_own_puts_supply(p)) return;
      throw InvalidArgument(
          ctx.here() +
          ": a lossless draw waits for this rank's own next sample (the next in the fixed "
          "ingestion order is producer rank " +
          std::to_string(ctx.rank) +
          "'s, and everything it put has arrived), which only its own next put could bring: "
          "this rank must put before it draws (each producer its share of every consumer's "
          "ingest_per_draw), or call end_of_stream()");
    };
    const std::int64_t want = ctx.options.ingest_per_draw > 0 ? ctx.options.ingest_per_draw : batch;
    bool short_of = in.ingest_in_order(want, progress, check_turn) < want;
    while (!short_of && buffer.size() < need) {
      const std::int64_t more = need - buffer.size();
      short_of = in.ingest_in_order(more, progress, check_turn) < more;
    }
    drain = short_of || buffer.draining();
  }

  if (meta) {
    meta->clear();
    meta->reserve(static_cast<std::size_t>(batch));
  }
  std::int64_t row = 0;
  const SampleBuffer::Sink sink = [&](const std::byte* sample, const SampleMeta& m) {
    for (std::size_t f = 0; f < layout.size(); ++f) {
      const FieldLayout& l = layout[f];
      std::memcpy(static_cast<std::byte*>(out[f].data) + static_cast<std::size_t>(row) * l.bytes,
                  sample + l.offset, l.bytes);
    }
    if (meta) meta->push_back(m);
    ++row;
  };
  const std::int64_t n = drain ? buffer.drain(batch, sink) : buffer.draw(batch, sink);
  in.flush_acks();
  return n;
}

bool SampleStore::ended() const {
  if (!s_) return true;
  const StoreState& s = *s_;
  if (s.consumer) return s.consumer->stream_over();
  return s.stream_ended;
}

void SampleStore::progress() {
  live(s_, "progress").step_all();
}

void SampleStore::close() {
  StoreState& s = live(s_, "close");
  const StoreContext& ctx = s.ctx;
  if (s.producer && !s.stream_ended) end_of_stream();
  // What every wait below keeps doing: take in acknowledgements, and (a consumer) receive,
  // discard what lossless delivery has staged, and acknowledge, so that a producer still
  // putting (waiting for credit) gets it, reaches its own close() and sends its end marker.
  auto keep_flowing = [&] {
    if (s.producer) s.producer->take_acks();
    if (s.consumer) s.consumer->close_round();
  };
  // Consumers: everything up to every producer's end marker, then the last acknowledgement.
  if (s.consumer) {
    ConsumerSide& in = *s.consumer;
    ctx.wait_until(ctx.site("close (waiting for the end of stream)",
                            "from producer ranks " + ranks_text(in.producers_not_ended())),
                   "a producer is not calling close() (or end_of_stream)", [&] {
                     keep_flowing();
                     return in.all_ended() && in.nothing_staged();
                   });
    for (std::size_t p = 0; p < in.producers(); ++p) {
      const std::string rank = std::to_string(in.producer_rank(p));
      ctx.wait_until(ctx.site("close (acknowledging)", "to producer rank " + rank),
                     "producer rank " + rank + " is not calling close()", [&] {
                       keep_flowing();
                       return in.ack_free(p);
                     });
      in.send_close_ack(p);
    }
  }
  // Producers: every consumer's last acknowledgement, and every send complete.
  if (s.producer) {
    ProducerSide& out = *s.producer;
    for (std::size_t c = 0; c < out.consumers(); ++c) {
      const std::string rank = std::to_string(out.consumer_rank(c));
      ctx.wait_until(ctx.site("close (waiting for the consumer)", "consumer rank " + rank),
                     "consumer rank " + rank + " is not calling close()", [&] {
                       keep_flowing();
                       return out.finished_with(c);
                     });
    }
  }
  if (s.consumer) {
    ConsumerSide& in = *s.consumer;
    for (std::size_t p = 0; p < in.producers(); ++p) {
      const std::string rank = std::to_string(in.producer_rank(p));
      ctx.wait_until(ctx.site("close (acknowledging)", "to producer rank " + rank),
                     "producer rank " + rank + " is not calling close()", [&] {
                       keep_flowing();
                       return in.ack_free(p);
                     });
    }
  }
  s.closed = true;
  s.ctx.comm.reset();
}

StoreStats SampleStore::stats() const {
  if (!s_) throw InvalidArgument("sample store: stats on a moved-from store");
  const StoreState& s = *s_;
  StoreStats st;
  st.produced = s.produced;
  st.dropped = s.dropped;
  st.non_finite = s.non_finite;
  if (s.consumer) {
    const SampleBuffer& buffer = s.consumer->buffer();
    const BufferCounts& c = buffer.counts();
    st.ingested = c.ingested;
    st.drawn = c.drawn;
    st.reused = c.reused;
    st.evicted = c.evicted;
    st.rejected = c.rejected;
    st.discarded_at_close = s.consumer->discarded();
    st.mean_staleness = buffer.mean_staleness();
  }
  st.bytes = bytes();
  return st;
}

FieldMoments SampleStore::moments(const std::string& field) const {
  if (!s_) throw InvalidArgument("sample store: moments on a moved-from store");
  const StoreState& s = *s_;
  const std::vector<Field>& fields = s.ctx.options.fields;
  for (std::size_t f = 0; f < fields.size(); ++f) {
    if (fields[f].name != field) continue;
    if (fields[f].mask)
      throw InvalidArgument(s.ctx.label + ": field '" + field + "' is a mask: it has no moments");
    return s.consumer ? s.consumer->moments(f).result() : FieldMoments{};
  }
  throw InvalidArgument(s.ctx.label + ": no field '" + field + "'");
}

FieldMoments SampleStore::global_moments(const std::string& field) {
  StoreState& s = live(s_, "global_moments");
  const StoreContext& ctx = s.ctx;
  moments(field);  // the checks
  std::size_t f = 0;
  while (ctx.options.fields[f].name != field)
    ++f;
  const RunningMoments mine = s.consumer ? s.consumer->moments(f) : RunningMoments{};
  double local[3] = {mine.count, mine.mean, mine.m2};
  std::vector<double> all(3 * static_cast<std::size_t>(ctx.size));
  const std::string what = "MPI_Iallgather (moments of field '" + field + "')";
  ctx.comm->run(what.c_str(), [&](MPI_Request* r) {
    return MPI_Iallgather(local, 3, MPI_DOUBLE, all.data(), 3, MPI_DOUBLE, ctx.mpi(), r);
  });
  RunningMoments merged;  // in rank order: the same result on every rank
  for (int r = 0; r < ctx.size; ++r) {
    const double* m = all.data() + 3 * static_cast<std::size_t>(r);
    merged.merge(RunningMoments{m[0], m[1], m[2]});
  }
  return merged.result();
}

std::size_t SampleStore::bytes() const {
  if (!s_) return 0;
  const StoreState& s = *s_;
  return (s.producer ? s.producer->bytes() : 0) + (s.consumer ? s.consumer->bytes() : 0);
}

std::size_t SampleStore::sample_bytes() const {
  return s_ ? s_->ctx.layout.sample_bytes : 0;
}

const std::vector<int>& SampleStore::producers() const {
  if (!s_) throw InvalidArgument("sample store: producers on a moved-from store");
  return s_->ctx.producers;
}

const std::vector<int>& SampleStore::consumers() const {
  if (!s_) throw InvalidArgument("sample store: consumers on a moved-from store");
  return s_->ctx.consumers;
}

}  // namespace fullshard::store
