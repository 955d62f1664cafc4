#include "fullshard/fsdp/hooks.hpp"

#include "fullshard/fsdp/fully_shard.hpp"
#include "lib/fsdp/engine.hpp"
#include "lib/fsdp/param_group.hpp"
#include "lib/fsdp/running_backend.hpp"

namespace fullshard::fsdp {

namespace {

// The engine group fully_shard formed at a module (initialising its root on first use).
engine::Group* running_group(graph::Module& m) {
  FSDPModule* st = fsdp_state(m);
  if (!st) return nullptr;
  detail::ensure_initialized(*st);
  return &group_of(*st).engine();
}

// The traversal's view of a fully_shard'ed graph; installs `recorder` on the backends of the
// roots it meets for the duration of one forward or backward.
class RunningLookup final : public engine::GroupLookup {
 public:
  explicit RunningLookup(const ComputeRecorder& recorder) : recorder_(recorder) {}
  ~RunningLookup() override {
    for (detail::RunningBackend* b : touched_)
      b->compute_recorder = nullptr;
  }
  engine::Group* group_at(const graph::Module& m) const override {
    engine::Group* g = running_group(const_cast<graph::Module&>(m));
    if (g && recorder_) {
      auto* b = static_cast<detail::RunningBackend*>(g->root->backend);
      if (!b->compute_recorder) {
        b->compute_recorder = recorder_;
        touched_.push_back(b);
      }
    }
    return g;
  }
  engine::Backend* default_backend() const override { return nullptr; }

 private:
  const ComputeRecorder& recorder_;
  mutable std::vector<detail::RunningBackend*> touched_;
};

}  // namespace

void pre_forward(graph::Module& module) {
  if (engine::Group* g = running_group(module)) engine::pre_forward(*g);
}

void post_forward(graph::Module& module) {
  FSDPModule* st = fsdp_state(module);
  if (!st || !group_of(*st).attached()) return;
  engine::post_forward(group_of(*st).engine());
}

void pre_backward(graph::Module& module) {
  if (engine::Group* g = running_group(module)) engine::pre_backward(*g);
}

void post_backward(graph::Module& module) {
  FSDPModule* st = fsdp_state(module);
  if (!st || !group_of(*st).attached()) return;
  engine::post_backward(group_of(*st).engine());
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

void forward(graph::Module& module, const ComputeRecorder& recorder) {
  RunningLookup lookup(recorder);
  engine::forward(module, lookup);
}

void backward(graph::Module& module, const ComputeRecorder& recorder) {
  RunningLookup lookup(recorder);
  engine::backward(module, lookup);
}

}  // namespace fullshard::fsdp
