// The FSDP hooks, for a user's own driver loop and for the executor.
//
//   {
//     auto s = fsdp::forward_scope(layer);   // pre-forward: all-gather, prefetch
//     ... compute with layer.param("w").data() (the unsharded parameter) ...
//   }                                        // post-forward: reshard (policy)
//   {
//     auto s = fsdp::backward_scope(layer);  // pre-backward: all-gather, gradients zeroed
//     ... add into layer.param("w").grad() (the unsharded gradient) ...
//   }                                        // post-backward: reduce-scatter into the shards
//
// Scopes on modules without FSDP state do nothing (their parameters belong to an ancestor's
// group). A scope left by an exception runs no post hook: call reset_iter_state() on the
// root, then run the next iteration. Backward on the root module ends the iteration: it
// waits for every reduce-scatter, after which each parameter's grad() is its shard of the
// full-batch gradient (mean over the data-parallel ranks unless a divide factor is set).
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <string>

#include "fullshard/graph/module.hpp"

namespace fullshard::fsdp {

void pre_forward(graph::Module& module);
void post_forward(graph::Module& module);
void pre_backward(graph::Module& module);
void post_backward(graph::Module& module);

class ForwardScope {
 public:
  explicit ForwardScope(graph::Module& module);
  ~ForwardScope() noexcept(false);
  ForwardScope(const ForwardScope&) = delete;
  ForwardScope& operator=(const ForwardScope&) = delete;

 private:
  graph::Module* module_;
  int uncaught_;
};

class BackwardScope {
 public:
  explicit BackwardScope(graph::Module& module);
  ~BackwardScope() noexcept(false);
  BackwardScope(const BackwardScope&) = delete;
  BackwardScope& operator=(const BackwardScope&) = delete;

 private:
  graph::Module* module_;
  int uncaught_;
};

/// `auto s = fsdp::forward_scope(m);` (guaranteed copy elision: the scope is not copied).
inline ForwardScope forward_scope(graph::Module& m) {
  return ForwardScope(m);
}
inline BackwardScope backward_scope(graph::Module& m) {
  return BackwardScope(m);
}

/// Called after each module's callback with "fwd(<fqn>)" / "bwd(<fqn>)" and its start and end
/// (the executor's measured timeline).
using ComputeRecorder =
    std::function<void(const std::string& label, std::chrono::steady_clock::time_point start,
                       std::chrono::steady_clock::time_point end)>;

/// Runs forward over a subtree in declared order: pre-forward hook, the module's forward
/// callback, its children in order, post-forward hook (the engine's traversal, the same one
/// Scheduler::plan runs on its planning backend).
void forward(graph::Module& module, const ComputeRecorder& recorder = {});
/// Runs backward in reverse: pre-backward hook, children in reverse order, the module's
/// backward callback, post-backward hook.
void backward(graph::Module& module, const ComputeRecorder& recorder = {});

}  // namespace fullshard::fsdp
