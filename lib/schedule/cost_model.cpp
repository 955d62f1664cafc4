#include "fullshard/schedule/cost_model.hpp"

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "fullshard/base/error.hpp"
#include "fullshard/comm/communicator.hpp"
#include "fullshard/comm/stream.hpp"
#include "fullshard/kernels/quantize.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "lib/base/json_reader.hpp"
#include "lib/comm/shm.hpp"
#include "lib/kernels/multi_source.hpp"

namespace fullshard::schedule {

const char* collective_kind_name(CollectiveKind k) noexcept {
  switch (k) {
    case CollectiveKind::all_gather:
      return "all_gather";
    case CollectiveKind::reduce_scatter:
      return "reduce_scatter";
    case CollectiveKind::all_reduce:
      return "all_reduce";
  }
  return "?";
}

const char* mesh_dim_name(MeshDim d) noexcept {
  return d == MeshDim::shard ? "shard" : "replicate";
}

namespace {

constexpr CollectiveKind kKinds[] = {CollectiveKind::all_gather, CollectiveKind::reduce_scatter,
                                     CollectiveKind::all_reduce};
constexpr MeshDim kDims[] = {MeshDim::shard, MeshDim::replicate};
constexpr CollectiveKind kShmKinds[] = {CollectiveKind::all_gather, CollectiveKind::reduce_scatter};
// Shared-memory defaults: alpha (the counter handshake) and the copy bandwidth.
constexpr double kShmAlphaMs = 0.005;

[[noreturn]] void fail(const std::string& source, const std::string& path,
                       const std::string& what) {
  throw ConfigError(source + ": " + (path.empty() ? std::string("(top level)") : path) + ": " +
                    what);
}

std::string member(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

double non_negative(const nlohmann::json& v, const std::string& source, const std::string& path) {
  if (!v.is_number()) fail(source, path, "expected a number, got " + v.dump());
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < 0)
    fail(source, path, "expected a finite number >= 0, got " + v.dump());
  return d;
}

void check_object(const nlohmann::json& v, const std::string& source, const std::string& path) {
  if (!v.is_object()) fail(source, path, "expected an object, got " + v.dump());
}

}  // namespace

void AlphaBeta::set_points(std::vector<Point> p) {
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (!std::isfinite(p[i].bytes) || !std::isfinite(p[i].ms) || p[i].bytes < 0 || p[i].ms < 0)
      throw InvalidArgument("AlphaBeta: point " + std::to_string(i) +
                            " must have finite bytes and ms >= 0");
    if (i > 0 && !(p[i].bytes > p[i - 1].bytes))
      throw InvalidArgument("AlphaBeta: the points' bytes must increase (point " +
                            std::to_string(i) + " has " + std::to_string(p[i].bytes) +
                            ", the one before " + std::to_string(p[i - 1].bytes) + ")");
  }
  points = std::move(p);
}

double AlphaBeta::interpolated_ms(double bytes) const noexcept {
  // The first point with more bytes; past the last: the last point plus the line's slope.
  const auto hi = std::upper_bound(points.begin(), points.end(), bytes,
                                   [](double b, const Point& p) { return b < p.bytes; });
  if (hi == points.begin()) {  // from (0, alpha) to the first point
    const Point& b = points.front();
    const double a = std::min(alpha_ms, b.ms);
    return b.bytes > 0 ? a + std::max(0.0, bytes) * (b.ms - a) / b.bytes : b.ms;
  }
  if (hi == points.end())
    return points.back().ms + (bytes - points.back().bytes) * beta_ms_per_byte;
  const Point& a = *(hi - 1);
  return a.ms + (bytes - a.bytes) * (hi->ms - a.ms) / (hi->bytes - a.bytes);
}

CostModel CostModel::defaults(const MeshShape& mesh, double alpha_ms, double bus_gb_per_s,
                              double copy_gb_per_s) {
  if (!(bus_gb_per_s > 0) || !(copy_gb_per_s > 0) || !(alpha_ms >= 0))
    throw InvalidArgument("CostModel::defaults: alpha must be >= 0 and bandwidths > 0");
  CostModel c;
  const double bus = bus_gb_per_s * 1e6;  // bytes per ms
  for (MeshDim d : kDims) {
    const int n = d == MeshDim::shard ? mesh.shard_size : mesh.replicate_size;
    const double n1 = n > 1 ? n - 1 : 0;
    c.collective(CollectiveKind::all_gather, d) = {alpha_ms, n1 / bus};
    c.collective(CollectiveKind::reduce_scatter, d) = {alpha_ms, n1 / bus};
    c.collective(CollectiveKind::all_reduce, d) = {alpha_ms, n > 1 ? 2.0 * n1 / n / bus : 0.0};
    const double copy_beta = std::max(n, 1) / (copy_gb_per_s * 1e6);
    for (CollectiveKind k : kShmKinds)
      c.shm_collective(k, d) = {kShmAlphaMs, copy_beta};
  }
  c.copy_gb_per_s_ = copy_gb_per_s;
  return c;
}

