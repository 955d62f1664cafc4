#include "lib/session/optimizer.hpp"

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <utility>
#include <vector>

#include "fullshard/optim/optimizer.hpp"
#include "fullshard/torch/checkpoint.hpp"

namespace fullshard::session {

namespace fst = fullshard::torch;

namespace {

// fullshard's SGD and AdamW on the graph parameters: each update works on the shard the
// LibTorch parameter views, from the sharded gradient the reduce-scatter wrote (or, inside
// backward, from the reduction itself: no sharded gradient is kept).
class FullshardOptimizer final : public SessionOptimizer {
 public:
  FullshardOptimizer(const OptimizerSpec& o, fst::ShardedModel& model) : model_(model) {
    std::vector<graph::Parameter*> params = model.graph().parameters();
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
    if (o.in_backward) opt_->run_in_backward();
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
  LibTorchOptimizer(const OptimizerSpec& o, fst::ShardedModel& model) : model_(model) {
    std::vector<at::Tensor> params = model.parameters();
    tensors_ = params.size();
    if (o.type == "adamw")
      opt_ = std::make_unique<::torch::optim::AdamW>(params, ::torch::optim::AdamWOptions(o.lr)
                                                                 .betas({o.beta1, o.beta2})
                                                                 .eps(o.eps)
                                                                 .weight_decay(o.weight_decay));
    else
      opt_ = std::make_unique<::torch::optim::SGD>(
          params,
          ::torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
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
  if (f32 || cfg.optimizer.in_backward)
    return std::make_unique<FullshardOptimizer>(cfg.optimizer, model);
  return std::make_unique<LibTorchOptimizer>(cfg.optimizer, model);
}

}  // namespace fullshard::session
