#include "fullshard/schedule/compute_cost.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

#include "fullshard/base/error.hpp"
#include "fullshard/schedule/plan.hpp"
#include "lib/base/json_reader.hpp"

namespace fullshard::schedule {

namespace {

constexpr std::int64_t kMaxGemmDim = std::int64_t(1) << 24;

[[noreturn]] void fail(const std::string& source, const std::string& path,
                       const std::string& what) {
  throw ConfigError(source + ": " + (path.empty() ? std::string("(top level)") : path) + ": " +
                    what);
}

double number(const nlohmann::json& v, const std::string& source, const std::string& path,
              bool positive) {
  if (!v.is_number()) fail(source, path, "expected a number, got " + v.dump());
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < 0 || (positive && d == 0))
    fail(source, path,
         std::string(positive ? "expected a finite number > 0" : "expected a finite number >= 0") +
             ", got " + v.dump());
  return d;
}

std::int64_t positive_integer(const nlohmann::json& v, const std::string& source,
                              const std::string& path) {
  if (!v.is_number_integer() || v.get<std::int64_t>() < 1)
    fail(source, path, "expected an integer >= 1, got " + v.dump());
  return v.get<std::int64_t>();
}

const nlohmann::json& object(const nlohmann::json& v, const std::string& source,
                             const std::string& path) {
  if (!v.is_object()) fail(source, path, "expected an object, got " + v.dump());
  return v;
}

ModuleTime module_time_from_json(const nlohmann::json& v, const std::string& source,
                                 const std::string& path) {
  ModuleTime t;
  bool has_f = false, has_b = false;
  for (auto it = object(v, source, path).begin(); it != v.end(); ++it) {
    const std::string p = detail::json_member(path, it.key());
    if (it.key() == "forward_ms") {
      t.forward_ms = number(it.value(), source, p, false);
      has_f = true;
    } else if (it.key() == "backward_ms") {
      t.backward_ms = number(it.value(), source, p, false);
      has_b = true;
    } else {
      fail(source, p,
           "unknown key " + detail::json_key_shown(it.key()) +
               " (allowed: forward_ms, backward_ms)");
    }
  }
  if (!has_f || !has_b)
    fail(source, path, std::string("missing key '") + (has_f ? "backward_ms" : "forward_ms") + "'");
  return t;
}

MeasuredModules measured_from_json(const nlohmann::json& e, const std::string& source,
                                   const std::string& path) {
  MeasuredModules m;
  bool has_model = false, has_shape = false, has_modules = false;
  for (auto it = object(e, source, path).begin(); it != e.end(); ++it) {
    const std::string p = detail::json_member(path, it.key());
    const nlohmann::json& v = it.value();
    if (it.key() == "model") {
      if (!v.is_string() || v.get<std::string>().empty())
        fail(source, p, "expected a non-empty string, got " + v.dump());
      m.model = v.get<std::string>();
      has_model = true;
    } else if (it.key() == "shape") {
      for (auto d = object(v, source, p).begin(); d != v.end(); ++d)
        m.shape[d.key()] = positive_integer(d.value(), source, detail::json_member(p, d.key()));
      has_shape = true;
    } else if (it.key() == "modules") {
      for (auto d = object(v, source, p).begin(); d != v.end(); ++d)
        m.modules[d.key()] =
            module_time_from_json(d.value(), source, detail::json_member(p, d.key()));
      if (m.modules.empty()) fail(source, p, "expected at least one module");
      has_modules = true;
    } else if (it.key() == "reps") {
      const std::int64_t r = positive_integer(v, source, p);
      if (r > 1 << 30) fail(source, p, "expected an integer in 1..2^30, got " + v.dump());
      m.reps = static_cast<int>(r);
    } else {
      fail(source, p,
           "unknown key " + detail::json_key_shown(it.key()) +
               " (allowed: model, shape, modules, reps)");
    }
  }
  if (!has_model || !has_shape || !has_modules)
    fail(source, path,
         std::string("missing key '") +
             (!has_model   ? "model"
              : !has_shape ? "shape"
                           : "modules") +
             "'");
  return m;
}

// Parses "MxNxK[:AB]" into g; returns "" or what is wrong with `text`.
std::string parse_gemm(const std::string& text, Gemm& g) {
  const std::string form =
      "'" + text + "' is not a GEMM shape MxNxK[:NN|NT|TN|TT] (e.g. 256x512x512:NT)";
  std::size_t pos = 0;
  std::int64_t* dims[] = {&g.m, &g.n, &g.k};
  for (int d = 0; d < 3; ++d) {
    if (d > 0) {
      if (pos >= text.size() || text[pos] != 'x') return form;
      ++pos;
    }
    const std::size_t start = pos;
    while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9')
      ++pos;
    if (pos == start || pos - start > 9) return form;
    const std::int64_t v = std::atoll(text.substr(start, pos - start).c_str());
    if (v < 1 || v > kMaxGemmDim)
      return "'" + text + "': size " + std::to_string(v) + " is not in 1.." +
             std::to_string(kMaxGemmDim);
    *dims[d] = v;
  }
  g.trans_a = g.trans_b = false;
  if (pos == text.size()) return "";
  if (text[pos] != ':') return form;
  ++pos;
  if (text.size() - pos != 2 || (text[pos] != 'N' && text[pos] != 'T') ||
      (text[pos + 1] != 'N' && text[pos + 1] != 'T'))
    return "'" + text + "': the transposes are two letters N or T (NN, NT, TN, TT)";
  g.trans_a = text[pos] == 'T';
  g.trans_b = text[pos + 1] == 'T';
  return "";
}

}  // namespace