CostModel CostModel::scaled(double factor) const {
  if (!(factor > 0) || !std::isfinite(factor))
    throw InvalidArgument("CostModel::scaled: the factor must be > 0 and finite, not " +
                          std::to_string(factor));
  CostModel c = *this;
  auto scale = [factor](AlphaBeta& ab) {
    ab.alpha_ms *= factor;
    ab.beta_ms_per_byte *= factor;
    std::vector<AlphaBeta::Point> points = ab.points;
    for (AlphaBeta::Point& p : points)
      p.ms *= factor;
    ab.set_points(std::move(points));
  };
  for (CollectiveKind k : kKinds)
    for (MeshDim d : kDims)
      scale(c.collective(k, d));
  for (CollectiveKind k : kShmKinds)
    for (MeshDim d : kDims)
      scale(c.shm_collective(k, d));
  c.copy_gb_per_s_ /= factor;
  c.quant_ns_per_element_ *= factor;
  return c;
}

MeshShape MeshShape::of(const DeviceMesh& mesh) {
  const int shard = mesh.size(mesh.names().back());
  return mesh.ndim() > 1 ? hsdp(mesh.size(mesh.names().front()), shard) : fsdp(shard);
}

CostModel mesh_defaults(const DeviceMesh& mesh) {
  const std::string shard_dim = mesh.names().back();
  CostModel c = CostModel::defaults(MeshShape::of(mesh));
  if (mesh.node_split(shard_dim))
    c.set_transport(MeshDim::shard, Transport::two_level);
  else if (mesh.shm(shard_dim))
    c.set_transport(MeshDim::shard, Transport::shm);
  return c;
}

CostModel::CostModel() {
  // Base values for defaults(); replaced there. Mesh {2, 2}: 1 GB/s bus, alpha 20 us.
  for (CollectiveKind k : kKinds)
    for (MeshDim d : kDims)
      collective(k, d) = {0.02, 1e-6};
  for (CollectiveKind k : kShmKinds)
    for (MeshDim d : kDims)
      shm_collective(k, d) = {kShmAlphaMs, 2.0 / (copy_gb_per_s_ * 1e6)};
}

const AlphaBeta& CostModel::collective(CollectiveKind k, MeshDim d) const noexcept {
  return c_[static_cast<int>(k)][static_cast<int>(d)];
}
AlphaBeta& CostModel::collective(CollectiveKind k, MeshDim d) noexcept {
  return c_[static_cast<int>(k)][static_cast<int>(d)];
}

double CostModel::time_ms(CollectiveKind k, MeshDim d, double bytes_per_rank) const noexcept {
  return collective(k, d).time_ms(bytes_per_rank);
}

const AlphaBeta& CostModel::shm_collective(CollectiveKind k, MeshDim d) const {
  if (k == CollectiveKind::all_reduce)
    throw InvalidArgument(
        "CostModel::shm_collective: all_reduce has no shared-memory form (only all_gather and "
        "reduce_scatter)");
  return shm_[static_cast<int>(k)][static_cast<int>(d)];
}
AlphaBeta& CostModel::shm_collective(CollectiveKind k, MeshDim d) {
  const CostModel& self = *this;
  return const_cast<AlphaBeta&>(self.shm_collective(k, d));
}

void CostModel::set_copy_gb_per_s(double v) {
  if (!(v > 0) || !std::isfinite(v))
    throw InvalidArgument("CostModel: the copy bandwidth must be > 0 GB/s, got " +
                          std::to_string(v));
  copy_gb_per_s_ = v;
}

void CostModel::set_quant_ns_per_element(double v) {
  if (!(v > 0) || !std::isfinite(v))
    throw InvalidArgument("CostModel: the quantize cost must be > 0 ns per element, got " +
                          std::to_string(v));
  quant_ns_per_element_ = v;
}

