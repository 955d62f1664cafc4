#include <nlohmann/json.hpp>

#include "lib/session/optimizer.hpp"

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <set>
#include <utility>
#include <vector>

#include "fullshard/optim/optimizer.hpp"
#include "fullshard/torch/checkpoint.hpp"

namespace fullshard::session {

namespace fst = fullshard::torch;

namespace {

// LibTorch's SGD and AdamW on ShardedModel::parameters() (each tensor once): f64 models.
class LibTorchOptimizer final : public SessionOptimizer {
 public:
  LibTorchOptimizer(const Config& cfg, fst::ShardedModel& model) : model_(model) {
    const OptimizerSpec& o = cfg.optimizer;
    const std::set<std::string> no_decay = no_decay_names(cfg, model.graph());
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
    return fst::save_checkpoint(dir, model_, opt_.get(), step, options, metadata.dump());
  }
  checkpoint::AsyncSave save_async(const std::string& dir, std::int64_t step,
                                   const checkpoint::SaveOptions& options,
                                   const nlohmann::json& metadata) override {
    return fst::save_checkpoint_async(dir, model_, opt_.get(), step, options, metadata.dump());
  }
  checkpoint::Loaded load(const std::string& dir) override {
    return fst::load_checkpoint(dir, model_, opt_.get());
  }
  // LibTorch's optimizer state is staged as its save finds it: the parameters' staging only.
  std::uint64_t reserve_async_staging() override {
    return checkpoint::reserve_async_staging(model_.graph(), nullptr);
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
  if (f32 || cfg.optimizer.in_backward) return make_graph_optimizer(cfg, model.graph());
  return std::make_unique<LibTorchOptimizer>(cfg, model);
}

}  // namespace fullshard::session
