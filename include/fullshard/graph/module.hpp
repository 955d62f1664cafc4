// The model graph: a tree of modules holding named parameters, like a torch.nn.Module tree.
// A module runs its children in the order they were added; FSDP (the fsdp layer) shards the
// parameters of the modules it is applied to and swaps the tensors registered on each
// Parameter. Names follow torch: the root's name is not part of any fully qualified name (FQN),
// a child of the root is "layers", a grandchild "layers.0", its parameter "layers.0.w1".
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/graph/shard_request.hpp"
#include "fullshard/tensor/shape.hpp"
#include "fullshard/tensor/tensor.hpp"

namespace fullshard::graph {

/// Declared cost of running a module (its own work, without its children), in milliseconds.
/// `declared` is true when the cost came from the graph file (a "cost" key) or the user set it.
struct Cost {
  double forward_ms = 0.0;
  double backward_ms = 0.0;
  bool declared = false;
};

/// Limits of a graph (docs/graph-format.md, "Limits"), enforced by Module and the JSON loader
/// alike, so that every walk over a graph (recursive traversals, the destructor) is bounded.
/// Modules nest at most this many levels below the root.
inline constexpr std::size_t kMaxModuleDepth = 256;
/// A fully qualified name (and the root's name) has at most this many bytes.
inline constexpr std::size_t kMaxFqnBytes = 1024;

/// Why `name` is not a valid module or parameter name, or "" when it is one. Valid names are
/// non-empty, contain no '.', and consist of printable characters: ASCII 0x21-0x7E (no space,
/// no control character) or UTF-8 encoded characters from U+00A0 up (no C1 control, no
/// malformed UTF-8). Length: see kMaxFqnBytes.
std::string name_problem(const std::string& name);

/// `s` in double quotes, safe to print: control characters and malformed UTF-8 escaped
/// (`\u0000`, `\xff`), quotes and backslashes escaped, cut to about `max_bytes` with "...".
std::string quoted_name(const std::string& s, std::size_t max_bytes = 80);

class Module;
class Parameter;

/// What a front end (a tensor library's parameters) attaches to a Parameter to follow what
/// the fsdp layer shows on it, without a copy: each show calls one of these right after the
/// Parameter's data() or grad() changed. Called from the thread that runs the hooks.
class ParameterBinding {
 public:
  virtual ~ParameterBinding() = default;
  /// data() is now the local shard (sharded == true) or the unsharded parameter.
  virtual void data_shown(const Parameter& p, bool sharded) = 0;
  /// grad() is now the sharded gradient (or none; sharded == true), or, at pre-backward, the
  /// unsharded gradient the front end registered earlier and the engine kept (no_sync), or
  /// none (sharded == false).
  virtual void grad_shown(const Parameter& p, bool sharded) = 0;
};

/// A user callback run with the module it is attached to.
using Callback = std::function<void(Module&)>;

/// A named tensor of a module. Its shape and dtype are the global (unsharded) ones and never
/// change; the tensors registered on it (data, grad) are swapped by the fsdp layer.
class Parameter {
 public:
  Parameter(const Parameter&) = delete;
  Parameter& operator=(const Parameter&) = delete;

  /// Local name, e.g. "weight".
  const std::string& name() const noexcept { return name_; }
  /// Fully qualified name, e.g. "layers.0.weight"; a parameter of the root: just its name.
  const std::string& fqn() const noexcept { return fqn_; }
  /// Global (unsharded) shape.
  const Shape& shape() const noexcept { return shape_; }
  /// The extent of dim 0 and the element count of the other dims (what sharding on dim 0
  /// needs; -1 when that count does not fit int64, which needs a dim 0 of 0), and the
  /// element count.
  std::int64_t first_extent() const noexcept { return first_extent_; }
  std::int64_t inner_numel() const noexcept { return inner_numel_; }
  std::int64_t numel() const noexcept {
    return inner_numel_ < 0 ? 0 : first_extent_ * inner_numel_;
  }
  /// Original dtype.
  DType dtype() const noexcept { return dtype_; }
  bool requires_grad() const noexcept { return requires_grad_; }
  /// The module that owns this parameter.
  Module& module() const noexcept { return *module_; }