bool CostModel::operator==(const CostModel& o) const noexcept {
  for (CollectiveKind k : kKinds)
    for (MeshDim d : kDims)
      if (collective(k, d) != o.collective(k, d)) return false;
  for (CollectiveKind k : kShmKinds)
    for (MeshDim d : kDims)
      if (shm_collective(k, d) != o.shm_collective(k, d)) return false;
  for (MeshDim d : kDims)
    if (transport(d) != o.transport(d)) return false;
  return copy_gb_per_s_ == o.copy_gb_per_s_ && quant_ns_per_element_ == o.quant_ns_per_element_;
}

namespace {

// {"alpha_ms": .., "beta_ms_per_byte": .., "points": [[bytes, ms], ...]} (points when any).
nlohmann::json alpha_beta_json(const AlphaBeta& ab) {
  nlohmann::json j = {{"alpha_ms", ab.alpha_ms}, {"beta_ms_per_byte", ab.beta_ms_per_byte}};
  if (!ab.points.empty()) {
    nlohmann::json pts = nlohmann::json::array();
    for (const AlphaBeta::Point& p : ab.points)
      pts.push_back({p.bytes, p.ms});
    j["points"] = pts;
  }
  return j;
}

// {"all_gather": {"shard": alpha_beta_json, ...}, ...} over `kinds`.
template <class Kinds, class Lookup>
nlohmann::json alpha_beta_table(const Kinds& kinds, Lookup&& ab) {
  nlohmann::json out = nlohmann::json::object();
  for (CollectiveKind k : kinds) {
    nlohmann::json per = nlohmann::json::object();
    for (MeshDim d : kDims)
      per[mesh_dim_name(d)] = alpha_beta_json(ab(k, d));
    out[collective_kind_name(k)] = per;
  }
  return out;
}

}  // namespace

std::string CostModel::to_json(int indent) const {
  nlohmann::json j =
      alpha_beta_table(kKinds, [this](CollectiveKind k, MeshDim d) { return collective(k, d); });
  j["copy_gb_per_s"] = copy_gb_per_s_;
  j["quant_ns_per_element"] = quant_ns_per_element_;
  nlohmann::json transport = nlohmann::json::object();
  for (MeshDim d : kDims)
    transport[mesh_dim_name(d)] = transport_name(this->transport(d));
  j["transport"] = transport;
  j["shm"] = alpha_beta_table(kShmKinds,
                              [this](CollectiveKind k, MeshDim d) { return shm_collective(k, d); });
  return j.dump(indent);
}

namespace {

// The mesh dim a key names ("shard", "replicate"), or fails naming the JSON path.
MeshDim dim_named(const std::string& key, const std::string& source, const std::string& path) {
  for (MeshDim d : kDims)
    if (key == mesh_dim_name(d)) return d;
  fail(source, path, "unknown key '" + key + "' (allowed: shard, replicate)");
}

// [[bytes, ms], ...] with increasing bytes, at `path`.
std::vector<AlphaBeta::Point> read_points(const nlohmann::json& v, const std::string& source,
                                          const std::string& path) {
  if (!v.is_array()) fail(source, path, "expected an array of [bytes, ms] pairs, got " + v.dump());
  std::vector<AlphaBeta::Point> out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const std::string ipath = path + "[" + std::to_string(i) + "]";
    if (!v[i].is_array() || v[i].size() != 2)
      fail(source, ipath, "expected a [bytes, ms] pair, got " + v[i].dump());
    const AlphaBeta::Point p{non_negative(v[i][0], source, ipath + "[0]"),
                             non_negative(v[i][1], source, ipath + "[1]")};
    if (!out.empty() && !(p.bytes > out.back().bytes))
      fail(source, ipath + "[0]",
           "the points' bytes must increase (" + v[i][0].dump() + " after " + v[i - 1][0].dump() +
               ")");
    out.push_back(p);
  }
  return out;
}

