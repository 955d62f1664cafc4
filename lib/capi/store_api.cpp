// The C API of the in-situ sample store (include/fullshard/fullshard.h, "The in-situ sample
// store"): extern "C" functions over fullshard::store::SampleStore
// (fullshard/store/sample_store.hpp), which does all the work: this file converts the options,
// the arrays and the handles. Every function runs its body through capi::guarded
// (lib/capi/status.hpp): exceptions become statuses and the thread's last-error message.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/fullshard.h"
#include "fullshard/store/sample_store.hpp"
#include "lib/capi/handles.hpp"
#include "lib/capi/status.hpp"

namespace fs = fullshard;
namespace capi = fullshard::capi;
namespace st = fullshard::store;

namespace {

// A store handle's object: the store and its fields (the shapes and dtypes put and draw take).
struct Store {
  Store(st::SampleStore s, std::vector<st::Field> f, std::string n)
      : store(std::move(s)), fields(std::move(f)), name(std::move(n)) {}
  st::SampleStore store;
  std::vector<st::Field> fields;
  std::string name;
};

// Never destroyed: a store still alive at exit (no fullshard_finalize) must not free its
// communicator after MPI_Finalize. Its generations outlive fullshard_finalize, so a handle
// from before it is found out as freed after the next fullshard_init too.
capi::HandleTable<Store>& stores() {
  static auto* table = new capi::HandleTable<Store>(
      4, "store", "freed (fullshard_store_free or fullshard_finalize)");
  return *table;
}

Store& store_of(fullshard_store store) {
  capi::require_initialized();
  return *stores().get(store.id, "store");
}

template <class T>
T* required(T* p, const char* what) {
  if (!p) throw fs::InvalidArgument(std::string(what) + " is NULL");
  return p;
}

std::string dtype_text(std::int32_t dtype) {
  switch (dtype) {
    case FULLSHARD_FLOAT32:
      return "FULLSHARD_FLOAT32";
    case FULLSHARD_FLOAT64:
      return "FULLSHARD_FLOAT64";
    case FULLSHARD_INT32:
      return "FULLSHARD_INT32";
    case FULLSHARD_INT64:
      return "FULLSHARD_INT64";
  }
  return std::to_string(dtype) + " (not a fullshard_dtype)";
}

// The store's dtype of a fullshard_dtype; "" or the problem, naming `what`.
std::string dtype_of(std::int32_t dtype, fs::DType& out, const std::string& what) {
  if (dtype == FULLSHARD_FLOAT32) {
    out = fs::DType::f32;
    return {};
  }
  if (dtype == FULLSHARD_FLOAT64) {
    out = fs::DType::f64;
    return {};
  }
  return what + ": dtype " + dtype_text(dtype) +
         ": the sample store takes FULLSHARD_FLOAT32 and FULLSHARD_FLOAT64";
}

fs::DType dtype_or_throw(std::int32_t dtype, const std::string& what) {
  fs::DType t = fs::DType::f32;
  const std::string problem = dtype_of(dtype, t, what);
  if (!problem.empty()) throw fs::InvalidArgument(problem);
  return t;
}

// The store's enums of the C ones, by name (their numbers differ: FULLSHARD_STORE_RESERVOIR, the
// default, is 0). An unknown value is passed on as it is (never one of the store's), so that the
// store refuses it, naming it, with every rank.
st::Policy policy_of(std::int32_t p) {
  switch (p) {
    case FULLSHARD_STORE_RESERVOIR:
      return st::Policy::reservoir;
    case FULLSHARD_STORE_FIFO:
      return st::Policy::fifo;
    case FULLSHARD_STORE_WINDOW:
      return st::Policy::window;
  }
  return static_cast<st::Policy>(p);
}

st::Delivery delivery_of(std::int32_t d) {
  switch (d) {
    case FULLSHARD_STORE_NONBLOCKING:
      return st::Delivery::nonblocking;
    case FULLSHARD_STORE_LOSSLESS:
      return st::Delivery::lossless;
  }
  return static_cast<st::Delivery>(d);
}

st::NonFinite non_finite_of(std::int32_t n) {
  switch (n) {
    case FULLSHARD_STORE_REFUSE:
      return st::NonFinite::refuse;
    case FULLSHARD_STORE_DROP:
      return st::NonFinite::drop;
  }
  return static_cast<st::NonFinite>(n);
}

st::Role role_of(fullshard_store_role r) {
  switch (r) {
    case FULLSHARD_STORE_PRODUCER:
      return st::Role::producer;
    case FULLSHARD_STORE_CONSUMER:
      return st::Role::consumer;
    case FULLSHARD_STORE_BOTH:
      return st::Role::both;
  }
  return static_cast<st::Role>(r);
}

// The C options as the store's; "" or the first problem the store itself cannot name (a NULL
// pointer, a dims count, an integer dtype), which create() hands to the store as the options'
// binding_refusal. The rest (extents, names, enums, numbers) the store checks. Either way every
// rank is refused with the first bad rank's text, prefixed by the store's name.
std::string convert(const fullshard_store_options& c, st::StoreOptions& o) {
  if (c.name) o.name = c.name;
  o.policy = policy_of(c.policy);
  o.delivery = delivery_of(c.delivery);
  o.non_finite = non_finite_of(c.non_finite);
  o.capacity = c.capacity;
  o.window = c.window;
  o.in_flight = c.in_flight;
  o.ingest_per_draw = c.ingest_per_draw;
  o.min_samples = c.min_samples;
  o.seed = c.seed;
  o.timeout_s = c.timeout_s;
  if (c.n_fields < 0) return "options->n_fields is " + std::to_string(c.n_fields);
  if (c.n_fields > 0 && !c.fields) return "options->fields is NULL";
  for (int f = 0; f < c.n_fields; ++f) {
    const fullshard_store_field& in = c.fields[f];
    std::string what = "options->fields[" + std::to_string(f) + "]";
    if (!in.name) return what + ".name is NULL";
    what += " ('" + std::string(in.name) + "')";
    st::Field field;
    field.name = in.name;
    if (in.ndim < 0 || in.ndim > FULLSHARD_MAX_DIMS)
      return what + ": ndim is " + std::to_string(in.ndim) + "; expected 0 (a scalar) to " +
             std::to_string(FULLSHARD_MAX_DIMS);
    field.shape.assign(in.shape, in.shape + in.ndim);
    const std::string problem = dtype_of(in.dtype, field.dtype, what);
    if (!problem.empty()) return problem;
    field.store_as_f32 = in.store_as_f32 != 0;
    field.mask = in.mask != 0;
    o.fields.push_back(std::move(field));
  }
  return {};
}

fullshard_status create(MPI_Comm comm, fullshard_store_role role,
                        const fullshard_store_options* options, fullshard_store* store,
                        const char* call) {
  return capi::guarded(call, [&] {
    capi::require_initialized();
    if (store) *store = fullshard_store{0};
    st::StoreOptions o;
    // A refusal of this rank's own still goes through the store's construction, which refuses
    // it on every rank with its text (the other ranks learn that this rank's options are bad
    // instead of waiting for it); it never returns a store.
    o.binding_refusal = !store     ? "store is NULL"
                        : !options ? "options is NULL"
                                   : convert(*options, o);
    std::vector<st::Field> fields = o.fields;
    std::string name = o.name;
    st::SampleStore s(comm, role_of(role), std::move(o));
    store->id =
        stores().add(std::make_shared<Store>(std::move(s), std::move(fields), std::move(name)));
  });
}

// Strides of a fullshard_array: {} when all 0 (contiguous), else every one >= 1.
std::vector<std::int64_t> strides_of(const fullshard_array& a, const std::string& what) {
  bool strided = false;
  for (int d = 0; d < a.ndim; ++d)
    strided = strided || a.strides[d] != 0;
  if (!strided) return {};
  for (int d = 0; d < a.ndim; ++d)
    if (a.strides[d] < 1)
      throw fs::InvalidArgument(what + ": strides[" + std::to_string(d) + "] is " +
                                std::to_string(a.strides[d]) +
                                "; strides are >= 1 (or all 0 for a contiguous array)");
  return std::vector<std::int64_t>(a.strides, a.strides + a.ndim);
}

void check_ndim(const fullshard_array& a, const std::string& what) {
  if (a.ndim < 0 || a.ndim > FULLSHARD_MAX_DIMS)
    throw fs::InvalidArgument(what + ": ndim is " + std::to_string(a.ndim) + "; expected 0 to " +
                              std::to_string(FULLSHARD_MAX_DIMS));
}

std::string field_text(const Store& s, std::size_t f, const char* array) {
  return "sample store '" + s.name + "': " + array + "[" + std::to_string(f) + "]";
}

// Copies the first `rows` rows of a contiguous row-major array of `shape` into `dst`, which has
// that shape with `strides` (elements of `size` bytes).
void scatter(const std::byte* src, std::byte* dst, const std::vector<std::int64_t>& shape,
             const std::vector<std::int64_t>& strides, std::int64_t rows, std::size_t size) {
  std::int64_t row_elements = 1;
  for (std::size_t d = 1; d < shape.size(); ++d)
    row_elements *= shape[d];
  const std::size_t nd = shape.size();
  std::vector<std::int64_t> idx(nd, 0);
  std::int64_t at = 0;  // elements from dst
  for (std::int64_t e = 0; e < rows * row_elements; ++e) {
    std::memcpy(dst + at * static_cast<std::ptrdiff_t>(size),
                src + static_cast<std::size_t>(e) * size, size);
    for (std::size_t d = nd; d-- > 0;) {  // the next row-major index
      at += strides[d];
      if (++idx[d] < shape[d]) break;
      at -= strides[d] * shape[d];
      idx[d] = 0;
    }
  }
}

struct Meta {
  std::int64_t* steps;
  int* ranks;
  std::int64_t* tags;
  bool wanted() const { return steps || ranks || tags; }
  void copy(const std::vector<st::SampleMeta>& meta) const {
    for (std::size_t i = 0; i < meta.size(); ++i) {
      if (steps) steps[i] = meta[i].step;
      if (ranks) ranks[i] = meta[i].rank;
      if (tags) tags[i] = meta[i].tag;
    }
  }
};

void fill(fullshard_field_moments& out, const st::FieldMoments& m) {
  out.count = m.count;
  out.mean = m.mean;
  out.stddev = m.stddev;
}

}  // namespace

