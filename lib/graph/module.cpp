#include "fullshard/graph/module.hpp"

#include <cstdio>
#include <utility>

#include "fullshard/base/checked.hpp"
#include "fullshard/base/error.hpp"
#include "lib/base/prefetch.hpp"

namespace fullshard::graph {

namespace {

std::string module_list(const std::vector<std::unique_ptr<Module>>& children) {
  if (children.empty()) return "it has no child modules";
  std::string s = "it has ";
  for (std::size_t i = 0; i < children.size(); ++i)
    s += (i ? ", " : "") + children[i]->name();
  return s;
}

std::string param_list(const Module& m) {
  if (m.num_params() == 0) return "it has no parameters";
  std::string s = "it has ";
  for (std::size_t i = 0; i < m.num_params(); ++i)
    s += (i ? ", " : "") + m.param(i).name();
  return s;
}

/// Splits "a.b.c" at the last '.': {"a.b", "c"}; {"", "c"} without a '.'.
std::pair<std::string, std::string> split_last(const std::string& fqn) {
  const auto dot = fqn.rfind('.');
  if (dot == std::string::npos) return {std::string(), fqn};
  return {fqn.substr(0, dot), fqn.substr(dot + 1)};
}

/// Length of the UTF-8 sequence at s[i] encoding a character from U+00A0 up, or 0 when the
/// bytes there are malformed, overlong, a surrogate, beyond U+10FFFF or a C1 control.
std::size_t utf8_printable(const std::string& s, std::size_t i) {
  const auto b = [&](std::size_t k) {
    return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0u;
  };
  const auto cont = [&](std::size_t k) { return (b(k) & 0xC0u) == 0x80u; };
  const unsigned c = b(0);
  if (c >= 0xC2 && c <= 0xDF) return cont(1) && !(c == 0xC2 && b(1) < 0xA0) ? 2 : 0;
  if (c == 0xE0) return b(1) >= 0xA0 && b(1) <= 0xBF && cont(2) ? 3 : 0;
  if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) return cont(1) && cont(2) ? 3 : 0;
  if (c == 0xED) return b(1) >= 0x80 && b(1) <= 0x9F && cont(2) ? 3 : 0;
  if (c == 0xF0) return b(1) >= 0x90 && b(1) <= 0xBF && cont(2) && cont(3) ? 4 : 0;
  if (c >= 0xF1 && c <= 0xF3) return cont(1) && cont(2) && cont(3) ? 4 : 0;
  if (c == 0xF4) return b(1) >= 0x80 && b(1) <= 0x8F && cont(2) && cont(3) ? 4 : 0;
  return 0;
}

/// 'name' when it is plain printable ASCII, else quoted_name(name) (escaped).
std::string shown(const std::string& name) {
  for (char ch : name)
    if (ch < 0x20 || ch > 0x7E) return quoted_name(name);
  return name.size() > 80 ? quoted_name(name) : "'" + name + "'";
}

}  // namespace

std::string name_problem(const std::string& name) {
  if (name.empty()) return "the name is empty";
  if (name.size() > kMaxFqnBytes)
    return "the name has " + std::to_string(name.size()) + " bytes, more than " +
           std::to_string(kMaxFqnBytes);
  for (std::size_t i = 0; i < name.size();) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c > 0x20 && c < 0x7F && c != '.') {
      ++i;
      continue;
    }
    const auto at = [i] { return " at byte " + std::to_string(i); };
    if (c == '.') return "names must not contain '.' (found" + at() + ")";
    if (c < 0x80) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "U+%04X", c);
      return std::string(c == 0x20 ? "a space" : std::string("control character ") + hex) + at() +
             " (names are printable and contain no spaces)";
    }
    const std::size_t n = utf8_printable(name, i);
    if (n == 0)
      return "malformed UTF-8 or a C1 control character" + at() +
             " (names are printable UTF-8 text)";
    i += n;
  }
  return std::string();
}

std::string quoted_name(const std::string& s, std::size_t max_bytes) {
  std::string out = "\"";
  for (std::size_t i = 0; i < s.size();) {
    if (out.size() > max_bytes) {
      out += "...";
      break;
    }
    const auto c = static_cast<unsigned char>(s[i]);
    char hex[8];
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
      ++i;
    } else if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
      ++i;
    } else if (c < 0x80) {
      std::snprintf(hex, sizeof hex, "\\u%04x", c);
      out += hex;
      ++i;
    } else if (const std::size_t n = utf8_printable(s, i)) {
      out.append(s, i, n);
      i += n;
    } else {
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
      ++i;
    }
  }
  return out + "\"";
}