// {"shard": {"alpha_ms": .., "beta_ms_per_byte": .., "points": ..}, "replicate": {..}} at
// `path`, over `ab`.
template <class Lookup>
void read_dims(const nlohmann::json& v, const std::string& source, const std::string& path,
               Lookup&& ab) {
  check_object(v, source, path);
  for (auto dt = v.begin(); dt != v.end(); ++dt) {
    const std::string dpath = member(path, dt.key());
    const MeshDim dim = dim_named(dt.key(), source, dpath);
    check_object(dt.value(), source, dpath);
    AlphaBeta& out = ab(dim);
    for (auto f = dt.value().begin(); f != dt.value().end(); ++f) {
      const std::string fpath = member(dpath, f.key());
      if (f.key() == "alpha_ms")
        out.alpha_ms = non_negative(f.value(), source, fpath);
      else if (f.key() == "beta_ms_per_byte")
        out.beta_ms_per_byte = non_negative(f.value(), source, fpath);
      else if (f.key() == "points")
        out.points = read_points(f.value(), source, fpath);
      else
        fail(source, fpath,
             "unknown key '" + f.key() + "' (allowed: alpha_ms, beta_ms_per_byte, points)");
    }
  }
}

}  // namespace

namespace {

// Reads `j` over `base` (CostModel::parse_json).
CostModel cost_model_from_json(const nlohmann::json& j, const CostModel& base,
                               const std::string& source) {
  CostModel c = base;
  check_object(j, source, "");
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const std::string path = key;
    if (key == "copy_gb_per_s") {
      const double v = non_negative(it.value(), source, path);
      if (v <= 0) fail(source, path, "expected a bandwidth > 0");
      c.set_copy_gb_per_s(v);
      continue;
    }
    if (key == "quant_ns_per_element") {
      const double v = non_negative(it.value(), source, path);
      if (v <= 0) fail(source, path, "expected a time > 0 ns");
      c.set_quant_ns_per_element(v);
      continue;
    }
    if (key == "transport") {
      check_object(it.value(), source, path);
      for (auto dt = it.value().begin(); dt != it.value().end(); ++dt) {
        const std::string dpath = member(path, dt.key());
        const MeshDim dim = dim_named(dt.key(), source, dpath);
        const nlohmann::json& v = dt.value();
        if (v == "mpi")
          c.set_transport(dim, Transport::mpi);
        else if (v == "shm")
          c.set_transport(dim, Transport::shm);
        else if (v == "shm+mpi")
          c.set_transport(dim, Transport::two_level);
        else
          fail(source, dpath, "expected \"mpi\", \"shm\" or \"shm+mpi\", got " + v.dump());
      }
      continue;
    }
    if (key == "shm") {
      check_object(it.value(), source, path);
      for (auto kt = it.value().begin(); kt != it.value().end(); ++kt) {
        const std::string kpath = member(path, kt.key());
        const CollectiveKind* kind = nullptr;
        for (const CollectiveKind& k : kShmKinds)
          if (kt.key() == collective_kind_name(k)) kind = &k;
        if (!kind)
          fail(source, kpath,
               "unknown key '" + kt.key() + "' (allowed: all_gather, reduce_scatter)");
        read_dims(kt.value(), source, kpath,
                  [&](MeshDim d) -> AlphaBeta& { return c.shm_collective(*kind, d); });
      }
      continue;
    }
    const CollectiveKind* kind = nullptr;
    for (const CollectiveKind& k : kKinds)
      if (key == collective_kind_name(k)) kind = &k;
    if (!kind)
      fail(source, path,
           "unknown key '" + key +
               "' (allowed: all_gather, reduce_scatter, all_reduce, copy_gb_per_s, "
               "quant_ns_per_element, transport, shm)");
    read_dims(it.value(), source, path,
              [&](MeshDim d) -> AlphaBeta& { return c.collective(*kind, d); });
  }
  return c;
}

}  // namespace

CostModel CostModel::parse_json(const std::string& text, const CostModel& base,
                                const std::string& source) {
  // The graph loader's reader: duplicate keys, nesting and out-of-range numbers are refused
  // naming the JSON path. The document is a few levels deep, so the conversion is cheap.
  detail::JsonLimits limits;
  limits.max_depth = 64;
  const nlohmann::json j = detail::parse_json_strict(text, source, limits);
  return cost_model_from_json(j, base, source);
}

CostModel CostModel::load_json(const std::string& path, const CostModel& base) {
  return parse_json(fullshard::read_text_file(path, "cost model file"), base, path);
}

