#include "fullshard/graph/json_graph.hpp"

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "fullshard/base/error.hpp"

namespace fullshard::graph {

namespace {

using ojson = nlohmann::ordered_json;

const char* const kModuleKeys = "name, params, modules, cost, fully_shard";
const char* const kParamKeys = "shape, dtype, requires_grad";
const char* const kCostKeys = "forward_ms, backward_ms";

std::string member(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

std::string element(const std::string& path, std::size_t i) {
  return path + "[" + std::to_string(i) + "]";
}

/// "-3", "\"x\"", "an array": what a value is, for "got ..." in messages.
std::string describe(const ojson& j) {
  if (j.is_object()) return "an object";
  if (j.is_array()) return "an array";
  std::string s = j.dump();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& path, const std::string& problem) const {
    throw ConfigError(source_ + ": " + (path.empty() ? "" : path + ": ") + problem);
  }

  /// Rejects keys of object `j` (at `path`) other than those in `allowed` (", "-separated).
  void check_keys(const ojson& j, const std::string& path, const char* allowed) const {
    const std::string list = std::string(", ") + allowed + ", ";
    for (const auto& item : j.items())
      if (list.find(", " + item.key() + ", ") == std::string::npos)
        fail(path, "unknown key '" + item.key() + "' (allowed: " + allowed + ")");
  }

  void expect_object(const ojson& j, const std::string& path, const char* what) const {
    if (!j.is_object()) fail(path, std::string("expected ") + what + ", got " + describe(j));
  }

  /// A child-module or parameter name at `path`: a non-empty string without '.'.
  std::string name(const ojson& j, const std::string& path, const char* what) const {
    if (!j.is_string())
      fail(path, std::string("expected a ") + what + " name string, got " + describe(j));
    const std::string n = j.get<std::string>();
    if (n.empty() || n.find('.') != std::string::npos)
      fail(path, std::string("invalid ") + what + " name '" + n +
                     "' (names are non-empty and contain no '.')");
    return n;
  }

  Shape shape(const ojson& j, const std::string& path) const {
    if (!j.is_array()) fail(path, "expected an array of non-negative integers, got " + describe(j));
    if (j.empty()) fail(path, "expected at least one extent (use [1] for a scalar), got []");
    Shape s;
    for (std::size_t i = 0; i < j.size(); ++i) {
      const ojson& e = j[i];
      const bool ok =
          (e.is_number_unsigned() &&
           e.get<std::uint64_t>() <=
               static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) ||
          (e.is_number_integer() && !e.is_number_unsigned() && e.get<std::int64_t>() >= 0);
      if (!ok) fail(element(path, i), "expected a non-negative integer, got " + describe(e));
      s.push_back(e.get<std::int64_t>());
    }
    return s;
  }

  double milliseconds(const ojson& j, const std::string& path) const {
    if (!j.is_number() || !std::isfinite(j.get<double>()) || j.get<double>() < 0.0)
      fail(path, "expected a non-negative number of milliseconds, got " + describe(j));
    return j.get<double>();
  }

  void param(const ojson& j, const std::string& pname, const std::string& path, Module& m) const {
    expect_object(j, path, "an object with keys shape, dtype, requires_grad");
    check_keys(j, path, kParamKeys);
    if (!j.contains("shape")) fail(path, "missing required key 'shape'");
    Shape s = shape(j.at("shape"), member(path, "shape"));
    DType dtype = DType::f32;
    if (j.contains("dtype")) {
      const ojson& d = j.at("dtype");
      const std::string dpath = member(path, "dtype");
      if (!d.is_string()) fail(dpath, "expected a dtype name string, got " + describe(d));
      dtype = parse_dtype(d.get<std::string>(), source_ + ": " + dpath);
    }
    bool requires_grad = true;
    if (j.contains("requires_grad")) {
      const ojson& r = j.at("requires_grad");
      if (!r.is_boolean())
        fail(member(path, "requires_grad"), "expected true or false, got " + describe(r));
      requires_grad = r.get<bool>();
    }
    m.add_param(pname, std::move(s), dtype, requires_grad);
  }

  /// Reads everything of module object `j` at `path` except its name into `m`.
  void module_body(const ojson& j, const std::string& path, Module& m) const {
    if (j.contains("fully_shard")) {
      const ojson& f = j.at("fully_shard");
      if (!f.is_boolean() && !f.is_object())
        fail(member(path, "fully_shard"),
             "expected true, false or an object of options, got " + describe(f));
      m.set_fully_shard_request(nlohmann::json(f));
    }
    if (j.contains("cost")) {
      const ojson& c = j.at("cost");
      const std::string cpath = member(path, "cost");
      expect_object(c, cpath, "an object with keys forward_ms, backward_ms");
      check_keys(c, cpath, kCostKeys);
      Cost& cost = m.cost();
      if (c.contains("forward_ms"))
        cost.forward_ms = milliseconds(c.at("forward_ms"), member(cpath, "forward_ms"));
      if (c.contains("backward_ms"))
        cost.backward_ms = milliseconds(c.at("backward_ms"), member(cpath, "backward_ms"));
      cost.declared = true;
    }
    // name -> (JSON path where it was declared, whether it is a parameter)
    std::map<std::string, std::pair<std::string, bool>> taken;
    if (j.contains("params")) {
      const ojson& ps = j.at("params");
      const std::string ppath = member(path, "params");
      expect_object(ps, ppath,
                    "an object mapping parameter names to {shape, dtype, requires_grad}");
      for (const auto& item : ps.items()) {
        const std::string pname = name(ojson(item.key()), ppath, "parameter");
        const std::string at = member(ppath, pname);
        taken.emplace(pname,
                      std::make_pair(at, true));  // duplicate keys were rejected while parsing
        param(item.value(), pname, at, m);
      }
    }
    if (j.contains("modules")) {
      const ojson& ms = j.at("modules");
      const std::string mpath = member(path, "modules");
      if (!ms.is_array()) fail(mpath, "expected an array of module objects, got " + describe(ms));
      for (std::size_t i = 0; i < ms.size(); ++i) {
        const ojson& c = ms[i];
        const std::string cpath = element(mpath, i);
        expect_object(c, cpath, "a module object");
        check_keys(c, cpath, kModuleKeys);
        if (!c.contains("name")) fail(cpath, "missing required key 'name'");
        const std::string cname = name(c.at("name"), member(cpath, "name"), "module");
        const auto [it, inserted] = taken.emplace(cname, std::make_pair(cpath, false));
        if (!inserted)
          fail(cpath, (it->second.second ? "module name '" + cname + "' is also a parameter name"
                                         : "duplicate module name '" + cname + "'") +
                          " (also at " + it->second.first + ")");
        Module& child = m.add_module(cname);
        child.set_json_path(cpath);
        module_body(c, cpath, child);
      }
    }
  }

 private:
  std::string source_;
};

/// Parses `text` into an ordered_json, rejecting duplicate object keys (which nlohmann would
/// silently merge) with their JSON path.
ojson parse_json(const std::string& text, const Reader& reader) {
  struct Frame {
    bool array;
    std::size_t index;
    std::string key;
    std::set<std::string> keys;
  };
  std::vector<Frame> frames;
  auto path_of = [&frames](std::size_t n) {
    std::string p;
    for (std::size_t i = 0; i < n; ++i)
      p = frames[i].array ? element(p, frames[i].index) : member(p, frames[i].key);
    return p;
  };
  auto element_done = [&frames] {
    if (!frames.empty() && frames.back().array) ++frames.back().index;
  };
  const ojson::parser_callback_t callback = [&](int /*depth*/, ojson::parse_event_t event,
                                                ojson& parsed) {
    switch (event) {
      case ojson::parse_event_t::object_start:
        frames.push_back(Frame{false, 0, std::string(), {}});
        break;
      case ojson::parse_event_t::array_start:
        frames.push_back(Frame{true, 0, std::string(), {}});
        break;
      case ojson::parse_event_t::key: {
        const std::string key = parsed.get<std::string>();
        if (!frames.back().keys.insert(key).second) {
          const std::string object_path = path_of(frames.size() - 1);
          const bool params = frames.size() >= 2 && !frames[frames.size() - 2].array &&
                              frames[frames.size() - 2].key == "params";
          reader.fail(object_path,
                      (params ? "duplicate parameter name '" : "duplicate key '") + key + "'");
        }
        frames.back().key = key;
        break;
      }
      case ojson::parse_event_t::object_end:
      case ojson::parse_event_t::array_end:
        frames.pop_back();
        element_done();
        break;
      case ojson::parse_event_t::value:
        element_done();
        break;
    }
    return true;
  };
  try {
    return ojson::parse(text, callback);
  } catch (const ojson::parse_error& e) {
    reader.fail("", "invalid JSON at byte " + std::to_string(e.byte) + ": " + e.what());
  }
}

void module_to_json(const Module& m, ojson& out) {
  out["name"] = m.name();
  if (!m.fully_shard_request().is_null()) out["fully_shard"] = ojson(m.fully_shard_request());
  const Cost& c = m.cost();
  if (c.declared || c.forward_ms != 0.0 || c.backward_ms != 0.0)
    out["cost"] = ojson{{"forward_ms", c.forward_ms}, {"backward_ms", c.backward_ms}};
  if (m.num_params() > 0) {
    ojson params = ojson::object();
    for (std::size_t i = 0; i < m.num_params(); ++i) {
      const Parameter& p = m.param(i);
      ojson spec = ojson::object();
      spec["shape"] = p.shape();
      spec["dtype"] = dtype_name(p.dtype());
      if (!p.requires_grad()) spec["requires_grad"] = false;
      params[p.name()] = std::move(spec);
    }
    out["params"] = std::move(params);
  }
  if (m.num_children() > 0) {
    ojson modules = ojson::array();
    for (std::size_t i = 0; i < m.num_children(); ++i) {
      ojson child = ojson::object();
      module_to_json(m.child(i), child);
      modules.push_back(std::move(child));
    }
    out["modules"] = std::move(modules);
  }
}

}  // namespace

std::unique_ptr<Module> parse_graph_json(const std::string& text, const std::string& source) {
  const Reader reader(source);
  const ojson doc = parse_json(text, reader);
  reader.expect_object(doc, "", "a module object at the top level");
  reader.check_keys(doc, "", kModuleKeys);
  std::string root_name = "model";
  if (doc.contains("name")) {
    const ojson& n = doc.at("name");
    if (!n.is_string() || n.get<std::string>().empty())
      reader.fail("name", "expected a non-empty root module name string, got " + describe(n));
    root_name = n.get<std::string>();
  }
  auto root = Module::make_root(root_name);
  reader.module_body(doc, "", *root);
  return root;
}

std::unique_ptr<Module> load_graph_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path + ": cannot open the graph file (" + std::strerror(errno) + ")");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw ConfigError(path + ": cannot read the graph file");
  return parse_graph_json(text.str(), path);
}

nlohmann::ordered_json graph_to_json(const Module& root) {
  ojson out = ojson::object();
  module_to_json(root, out);
  return out;
}

}  // namespace fullshard::graph