std::string Gemm::to_string() const {
  return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) + ":" +
         (trans_a ? "T" : "N") + (trans_b ? "T" : "N");
}

Gemm Gemm::parse(const std::string& text, const std::string& what) {
  Gemm g;
  const std::string problem = parse_gemm(text, g);
  if (!problem.empty()) throw InvalidArgument(what + ": " + problem);
  return g;
}

double ComputeRates::gemm_gflop_per_s(const Gemm& g) const noexcept {
  const GemmRate* best = nullptr;
  double best_d = std::numeric_limits<double>::infinity();
  bool best_same = false;
  auto l = [](std::int64_t a, std::int64_t b) {
    return std::fabs(
        std::log(double(std::max<std::int64_t>(a, 1)) / double(std::max<std::int64_t>(b, 1))));
  };
  for (const GemmRate& r : gemm) {
    if (r.shape == g) return r.gflop_per_s;
    const bool same = r.shape.trans_a == g.trans_a && r.shape.trans_b == g.trans_b;
    const double d = l(r.shape.m, g.m) + l(r.shape.n, g.n) + l(r.shape.k, g.k);
    if ((same && !best_same) || (same == best_same && d < best_d)) {
      best = &r;
      best_d = d;
      best_same = same;
    }
  }
  return best ? best->gflop_per_s : default_gemm_gflop_per_s;
}

double ComputeRates::time_ms(const Gemm& g) const noexcept {
  return g.flops() / (gemm_gflop_per_s(g) * 1e6);
}

double ComputeRates::time_ms(const ModuleWork& w) const noexcept {
  double t = w.elementwise_bytes / (elementwise_gb_per_s * 1e6);
  for (const Gemm& g : w.gemms)
    t += time_ms(g);
  return t;
}

double ComputeRates::optimizer_ms(const std::string& optimizer, double elements) const {
  if (optimizer == "adamw") return elements * adamw_ns_per_element * 1e-6;
  if (optimizer == "sgd") return elements * sgd_ns_per_element * 1e-6;
  throw InvalidArgument("ComputeRates::optimizer_ms: unknown optimizer '" + optimizer +
                        "' (adamw or sgd)");
}

std::string ComputeRates::to_json(int indent) const {
  nlohmann::json g = nlohmann::json::array();
  for (const GemmRate& r : gemm)
    g.push_back({{"shape", r.shape.to_string()}, {"gflop_per_s", r.gflop_per_s}});
  nlohmann::json j = {{"gemm", g},
                      {"default_gemm_gflop_per_s", default_gemm_gflop_per_s},
                      {"elementwise_gb_per_s", elementwise_gb_per_s},
                      {"adamw_ns_per_element", adamw_ns_per_element},
                      {"sgd_ns_per_element", sgd_ns_per_element},
                      {"ranks", ranks},
                      {"ranks_per_core", ranks_per_core}};
  nlohmann::json mt = nlohmann::json::array();
  for (const MeasuredModules& m : module_times) {
    nlohmann::json shape = nlohmann::json::object(), mods = nlohmann::json::object();
    for (const auto& [k, v] : m.shape)
      shape[k] = v;
    for (const auto& [k, t] : m.modules)
      mods[k] = {{"forward_ms", t.forward_ms}, {"backward_ms", t.backward_ms}};
    mt.push_back({{"model", m.model}, {"shape", shape}, {"modules", mods}, {"reps", m.reps}});
  }
  j["module_times"] = mt;
  return j.dump(indent);
}

const MeasuredModules* ComputeRates::measured_modules(
    const std::string& model, const std::map<std::string, std::int64_t>& shape) const noexcept {
  for (const MeasuredModules& m : module_times)
    if (m.model == model && m.shape == shape) return &m;
  return nullptr;
}