// ---------------------------------------------------------------------------------------------
// Parameter

namespace {

// The element count of dims 1.. of a shape add_param accepted, -1 when it does not fit int64
// (possible only when dim 0 is 0: (0, 2^62, 2^62) has no elements).
std::int64_t inner_numel_of(const Shape& s) noexcept {
  std::int64_t n = 1;
  for (std::size_t i = 1; i < s.size(); ++i)
    if (__builtin_mul_overflow(n, s[i], &n)) return -1;
  return n;
}

}  // namespace

Parameter::Parameter(Module* module, std::string name, Shape shape, DType dtype, bool requires_grad)
    : module_(module),
      shape_(std::move(shape)),
      // add_param checked that the shape has a dim and its element count fits int64.
      first_extent_(shape_.empty() ? 1 : shape_.front()),
      inner_numel_(inner_numel_of(shape_)),
      dtype_(dtype),
      requires_grad_(requires_grad),
      name_(std::move(name)),
      fqn_(module->fqn().empty() ? name_ : module->fqn() + "." + name_) {}

Parameter& Parameter::init(const std::function<double(std::int64_t)>& fn) {
  Tensor t = Tensor::empty(shape_, dtype_, MemorySpace::host, fqn_);
  const std::int64_t n = t.numel();
  for (std::int64_t i = 0; i < n; ++i)
    t.set(i, fn(i));
  data_ = std::move(t);
  initializer_ = nullptr;
  return *this;
}

Parameter& Parameter::init_sharded(std::function<double(std::int64_t)> fn) {
  if (!fn) throw InvalidArgument("parameter '" + fqn_ + "': init_sharded needs a function");
  data_ = Tensor();
  initializer_ = std::move(fn);
  return *this;
}

Parameter& Parameter::materialize() {
  if (!initializer_) return *this;
  const std::function<double(std::int64_t)> fn = std::move(initializer_);
  initializer_ = nullptr;
  return init(fn);
}

// ---------------------------------------------------------------------------------------------
// Module

Module::Module(std::string name, Module* parent)
    : parent_(parent),
      depth_(parent == nullptr ? 0 : parent->depth_ + 1),
      fqn_(parent == nullptr ? std::string()
                             : (parent->is_root() ? name : parent->fqn() + "." + name)),
      name_(std::move(name)) {}

Module::~Module() = default;

std::unique_ptr<Module> Module::make_root(std::string name) {
  if (name.empty()) throw InvalidArgument("Module::make_root: the root module's name is empty");
  const std::string problem = name_problem(name);
  if (!problem.empty())
    throw InvalidArgument("Module::make_root: invalid root module name " + quoted_name(name) +
                          ": " + problem);
  return std::unique_ptr<Module>(new Module(std::move(name), nullptr));
}

std::string Module::json_path() const {
  if (is_root() || json_index_ == static_cast<std::size_t>(-1)) return std::string();
  std::vector<std::size_t> indices;
  for (const Module* m = this; !m->is_root(); m = m->parent_) {
    if (m->json_index_ == static_cast<std::size_t>(-1)) return std::string();  // built in C++
    indices.push_back(m->json_index_);
  }
  std::string path;
  for (auto it = indices.rbegin(); it != indices.rend(); ++it)
    path += (path.empty() ? "modules[" : ".modules[") + std::to_string(*it) + "]";
  return path;
}

Module& Module::root() noexcept {
  Module* m = this;
  while (m->parent_ != nullptr)
    m = m->parent_;
  return *m;
}

std::string Module::describe() const {
  return is_root() ? "root module '" + name_ + "'" : "module '" + fqn_ + "'";
}

void Module::check_new_name(const std::string& name, const char* what) const {
  if (name.empty())
    throw InvalidArgument(describe() + ": cannot add a " + what + " with an empty name");
  const std::string problem = name_problem(name);
  if (!problem.empty())
    throw InvalidArgument(describe() + ": invalid " + what + " name " + shown(name) + ": " +
                          problem);
  // FQN of the new child or parameter: fqn_ + "." + name.
  const std::size_t fqn_bytes = fqn_.empty() ? name.size() : fqn_.size() + 1 + name.size();
  if (fqn_bytes > kMaxFqnBytes)
    throw InvalidArgument(describe() + ": cannot add " + what + " " + quoted_name(name) +
                          ": its fully qualified name would have " + std::to_string(fqn_bytes) +
                          " bytes, more than " + std::to_string(kMaxFqnBytes));
}

