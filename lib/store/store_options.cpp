#include "lib/store/store_options.hpp"

#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "fullshard/base/error.hpp"
#include "lib/store/describe.hpp"
#include "lib/store/sample_layout.hpp"

namespace fullshard::store {

std::string options_problem(const StoreOptions& o, Role role) {
  if (role != Role::producer && role != Role::consumer && role != Role::both)
    return "role " + std::to_string(static_cast<int>(role)) +
           ": expected producer, consumer or both";
  if (o.fields.empty()) return "no fields: a sample needs at least one";
  std::size_t total = 0;
  for (std::size_t f = 0; f < o.fields.size(); ++f) {
    const Field& field = o.fields[f];
    if (field.name.empty()) return "field " + std::to_string(f) + " has no name";
    for (std::size_t g = 0; g < f; ++g)
      if (o.fields[g].name == field.name) return "two fields named '" + field.name + "'";
    std::int64_t elements = 1;
    for (std::int64_t n : field.shape) {
      if (n < 1)
        return "field '" + field.name + "' has shape " + shape_text(field.shape) +
               ": every extent must be at least 1";
      if (elements > INT_MAX / n) return "field '" + field.name + "' is too large for a message";
      elements *= n;
    }
    if (field.dtype != DType::f32 && field.dtype != DType::f64 && field.dtype != DType::f16 &&
        field.dtype != DType::bf16)
      return "field '" + field.name + "' has an unknown dtype";
    if (field.store_as_f32 && field.dtype != DType::f64)
      return "field '" + field.name + "' is store_as_f32 with dtype " + dtype_name(field.dtype) +
             ": store_as_f32 keeps an f64 field as f32";
    const DType stored = field.store_as_f32 ? DType::f32 : field.dtype;
    total = align8(total) + static_cast<std::size_t>(elements) * dtype_size(stored);
    // A message (header + sample) is sent as one MPI_BYTE count, an int.
    if (total > static_cast<std::size_t>(INT_MAX) - 64)
      return "a sample is too large for a message";
  }
  if (o.policy != Policy::fifo && o.policy != Policy::reservoir && o.policy != Policy::window)
    return "policy " + std::to_string(static_cast<int>(o.policy)) + ": unknown";
  if (o.delivery != Delivery::nonblocking && o.delivery != Delivery::lossless)
    return "delivery " + std::to_string(static_cast<int>(o.delivery)) + ": unknown";
  if (o.non_finite != NonFinite::refuse && o.non_finite != NonFinite::drop)
    return "non_finite " + std::to_string(static_cast<int>(o.non_finite)) + ": unknown";
  if (o.capacity < 1)
    return "capacity " + std::to_string(o.capacity) + ": a buffer holds at least 1 sample";
  if (o.window < 0 || o.window > o.capacity)
    return "window " + std::to_string(o.window) + ": expected 0 (the capacity) to the capacity " +
           std::to_string(o.capacity);
  if (o.in_flight < 1)
    return "in_flight " + std::to_string(o.in_flight) +
           ": a producer needs at least 1 sample in transit per consumer";
  if (o.in_flight > (std::int64_t(1) << 20))
    return "in_flight " + std::to_string(o.in_flight) + ": at most 1048576";
  if (o.ingest_per_draw < 0)
    return "ingest_per_draw " + std::to_string(o.ingest_per_draw) +
           ": expected >= 0 (0: the batch)";
  const std::int64_t bound = o.policy == Policy::window && o.window > 0 ? o.window : o.capacity;
  if (o.min_samples < 1 || o.min_samples > bound)
    return "min_samples " + std::to_string(o.min_samples) + ": expected 1 to the buffer's bound (" +
           (o.policy == Policy::window && o.window > 0 ? "the window " : "the capacity ") +
           std::to_string(bound) + ")";
  if (!(o.timeout_s >= 0) || !std::isfinite(o.timeout_s))
    return "timeout_s " + value_text(o.timeout_s) + ": expected >= 0 (0: FULLSHARD_TIMEOUT)";
  return {};
}

std::vector<std::string> canonical_lines(const StoreOptions& o) {
  std::vector<std::string> lines;
  lines.push_back("name = " + o.name);
  lines.push_back("fields = " + std::to_string(o.fields.size()));
  for (std::size_t f = 0; f < o.fields.size(); ++f) {
    const Field& x = o.fields[f];
    lines.push_back("field " + std::to_string(f) + " = '" + x.name + "' shape " +
                    shape_text(x.shape) + " dtype " + dtype_name(x.dtype) + " store_as_f32 " +
                    (x.store_as_f32 ? "1" : "0") + " mask " + (x.mask ? "1" : "0"));
  }
  lines.push_back(std::string("policy = ") + policy_name(o.policy));
  lines.push_back(std::string("delivery = ") + delivery_name(o.delivery));
  lines.push_back("capacity = " + std::to_string(o.capacity));
  lines.push_back("window = " + std::to_string(o.window));
  lines.push_back("in_flight = " + std::to_string(o.in_flight));
  lines.push_back("ingest_per_draw = " + std::to_string(o.ingest_per_draw));
  lines.push_back("min_samples = " + std::to_string(o.min_samples));
  lines.push_back("seed = " + std::to_string(o.seed));
  lines.push_back(std::string("non_finite = ") +
                  (o.non_finite == NonFinite::drop ? "drop" : "refuse"));
  // timeout_s is not compared: each rank bounds only its own waits; binding_refusal is not
  // either (refuse_bad_options() has handled it before any comparison).
  return lines;
}

namespace {

std::string clip(const std::string& s) {
  return s.size() <= 400 ? s : s.substr(0, 400) + "...";
}

}  // namespace

void refuse_bad_options(BoundedComm& c, const std::string& problem, const std::string& label) {
  // The first rank with a problem (size: none), then its text: the same on every rank.
  int first = problem.empty() ? c.size() : c.rank();
  if (c.size() > 1)
    first = c.allreduce(first, MPI_MIN, "MPI_Iallreduce (whether a rank's options are bad)");
  if (first >= c.size()) return;
  std::string text = c.rank() == first ? problem : std::string();
  if (c.size() > 1) c.bcast(text, first, "MPI_Ibcast (the bad options' problem)");
  throw InvalidArgument(label + ": bad options on rank " + std::to_string(first) + ": " + text);
}

void agree_on_options(BoundedComm& c, const std::vector<std::string>& lines,
                      const std::string& label) {
  if (c.size() <= 1) return;
  const std::string what = "MPI_Iallreduce (" + label + " options fingerprint)";
  const std::size_t d = first_difference(c, lines, what.c_str());
  if (d == kNoDifference) return;
  const bool count_differs = d == 0;
  const std::string mine =
      count_differs ? std::to_string(lines.size()) + " entries, the first \"" +
                          (lines.empty() ? std::string("none") : clip(lines.front())) + "\""
                    : lines[d - 1];
  std::string first = c.rank() == 0 ? mine : std::string();
  c.bcast(first, 0, "MPI_Ibcast (options difference)");
  const int other = c.allreduce(mine != first ? c.rank() : c.size(), MPI_MIN,
                                "MPI_Iallreduce (options difference)");
  if (other >= c.size()) return;  // the hashes differ but not the texts: a hash collision
  std::string theirs = c.rank() == other ? mine : std::string();
  c.bcast(theirs, other, "MPI_Ibcast (options difference)");
  throw RankMismatch(label + ": the options differ across ranks" +
                     (count_differs ? std::string() : ", entry " + std::to_string(d - 1)) +
                     ": rank 0 has \"" + clip(first) + "\"; rank " + std::to_string(other) +
                     " has \"" + clip(theirs) +
                     "\" (the first rank that differs). Every rank of the store must pass the "
                     "same StoreOptions");
}

}  // namespace fullshard::store