  /// The tensor registered now. Before fully_shard: the full initial values the user set (or an
  /// undefined tensor); while sharded: the local shard; between unshard and reshard: the
  /// unsharded tensor.
  const Tensor& data() const noexcept { return data_; }
  /// The gradient registered now: unsharded during backward, the sharded gradient after the
  /// reduce-scatter; undefined when there is none.
  const Tensor& grad() const noexcept { return grad_; }
  /// Registers `t` as the data. Checks nothing about its shape or dtype: the fsdp layer swaps
  /// shards and unsharded tensors in here.
  void set_data(Tensor t) noexcept { data_ = std::move(t); }
  /// Registers `t` as the gradient (an undefined tensor clears it). Checks nothing.
  void set_grad(Tensor t) noexcept { grad_ = std::move(t); }
  /// During backward, under FSDPModule::set_fresh_gradients(true): grad() holds no values
  /// yet (it was not zeroed), so a backward callback assigns its gradient, every element,
  /// instead of adding into it. False otherwise (the default contract: add into grad()). The
  /// engine clears it when the first backward callback of the parameter's module returns.
  bool grad_fresh() const noexcept { return grad_fresh_; }
  void set_grad_fresh(bool fresh) noexcept { grad_fresh_ = fresh; }

  /// Convenience for users before sharding: allocates a host tensor of shape()/dtype() and sets
  /// element i (flat, row-major) to fn(i), rounded to the dtype. Returns *this.
  Parameter& init(const std::function<double(std::int64_t)>& fn);
  /// Sharded creation: declares element i's initial value as fn(i) (flat, row-major index of
  /// the full tensor, rounded to the dtype) without allocating anything. fully_shard fills
  /// each rank's shard from it, so the full tensor never exists on any rank and the values do
  /// not depend on the rank count; data() stays undefined until then. Where the parameter is
  /// used unsharded, materialize() makes the full tensor. Drops values set before. `fn` is
  /// called from the thread that shards; it must be pure (a counter-based generator, not a
  /// stateful one). Returns *this.
  Parameter& init_sharded(std::function<double(std::int64_t)> fn);
  /// The initialiser init_sharded declared, until fully_shard or materialize() used it; empty
  /// otherwise.
  const std::function<double(std::int64_t)>& initializer() const noexcept { return initializer_; }
  /// Makes data() the full tensor from the pending initialiser (as init() would) and drops it;
  /// nothing without one. Returns *this.
  Parameter& materialize();
  /// Drops the pending initialiser (fully_shard, once it filled the shard). Internal.
  void clear_initializer() noexcept { initializer_ = nullptr; }

  /// The front end's binding (nullptr: none). Set by front ends only; the binding must
  /// outlive the parameter's sharding (or be unset first).
  ParameterBinding* binding() const noexcept { return binding_; }
  void set_binding(ParameterBinding* b) noexcept { binding_ = b; }

 private:
  friend class Module;
  Parameter(Module* module, std::string name, Shape shape, DType dtype, bool requires_grad);

  // What planning reads first (the kWalkedBytes Module::prefetch_child asks for: up to
  // requires_grad_, 50 bytes with libstdc++), the names after.
  static constexpr std::size_t kWalkedBytes = 50;
  Module* module_;
  Shape shape_;
  std::int64_t first_extent_;
  std::int64_t inner_numel_;
  DType dtype_;
  bool requires_grad_;
  std::string name_;
  std::string fqn_;
  Tensor data_;
  Tensor grad_;
  std::function<double(std::int64_t)> initializer_;
  ParameterBinding* binding_ = nullptr;
  bool grad_fresh_ = false;
};

/// A node of the model graph. Modules are created by make_root (or load_graph_json) and
/// add_module; the root owns the whole tree, and references to modules and parameters stay
/// valid while it lives. Not copyable or movable.
///
/// Names (of child modules and parameters) are valid (name_problem) and unique among the
/// children and parameters of one module; modules nest at most kMaxModuleDepth levels and FQNs
/// have at most kMaxFqnBytes bytes; a parameter's size in bytes fits in a signed 64-bit
/// integer. Errors are InvalidArgument naming the module ("root module 'model'" for the root,
/// else "module '<fqn>'") and the offending name.
class Module {
 public:
  /// A root module. Its name (e.g. "model") is not part of any FQN (torch semantics); it must
  /// be a valid name (name_problem) of at most kMaxFqnBytes bytes.
  static std::unique_ptr<Module> make_root(std::string name = "model");

  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  ~Module();