AlphaBeta fit_alpha_beta(const std::vector<double>& x, const std::vector<double>& t) {
  if (x.size() != t.size() || x.empty())
    throw InvalidArgument("fit_alpha_beta: need as many times as sizes, at least one");
  const double n = static_cast<double>(x.size());
  double sx = 0, st = 0, sxx = 0, sxt = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sx += x[i];
    st += t[i];
    sxx += x[i] * x[i];
    sxt += x[i] * t[i];
  }
  const double den = n * sxx - sx * sx;
  AlphaBeta ab;
  if (den > 0) {
    ab.beta_ms_per_byte = (n * sxt - sx * st) / den;
    ab.alpha_ms = (st - ab.beta_ms_per_byte * sx) / n;
  } else {
    ab.alpha_ms = st / n;
  }
  if (ab.beta_ms_per_byte < 0) {  // noise: all latency
    ab.beta_ms_per_byte = 0;
    ab.alpha_ms = st / n;
  }
  if (ab.alpha_ms < 0) {  // through the origin
    ab.alpha_ms = 0;
    ab.beta_ms_per_byte = sxx > 0 ? std::max(0.0, sxt / sxx) : 0.0;
  }
  return ab;
}

namespace {

// Slowest rank's value over the communicator (every rank gets it).
double agree_max(comm::Communicator& c, comm::Stream& s, double v) {
  double out = v;
  c.all_reduce(&v, &out, 1, DType::f64, comm::ReduceOp::max, s).wait();
  return out;
}

}  // namespace

