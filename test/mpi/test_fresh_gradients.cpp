// FSDPModule::set_fresh_gradients: the gradients are not zeroed before backward; callbacks
// assign a parameter's first gradient (Parameter::grad_fresh) and the post-backward zeroes
// those none wrote. Against the default contract (zeroed, add into grad()) on 1-4 ranks:
// the same sharded gradients, bit for bit, over several steps (so that reused buffers hold
// the last step's values), with micro-batches, mixed precision and HSDP.
#include <doctest/doctest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "test_support.hpp"

using namespace fullshard;
using graph::Module;
using graph::Parameter;

namespace {

int W() {
  return test::world_size();
}
int R() {
  return test::world_rank();
}

struct Config {
  bool bf16 = false;  // parameters and gradients in bf16 during backward
  bool hsdp = false;
  int micro = 1;
  HostProgress progress = HostProgress::inline_;
};

// l0 (7,3)+(5,) and l1 (13,) write their gradients; l2 (6,4) has no backward callback (its
// gradient is zero); the root's own parameter is written by the root's callback.
struct Model {
  std::unique_ptr<Module> root = Module::make_root("model");
  int step = 0, micro = 0;
  bool fresh_mode;
  int fresh_seen = 0, written = 0;

  Model(const Config& c, bool fresh) : fresh_mode(fresh) {
    Module& l0 = root->add_module("l0");
    Module& l1 = root->add_module("l1");
    Module& l2 = root->add_module("l2");
    l0.add_param("w", {7, 3});
    l0.add_param("b", {5});
    l1.add_param("w", {13});
    l2.add_param("w", {6, 4});
    root->add_param("scale", {3});
    for (Parameter* p : root->parameters())
      p->init([](std::int64_t e) { return 0.25 * static_cast<double>(e % 5) - 0.5; });
    for (Module* m : {&l0, &l1, root.get()})
      m->on_backward([this](Module& mod) {
        for (std::size_t i = 0; i < mod.num_params(); ++i) {
          Parameter& p = mod.param(i);
          Tensor g = p.grad();
          const bool assign = p.grad_fresh();
          fresh_seen += assign ? 1 : 0;
          ++written;
          for (std::int64_t e = 0; e < g.numel(); ++e) {
            const double v =
                test::sample(R(), static_cast<std::size_t>(e),
                             test::name_salt(p.fqn()) + 1000 * step + 100 * micro, true) +
                0.5 * p.data().at(e);
            g.set(e, assign ? v : g.at(e) + v);
          }
        }
      });
    const DeviceMesh mesh =
        c.hsdp ? DeviceMesh(MPI_COMM_WORLD, {2, W() / 2}, {"replicate", "shard"}, 60.0, c.progress)
               : DeviceMesh(MPI_COMM_WORLD, {W()}, {"dp"}, 60.0, c.progress);
    fsdp::FullyShardOptions o;
    if (c.bf16) o.mp_policy.param_dtype = DType::bf16;
    for (Module* m : {&l0, &l1, &l2})
      fsdp::fully_shard(*m, mesh, o);
    fsdp::fully_shard(*root, mesh, o).set_fresh_gradients(fresh);
  }
  fsdp::FSDPModule& state() { return *fsdp::fsdp_state(*root); }
};

// The sharded gradients after each step, per parameter (local shard values).
std::vector<std::map<std::string, std::vector<double>>> run(const Config& c, bool fresh,
                                                            int* fresh_seen = nullptr) {
  Model m(c, fresh);
  std::vector<std::map<std::string, std::vector<double>>> out;
  for (int k = 0; k < 3; ++k) {
    m.step = k;
    for (m.micro = 0; m.micro < c.micro; ++m.micro) {
      m.state().set_requires_gradient_sync(m.micro + 1 == c.micro);
      fsdp::forward(*m.root);
      fsdp::backward(*m.root);
    }
    auto& grads = out.emplace_back();
    for (Parameter* p : m.root->parameters()) {
      auto& v = grads[p->fqn()];
      REQUIRE(p->grad().defined());
      for (std::int64_t e = 0; e < p->grad().numel(); ++e)
        v.push_back(p->grad().at(e));
      CHECK(!p->grad_fresh());
    }
    m.state().zero_grad();
  }
  if (fresh_seen) *fresh_seen = m.fresh_seen;
  return out;
}

}  // namespace

TEST_CASE("fresh gradients: the sharded gradients of the zeroed ones, bit for bit") {
  std::vector<Config> configs = {
      {}, {true, false, 1}, {false, false, 3}, {true, false, 2, HostProgress::thread}};
  if (W() % 2 == 0) {
    configs.push_back({false, true, 1});
    configs.push_back({true, true, 2});
  }
  for (const Config& c : configs) {
    CAPTURE(c.bf16);
    CAPTURE(c.hsdp);
    CAPTURE(c.micro);
    int fresh_seen = 0;
    const auto zeroed = run(c, false);
    const auto fresh = run(c, true, &fresh_seen);
    // Each step's first micro-batch assigns the 4 written parameters' gradients; the later
    // micro-batches add.
    CHECK(fresh_seen == 3 * 4);
    REQUIRE(zeroed.size() == fresh.size());
    for (std::size_t k = 0; k < zeroed.size(); ++k)
      for (const auto& entry : zeroed[k]) {  // (no structured bindings: CAPTURE captures)
        const auto& fqn = entry.first;
        const auto& want = entry.second;
        CAPTURE(k);
        CAPTURE(fqn);
        CHECK(fresh[k].at(fqn) == want);
      }
    // l2 had no callback: its gradient is zero (not what the buffer held before).
    for (const auto& step : fresh)
      for (double x : step.at("l2.w"))
        CHECK(x == 0.0);
  }
}

TEST_CASE("fresh gradients: marks only inside backward; off by default; set before backward") {
  Model m({}, false);
  CHECK(!m.root->parameters().front()->grad_fresh());
  fsdp::forward(*m.root);
  fsdp::backward(*m.root);
  CHECK(m.fresh_seen == 0);  // the default contract: never fresh
  m.state().set_fresh_gradients(true);
  m.state().set_fresh_gradients(false);  // clears, as often as wanted between backwards
  m.state().set_fresh_gradients(true);
  m.state().zero_grad();
  fsdp::forward(*m.root);
  fsdp::backward(*m.root);
  CHECK(m.fresh_seen == 4);
  for (Parameter* p : m.root->parameters())
    CHECK(!p->grad_fresh());
}