void capi::free_stores() noexcept {
  try {
    stores().clear();  // each store's destructor: never waits, never throws
  } catch (...) {
    // No memory for the list: the stores stay (leaked) rather than fail finalize.
  }
}

extern "C" {

fullshard_store_options fullshard_store_options_default(void) {
  fullshard_store_options o;
  std::memset(&o, 0, sizeof o);
  const st::StoreOptions d;
  o.policy = FULLSHARD_STORE_RESERVOIR;
  o.delivery = FULLSHARD_STORE_NONBLOCKING;
  o.non_finite = FULLSHARD_STORE_REFUSE;
  o.capacity = d.capacity;
  o.window = d.window;
  o.in_flight = d.in_flight;
  o.ingest_per_draw = d.ingest_per_draw;
  o.min_samples = d.min_samples;
  o.seed = d.seed;
  o.timeout_s = d.timeout_s;
  return o;
}

fullshard_status fullshard_store_create(MPI_Comm comm, fullshard_store_role role,
                                        const fullshard_store_options* options,
                                        fullshard_store* store) {
  return create(comm, role, options, store, "fullshard_store_create");
}

fullshard_status fullshard_store_create_f(MPI_Fint comm, fullshard_store_role role,
                                          const fullshard_store_options* options,
                                          fullshard_store* store) {
  return create(MPI_Comm_f2c(comm), role, options, store, "fullshard_store_create_f");
}

fullshard_status fullshard_store_put(fullshard_store store, int64_t step, int64_t tag,
                                     const void* const* data, const int64_t* const* strides,
                                     int* sent) {
  return capi::guarded("fullshard_store_put", [&] {
    if (sent) *sent = 0;
    Store& s = store_of(store);
    required(data, "data");
    std::vector<st::ArrayView> views(s.fields.size());
    for (std::size_t f = 0; f < views.size(); ++f) {
      const st::Field& field = s.fields[f];
      views[f].data = data[f];
      views[f].dtype = field.dtype;
      views[f].shape = field.shape;
      if (!strides || !strides[f]) continue;
      views[f].strides.assign(strides[f], strides[f] + field.shape.size());
      for (std::size_t d = 0; d < field.shape.size(); ++d)
        if (strides[f][d] < 1)
          throw fs::InvalidArgument(field_text(s, f, "strides") + "[" + std::to_string(d) +
                                    "] (field '" + field.name + "') is " +
                                    std::to_string(strides[f][d]) + "; strides are >= 1");
    }
    const bool ok = s.store.put(step, tag, views);
    if (sent) *sent = ok ? 1 : 0;
  });
}

fullshard_status fullshard_store_put_arrays(fullshard_store store, int64_t step, int64_t tag,
                                            int n_fields, const fullshard_array* fields,
                                            int* sent) {
  return capi::guarded("fullshard_store_put_arrays", [&] {
    if (sent) *sent = 0;
    Store& s = store_of(store);
    if (n_fields < 0) throw fs::InvalidArgument("n_fields is " + std::to_string(n_fields));
    if (n_fields > 0) required(fields, "fields");
    std::vector<st::ArrayView> views(static_cast<std::size_t>(n_fields));
    for (std::size_t f = 0; f < views.size(); ++f) {
      const fullshard_array& a = fields[f];
      const std::string what = field_text(s, f, "fields");
      check_ndim(a, what);
      views[f].data = a.data;
      views[f].dtype = dtype_or_throw(a.dtype, what);
      views[f].shape.assign(a.shape, a.shape + a.ndim);
      views[f].strides = strides_of(a, what);
    }
    const bool ok = s.store.put(step, tag, views);  // checks the count, shapes and dtypes
    if (sent) *sent = ok ? 1 : 0;
  });
}

fullshard_status fullshard_store_end_of_stream(fullshard_store store) {
  return capi::guarded("fullshard_store_end_of_stream",
                       [&] { store_of(store).store.end_of_stream(); });
}

fullshard_status fullshard_store_draw(fullshard_store store, int64_t batch, void* const* out,
                                      int64_t* steps, int* ranks, int64_t* tags, int64_t* drawn) {
  return capi::guarded("fullshard_store_draw", [&] {
    Store& s = store_of(store);
    required(drawn, "drawn");
    *drawn = 0;
    required(out, "out");
    std::vector<st::MutableArrayView> views(s.fields.size());
    for (std::size_t f = 0; f < views.size(); ++f) {
      const st::Field& field = s.fields[f];
      views[f].data = out[f];
      views[f].dtype = field.store_as_f32 ? fs::DType::f32 : field.dtype;
      views[f].shape = {batch};
      views[f].shape.insert(views[f].shape.end(), field.shape.begin(), field.shape.end());
    }
    const Meta meta{steps, ranks, tags};
    std::vector<st::SampleMeta> origins;
    *drawn = s.store.draw(batch, views, meta.wanted() ? &origins : nullptr);
    meta.copy(origins);
  });
}

fullshard_status fullshard_store_draw_arrays(fullshard_store store, int64_t batch, int n_fields,
                                             const fullshard_array* out, int64_t* steps, int* ranks,
                                             int64_t* tags, int64_t* drawn) {
  return capi::guarded("fullshard_store_draw_arrays", [&] {
    Store& s = store_of(store);
    required(drawn, "drawn");
    *drawn = 0;
    if (n_fields < 0) throw fs::InvalidArgument("n_fields is " + std::to_string(n_fields));
    if (n_fields > 0) required(out, "out");
    // A strided output is drawn into a contiguous copy, then scattered into it.
    std::vector<st::MutableArrayView> views(static_cast<std::size_t>(n_fields));
    std::vector<std::vector<std::int64_t>> strides(views.size());
    std::vector<std::vector<std::byte>> staging(views.size());
    for (std::size_t f = 0; f < views.size(); ++f) {
      const fullshard_array& a = out[f];
      const std::string what = field_text(s, f, "out");
      check_ndim(a, what);
      views[f].dtype = dtype_or_throw(a.dtype, what);
      views[f].shape.assign(a.shape, a.shape + a.ndim);
      views[f].data = a.data;
      strides[f] = strides_of(a, what);
      std::vector<std::int64_t> contiguous(views[f].shape.size(), 1);
      std::int64_t elements = 1;
      for (std::size_t d = contiguous.size(); d-- > 0;) {
        contiguous[d] = elements;
        elements *= views[f].shape[d] > 0 ? views[f].shape[d] : 0;
      }
      if (strides[f].empty() || strides[f] == contiguous || a.data == nullptr) {
        strides[f].clear();
        continue;
      }
      // The store checks the shape before it writes; a wrong one never reaches the copy.
      staging[f].resize(static_cast<std::size_t>(elements) * fs::dtype_size(views[f].dtype));
      views[f].data = staging[f].data();
    }
    const Meta meta{steps, ranks, tags};
    std::vector<st::SampleMeta> origins;
    const std::int64_t n = s.store.draw(batch, views, meta.wanted() ? &origins : nullptr);
    for (std::size_t f = 0; f < views.size(); ++f)
      if (!strides[f].empty())
        scatter(staging[f].data(), static_cast<std::byte*>(out[f].data), views[f].shape, strides[f],
                n, fs::dtype_size(views[f].dtype));
    meta.copy(origins);
    *drawn = n;
  });
}

fullshard_status fullshard_store_ended(fullshard_store store, int* ended) {
  return capi::guarded("fullshard_store_ended", [&] {
    Store& s = store_of(store);
    *required(ended, "ended") = s.store.ended() ? 1 : 0;
  });
}

fullshard_status fullshard_store_progress(fullshard_store store) {
  return capi::guarded("fullshard_store_progress", [&] { store_of(store).store.progress(); });
}

fullshard_status fullshard_store_stats(fullshard_store store, fullshard_store_stats_info* stats) {
  return capi::guarded("fullshard_store_stats", [&] {
    Store& s = store_of(store);
    fullshard_store_stats_info* out = required(stats, "stats");
    const st::StoreStats c = s.store.stats();
    out->produced = c.produced;
    out->dropped = c.dropped;
    out->non_finite = c.non_finite;
    out->ingested = c.ingested;
    out->drawn = c.drawn;
    out->reused = c.reused;
    out->evicted = c.evicted;
    out->rejected = c.rejected;
    out->discarded_at_close = c.discarded_at_close;
    out->mean_staleness = c.mean_staleness;
    out->bytes = static_cast<std::int64_t>(c.bytes);
  });
}

fullshard_status fullshard_store_moments(fullshard_store store, const char* field,
                                         fullshard_field_moments* moments) {
  return capi::guarded("fullshard_store_moments", [&] {
    Store& s = store_of(store);
    required(field, "field");
    fill(*required(moments, "moments"), s.store.moments(field));
  });
}

fullshard_status fullshard_store_global_moments(fullshard_store store, const char* field,
                                                fullshard_field_moments* moments) {
  return capi::guarded("fullshard_store_global_moments", [&] {
    Store& s = store_of(store);
    required(field, "field");
    fill(*required(moments, "moments"), s.store.global_moments(field));
  });
}

fullshard_status fullshard_store_bytes(fullshard_store store, int64_t* bytes,
                                       int64_t* sample_bytes) {
  return capi::guarded("fullshard_store_bytes", [&] {
    Store& s = store_of(store);
    *required(bytes, "bytes") = static_cast<std::int64_t>(s.store.bytes());
    if (sample_bytes) *sample_bytes = static_cast<std::int64_t>(s.store.sample_bytes());
  });
}

fullshard_status fullshard_store_close(fullshard_store store) {
  return capi::guarded("fullshard_store_close", [&] { store_of(store).store.close(); });
}

fullshard_status fullshard_store_free(fullshard_store* store) {
  return capi::guarded("fullshard_store_free", [&] {
    capi::require_initialized();
    required(store, "store");
    if (store->id == 0) return;
    stores().remove(store->id, "store");
    *store = fullshard_store{0};
  });
}

}  // extern "C"