CostModel CostModel::calibrate(const comm::Communicator& shard_comm, const CostModel& base,
                               const comm::Communicator* replicate_comm,
                               const std::vector<std::size_t>& sizes, int reps,
                               const comm::ShmComm* shard_shm, bool median,
                               const NodeSplit* shard_split) {
  if (sizes.empty() || reps < 1)
    throw InvalidArgument("CostModel::calibrate: need at least one size and one repetition");
  if (shard_shm && shard_split)
    throw InvalidArgument(
        "CostModel::calibrate: pass the shard dim's shared memory (one node) or "
        "its node split (across nodes), not both");
  if (shard_shm && shard_shm->size() != shard_comm.size())
    throw InvalidArgument("CostModel::calibrate: the shared memory '" + shard_shm->name() +
                          "' has " + std::to_string(shard_shm->size()) +
                          " ranks, the shard communicator '" + shard_comm.name() + "' " +
                          std::to_string(shard_comm.size()) + " (pass the shard dim's)");
  if (shard_split && shard_split->nodes() * shard_split->ranks_per_node() != shard_comm.size())
    throw InvalidArgument("CostModel::calibrate: the node split has " +
                          std::to_string(shard_split->nodes() * shard_split->ranks_per_node()) +
                          " ranks, the shard communicator '" + shard_comm.name() + "' " +
                          std::to_string(shard_comm.size()) + " (pass the shard dim's)");
  comm::Stream s = comm::Stream::caller("fullshard.calibrate");
  // Two levels: the shard dim's MPI part runs across nodes, among one rank per node.
  const comm::Communicator& shard_mpi =
      shard_split ? shard_split->across(comm::StreamKind::compute) : shard_comm;
  std::unique_ptr<comm::Communicator> sc = shard_mpi.dup(shard_mpi.name() + ".calibrate");
  std::unique_ptr<comm::Communicator> rc =
      replicate_comm ? replicate_comm->dup(replicate_comm->name() + ".calibrate") : nullptr;
  // Two levels: the whole shard dim starts each measurement together (every column at once,
  // as in a step) and agrees on the slowest rank's time, so every rank gets the same model.
  std::unique_ptr<comm::Communicator> whole =
      shard_split ? shard_comm.dup(shard_comm.name() + ".calibrate") : nullptr;
  auto agree = [&](double v) {
    v = agree_max(*sc, s, v);
    if (whole) v = agree_max(*whole, s, v);
    if (rc) v = agree_max(*rc, s, v);
    return v;
  };

  std::size_t largest = 0;
  for (std::size_t b : sizes)
    largest = std::max(largest, b);
  const std::size_t max_count = (largest + 3) / 4;
  const int n = std::max(shard_comm.size(), rc ? rc->size() : 1);
  std::vector<float> a(max_count * static_cast<std::size_t>(n), 1.0f);
  std::vector<float> b(max_count * static_cast<std::size_t>(n), 0.0f);

  // Time of `op` at each size: fastest of reps, slowest rank.
  auto measure = [&](comm::Communicator& c, auto op) {
    std::vector<double> x, t;
    for (std::size_t bytes : sizes) {
      const std::size_t count = std::max<std::size_t>(1, (bytes + 3) / 4);
      double best = 1e300;
      std::vector<double> times;
      op(c, count);  // warm-up
      for (int r = 0; r < reps; ++r) {
        (whole ? *whole : c).barrier(s).wait();
        const double t0 = MPI_Wtime();
        op(c, count);
        times.push_back((MPI_Wtime() - t0) * 1e3);
        best = std::min(best, times.back());
      }
      if (median) {
        std::sort(times.begin(), times.end());
        best = times[times.size() / 2];
      }
      x.push_back(static_cast<double>(count * 4));
      t.push_back(agree(best));
    }
    AlphaBeta ab = fit_alpha_beta(x, t);
    std::vector<AlphaBeta::Point> points;  // sorted by size; a repeated size keeps its first time
    for (std::size_t i = 0; i < x.size(); ++i)
      points.push_back({x[i], t[i]});
    std::sort(
        points.begin(), points.end(),
        [](const AlphaBeta::Point& p, const AlphaBeta::Point& q) { return p.bytes < q.bytes; });
    points.erase(std::unique(points.begin(), points.end(),
                             [](const AlphaBeta::Point& p, const AlphaBeta::Point& q) {
                               return p.bytes == q.bytes;
                             }),
                 points.end());
    ab.set_points(std::move(points));
    return ab;
  };

  CostModel m = base;
  m.collective(CollectiveKind::all_gather, MeshDim::shard) =
      measure(*sc, [&](comm::Communicator& c, std::size_t count) {
        c.all_gather(a.data(), b.data(), count, DType::f32, s).wait();
      });
  // Two levels: the reduce-scatter's part across the nodes is an all-to-all of the nodes' sums
  // and the sum of the N received (what the transport runs).
  m.collective(CollectiveKind::reduce_scatter, MeshDim::shard) =
      measure(*sc, [&](comm::Communicator& c, std::size_t count) {
        if (!shard_split) {
          c.reduce_scatter(a.data(), b.data(), count, DType::f32, comm::ReduceOp::sum, s).wait();
          return;
        }
        c.all_to_all(a.data(), b.data(), count, DType::f32, s).wait();
        std::vector<const void*> sums(static_cast<std::size_t>(c.size()));
        for (int q = 0; q < c.size(); ++q)
          sums[static_cast<std::size_t>(q)] = b.data() + static_cast<std::size_t>(q) * count;
        kernels::reduce_sources(sums.data(), c.size(), DType::f32, DType::f32, a.data(), DType::f32,
                                static_cast<std::int64_t>(count), 1.0, false);
      });
  if (rc)
    m.collective(CollectiveKind::all_reduce, MeshDim::replicate) =
        measure(*rc, [&](comm::Communicator& c, std::size_t count) {
          c.all_reduce(a.data(), b.data(), count, DType::f32, comm::ReduceOp::sum, s).wait();
        });

  m.set_transport(MeshDim::shard, shard_split ? Transport::two_level
                                  : shard_shm ? Transport::shm
                                              : Transport::mpi);
  const comm::ShmComm* node_shm = shard_split ? &shard_split->local() : shard_shm;
  if (node_shm && node_shm->size() > 1) {
    // What the shared-memory transport does (lib/transport/shm_transport.cpp), over the node's
    // L ranks of the shard dim's W (one node: L = W). Each rank's segment holds W shards (the
    // unsharded gradients of a reduce-scatter; the all-gather's slots are the first N, one per
    // node). Counters 0/1: all-gather published/read, 2/3: the reduce-scatter's.
    const int L = node_shm->size();
    const int nodes = shard_split ? shard_split->nodes() : 1;
    const int W = L * nodes;
    const int me = node_shm->rank();
    const std::size_t seg_count = max_count * static_cast<std::size_t>(W);
    comm::ShmWindow win = node_shm->allocate(seg_count * 4, "fullshard.calibrate");
    std::fill_n(reinterpret_cast<float*>(win.local()), seg_count, 1.0f);
    const kernels::ExecStream host = kernels::ExecStream::host();
    std::uint64_t ag_round = 0, rs_round = 0;
    std::vector<const void*> sources(static_cast<std::size_t>(L));
    // All-gather: publish, wait for every peer's, copy every slot (this rank's too; two levels:
    // N per peer's segment) into the "unsharded parameters" (b), then tell the peers their
    // shards were read.
    m.shm_collective(CollectiveKind::all_gather,
                     MeshDim::shard) = measure(*sc, [&](comm::Communicator&, std::size_t count) {
      win.publish(0, ++ag_round);
      win.wait_all(0, ag_round, "all_gather", "calibration");
      for (int q = 0; q < W; ++q)
        kernels::cast_copy(host, win.segment(q % L) + static_cast<std::size_t>(q / L) * count * 4,
                           DType::f32, b.data() + static_cast<std::size_t>(q) * count, DType::f32,
                           static_cast<std::int64_t>(count));
      host.fence();
      win.publish(1, ag_round);
    });
    // Reduce-scatter: publish the gradients, wait for every peer's, sum this rank's chunk of
    // each with the divide fused (into the "sharded gradients", a; two levels: a chunk per
    // node, undivided, into the input of the all-to-all across), then release the chunks.
    m.shm_collective(CollectiveKind::reduce_scatter, MeshDim::shard) =
        measure(*sc, [&](comm::Communicator&, std::size_t count) {
          win.publish(2, ++rs_round);
          win.wait_all(2, rs_round, "reduce_scatter", "calibration");
          for (int node = 0; node < nodes; ++node) {
            for (int q = 0; q < L; ++q)
              sources[static_cast<std::size_t>(q)] =
                  win.segment(q) + static_cast<std::size_t>(node * L + me) * count * 4;
            kernels::reduce_sources(sources.data(), L, DType::f32, DType::f32,
                                    a.data() + static_cast<std::size_t>(node) * count, DType::f32,
                                    static_cast<std::int64_t>(count),
                                    shard_split ? 1.0 : static_cast<double>(W), false);
          }
          win.publish(3, rs_round);
        });
    // The window is freed (collectively) only after every rank's last read.
    win.wait_all(1, ag_round, "all_gather (peers still reading)", "calibration");
    win.wait_all(3, rs_round, "reduce_scatter (peers still reading)", "calibration");
  }

  // Copy bandwidth: a memcpy of the largest size, fastest of reps.
  double best = 1e300;
  const std::size_t bytes = max_count * 4;
  for (int r = 0; r < reps + 1; ++r) {
    const double t0 = MPI_Wtime();
    std::memcpy(b.data(), a.data(), bytes);
    best = std::min(best, (MPI_Wtime() - t0) * 1e3);
  }
  best = agree(std::max(best, 1e-6));
  m.copy_gb_per_s_ = static_cast<double>(bytes) / best / 1e6;

  // Quantize cost: an int8 encode of the largest size into `b` (codes, then scales).
  {
    const auto n = static_cast<std::int64_t>(max_count);
    const std::int64_t block = 256;
    auto* codes = reinterpret_cast<std::uint8_t*>(b.data());
    float* scales = b.data() + (max_count + 3) / 4;
    const kernels::ExecStream host = kernels::ExecStream::host();
    double q = 1e300;
    for (int r = 0; r < reps + 1; ++r) {
      const double t0 = MPI_Wtime();
      kernels::quantize(host, a.data(), DType::f32, n, block, kernels::QuantCode::int8, codes,
                        scales);
      host.fence();
      q = std::min(q, (MPI_Wtime() - t0) * 1e3);
    }
    m.quant_ns_per_element_ = agree(std::max(q, 1e-6)) * 1e6 / static_cast<double>(n);
  }
  return m;
}

