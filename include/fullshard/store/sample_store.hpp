// An in-situ sample store: simulation ranks (producers) put samples from their own arrays,
// training ranks (consumers: the same ranks, or other ranks of the same communicator) draw
// mini-batches mixed across the producers, each consumer from a buffer of bounded memory.
//
//   store::StoreOptions o;
//   o.fields = {{"x", {3}}, {"y", {2}}};  // reservoir, nonblocking, min_samples 1: the defaults
//   store::SampleStore samples(MPI_COMM_WORLD, store::Role::both, o);  // collective
//   float xb[32][3], yb[32][2];
//   const std::vector<store::MutableArrayView> batch = {{xb, DType::f32, {32, 3}},
//                                                       {yb, DType::f32, {32, 2}}};
//   for (std::int64_t step = 0; step < steps; ++step) {
//     simulate(step);                           // x[cell][3], y[cell][2]
//     for (std::int64_t cell : sampled_cells)   // every sampled cell of the step, then a draw
//       samples.put(step, cell, {{x[cell], DType::f32, {3}}, {y[cell], DType::f32, {2}}});
//     samples.draw(32, batch);                  // train on xb, yb
//   }
//   samples.end_of_stream();
//   while (samples.draw(32, batch) > 0) { ... }  // the buffer's last samples, each once
//   samples.close();                             // collective
//
// A reservoir or window draw waits only until the buffer holds `min_samples` samples (1) and
// draws with replacement from what is there: when the simulation is slower than the training,
// the trainer replays samples (StoreStats::reused) rather than waits. A FIFO draw waits for
// its whole batch (each sample is drawn once).
//
// Transport: one nonblocking MPI message per sample from its producer to one consumer (the
// producer's k-th goes to consumer (producer's index + k) mod consumers), with credits: a
// producer has at most `in_flight` samples unacknowledged by each consumer, in a ring of
// send buffers. Every wait is bounded by the store's timeout and ends in CommError naming the
// store, the rank and the peer waited for; a wait that only this rank itself could end (a draw
// whose samples can only come from this rank's own later puts, a lossless put whose credit can
// only come from this rank's own draws) is refused at once (InvalidArgument).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/base/dtype.hpp"