  const std::string& name() const noexcept { return name_; }
  /// "" for the root, "layers" for a child of the root, "layers.0" for a grandchild.
  const std::string& fqn() const noexcept { return fqn_; }
  Module* parent() const noexcept { return parent_; }
  /// Levels below the root: 0 for the root, 1 for its children.
  std::size_t depth() const noexcept { return depth_; }
  bool is_root() const noexcept { return parent_ == nullptr; }
  Module& root() noexcept;

  /// Appends a child; children run in the order they are added. InvalidArgument beyond
  /// kMaxModuleDepth levels.
  Module& add_module(const std::string& name);
  /// Adds a parameter (declaration order defines the flat layout). The shape needs at least one
  /// dim (use (1,) for a scalar), extents >= 0, and numel * dtype size must fit in an int64
  /// (InvalidArgument naming the parameter's FQN otherwise).
  Parameter& add_param(const std::string& name, Shape shape, DType dtype = DType::f32,
                       bool requires_grad = true);

  /// Makes room for this many children and parameters (a loader that knows the counts).
  void reserve(std::size_t children, std::size_t params);

  std::size_t num_children() const noexcept { return children_.size(); }
  /// Modules below this one (children, their children, ...).
  std::size_t num_descendants() const noexcept { return descendants_; }
  /// Child i in execution order; InvalidArgument when out of range.
  Module& child(std::size_t i) const;
  /// Asks the cache for what a walk reads of child i: its lists, request, cost and FQN
  /// (stage 0), the array of its parameters (1, once stage 0 arrived) or the
  /// parameters' extents and dtypes (2, once stage 1 arrived). A walk over a large graph calls
  /// it a few children ahead, one child further per stage. Nothing when out of range.
  void prefetch_child(std::size_t i, int stage = 0) const noexcept;

  std::size_t num_params() const noexcept { return params_.size(); }
  /// Parameter i in declaration order; InvalidArgument when out of range.
  Parameter& param(std::size_t i) const;
  /// This module's own parameter by local name; InvalidArgument listing the names it has.
  Parameter& param(const std::string& name) const;

  /// The descendant at `relative_fqn` ("layers.0"), or *this for "". InvalidArgument naming the
  /// missing part.
  Module& module(const std::string& relative_fqn);
  /// As module(), but nullptr when there is no such descendant.
  Module* find_module(const std::string& relative_fqn) noexcept;
  /// The parameter at `relative_fqn` ("layers.0.w1", or "w1" for an own parameter);
  /// InvalidArgument naming the missing module or parameter.
  Parameter& find_param(const std::string& relative_fqn) const;
  /// As find_param(), but nullptr when there is no such parameter.
  Parameter* try_find_param(const std::string& relative_fqn) const noexcept;

  /// Every module of the subtree, self first, children in order.
  std::vector<Module*> modules_preorder();
  /// Every module of the subtree, children (in order) before their parent; self last.
  std::vector<Module*> modules_postorder();
  /// Every parameter of the subtree: own parameters first, then each child's, recursively
  /// (torch's named_parameters order).
  std::vector<Parameter*> parameters();

  /// Sets (replaces) the callback run when this module's forward runs; an empty `fn` removes
  /// it. Returns *this.
  Module& on_forward(Callback fn);
  /// Sets (replaces) the callback run when this module's backward runs; an empty `fn` removes it.
  Module& on_backward(Callback fn);
  /// module(relative_fqn).on_forward(fn); returns *this (the module called on).
  Module& on_forward(const std::string& relative_fqn, Callback fn);
  /// module(relative_fqn).on_backward(fn); returns *this (the module called on).
  Module& on_backward(const std::string& relative_fqn, Callback fn);
  /// The callbacks set; empty when none.
  const Callback& forward_callback() const noexcept { return forward_callback_; }
  const Callback& backward_callback() const noexcept { return backward_callback_; }

