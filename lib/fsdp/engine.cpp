// The engine's vocabulary, and its state machine (lib/fsdp/state_machine.hpp)
// on the abstract Backend: what fully_shard and the hooks call.
#include "lib/fsdp/engine.hpp"

#include "lib/fsdp/state_machine.hpp"

namespace fullshard::fsdp::engine {

const char* op_kind_name(OpKind k) noexcept {
  switch (k) {
    case OpKind::all_gather:
      return "all_gather";
    case OpKind::copy_in:
      return "copy_in";
    case OpKind::copy_out:
      return "copy_out";
    case OpKind::forward:
      return "forward";
    case OpKind::backward:
      return "backward";
    case OpKind::reduce_scatter:
      return "reduce_scatter";
    case OpKind::all_reduce:
      return "all_reduce";
    case OpKind::reduce_copy_out:
      return "reduce_copy_out";
    case OpKind::reshard:
      return "reshard";
    case OpKind::grad_init:
      return "grad_init";
    case OpKind::wait:
      return "wait";
    case OpKind::update:
      return "update";
  }
  return "?";
}

const char* buf_kind_name(BufKind k) noexcept {
  switch (k) {
    case BufKind::ag_buffer:
      return "ag_buffer";
    case BufKind::unsharded:
      return "unsharded";
    case BufKind::post_forward:
      return "post_forward";
    case BufKind::grads:
      return "grads";
    case BufKind::rs_input:
      return "rs_input";
    case BufKind::rs_output:
      return "rs_output";
    case BufKind::partial_reduce:
      return "partial_reduce";
  }
  return "?";
}

std::size_t GroupInfo::unsharded_bytes() const noexcept {
  return static_cast<std::size_t>(arena_numel) * dtype_size(param_dtype);
}

// ---- the state machine, on the abstract backend (the running backend's calls) -------------

using Machine = detail::StateMachine<Backend>;

void attach(Root& root, const std::vector<Group*>& groups) {
  root.groups.reserve(root.groups.size() + groups.size());
  for (Group* g : groups) {
    g->root = &root;
    g->reshard_after_forward = g->reshard_after_forward.resolved(g == groups.front());
    root.groups.push_back(g);
  }
}

void issue_unshard(Group& g, bool own) {
  Machine::issue_unshard(g, own);
}
void wait_unshard(Group& g) {
  Machine::wait_unshard(g);
}
void reshard(Group& g) {
  Machine::reshard(g);
}
void post_forward_reshard(Group& g) {
  Machine::post_forward_reshard(g);
}
void prepare_gradients(Group& g) {
  Machine::prepare_gradients(g);
}
void reduce_gradients(Group& g) {
  Machine::reduce_gradients(g);
}
void wait_reductions(Root& root, std::size_t keep) {
  Machine::wait_reductions(root, keep);
}
void discard_iteration(Root& root) {
  Machine::discard_iteration(root);
}
void zero_grad(Group& g) {
  Machine::zero_grad(g);
}
void pre_forward(Group& g) {
  Machine::pre_forward(g);
}
void post_forward(Group& g) {
  Machine::post_forward(g);
}
void pre_backward(Group& g) {
  Machine::pre_backward(g);
}
void post_backward(Group& g) {
  Machine::post_backward(g);
}
void begin_backward(Backend& b) {
  Machine::begin_backward(b);
}
void forward(graph::Module& m, const GroupLookup& lookup, Group* owner) {
  Machine::forward(m, lookup, owner);
}
void backward(graph::Module& m, const GroupLookup& lookup, Group* owner) {
  Machine::backward(m, lookup, owner);
}

}  // namespace fullshard::fsdp::engine