namespace fullshard::store {

/// Which samples a consumer's buffer keeps and how a draw picks them.
enum class Policy {
  /// A bounded queue: a draw takes the oldest samples, each once; an arrival into a full
  /// buffer pushes the oldest out (evicted).
  fifo,
  /// Vitter's algorithm R: the buffer holds a uniform sample of `capacity` of every sample
  /// this consumer ingested; a draw picks uniformly, with replacement.
  reservoir,
  /// The last `window` samples ingested; a draw picks uniformly among them, with replacement.
  window,
};

/// How samples travel from producers to consumers.
enum class Delivery {
  /// A put never waits: a sample whose consumer has `in_flight` samples unacknowledged is
  /// dropped (counted). A consumer ingests whatever has arrived, in any order, at each draw or
  /// progress().
  nonblocking,
  /// No sample is lost in transit, and a run is reproducible for a seed at the same rank
  /// counts: a put waits for credit; a consumer ingests in a fixed order (round robin over the
  /// producers, each in its own order, skipping the producers that ended) a fixed number of
  /// samples before each draw. Between two of its draws a consumer ingests `ingest_per_draw`
  /// samples, so the producers must together put at least as many as the consumers ingest, or
  /// a draw waits (up to the timeout) for a producer's next sample. The policy may still evict
  /// what arrived (a FIFO or window buffer pushes its oldest out when more is ingested than
  /// drawn, e.g. ingest_per_draw > batch; the reservoir rejects and replaces samples), and
  /// close() discards what was never ingested (StoreStats::discarded_at_close). After every
  /// producer's end_of_stream, draws start to drain the buffer at the first draw whose
  /// ingestion comes up short (every end marker was waited for), never earlier because an end
  /// marker happened to arrive: the batches do not depend on timing.
  lossless,
};

/// What a put does with a NaN or an infinity in a sample.
enum class NonFinite {
  /// InvalidArgument naming the store, field, element, step and rank.
  refuse,
  /// The sample is not sent: put returns false; counted in StoreStats::dropped and
  /// StoreStats::non_finite.
  drop,
};

/// What this rank does in the store.
enum class Role { producer, consumer, both };

/// One array of every sample.
struct Field {
  std::string name;
  /// The sample's shape (no batch dim); every extent >= 1; {} is a scalar.
  std::vector<std::int64_t> shape;
  DType dtype = DType::f32;
  /// An f64 field kept (sent, buffered, drawn) as f32: puts take f64 (rounded to nearest) or
  /// f32 arrays, draws give f32. Only for dtype f64.
  bool store_as_f32 = false;
  /// Elements must be 0 or 1 (checked at put); moments() does not keep statistics of a mask.
  bool mask = false;
};

/// The store's configuration; every rank of the communicator passes the same (checked).
/// Every rank checks its own first: bad options on any rank are InvalidArgument on every rank,
/// with the first such rank's problem; only then are the options compared (RankMismatch).
struct StoreOptions {
  std::vector<Field> fields;
  Policy policy = Policy::reservoir;
  Delivery delivery = Delivery::nonblocking;
  /// Samples each consumer rank's buffer holds: its memory bound (capacity x sample bytes).
  std::int64_t capacity = 1024;
  /// Policy::window: the last `window` samples (0: capacity; at most capacity).
  std::int64_t window = 0;
  /// Samples a producer may have in transit to one consumer (unacknowledged), >= 1.
  std::int64_t in_flight = 4;
  /// Delivery::lossless: samples a consumer ingests before each draw (0: the batch size).
  std::int64_t ingest_per_draw = 0;
  /// Policy::reservoir and Policy::window: a draw waits until the buffer holds this many
  /// samples (1 to its bound: capacity, or the window), then draws its batch with replacement
  /// from what is there (a batch larger than the buffer repeats samples). Checked but not used
  /// by Policy::fifo, whose draw waits for its whole batch.
  std::int64_t min_samples = 1;
  /// Seeds the consumers' random choices (each consumer its own stream, from the seed and its
  /// index among the consumers).
  std::uint64_t seed = 0;
  NonFinite non_finite = NonFinite::refuse;
  /// Bound on every wait, seconds (0: FULLSHARD_TIMEOUT from the environment, Settings).
  double timeout_s = 0;
  /// The store's name in messages.
  std::string name = "store";
  /// For language bindings (the C API): this rank's refusal of options that it could not even
  /// convert (a NULL pointer, an integer dtype, too many dims), as text. When not empty the
  /// store refuses this rank's options with it, as it refuses any bad option: InvalidArgument
  /// on every rank, carrying this text when this is the first bad rank. Not compared across
  /// ranks. Leave it empty from C++.
  std::string binding_refusal;
};

/// A producer's array of one field of one sample: any strides (in elements; empty: contiguous
/// row-major). A column-major (Fortran) array passes its dims and strides reversed, or its
/// dims as they are with strides {1, d0, d0 * d1, ...}.
struct ArrayView {
  const void* data = nullptr;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
};

/// Where a draw writes one field of a batch: shape [batch, field shape...], contiguous
/// row-major, the field's stored dtype (f32 for a store_as_f32 field).
struct MutableArrayView {
  void* data = nullptr;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
};

/// Where a drawn sample came from.
struct SampleMeta {
  std::int64_t step = 0;  ///< the producer's simulation step, as put
  int rank = -1;          ///< the producer's rank in the store's communicator
  std::int64_t tag = 0;   ///< the producer's tag (a position, a cell id), as put
};

/// This rank's counters.
struct StoreStats {
  std::int64_t produced = 0;  ///< puts sent (producer)
  std::int64_t dropped = 0;   ///< puts not sent: no credit (nonblocking) or non-finite (drop)
  /// Puts with a NaN or an infinity (refused or dropped); a put dropped for want of credit is
  /// not checked.
  std::int64_t non_finite = 0;
  std::int64_t ingested = 0;  ///< samples taken into this consumer's buffer
  std::int64_t drawn = 0;     ///< samples returned by draws
  std::int64_t reused = 0;    ///< draws of a sample drawn before
  std::int64_t evicted = 0;   ///< samples the policy replaced or pushed out of the buffer
  std::int64_t rejected = 0;  ///< reservoir: ingested samples algorithm R did not keep
  /// Lossless: samples that arrived but were never ingested, discarded by close() (it
  /// acknowledges them so that a producer still putting gets its credit); not counted in
  /// ingested, evicted or the moments. Nonblocking delivery ingests what close() receives.
  std::int64_t discarded_at_close = 0;
  /// Mean over the drawn samples of (the newest step this consumer had ingested at the draw)
  /// - (the sample's step); 0 before any draw.
  double mean_staleness = 0;
  std::size_t bytes = 0;  ///< SampleStore::bytes()
};

/// Running moments of one field over all its elements: population standard deviation.
struct FieldMoments {
  std::int64_t count = 0;
  double mean = 0;
  double stddev = 0;
};

// Opaque: the store's state (lib/store/sample_store.cpp).
struct StoreState;

/// The sample store of one communicator. Use it from one thread at a time.
class SampleStore {
 public:
  /// Collective over `comm` (duplicated: the store's messages never meet the caller's). Each
  /// rank checks its own options, then the ranks learn whether any rank's are bad: if so,
  /// InvalidArgument on every rank, carrying the first bad rank's problem ("bad options on
  /// rank r: ..."). Then they compare their options (RankMismatch naming the first difference)
  /// and exchange roles; there must be at least one producer and one consumer
  /// (InvalidArgument). Every step is a bounded collective (the job aborts at the timeout).
  SampleStore(MPI_Comm comm, Role role, StoreOptions options);
  /// Not collective, never throws, never waits: after close() it frees the communicator and
  /// the memory. Without close() (an error path) a send still in flight (to a consumer that
  /// stopped before receiving it) is left to MPI: its request freed, its buffer kept until
  /// MPI_Finalize; messages that arrived are received and discarded; and the store's
  /// communicator is kept (not freed) until MPI_Finalize, so that messages still on their way
  /// arrive there, never at a later communicator (MPI may give a freed communicator's context
  /// id to the next one created, which would match them in place of its own).
  ~SampleStore();
  SampleStore(SampleStore&&) noexcept;
  SampleStore& operator=(SampleStore&&) noexcept;
  SampleStore(const SampleStore&) = delete;
  SampleStore& operator=(const SampleStore&) = delete;

