#include "fullshard/fsdp/hooks.hpp"

#include "fullshard/fsdp/fully_shard.hpp"
#include "lib/fsdp/param_group.hpp"

namespace fullshard::fsdp {

namespace {

// Resets the per-pass bookkeeping of every group under a root.
void clear_iteration(FSDPModule& root) {
  auto* ctx = root.group()->context();
  ctx->post_forward_order.clear();
  ctx->in_backward = false;
  for (FSDPModule* s : root.subtree_states()) {
    auto& g = *s->group();
    g.forward_calls = g.forward_done = g.backward_calls = g.backward_done = 0;
    g.post_forward_indices.clear();
  }
}

void prefetch(graph::Module& m, bool backward) {
  FSDPModule* st = fsdp_state(m);
  detail::ensure_initialized(*st);
  auto& g = *st->group();
  if (backward && !g.unshard_in_backward) return;
  g.issue_unshard();
}

}  // namespace

void pre_forward(graph::Module& module) {
  FSDPModule* st = fsdp_state(module);
  if (!st) return;
  detail::ensure_initialized(*st);
  auto& g = *st->group();
  auto* ctx = g.context();
  if (ctx->in_backward) {  // recomputation inside backward: only make sure it is unsharded
    g.wait_unshard();
    return;
  }
  if (st->is_root() && g.forward_calls == 0) clear_iteration(*st);
  if (g.forward_calls++ == 0) g.wait_unshard();
  for (graph::Module* t : st->forward_prefetch)
    prefetch(*t, false);
}

void post_forward(graph::Module& module) {
  FSDPModule* st = fsdp_state(module);
  if (!st) return;
  auto& g = *st->group();
  auto* ctx = g.context();
  if (!ctx || ctx->in_backward) return;
  if (++g.forward_done < static_cast<int>(g.modules().size())) return;  // a list: wait for the last
  g.post_forward_indices.push_back(ctx->post_forward_order.size());
  ctx->post_forward_order.push_back(&g);
  g.forward_calls = g.forward_done = 0;
  g.post_forward_reshard();
}

void pre_backward(graph::Module& module) {
  FSDPModule* st = fsdp_state(module);
  if (!st) return;
  detail::ensure_initialized(*st);
  auto& g = *st->group();
  auto* ctx = g.context();
  ctx->in_backward = true;
  if (g.backward_calls++ > 0) return;
  if (g.unshard_in_backward) g.wait_unshard();
  g.prepare_gradients();
  if (st->explicit_backward_prefetch) {
    for (graph::Module* t : st->backward_prefetch)
      prefetch(*t, true);
  } else if (!g.post_forward_indices.empty()) {
    // Reverse post-forward order: prefetch the group that ran forward just before this one.
    const std::size_t i = g.post_forward_indices.back();
    g.post_forward_indices.pop_back();
    if (i > 0) {
      auto* next = ctx->post_forward_order[i - 1];
      if (next->unshard_in_backward) next->issue_unshard();
    }
  }
}

void post_backward(graph::Module& module) {
  FSDPModule* st = fsdp_state(module);
  if (!st) return;
  auto& g = *st->group();
  auto* ctx = g.context();
  if (!ctx) return;
  if (++g.backward_done >= static_cast<int>(g.modules().size())) {
    g.backward_calls = g.backward_done = 0;
    g.reduce_gradients();
    if (g.reshard_after_backward) g.reshard();
  }
  if (!st->is_root()) return;
  // End of the iteration's backward.
  for (FSDPModule* s : st->subtree_states()) {
    auto& other = *s->group();
    // Groups prefetched but never used in backward: finish their gather and reshard.
    if (&other != &g &&
        ((other.reshard_after_backward && other.state() != detail::ShardedState::sharded) ||
         other.gather_in_flight()))
      other.reshard();
  }
  if (ctx->is_last_backward) ctx->wait_reduces(0);
  clear_iteration(*st);
}

ForwardScope::ForwardScope(graph::Module& module)
    : module_(&module), uncaught_(std::uncaught_exceptions()) {
  pre_forward(module);
}

ForwardScope::~ForwardScope() noexcept(false) {
  if (std::uncaught_exceptions() == uncaught_) post_forward(*module_);
}

BackwardScope::BackwardScope(graph::Module& module)
    : module_(&module), uncaught_(std::uncaught_exceptions()) {
  pre_backward(module);
}

BackwardScope::~BackwardScope() noexcept(false) {
  if (std::uncaught_exceptions() == uncaught_) post_backward(*module_);
}

void forward(graph::Module& module) {
  auto scope = forward_scope(module);
  if (module.forward_callback()) module.forward_callback()(module);
  for (std::size_t i = 0; i < module.num_children(); ++i)
    forward(module.child(i));
}

void backward(graph::Module& module) {
  auto scope = backward_scope(module);
  for (std::size_t i = module.num_children(); i-- > 0;)
    backward(module.child(i));
  if (module.backward_callback()) module.backward_callback()(module);
}

}  // namespace fullshard::fsdp
