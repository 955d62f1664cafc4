#include "fullshard/graph/module.hpp"

#include <utility>

#include "fullshard/base/error.hpp"

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

}  // namespace

// ---------------------------------------------------------------------------------------------
// Parameter

Parameter::Parameter(Module* module, std::string name, Shape shape, DType dtype, bool requires_grad)
    : module_(module),
      name_(std::move(name)),
      fqn_(module->fqn().empty() ? name_ : module->fqn() + "." + name_),
      shape_(std::move(shape)),
      dtype_(dtype),
      requires_grad_(requires_grad) {}

Parameter& Parameter::init(const std::function<double(std::int64_t)>& fn) {
  Tensor t = Tensor::empty(shape_, dtype_, MemorySpace::host, fqn_);
  const std::int64_t n = t.numel();
  for (std::int64_t i = 0; i < n; ++i)
    t.set(i, fn(i));
  data_ = std::move(t);
  return *this;
}

// ---------------------------------------------------------------------------------------------
// Module

Module::Module(std::string name, Module* parent)
    : name_(std::move(name)),
      fqn_(parent == nullptr ? std::string()
                             : (parent->is_root() ? name_ : parent->fqn() + "." + name_)),
      parent_(parent) {}

Module::~Module() = default;

std::unique_ptr<Module> Module::make_root(std::string name) {
  if (name.empty()) throw InvalidArgument("Module::make_root: the root module's name is empty");
  return std::unique_ptr<Module>(new Module(std::move(name), nullptr));
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
  if (name.find('.') != std::string::npos)
    throw InvalidArgument(describe() + ": invalid " + what + " name '" + name +
                          "' (names must not contain '.')");
  if (child_by_name_.count(name))
    throw InvalidArgument(describe() + ": cannot add " + what + " '" + name +
                          "': a child module of that name exists");
  if (own_param(name) != nullptr)
    throw InvalidArgument(describe() + ": cannot add " + what + " '" + name +
                          "': a parameter of that name exists");
}

Module& Module::add_module(const std::string& name) {
  check_new_name(name, "child module");
  children_.push_back(std::unique_ptr<Module>(new Module(name, this)));
  child_by_name_[name] = children_.back().get();
  return *children_.back();
}

Parameter& Module::add_param(const std::string& name, Shape shape, DType dtype,
                             bool requires_grad) {
  check_new_name(name, "parameter");
  if (shape.empty())
    throw InvalidArgument(describe() + ": parameter '" + name +
                          "' has a 0-d shape (); use shape (1,)");
  for (std::size_t d = 0; d < shape.size(); ++d)
    if (shape[d] < 0)
      throw InvalidArgument(describe() + ": parameter '" + name + "' has shape " +
                            shape_string(shape) + " with negative extent " +
                            std::to_string(shape[d]) + " in dim " + std::to_string(d));
  params_.push_back(std::unique_ptr<Parameter>(
      new Parameter(this, name, std::move(shape), dtype, requires_grad)));
  param_by_name_[name] = params_.back().get();
  return *params_.back();
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

void Module::set_fully_shard_request(nlohmann::json r) {
  if (!r.is_null() && !r.is_boolean() && !r.is_object())
    throw InvalidArgument(describe() +
                          ": the fully_shard request must be null, a boolean or an "
                          "object of options, got " +
                          std::string(r.type_name()));
  fully_shard_request_ = std::move(r);
}

}  // namespace fullshard::graph
