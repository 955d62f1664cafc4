#include <fnmatch.h>

#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "fullshard/base/error.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "lib/session/session_optimizer.hpp"

namespace fullshard::session {

int state_arrays(const OptimizerSpec& o) {
  return o.type == "adamw" ? 2 : (o.momentum > 0 ? 1 : 0);
}

std::set<std::string> no_decay_names(const Config& cfg, graph::Module& root) {
  std::set<std::string> out;
  const std::vector<graph::Parameter*> params = root.parameters();
  for (const std::string& pattern : cfg.optimizer.no_weight_decay) {
    bool any = false;
    for (const graph::Parameter* p : params)
      if (fnmatch(pattern.c_str(), p->fqn().c_str(), 0) == 0) {
        out.insert(p->fqn());
        any = true;
      }
    if (!any)
      throw ConfigError(cfg.source + ": optimizer.no_weight_decay: \"" + pattern +
                        "\" matches no parameter of the model (names are fully qualified, "
                        "e.g. \"" +
                        (params.empty() ? std::string("blocks.0.weight") : params.front()->fqn()) +
                        "\")");
  }
  return out;
}

namespace {

// fullshard's SGD and AdamW on the graph parameters: each update works on the shard, from the
// sharded gradient the reduce-scatter wrote (or, inside backward, from the reduction itself:
// no sharded gradient is kept).
class GraphOptimizer final : public SessionOptimizer {
 public:
  GraphOptimizer(const Config& cfg, graph::Module& root) : root_(root) {
    const OptimizerSpec& o = cfg.optimizer;
    std::vector<graph::Parameter*> params = root.parameters();
    const std::set<std::string> no_decay = no_decay_names(cfg, root);
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
  ~GraphOptimizer() override {
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
    return checkpoint::save(dir, root_, opt_.get(), step, metadata.dump(), {}, options);
  }
  checkpoint::AsyncSave save_async(const std::string& dir, std::int64_t step,
                                   const checkpoint::SaveOptions& options,
                                   const nlohmann::json& metadata) override {
    return checkpoint::save_async(dir, root_, opt_.get(), step, metadata.dump(), {}, options);
  }
  checkpoint::Loaded load(const std::string& dir) override {
    return checkpoint::load(dir, root_, opt_.get());
  }
  std::uint64_t reserve_async_staging() override {
    return checkpoint::reserve_async_staging(root_, opt_.get());
  }

 private:
  graph::Module& root_;
  std::unique_ptr<optim::Optimizer> opt_;
  double* lr_ = nullptr;
};

}  // namespace

std::unique_ptr<SessionOptimizer> make_graph_optimizer(const Config& cfg, graph::Module& root) {
  return std::make_unique<GraphOptimizer>(cfg, root);
}

}  // namespace fullshard::session