void Module::name_taken(const std::string& name, const char* what, bool by_module) const {
  throw InvalidArgument(describe() + ": cannot add " + what + " '" + name + "': a " +
                        (by_module ? "child module" : "parameter") + " of that name exists");
}

void Module::reserve(std::size_t children, std::size_t params) {
  children_.reserve(children);
  child_by_name_.reserve(children);
  params_.reserve(params);
  param_by_name_.reserve(params);
}

// One lookup in each name table per add (graphs of 400,000 siblings load in linear time).
Module& Module::add_module(const std::string& name) {
  check_new_name(name, "child module");
  if (depth_ + 1 > kMaxModuleDepth)
    throw InvalidArgument(describe() + ": cannot add child module " + quoted_name(name) +
                          ": modules nest at most " + std::to_string(kMaxModuleDepth) +
                          " levels below the root");
  if (param_by_name_.count(name)) name_taken(name, "child module", false);
  const auto [slot, inserted] = child_by_name_.try_emplace(name, nullptr);
  if (!inserted) name_taken(name, "child module", true);
  try {
    children_.push_back(std::unique_ptr<Module>(new Module(name, this)));
  } catch (...) {
    child_by_name_.erase(slot);
    throw;
  }
  slot->second = children_.back().get();
  for (Module* a = this; a; a = a->parent_)  // at most kMaxModuleDepth levels
    ++a->descendants_;
  return *children_.back();
}

Parameter& Module::add_param(const std::string& name, Shape shape, DType dtype,
                             bool requires_grad) {
  check_new_name(name, "parameter");
  if (child_by_name_.count(name)) name_taken(name, "parameter", true);
  if (shape.empty())
    throw InvalidArgument(describe() + ": parameter '" + name +
                          "' has a 0-d shape (); use shape (1,)");
  for (std::size_t d = 0; d < shape.size(); ++d)
    if (shape[d] < 0)
      throw InvalidArgument(describe() + ": parameter '" + name + "' has shape " +
                            shape_string(shape) + " with negative extent " +
                            std::to_string(shape[d]) + " in dim " + std::to_string(d));
  checked_nbytes(shape, dtype, [&] {
    return describe() + ": parameter '" + (fqn_.empty() ? name : fqn_ + "." + name) + "'";
  });
  const auto [slot, inserted] = param_by_name_.try_emplace(name, nullptr);
  if (!inserted) name_taken(name, "parameter", false);
  try {
    params_.push_back(std::unique_ptr<Parameter>(
        new Parameter(this, name, std::move(shape), dtype, requires_grad)));
  } catch (...) {
    param_by_name_.erase(slot);
    throw;
  }
  slot->second = params_.back().get();
  return *params_.back();
}

void Module::prefetch_child(std::size_t i, int stage) const noexcept {
  if (i >= children_.size()) return;
  const Module& c = *children_[i];
  if (stage == 0) {
    prefetch_lines<kWalkedBytes>(&c);
  } else if (stage == 1) {
    prefetch_lines<1>(c.params_.data());
  } else {
    for (const auto& p : c.params_)
      prefetch_lines<Parameter::kWalkedBytes>(p.get());
  }
}

Module& Module::child(std::size_t i) const {
  if (i >= children_.size())
    throw InvalidArgument(describe() + ": child index " + std::to_string(i) +
                          " is out of range (it has " + std::to_string(children_.size()) +
                          " children)");
  return *children_[i];
}

Parameter& Module::param(std::size_t i) const {
  if (i >= params_.size())
    throw InvalidArgument(describe() + ": parameter index " + std::to_string(i) +
                          " is out of range (it has " + std::to_string(params_.size()) +
                          " parameters)");
  return *params_[i];
}

const Parameter* Module::own_param(const std::string& name) const noexcept {
  const auto it = param_by_name_.find(name);
  return it == param_by_name_.end() ? nullptr : it->second;
}

Parameter& Module::param(const std::string& name) const {
  if (const Parameter* p = own_param(name)) return const_cast<Parameter&>(*p);
  throw InvalidArgument(describe() + " has no parameter '" + name + "' (" + param_list(*this) +
                        ")");
}