  /// Producer: one sample, one view per field in the order of StoreOptions::fields (shape
  /// equal to the field's, dtype equal, or f64/f32 for a store_as_f32 field:
  /// InvalidArgument naming the store, field, expected and given). `step`: the producer's
  /// simulation step; `tag`: the caller's position or id of the sample. Non-finite values:
  /// as StoreOptions::non_finite says; a mask element other than 0 or 1: InvalidArgument.
  /// Nonblocking delivery never waits: when the sample's consumer has `in_flight` samples
  /// unacknowledged the sample is dropped before its values are read (no non-finite or mask
  /// check, not counted in non_finite; the next put goes to the next consumer). Lossless
  /// delivery waits for credit before the checks (meanwhile receiving this rank's own incoming
  /// samples), up to the timeout (CommError naming the consumer rank); a put that could only
  /// get credit from this rank's own draws is refused (InvalidArgument). Returns whether the
  /// sample was sent.
  bool put(std::int64_t step, std::int64_t tag, const std::vector<ArrayView>& fields);

  /// Producer: no more puts; every consumer learns it (with the number of samples sent to
  /// it). A second call does nothing.
  void end_of_stream();

  /// Consumer: `batch` samples into one view per field, and their origins into `meta` when
  /// given (resized to the count). How many samples it waits for: reservoir and window,
  /// `min_samples` (then `batch` drawn with replacement from what the buffer holds); FIFO, the
  /// whole `batch` (a FIFO draw of more than `capacity` is refused). Nonblocking delivery waits
  /// (up to the timeout) until the buffer holds that many; lossless first ingests
  /// `ingest_per_draw` samples in the fixed order, then more until it holds that many. A wait
  /// that only this rank's own later puts could end (no other producer can send more: one
  /// rank, or the others ended; or lossless, whose next sample in order is this rank's own)
  /// is refused at once: InvalidArgument saying so. Once every producer ended and everything
  /// was ingested (lossless: at the first draw whose ingestion came up short), draws drain the
  /// buffer without replacement (FIFO: in order). Returns `batch`, or fewer only once the
  /// stream ended: 0 when nothing is left.
  std::int64_t draw(std::int64_t batch, const std::vector<MutableArrayView>& out,
                    std::vector<SampleMeta>* meta = nullptr);

  /// Consumer: every producer ended and everything it sent was ingested (the buffer may still
  /// hold samples to draw). A rank that is only a producer: its end_of_stream() was called.
  bool ended() const;

  /// Receives what has arrived without waiting (nonblocking delivery: ingests it and
  /// acknowledges; lossless: holds it until the draws ingest it in order) and takes in the
  /// producer's acknowledgements. Never needed for correctness; a consumer that draws rarely
  /// calls it to keep samples flowing.
  void progress();

  /// Ends the store's traffic, so that no message is left in flight: collective over the
  /// store's communicator. Producers end their stream (end_of_stream() if not called);
  /// consumers receive up to every producer's end marker and send a last acknowledgement;
  /// producers wait for it and for their sends. A consumer in close() keeps acknowledging
  /// what arrives, so producers still putting (lossless: waiting for credit) go on until they
  /// close too: nonblocking delivery ingests those samples into the buffer (never drawn),
  /// lossless discards every sample not yet ingested (StoreStats::discarded_at_close). Samples
  /// not drawn are lost with the store. Every wait is bounded by the timeout (CommError).
  /// Afterwards only stats(), moments(), ended(), bytes() and the destructor may be called.
  void close();

  /// This rank's counters.
  StoreStats stats() const;

  /// Running mean and standard deviation of `field` over every element of every sample this
  /// rank ingested (Welford; count 0 on a rank that is only a producer). InvalidArgument for
  /// an unknown field or a mask.
  FieldMoments moments(const std::string& field) const;

  /// The consumers' moments of `field` merged (Chan et al.), the same on every rank.
  /// Collective over the store's communicator.
  FieldMoments global_moments(const std::string& field);

  /// Bytes this rank holds for the store: the buffer's slots (allocated as samples arrive, up
  /// to its bound x sample_bytes()), the staging of received samples and the producer's send
  /// rings (in_flight x (32 + sample_bytes()) per consumer sent to and per producer received
  /// from).
  std::size_t bytes() const;

  /// Bytes of one sample (every field in its stored dtype, each field 8-byte aligned).
  std::size_t sample_bytes() const;

  /// The store's ranks that produce, and that consume (ranks of its communicator, ascending).
  const std::vector<int>& producers() const;
  const std::vector<int>& consumers() const;

 private:
  std::unique_ptr<StoreState> s_;
};

}  // namespace fullshard::store
