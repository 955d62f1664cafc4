#include "lib/session/optimizer.hpp"

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <fnmatch.h>

#include <algorithm>
#include <set>
#include <utility>
#include <vector>

#include "fullshard/optim/optimizer.hpp"
#include "fullshard/torch/checkpoint.hpp"

namespace fullshard::session {

namespace fst = fullshard::torch;

namespace {

// The FQNs of the parameters optimizer.no_weight_decay names (a pattern matching none is a
// ConfigError naming it).
std::set<std::string> no_decay_names(const Config& cfg, fst::ShardedModel& model) {
  std::set<std::string> out;
  for (const std::string& pattern : cfg.optimizer.no_weight_decay) {
    bool any = false;
    for (const graph::Parameter* p : model.graph().parameters())
      if (fnmatch(pattern.c_str(), p->fqn().c_str(), 0) == 0) {
        out.insert(p->fqn());
        any = true;
      }
    if (!any)
      throw ConfigError(cfg.source + ": optimizer.no_weight_decay: \"" + pattern +
                        "\" matches no parameter of the model (names are fully qualified, "
                        "e.g. \"" +
                        model.graph().parameters().front()->fqn() + "\")");
  }
  return out;
}

// fullshard's SGD and AdamW on the graph parameters: each update works on the shard the
// LibTorch parameter views, from the sharded gradient the reduce-scatter wrote (or, inside
// backward, from the reduction itself: no sharded gradient is kept).
class FullshardOptimizer final : public SessionOptimizer {
 public:
  FullshardOptimizer(const Config& cfg, fst::ShardedModel& model) : model_(model) {
    const OptimizerSpec& o = cfg.optimizer;
    std::vector<graph::Parameter*> params = model.graph().parameters();
    const std::set<std::string> no_decay = no_decay_names(cfg, model);
    std::vector<graph::Parameter*> without;
    for (graph::Parameter* p : params)
      if (no_decay.count(p->fqn())) without.push_back(p);
    if (o.type == "adamw") {
      auto a = std::make_unique<optim::AdamW>(std::move(params), o.lr, o.beta1, o.beta2, o.eps,
                                              o.weight_decay);
      lr_ = &a->lr;
      opt_ = std::move(a);
    } else {
      auto s = std::make_unique<optim::SGD>(std::move(params), o.lr, o.momentum, o.weight_decay);
      lr_ = &s->lr;
      opt_ = std::move(s);
    }
    opt_->set_no_weight_decay(without);
    try {
      if (o.in_backward) opt_->run_in_backward();
    } catch (const InvalidArgument& e) {
      if (without.empty()) throw;
      throw ConfigError(cfg.source +
                        ": optimizer.no_weight_decay with in_backward: " + e.message());
    }
  }
  ~FullshardOptimizer() override {
    try {
      if (opt_->runs_in_backward()) opt_->run_in_backward(false);
    } catch (...) {  // a group whose backward failed part way: the model goes with us
    }
  }

  void begin_step(double lr) override {
    *lr_ = lr;
    opt_->zero_grad();
  }
  void step() override { opt_->step(); }
  std::size_t tensors() const override { return opt_->params().size(); }
  std::string save(const std::string& dir, std::int64_t step,
                   const checkpoint::SaveOptions& options,
                   const nlohmann::json& metadata) override {
    return checkpoint::save(dir, model_.graph(), opt_.get(), step, metadata, {}, options);
  }
  checkpoint::AsyncSave save_async(const std::string& dir, std::int64_t step,
                                   const checkpoint::SaveOptions& options,
                                   const nlohmann::json& metadata) override {
    return checkpoint::save_async(dir, model_.graph(), opt_.get(), step, metadata, {}, options);
  }
  checkpoint::Loaded load(const std::string& dir) override {
    return checkpoint::load(dir, model_.graph(), opt_.get());
  }

 private:
  fst::ShardedModel& model_;
  std::unique_ptr<optim::Optimizer> opt_;
  double* lr_ = nullptr;
};

// LibTorch's SGD and AdamW on ShardedModel::parameters() (each tensor once): f64 models.
class LibTorchOptimizer final : public SessionOptimizer {
 public:
  LibTorchOptimizer(const Config& cfg, fst::ShardedModel& model) : model_(model) {
    const OptimizerSpec& o = cfg.optimizer;
    const std::set<std::string> no_decay = no_decay_names(cfg, model);
    // Two groups, with and without weight decay; each tensor once, by its first name.
    std::vector<at::Tensor> with, without;
    for (const auto& np : model.module("").named_parameters()) {
      auto seen = [&](const at::Tensor& q) { return q.is_same(np.value()); };
      if (std::any_of(with.begin(), with.end(), seen) ||
          std::any_of(without.begin(), without.end(), seen))
        continue;
      (no_decay.count(np.key()) ? without : with).push_back(np.value());
    }
    tensors_ = with.size() + without.size();
    auto options = [&](double wd) -> std::unique_ptr<::torch::optim::OptimizerOptions> {
      if (o.type == "adamw")
        return std::make_unique<::torch::optim::AdamWOptions>(::torch::optim::AdamWOptions(o.lr)
                                                                  .betas({o.beta1, o.beta2})
                                                                  .eps(o.eps)
                                                                  .weight_decay(wd));
      return std::make_unique<::torch::optim::SGDOptions>(
          ::torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(wd));
    };
    std::vector<::torch::optim::OptimizerParamGroup> groups;
    if (!with.empty()) groups.emplace_back(with, options(o.weight_decay));
    if (!without.empty()) groups.emplace_back(without, options(0.0));
    if (o.type == "adamw")
      opt_ = std::make_unique<::torch::optim::AdamW>(std::move(groups),
                                                     ::torch::optim::AdamWOptions(o.lr));
    else
      opt_ = std::make_unique<::torch::optim::SGD>(std::move(groups),
                                                   ::torch::optim::SGDOptions(o.lr));
  }

  void begin_step(double lr) override {
    for (auto& group : opt_->param_groups())
      group.options().set_lr(lr);
    opt_->zero_grad();
  }
  void step() override { opt_->step(); }
  std::size_t tensors() const override { return tensors_; }
  std::string save(const std::string& dir, std::int64_t step,
                   const checkpoint::SaveOptions& options,
                   const nlohmann::json& metadata) override {
    return fst::save_checkpoint(dir, model_, opt_.get(), step, options, metadata);
  }
  checkpoint::AsyncSave save_async(const std::string& dir, std::int64_t step,
                                   const checkpoint::SaveOptions& options,
                                   const nlohmann::json& metadata) override {
    return fst::save_checkpoint_async(dir, model_, opt_.get(), step, options, metadata);
  }
  checkpoint::Loaded load(const std::string& dir) override {
    return fst::load_checkpoint(dir, model_, opt_.get());
  }

 private:
  fst::ShardedModel& model_;
  std::unique_ptr<::torch::optim::Optimizer> opt_;
  std::size_t tensors_ = 0;
};

}  // namespace

std::unique_ptr<SessionOptimizer> make_optimizer(const Config& cfg, fst::ShardedModel& model) {
  // fullshard's optimizers hold f32 parameters (a TorchScript file may bring others); inside
  // backward they are required (the constructor names a parameter that is not f32).
  bool f32 = true;
  for (const graph::Parameter* p : model.graph().parameters())
    f32 = f32 && p->dtype() == DType::f32;
  if (f32 || cfg.optimizer.in_backward) return std::make_unique<FullshardOptimizer>(cfg, model);
  return std::make_unique<LibTorchOptimizer>(cfg, model);
}

}  // namespace fullshard::session
