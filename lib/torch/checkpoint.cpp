#include "fullshard/torch/checkpoint.hpp"

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <map>
#include <memory>
#include <sstream>
#include <type_traits>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "lib/torch/parameter_binding.hpp"

namespace fullshard::torch {
namespace {

// The optimizer state as a fullshard Optimizer that only holds it (never steps): what
// checkpoint::save writes and checkpoint::load fills, per parameter and reshardable.
class StateHolder final : public optim::Optimizer {
 public:
  StateHolder(std::vector<graph::Parameter*> params, std::vector<std::string> names)
      : Optimizer(std::move(params)), names_(std::move(names)) {}
  std::vector<std::string> state_names() const override { return names_; }

 protected:
  void update(graph::Parameter& p, const Tensor&, std::vector<Tensor>&, bool,
              std::int64_t) override {
    throw InvalidArgument(
        "fullshard::torch: the checkpoint's optimizer state holder cannot "
        "step ('" +
        p.fqn() + "')");
  }

 private:
  std::vector<std::string> names_;
};

enum class Kind { adamw, sgd };

Kind kind_of(const ::torch::optim::Optimizer& opt) {
  if (const auto* a = dynamic_cast<const ::torch::optim::AdamW*>(&opt)) {
    for (const auto& g : a->param_groups())
      if (static_cast<const ::torch::optim::AdamWOptions&>(g.options()).amsgrad())
        throw InvalidArgument(
            "fullshard::torch checkpoints: AdamW with amsgrad is not "
            "supported (its max_exp_avg_sq is not saved)");
    return Kind::adamw;
  }
  if (dynamic_cast<const ::torch::optim::SGD*>(&opt)) return Kind::sgd;
  throw InvalidArgument(
      "fullshard::torch checkpoints: the optimizer state of "
      "torch::optim::AdamW and torch::optim::SGD is supported; use one of "
      "them (or fullshard's optimizers on ShardedModel::graph().parameters())");
}

std::vector<std::string> state_names(Kind k) {
  return k == Kind::adamw ? std::vector<std::string>{"exp_avg", "exp_avg_sq"}
                          : std::vector<std::string>{"momentum_buffer"};
}

// The key of a parameter in the optimizer's state map: a string in LibTorch 1.x, the
// TensorImpl's address in 2.x.
template <class Map>
typename Map::key_type state_key(const at::Tensor& p) {
  if constexpr (std::is_same_v<typename Map::key_type, std::string>) {
    std::ostringstream os;  // LibTorch 1.x's c10::guts::to_string of the address
    os << p.unsafeGetTensorImpl();
    return os.str();
  } else
    return p.unsafeGetTensorImpl();
}

at::Tensor torch_param(const graph::Parameter& p) {
  const auto* b = dynamic_cast<const detail::ParameterBinding*>(p.binding());
  if (!b)
    throw InvalidArgument("fullshard::torch checkpoints: parameter '" + p.fqn() +
                          "' is not sharded; apply fully_shard to the root first");
  return b->param();
}

Tensor wrap(const at::Tensor& t, const Shape& shape) {
  at::Tensor c = t.contiguous();
  auto keep = std::make_shared<at::Tensor>(c);
  return Tensor::from_owner(keep, c.data_ptr(), shape,
                            detail::dtype_of(c.scalar_type(), "an optimizer state tensor"),
                            c.is_cuda() ? MemorySpace::device : MemorySpace::host);
}

// Calls save(graph, optimizer state holder or null) with the optimizer's state wrapped as a
// fullshard Optimizer (the holder lives for the call: save and save_async read it before they
// return).
template <class Save>
auto with_state(ShardedModel& model, const ::torch::optim::Optimizer* optimizer, std::int64_t step,
                Save&& save) {
  graph::Module& graph = model.graph();
  if (!optimizer) return save(graph, nullptr);
  const Kind kind = kind_of(*optimizer);
  std::vector<graph::Parameter*> params = graph.parameters();
  StateHolder holder(params, state_names(kind));
  std::map<std::string, Tensor> state;
  std::int64_t steps = 0;
  const auto& map = optimizer->state();
  using Map = std::decay_t<decltype(map)>;
  for (graph::Parameter* p : params) {
    const at::Tensor tp = torch_param(*p);
    auto it = map.find(state_key<Map>(tp));
    if (it == map.end()) continue;  // no state yet (no step, or no gradient)
    const Shape shard = p->data().shape();
    if (kind == Kind::adamw) {
      const auto& s = static_cast<const ::torch::optim::AdamWParamState&>(*it->second);
      state[p->fqn() + ".exp_avg"] = wrap(s.exp_avg(), shard);
      state[p->fqn() + ".exp_avg_sq"] = wrap(s.exp_avg_sq(), shard);
      steps = std::max<std::int64_t>(steps, s.step());
    } else {
      const auto& s = static_cast<const ::torch::optim::SGDParamState&>(*it->second);
      if (!s.momentum_buffer().defined()) continue;
      state[p->fqn() + ".momentum_buffer"] = wrap(s.momentum_buffer(), shard);
    }
  }
  Tensor count = Tensor::empty({1}, DType::f64);
  count.set(0, static_cast<double>(kind == Kind::adamw ? steps : step));
  state["step"] = count;
  holder.load_state_dict(std::move(state));
  return save(graph, &holder);
}

}  // namespace

std::string save_checkpoint(const std::string& dir, ShardedModel& model,
                            const ::torch::optim::Optimizer* optimizer, std::int64_t step,
                            const checkpoint::SaveOptions& options, const std::string& metadata) {
  return with_state(model, optimizer, step,
                    [&](graph::Module& graph, const optim::Optimizer* holder) {
                      return checkpoint::save(dir, graph, holder, step, metadata, {}, options);
                    });
}

checkpoint::AsyncSave save_checkpoint_async(const std::string& dir, ShardedModel& model,
                                            const ::torch::optim::Optimizer* optimizer,
                                            std::int64_t step,
                                            const checkpoint::SaveOptions& options,
                                            const std::string& metadata) {
  return with_state(
      model, optimizer, step, [&](graph::Module& graph, const optim::Optimizer* holder) {
        return checkpoint::save_async(dir, graph, holder, step, metadata, {}, options);
      });
}

checkpoint::Loaded load_checkpoint(const std::string& dir, ShardedModel& model,
                                   ::torch::optim::Optimizer* optimizer) {
  graph::Module& graph = model.graph();
  if (!optimizer) return checkpoint::load(dir, graph, nullptr);
  const Kind kind = kind_of(*optimizer);
  std::vector<graph::Parameter*> params = graph.parameters();
  StateHolder holder(params, state_names(kind));
  checkpoint::Loaded loaded = checkpoint::load(dir, graph, &holder);
  const std::map<std::string, Tensor> views = holder.state_views();
  auto& map = optimizer->state();
  using Map = std::decay_t<decltype(map)>;
  // A LibTorch tensor owning a copy of a loaded state tensor.
  auto owned = [](const Tensor& t, const at::Tensor& like) {
    const std::vector<int64_t> sizes(t.shape().begin(), t.shape().end());
    return ::torch::from_blob(t.data(), sizes, at::TensorOptions().dtype(at::kFloat))
        .to(like.device(), /*non_blocking=*/false, /*copy=*/true)
        .view_as(like);
  };
  for (graph::Parameter* p : params) {
    const at::Tensor tp = torch_param(*p);
    const auto key = state_key<Map>(tp);
    map.erase(key);
    const std::string first = p->fqn() + "." + state_names(kind).front();
    if (!views.count(first)) continue;  // no state saved for it
    if (kind == Kind::adamw) {
      auto s = std::make_unique<::torch::optim::AdamWParamState>();
      s->step(holder.steps());
      s->exp_avg(owned(views.at(p->fqn() + ".exp_avg"), tp));
      s->exp_avg_sq(owned(views.at(p->fqn() + ".exp_avg_sq"), tp));
      map[key] = std::move(s);
    } else {
      auto s = std::make_unique<::torch::optim::SGDParamState>();
      s->momentum_buffer(owned(views.at(first), tp));
      map[key] = std::move(s);
    }
  }
  return loaded;
}

}  // namespace fullshard::torch