// ---- two-level network ----

TwoLevelNetwork TwoLevelNetwork::dgx_h100() {
  TwoLevelNetwork n;
  n.gpus_per_node = 8;
  // docs/plan-format.md, "Two-level network": NCCL's ring latency per step (NVLink 3.4 us,
  // network 14 us, Simple protocol), NVLink 4 at 450 GB/s per direction, NDR 400 Gb/s.
  n.nvlink = {0.0034, 1.0 / (450.0 * 1e6)};
  n.infiniband = {0.014, 1.0 / (50.0 * 1e6)};
  return n;
}

std::pair<int, int> TwoLevelNetwork::span(const MeshShape& mesh, MeshDim d) const {
  const int G = std::max(1, gpus_per_node);
  const int S = std::max(1, mesh.shard_size);
  const int R = std::max(1, mesh.replicate_size);
  if (d == MeshDim::shard) {
    const int g = std::min(S, G);
    return {g, (S + g - 1) / g};
  }
  if (S >= G) return {1, R};
  const int g = std::max(1, std::min(R, G / S));
  return {g, (R + g - 1) / g};
}

AlphaBeta TwoLevelNetwork::collective(const MeshShape& mesh, CollectiveKind k, MeshDim d) const {
  const auto [g, m] = span(mesh, d);
  const double g1 = g - 1, m1 = m - 1;
  const double ring_beta = m1 * infiniband.beta_ms_per_byte + g1 * m * nvlink.beta_ms_per_byte;
  if (k != CollectiveKind::all_reduce)
    return {m1 * infiniband.alpha_ms + g1 * nvlink.alpha_ms, ring_beta};
  const double n = double(g) * m;
  const double tree_steps = m > 1 ? 2.0 * std::ceil(std::log2(double(m))) : 0.0;
  return {2.0 * g1 * nvlink.alpha_ms + tree_steps * infiniband.alpha_ms, 2.0 * ring_beta / n};
}