  /// Declared cost of this module's own work.
  Cost& cost() noexcept { return cost_; }
  const Cost& cost() const noexcept { return cost_; }

  /// What this module asks of fully_shard (graph/shard_request.hpp): null when nothing (a
  /// graph file's module without "fully_shard"). Requests are applied by
  /// fsdp::apply_fully_shard_requests and planned by the schedule layer.
  const ShardRequest* fully_shard_request() const noexcept { return fully_shard_request_.get(); }
  /// Sets (replaces) the request.
  void set_fully_shard_request(ShardRequest r);
  /// true: fully_shard with the defaults (a graph file's `"fully_shard": true`); false: never
  /// a group of its own (`false`).
  void set_fully_shard_request(bool shard);
  /// An int would convert to bool (3 meaning true).
  template <typename Int,
            typename = std::enable_if_t<std::is_integral_v<Int> && !std::is_same_v<Int, bool>>>
  void set_fully_shard_request(Int) = delete;
  /// Removes the request.
  void clear_fully_shard_request() noexcept { fully_shard_request_.reset(); }
  /// Whether this module asks for fully_shard (a request whose `shard` is true).
  bool requests_fully_shard() const noexcept {
    return fully_shard_request_ && fully_shard_request_->shard;
  }

  /// JSON path of this module in the file it came from, e.g. "modules[1].modules[0]"; "" for
  /// the root or a module built in C++. Built on demand from the indices set by the loader (a
  /// stored path per module would cost memory quadratic in the depth).
  std::string json_path() const;
  /// Set by the graph loader: this module is element `index` of its parent's "modules" array.
  void set_json_index(std::size_t index) noexcept { json_index_ = index; }

  /// Reserved for fullshard: the fsdp layer attaches its per-module state here. User code must
  /// not set it.
  std::shared_ptr<void>& extension() noexcept { return extension_; }
  const std::shared_ptr<void>& extension() const noexcept { return extension_; }

 private:
  Module(std::string name, Module* parent);
  /// "root module 'model'" or "module 'layers.0'", for messages.
  std::string describe() const;
  /// Name syntax and FQN length of a new child or parameter (not uniqueness).
  void check_new_name(const std::string& name, const char* what) const;
  [[noreturn]] void name_taken(const std::string& name, const char* what, bool by_module) const;
  /// The descendant at relative_fqn, or nullptr with *error saying what is missing.
  const Module* walk(const std::string& relative_fqn, std::string* error) const;
  const Parameter* own_param(const std::string& name) const noexcept;
  void collect_preorder(std::vector<Module*>& out);
  void collect_postorder(std::vector<Module*>& out);
  void collect_parameters(std::vector<Parameter*>& out);

  // What every walk over the graph reads (up to the FQN, which names a planned group: 144
  // bytes with libstdc++, prefetch_child's kWalkedBytes) comes first, then the callbacks
  // (read by the running hooks only); the local name and the lookups follow.
  static constexpr std::size_t kWalkedBytes = 144;
  std::vector<std::unique_ptr<Module>> children_;
  std::vector<std::unique_ptr<Parameter>> params_;
  std::shared_ptr<const ShardRequest> fully_shard_request_;  // shared: see set_..._request(bool)
  Cost cost_;
  Module* parent_;
  std::size_t depth_ = 0;
  std::size_t descendants_ = 0;
  std::string fqn_;
  Callback forward_callback_;
  Callback backward_callback_;
  std::string name_;
  // Name lookups: graphs of 100,000 modules are built and searched in linear time.
  std::unordered_map<std::string, Module*> child_by_name_;
  std::unordered_map<std::string, Parameter*> param_by_name_;
  std::size_t json_index_ = static_cast<std::size_t>(-1);  // none
  std::shared_ptr<void> extension_;
};

}  // namespace fullshard::graph