const Module* Module::walk(const std::string& relative_fqn, std::string* error) const {
  const Module* m = this;
  if (relative_fqn.empty()) return m;
  std::size_t start = 0;
  while (true) {
    const auto dot = relative_fqn.find('.', start);
    const std::string part =
        relative_fqn.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (part.empty()) {
      if (error)
        *error = describe() + ": invalid module path '" + relative_fqn + "' (empty name part)";
      return nullptr;
    }
    const auto found = m->child_by_name_.find(part);
    const Module* next = found == m->child_by_name_.end() ? nullptr : found->second;
    if (next == nullptr) {
      if (error) {
        *error = describe() + " has no submodule '" + relative_fqn + "'";
        if (m != this) *error += ": " + m->describe() + " has no child '" + part + "'";
        *error += " (" + module_list(m->children_) + ")";
      }
      return nullptr;
    }
    m = next;
    if (dot == std::string::npos) return m;
    start = dot + 1;
  }
}

Module& Module::module(const std::string& relative_fqn) {
  std::string error;
  const Module* m = walk(relative_fqn, &error);
  if (m == nullptr) throw InvalidArgument(error);
  return const_cast<Module&>(*m);
}

Module* Module::find_module(const std::string& relative_fqn) noexcept {
  try {
    return const_cast<Module*>(walk(relative_fqn, nullptr));
  } catch (...) {  // std::bad_alloc from a substring
    return nullptr;
  }
}

Parameter& Module::find_param(const std::string& relative_fqn) const {
  if (relative_fqn.empty()) throw InvalidArgument(describe() + ": empty parameter name");
  const auto [path, name] = split_last(relative_fqn);
  std::string error;
  const Module* m = path.empty() ? this : walk(path, &error);
  if (m == nullptr) throw InvalidArgument(error + "; looking up parameter '" + relative_fqn + "'");
  return m->param(name);
}

Parameter* Module::try_find_param(const std::string& relative_fqn) const noexcept {
  try {
    if (relative_fqn.empty()) return nullptr;
    const auto [path, name] = split_last(relative_fqn);
    const Module* m = path.empty() ? this : walk(path, nullptr);
    return m == nullptr ? nullptr : const_cast<Parameter*>(m->own_param(name));
  } catch (...) {  // std::bad_alloc from a substring
    return nullptr;
  }
}

void Module::collect_preorder(std::vector<Module*>& out) {
  out.push_back(this);
  for (auto& c : children_)
    c->collect_preorder(out);
}

void Module::collect_postorder(std::vector<Module*>& out) {
  for (auto& c : children_)
    c->collect_postorder(out);
  out.push_back(this);
}

void Module::collect_parameters(std::vector<Parameter*>& out) {
  for (auto& p : params_)
    out.push_back(p.get());
  for (auto& c : children_)
    c->collect_parameters(out);
}

std::vector<Module*> Module::modules_preorder() {
  std::vector<Module*> out;
  collect_preorder(out);
  return out;
}

std::vector<Module*> Module::modules_postorder() {
  std::vector<Module*> out;
  collect_postorder(out);
  return out;
}

std::vector<Parameter*> Module::parameters() {
  std::vector<Parameter*> out;
  collect_parameters(out);
  return out;
}

Module& Module::on_forward(Callback fn) {
  forward_callback_ = std::move(fn);
  return *this;
}

Module& Module::on_backward(Callback fn) {
  backward_callback_ = std::move(fn);
  return *this;
}

Module& Module::on_forward(const std::string& relative_fqn, Callback fn) {
  module(relative_fqn).on_forward(std::move(fn));
  return *this;
}

Module& Module::on_backward(const std::string& relative_fqn, Callback fn) {
  module(relative_fqn).on_backward(std::move(fn));
  return *this;
}

void Module::set_fully_shard_request(ShardRequest r) {
  fully_shard_request_ = std::make_shared<const ShardRequest>(std::move(r));
}

void Module::set_fully_shard_request(bool shard) {
  // The two requests without options are shared by every module that makes them.
  static const auto yes = std::make_shared<const ShardRequest>();
  static const auto no = std::make_shared<const ShardRequest>(ShardRequest::never());
  fully_shard_request_ = shard ? yes : no;
}

}  // namespace fullshard::graph