namespace {
// Reads `j` over `base` (ComputeRates::parse_json).
ComputeRates rates_from_json(const nlohmann::json& j, const ComputeRates& base,
                             const std::string& source) {
  ComputeRates c = base;
  if (!j.is_object()) fail(source, "", "expected an object, got " + j.dump());
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const nlohmann::json& v = it.value();
    if (key == "default_gemm_gflop_per_s") {
      c.default_gemm_gflop_per_s = number(v, source, key, true);
    } else if (key == "elementwise_gb_per_s") {
      c.elementwise_gb_per_s = number(v, source, key, true);
    } else if (key == "adamw_ns_per_element") {
      c.adamw_ns_per_element = number(v, source, key, false);
    } else if (key == "sgd_ns_per_element") {
      c.sgd_ns_per_element = number(v, source, key, false);
    } else if (key == "ranks") {
      if (!v.is_number_integer() || v.get<std::int64_t>() < 1 || v.get<std::int64_t>() > 1 << 24)
        fail(source, key, "expected an integer >= 1, got " + v.dump());
      c.ranks = v.get<int>();
    } else if (key == "ranks_per_core") {
      c.ranks_per_core = number(v, source, key, false);
      if (c.ranks_per_core > double(1 << 24))
        fail(source, key, "expected a number in 0..2^24, got " + v.dump());
    } else if (key == "module_times") {
      if (!v.is_array()) fail(source, key, "expected an array, got " + v.dump());
      c.module_times.clear();
      for (std::size_t i = 0; i < v.size(); ++i) {
        const std::string path = detail::json_element(key, i);
        MeasuredModules m = measured_from_json(v[i], source, path);
        if (c.measured_modules(m.model, m.shape))
          fail(source, path, "a second entry for model '" + m.model + "' at the same shape");
        c.module_times.push_back(std::move(m));
      }
    } else if (key == "gemm") {
      if (!v.is_array()) fail(source, key, "expected an array, got " + v.dump());
      c.gemm.clear();
      for (std::size_t i = 0; i < v.size(); ++i) {
        const std::string path = key + "[" + std::to_string(i) + "]";
        const nlohmann::json& e = v[i];
        if (!e.is_object()) fail(source, path, "expected an object, got " + e.dump());
        GemmRate r;
        bool has_shape = false, has_rate = false;
        for (auto f = e.begin(); f != e.end(); ++f) {
          const std::string fpath = path + "." + f.key();
          if (f.key() == "shape") {
            if (!f.value().is_string())
              fail(source, fpath, "expected a string MxNxK:TT, got " + f.value().dump());
            const std::string problem = parse_gemm(f.value().get<std::string>(), r.shape);
            if (!problem.empty()) fail(source, fpath, problem);
            has_shape = true;
          } else if (f.key() == "gflop_per_s") {
            r.gflop_per_s = number(f.value(), source, fpath, true);
            has_rate = true;
          } else {
            fail(source, fpath, "unknown key '" + f.key() + "' (allowed: shape, gflop_per_s)");
          }
        }
        if (!has_shape || !has_rate)
          fail(source, path,
               std::string("missing key '") + (has_shape ? "gflop_per_s" : "shape") + "'");
        c.gemm.push_back(r);
      }
    } else {
      fail(source, key,
           "unknown key '" + key +
               "' (allowed: gemm, default_gemm_gflop_per_s, elementwise_gb_per_s, "
               "adamw_ns_per_element, sgd_ns_per_element, ranks, ranks_per_core, "
               "module_times)");
    }
  }
  return c;
}
}  // namespace

ComputeRates ComputeRates::parse_json(const std::string& text, const ComputeRates& base,
                                      const std::string& source) {
  detail::JsonLimits limits;
  limits.max_depth = 64;
  const nlohmann::json j = detail::parse_json_strict(text, source, limits);
  return rates_from_json(j, base, source);
}

ComputeRates ComputeRates::load_json(const std::string& path, const ComputeRates& base) {
  return parse_json(fullshard::read_text_file(path, "compute calibration file"), base, path);
}

bool ComputeRates::operator==(const ComputeRates& o) const noexcept {
  if (gemm.size() != o.gemm.size()) return false;
  for (std::size_t i = 0; i < gemm.size(); ++i)
    if (!(gemm[i].shape == o.gemm[i].shape) || gemm[i].gflop_per_s != o.gemm[i].gflop_per_s)
      return false;
  return default_gemm_gflop_per_s == o.default_gemm_gflop_per_s &&
         elementwise_gb_per_s == o.elementwise_gb_per_s &&
         adamw_ns_per_element == o.adamw_ns_per_element &&
         sgd_ns_per_element == o.sgd_ns_per_element && ranks == o.ranks &&
         ranks_per_core == o.ranks_per_core && module_times == o.module_times;
}

double core_wait_ms(double ranks_per_core, const std::vector<double>& module_ms,
                    double collective_ms, double optimizer_ms, double slice_ms) noexcept {
  if (!(ranks_per_core > 1.0)) return 0.0;
  const double mates = ranks_per_core - 1.0, slice = std::max(0.0, slice_ms);
  double beyond = 0.0, within = 0.0;
  for (const double t : module_ms) {
    beyond += std::max(0.0, t - slice);
    within += std::min(t, slice);
  }
  return mates * (optimizer_ms + beyond) + std::max(0.0, mates * within - collective_ms);
}

graph::Cost cost_from_work(const ComputeRates& rates, const ModuleWork& forward,
                           const ModuleWork& backward) {
  graph::Cost c;
  c.forward_ms = rates.time_ms(forward);
  c.backward_ms = rates.time_ms(backward);
  c.declared = true;
  return c;
}

double serial_step_ms(const Plan& plan) noexcept {
  double t = 0.0;
  for (const Op& op : plan.ops)
    t += op.end_ms - op.start_ms;
  return t;
}

}  // namespace fullshard::schedule
