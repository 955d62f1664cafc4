#include "fullshard/graph/json_graph.hpp"

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include "fullshard/base/checked.hpp"
#include "fullshard/base/error.hpp"
#include "lib/base/json_reader.hpp"
#include "lib/graph/json_forms.hpp"

namespace fullshard::graph {

namespace {

using ojson = nlohmann::ordered_json;
using detail::json_element;
using detail::json_member;

const char* const kModuleKeys[] = {"name", "params", "modules", "cost", "fully_shard"};
const char* const kParamKeys[] = {"shape", "dtype", "requires_grad"};
const char* const kCostKeys[] = {"forward_ms", "backward_ms"};

/// "a, b, c".
template <std::size_t N>
std::string key_list(const char* const (&keys)[N]) {
  std::string s;
  for (std::size_t i = 0; i < N; ++i)
    s += (i ? ", " : "") + std::string(keys[i]);
  return s;
}

/// "-3", "\"x\"", "an array": what a value is, for "got ..." in messages.
std::string describe(const ojson& j) {
  if (j.is_object()) return "an object";
  if (j.is_array()) return "an array";
  std::string s = j.dump(-1, ' ', true, ojson::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

/// The JSON limits of a graph file (docs/graph-format.md, "Limits").
detail::JsonLimits graph_limits() {
  detail::JsonLimits l;
  l.max_depth = 1024;
  l.nested_key = "modules";
  l.max_nested_key = kMaxModuleDepth;
  l.nested_key_problem = "modules nest more than " + std::to_string(kMaxModuleDepth) +
                         " levels below the root (the limit)";
  l.duplicate_words = {{"params", "parameter name"}};
  return l;
}

/// Where in the file a value is: a chain of (key or index) steps from a module object, kept on
/// the stack while the reader is there and only turned into a string when an error needs it
/// (the module's own path comes from its indices, Module::json_path()). Steps refer to their
/// parent Where and to keys in the document: a Where lives no longer than the full expression
/// or the scope it was made in.
struct Where {
  const Module* module = nullptr;  // the first step only
  const Where* parent = nullptr;
  const char* ckey = nullptr;
  const std::string* skey = nullptr;
  std::size_t index = 0;  // when there is no key

  std::string str() const {
    if (parent == nullptr) return module->json_path();
    const std::string p = parent->str();
    if (ckey != nullptr) return json_member(p, ckey);
    if (skey != nullptr) return json_member(p, *skey);
    return json_element(p, index);
  }
  Where operator/(const char* key) const {
    Where w;
    w.parent = this;
    w.ckey = key;
    return w;
  }
  Where operator/(const std::string& key) const {
    Where w;
    w.parent = this;
    w.skey = &key;
    return w;
  }
  Where operator[](std::size_t i) const {
    Where w;
    w.parent = this;
    w.index = i;
    return w;
  }
};

class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& path, const std::string& problem) const {
    throw ConfigError(source_ + ": " + (path.empty() ? "" : path + ": ") + problem);
  }
  [[noreturn]] void fail(const Where& at, const std::string& problem) const {
    fail(at.str(), problem);
  }

  /// Rejects keys of object `j` other than those in `allowed`.
  template <std::size_t N>
  void check_keys(const ojson& j, const Where& at, const char* const (&allowed)[N]) const {
    for (const auto& item : j.items()) {
      bool ok = false;
      for (const char* a : allowed)
        ok = ok || item.key() == a;
      if (!ok)
        fail(at, "unknown key " + detail::json_key_shown(item.key()) +
                     " (allowed: " + key_list(allowed) + ")");
    }
  }

  void expect_object(const ojson& j, const Where& at, const char* what) const {
    if (!j.is_object()) fail(at, std::string("expected ") + what + ", got " + describe(j));
  }

  /// A child-module or parameter name of module `m`, at `at`: a valid name (name_problem) that
  /// keeps the FQN within kMaxFqnBytes.
  void check_name(const std::string& n, const Module& m, const Where& at, const char* what) const {
    const std::string problem = name_problem(n);
    if (!problem.empty())
      fail(at, std::string("invalid ") + what + " name " + shown(n) + ": " + problem);
    const std::size_t fqn_bytes = m.fqn().empty() ? n.size() : m.fqn().size() + 1 + n.size();
    if (fqn_bytes > kMaxFqnBytes)
      fail(at, std::string("the ") + what + " " + shown(n) +
                   " would have a fully qualified name of " + std::to_string(fqn_bytes) +
                   " bytes, more than " + std::to_string(kMaxFqnBytes) + " (the limit)");
  }

  /// 'name' for printable ASCII (as the old messages), else an escaped JSON string.
  static std::string shown(const std::string& n) { return detail::json_key_shown(n); }

  Shape shape(const ojson& j, const Where& at) const {
    if (!j.is_array()) fail(at, "expected an array of non-negative integers, got " + describe(j));
    if (j.empty()) fail(at, "expected at least one extent (use [1] for a scalar), got []");
    Shape s;
    s.reserve(j.size());
    for (std::size_t i = 0; i < j.size(); ++i) {
      const ojson& e = j[i];
      const bool ok =
          (e.is_number_unsigned() &&
           e.get<std::uint64_t>() <=
               static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) ||
          (e.is_number_integer() && !e.is_number_unsigned() && e.get<std::int64_t>() >= 0);
      if (!ok) fail(at[i], "expected a non-negative integer, got " + describe(e));
      s.push_back(e.get<std::int64_t>());
    }
    return s;
  }

  double milliseconds(const ojson& j, const Where& at) const {
    if (!j.is_number() || !std::isfinite(j.get<double>()) || j.get<double>() < 0.0)
      fail(at, "expected a non-negative number of milliseconds, got " + describe(j));
    return j.get<double>();
  }

  void param(const ojson& j, const std::string& pname, const Where& at, Module& m) const {
    expect_object(j, at, "an object with keys shape, dtype, requires_grad");
    check_keys(j, at, kParamKeys);
    const auto shape_it = j.find("shape");
    if (shape_it == j.end()) fail(at, "missing required key 'shape'");
    Shape s = shape(*shape_it, at / "shape");
    DType dtype = DType::f32;
    if (const auto d = j.find("dtype"); d != j.end()) {
      if (!d->is_string()) fail(at / "dtype", "expected a dtype name string, got " + describe(*d));
      try {
        dtype = parse_dtype(d->get<std::string>());
      } catch (const ConfigError&) {  // again, naming the path (only built for the error)
        dtype = parse_dtype(d->get<std::string>(), source_ + ": " + (at / "dtype").str());
      }
    }
    // Every size computed from the shape later (bytes, shards, offsets) must fit.
    checked_nbytes<ConfigError>(s, dtype, [&] { return source_ + ": " + (at / "shape").str(); });
    bool requires_grad = true;
    if (const auto r = j.find("requires_grad"); r != j.end()) {
      if (!r->is_boolean())
        fail(at / "requires_grad", "expected true or false, got " + describe(*r));
      requires_grad = r->get<bool>();
    }
    m.add_param(pname, std::move(s), dtype, requires_grad);
  }

  /// Reads everything of module object `j` except its name into `m` (whose json_path() is the
  /// object's path). Recursion is bounded: the JSON reader refused more than kMaxModuleDepth
  /// nested "modules" arrays.
  void module_body(const ojson& j, Module& m) const {
    Where here;
    here.module = &m;
    if (const auto f = j.find("fully_shard"); f != j.end()) {
      if (!f->is_boolean() && !f->is_object())
        fail(here / "fully_shard",
             "expected true, false or an object of options, got " + describe(*f));
      if (f->is_boolean()) {
        m.set_fully_shard_request(f->get<bool>());  // shared by every module
      } else {
        try {
          m.set_fully_shard_request(
              shard_request_from_json(nlohmann::json(*f), (here / "fully_shard").str()));
        } catch (const ConfigError& e) {
          throw ConfigError(source_ + ": " + e.message());
        }
      }
    }
    if (const auto c = j.find("cost"); c != j.end()) {
      const Where at = here / "cost";
      expect_object(*c, at, "an object with keys forward_ms, backward_ms");
      check_keys(*c, at, kCostKeys);
      Cost& cost = m.cost();
      if (const auto v = c->find("forward_ms"); v != c->end())
        cost.forward_ms = milliseconds(*v, at / "forward_ms");
      if (const auto v = c->find("backward_ms"); v != c->end())
        cost.backward_ms = milliseconds(*v, at / "backward_ms");
      cost.declared = true;
    }
    const auto ps = j.find("params");
    const auto ms = j.find("modules");
    const std::size_t n_children = ms != j.end() && ms->is_array() ? ms->size() : 0;
    const std::size_t n_params = ps != j.end() && ps->is_object() ? ps->size() : 0;
    if (n_children + n_params > 16) m.reserve(n_children, n_params);
    if (ps != j.end()) {
      const Where at = here / "params";
      expect_object(*ps, at, "an object mapping parameter names to {shape, dtype, requires_grad}");
      for (const auto& item : ps->items()) {
        // Duplicate keys were refused while parsing.
        check_name(item.key(), m, at, "parameter");
        param(item.value(), item.key(), at / item.key(), m);
      }
    }
    if (ms != j.end()) {
      const Where at = here / "modules";
      if (!ms->is_array()) fail(at, "expected an array of module objects, got " + describe(*ms));
      for (std::size_t i = 0; i < ms->size(); ++i) {
        const ojson& c = (*ms)[i];
        const Where cat = at[i];
        expect_object(c, cat, "a module object");
        check_keys(c, cat, kModuleKeys);
        const auto n = c.find("name");
        if (n == c.end()) fail(cat, "missing required key 'name'");
        if (!n->is_string())
          fail(cat / "name", "expected a module name string, got " + describe(*n));
        const std::string& cname = n->get_ref<const std::string&>();
        check_name(cname, m, cat / "name", "module");
        Module* child = nullptr;
        try {
          child = &m.add_module(cname);  // checks uniqueness in O(1)
        } catch (const InvalidArgument&) {
          if (const Module* other = m.find_module(cname))
            fail(cat,
                 "duplicate module name " + shown(cname) + " (also at " + other->json_path() + ")");
          if (m.try_find_param(cname) != nullptr)
            fail(cat, "module name " + shown(cname) + " is also a parameter name (also at " +
                          (here / "params" / cname).str() + ")");
          throw;
        }
        child->set_json_index(i);
        module_body(c, *child);
      }
    }
  }

 private:
  std::string source_;
};

void module_to_json(const Module& m, ojson& out) {
  out["name"] = m.name();
  if (const ShardRequest* r = m.fully_shard_request())
    out["fully_shard"] = ojson(shard_request_json(*r));
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
      // Names are unique: append without ordered_map's linear lookup.
      static_cast<ojson::object_t::Container&>(params.get_ref<ojson::object_t&>())
          .emplace_back(p.name(), std::move(spec));
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
  const ojson doc = detail::parse_json_strict(text, source, graph_limits());
  if (!doc.is_object())
    reader.fail("", "expected a module object at the top level, got " + describe(doc));
  std::string root_name = "model";
  if (const auto n = doc.find("name"); n != doc.end()) {
    if (!n->is_string() || n->get<std::string>().empty())
      reader.fail("name", "expected a non-empty root module name string, got " + describe(*n));
    root_name = n->get<std::string>();
    const std::string problem = name_problem(root_name);
    if (!problem.empty())
      reader.fail("name", "invalid root module name " + Reader::shown(root_name) + ": " + problem);
  }
  auto root = Module::make_root(root_name);
  Where top;
  top.module = root.get();
  reader.check_keys(doc, top, kModuleKeys);
  reader.module_body(doc, *root);
  return root;
}

std::unique_ptr<Module> load_graph_json(const std::string& path) {
  return parse_graph_json(fullshard::read_text_file(path, "graph file"), path);
}

nlohmann::ordered_json graph_document(const Module& root) {
  ojson out = ojson::object();
  module_to_json(root, out);
  return out;
}

std::string graph_to_json(const Module& root, int indent) {
  return graph_document(root).dump(indent);
}

}  // namespace fullshard::graph