TwoLevelNetwork::LinkBytes TwoLevelNetwork::link_bytes(const MeshShape& mesh, CollectiveKind k,
                                                       MeshDim d, double bytes) const {
  const auto [g, m] = span(mesh, d);
  LinkBytes b;
  if (k != CollectiveKind::all_reduce) {
    b.infiniband = (m - 1) * bytes;
    b.nvlink = double(g - 1) * m * bytes;
  } else {
    const double chunk = bytes / (double(g) * m);
    b.infiniband = 2.0 * (m - 1) * chunk;
    b.nvlink = 2.0 * double(g - 1) * m * chunk;
  }
  return b;
}

CostModel TwoLevelNetwork::cost_model(const MeshShape& mesh, double copy_gb_per_s) const {
  CostModel c = CostModel::defaults(mesh, 0.02, 1.0, copy_gb_per_s);
  for (CollectiveKind k : kKinds)
    for (MeshDim d : kDims)
      c.collective(k, d) = collective(mesh, k, d);
  return c;
}

namespace {

nlohmann::json link_json(const AlphaBeta& ab) {
  return {{"alpha_ms", ab.alpha_ms},
          {"gb_per_s", ab.beta_ms_per_byte > 0 ? 1.0 / (ab.beta_ms_per_byte * 1e6) : 0.0}};
}

}  // namespace

std::string TwoLevelNetwork::to_json(int indent) const {
  return nlohmann::json{{"gpus_per_node", gpus_per_node},
                        {"nvlink", link_json(nvlink)},
                        {"infiniband", link_json(infiniband)}}
      .dump(indent);
}

namespace {
TwoLevelNetwork network_from_json(const nlohmann::json& j, const TwoLevelNetwork& base,
                                  const std::string& source) {
  TwoLevelNetwork n = base;
  check_object(j, source, "");
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    if (key == "gpus_per_node") {
      const nlohmann::json& v = it.value();
      if (!v.is_number_integer() || v.get<std::int64_t>() < 1 || v.get<std::int64_t>() > 1 << 20)
        fail(source, key, "expected an integer >= 1, got " + v.dump());
      n.gpus_per_node = v.get<int>();
      continue;
    }
    if (key != "nvlink" && key != "infiniband")
      fail(source, key, "unknown key '" + key + "' (allowed: gpus_per_node, nvlink, infiniband)");
    check_object(it.value(), source, key);
    AlphaBeta& ab = key == "nvlink" ? n.nvlink : n.infiniband;
    for (auto f = it.value().begin(); f != it.value().end(); ++f) {
      const std::string fpath = member(key, f.key());
      const double v = non_negative(f.value(), source, fpath);
      if (f.key() == "alpha_ms") {
        ab.alpha_ms = v;
      } else if (f.key() == "gb_per_s") {
        if (v <= 0) fail(source, fpath, "expected a bandwidth > 0");
        ab.beta_ms_per_byte = 1.0 / (v * 1e6);
      } else {
        fail(source, fpath, "unknown key '" + f.key() + "' (allowed: alpha_ms, gb_per_s)");
      }
    }
  }
  return n;
}

}  // namespace

TwoLevelNetwork TwoLevelNetwork::parse_json(const std::string& text, const TwoLevelNetwork& base,
                                            const std::string& source) {
  detail::JsonLimits limits;
  limits.max_depth = 64;
  return network_from_json(detail::parse_json_strict(text, source, limits), base, source);
}

TwoLevelNetwork TwoLevelNetwork::load_json(const std::string& path, const TwoLevelNetwork& base) {
  return parse_json(fullshard::read_text_file(path, "network file"), base, path);
}

}  // namespace fullshard::schedule
