// The optimizer inside backward (Optimizer::run_in_backward, fsdp/shard_update.hpp) against
// the same optimizer stepped after backward, on 1-4 ranks: the same model, gradients and
// steps, with mixed precision, HSDP (its deferred all-reduce too) and micro-batches. SGD must
// give the same bits; AdamW within 1e-5 (max |a-b| / max |b| per tensor). Then what a user
// sees: no gradient after backward, the step count, the state dict, and the refusals.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "error_check.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "lib/fsdp/group_access.hpp"
#include "lib/fsdp/shard_update.hpp"
#include "test_support.hpp"

using namespace fullshard;
using graph::Module;
using graph::Parameter;

namespace {

using test::contains;
int W() {
  return test::world_size();
}
int R() {
  return test::world_rank();
}

enum class Opt { sgd, sgd_momentum, sgd_nesterov, adamw };

struct Config {
  bool bf16_params = false;       // all-gathered parameters and compute in bf16
  bool bf16_reduce = false;       // ... and the reduce-scatter too
  bool hsdp = false;              // 2 x W/2 mesh (W even)
  bool defer_all_reduce = false;  // HSDP: the all-reduce only at the last micro-batch
  int micro = 1;                  // micro-batches per step (no_sync before the last)
  HostCollectives collectives = HostCollectives::auto_;  // shared memory on one node
  HostProgress progress = HostProgress::inline_;         // thread: updates overlap the backward
  int ranks_per_node = 0;    // 2: a shard dim of 4 ranks on two levels (shm + MPI)
  int reduce_buffers = 1;    // set_reduce_scatter_max_input_buffers
  bool int8_reduce = false;  // the compressed reduce-scatter (it folds the copy-out)
  std::string name() const {
    return std::string(bf16_params ? "bf16 params" : "f32") + (bf16_reduce ? ", bf16 reduce" : "") +
           (hsdp ? ", HSDP" : "") + (defer_all_reduce ? " deferred" : "") + ", " +
           std::to_string(micro) + " micro-batches" +
           (collectives == HostCollectives::mpi ? ", MPI" : "") +
           (progress == HostProgress::thread ? ", worker threads" : "") +
           (ranks_per_node > 0 ? ", two levels" : "") +
           (reduce_buffers > 1 ? ", reduce buffers " + std::to_string(reduce_buffers) : "") +
           (int8_reduce ? ", int8 reduce-scatter" : "");
  }
};

DeviceMesh mesh_of(const Config& c) {
  if (c.hsdp)
    return DeviceMesh(MPI_COMM_WORLD, {2, W() / 2}, {"replicate", "shard"}, 60.0, c.progress,
                      c.collectives);
  return DeviceMesh(MPI_COMM_WORLD, {W()}, {"dp"}, 60.0, c.progress, c.collectives,
                    c.ranks_per_node);
}

// Layers of shapes (7,3)+(5,), (13,), (6,4), each and the root fully_shard'ed; the gradient
// of an element depends on the rank, the step, the micro-batch and the parameter's current
// (unsharded) value, so that a wrong update changes every later gradient.
struct Model {
  std::unique_ptr<Module> root = Module::make_root("model");
  int step = 0, micro = 0;

  Model(const DeviceMesh& mesh, const Config& c) {
    Module& l0 = root->add_module("l0");
    Module& l1 = root->add_module("l1");
    Module& l2 = root->add_module("l2");
    l0.add_param("w", {7, 3});
    l0.add_param("b", {5});
    l1.add_param("w", {13});
    l2.add_param("w", {6, 4});
    root->add_param("scale", {3});
    for (Parameter* p : root->parameters())
      p->init([](std::int64_t e) { return 0.37 * static_cast<double>(e % 11) - 1.3; });
    for (Module* m : {&l0, &l1, &l2, root.get()})
      m->on_backward([this](Module& mod) {
        for (std::size_t i = 0; i < mod.num_params(); ++i) {
          Parameter& p = mod.param(i);
          Tensor g = p.grad();
          for (std::int64_t e = 0; e < g.numel(); ++e)
            g.set(e, g.at(e) +
                         test::sample(R(), static_cast<std::size_t>(e),
                                      test::name_salt(p.fqn()) + 1000 * step + 100 * micro, true) +
                         0.25 * p.data().at(e));
        }
      });
    fsdp::FullyShardOptions o;
    if (c.bf16_params) o.mp_policy.param_dtype = DType::bf16;
    if (c.bf16_reduce) o.mp_policy.reduce_dtype = DType::bf16;
    if (c.int8_reduce) o.compression.reduce_scatter = kernels::QuantCode::int8;
    for (Module* m : {&l0, &l1, &l2})
      fsdp::fully_shard(*m, mesh, o);
    fsdp::fully_shard(*root, mesh, o);
    state().set_reduce_scatter_max_input_buffers(c.reduce_buffers);
  }
  fsdp::FSDPModule& state() { return *fsdp::fsdp_state(*root); }

  // One step of `c.micro` micro-batches.
  void iteration(const Config& c, int k) {
    step = k;
    for (micro = 0; micro < c.micro; ++micro) {
      const bool last = micro + 1 == c.micro;
      if (c.defer_all_reduce)
        state().set_requires_all_reduce(last);
      else
        state().set_requires_gradient_sync(last);
      fsdp::forward(*root);
      fsdp::backward(*root);
    }
  }
};

std::unique_ptr<optim::Optimizer> make_opt(Opt kind, std::vector<Parameter*> params) {
  switch (kind) {
    case Opt::sgd:
      return std::make_unique<optim::SGD>(std::move(params), 0.05);
    case Opt::sgd_momentum:
      return std::make_unique<optim::SGD>(std::move(params), 0.05, 0.9, 0.01);
    case Opt::sgd_nesterov:
      return std::make_unique<optim::SGD>(std::move(params), 0.05, 0.9, 0.0, true);
    case Opt::adamw:
      return std::make_unique<optim::AdamW>(std::move(params), 0.01, 0.9, 0.99, 1e-8, 0.05);
  }
  return nullptr;
}

struct Result {
  std::map<std::string, std::vector<float>> params;  // local shards
  std::map<std::string, Tensor> state;               // optimizer state dict
  std::int64_t steps = 0;
};

constexpr int kSteps = 3;

Result train(const Config& c, Opt kind, bool in_backward) {
  std::vector<fsdp::engine::OpDesc> log;  // outlives the model
  const DeviceMesh mesh = mesh_of(c);
  Model m(mesh, c);
  auto opt = make_opt(kind, m.root->parameters());
  if (in_backward) {
    opt->run_in_backward();
    fsdp::detail::record_operations(m.state(), &log);
  }
  for (int k = 0; k < kSteps; ++k) {
    m.iteration(c, k);
    if (in_backward)
      for (Parameter* p : m.root->parameters())
        CHECK_MESSAGE(!p->grad().defined(), p->fqn() << " shows a gradient after backward");
    opt->step();
    opt->zero_grad();
  }
  // Over more than one rank the update runs in the pass that writes the reduced shard (the
  // copy-out, or the shared-memory sum): no gradient is stored; the int8 reduce-scatter's
  // decode stores it for a separate update.
  int updates = 0, fused = 0, fused_copy_outs = 0;
  for (const fsdp::engine::OpDesc& d : log) {
    updates += d.kind == fsdp::engine::OpKind::update;
    fused += d.kind == fsdp::engine::OpKind::update && d.variant == 1;
    fused_copy_outs += d.kind == fsdp::engine::OpKind::reduce_copy_out && d.variant == 3;
  }
  CHECK(fused == fused_copy_outs);
  if (in_backward && (c.hsdp ? W() / 2 : W()) > 1) {
    CHECK(updates == 4 * kSteps);  // four groups
    CHECK(fused == (c.int8_reduce ? 0 : updates));
  }
  Result r;
  for (Parameter* p : m.root->parameters())
    for (std::int64_t e = 0; e < p->data().numel(); ++e)
      r.params[p->fqn()].push_back(static_cast<float>(p->data().at(e)));
  r.state = opt->state_dict();
  r.steps = opt->steps();
  if (in_backward) opt->run_in_backward(false);
  return r;
}

// max |a - b| / max |b| over one tensor (0 for equal tensors, also all-zero ones).
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::fabs(double(a[i]) - double(b[i])));
    den = std::max(den, std::fabs(double(b[i])));
  }
  return num == 0 ? 0 : num / std::max(den, 1e-30);
}

std::vector<float> values(const Tensor& t) {
  std::vector<float> v;
  for (std::int64_t e = 0; e < t.numel(); ++e)
    v.push_back(static_cast<float>(t.at(e)));
  return v;
}

void compare(const Config& c, Opt kind, bool bitwise) {
  CAPTURE(c.name());
  CAPTURE(static_cast<int>(kind));
  const Result after = train(c, kind, false);
  const Result inside = train(c, kind, true);
  CHECK(inside.steps == kSteps);
  CHECK(after.steps == kSteps);
  REQUIRE(inside.params.size() == after.params.size());
  for (const auto& entry : after.params) {  // (no structured bindings: CAPTURE captures)
    const std::string& fqn = entry.first;
    const std::vector<float>& want = entry.second;
    CAPTURE(fqn);
    const std::vector<float>& got = inside.params.at(fqn);
    REQUIRE(got.size() == want.size());
    if (bitwise)
      CHECK(got == want);
    else
      CHECK(rel_diff(got, want) <= 1e-5);
  }
  REQUIRE(inside.state.size() == after.state.size());
  for (const auto& entry : after.state) {
    const std::string& key = entry.first;
    const Tensor& want = entry.second;
    CAPTURE(key);
    REQUIRE(inside.state.count(key) == 1);
    const auto g = values(inside.state.at(key)), w = values(want);
    if (bitwise)
      CHECK(g == w);
    else
      CHECK(rel_diff(g, w) <= 1e-5);
  }
  // The steps changed the parameters (the comparison compares something).
  Model fresh(mesh_of(c), c);
  bool moved = false;
  for (Parameter* p : fresh.root->parameters())
    for (std::int64_t e = 0; e < p->data().numel(); ++e)
      moved = moved || static_cast<float>(p->data().at(e)) !=
                           after.params.at(p->fqn())[static_cast<std::size_t>(e)];
  CHECK(moved);
}

std::vector<Config> configs() {
  std::vector<Config> out;
  auto add = [&out](auto&& edit) {
    Config c;
    edit(c);
    out.push_back(c);
  };
  add([](Config&) {});
  add([](Config& c) { c.bf16_params = true; });
  add([](Config& c) { c.bf16_params = c.bf16_reduce = true, c.micro = 2; });
  add([](Config& c) { c.micro = 3, c.progress = HostProgress::thread, c.reduce_buffers = 2; });
  add([](Config& c) { c.collectives = HostCollectives::mpi, c.progress = HostProgress::thread; });
  add([](Config& c) {
    c.collectives = HostCollectives::mpi, c.bf16_params = true, c.reduce_buffers = 3;
  });
  add([](Config& c) { c.int8_reduce = true, c.progress = HostProgress::thread; });
  if (W() == 4) add([](Config& c) { c.ranks_per_node = 2, c.progress = HostProgress::thread; });
  if (W() % 2 == 0) {
    add([](Config& c) { c.hsdp = true; });
    add([](Config& c) {
      c.hsdp = c.bf16_params = true, c.micro = 2, c.progress = HostProgress::thread;
    });
    add([](Config& c) { c.hsdp = c.defer_all_reduce = true, c.micro = 2; });
    add([](Config& c) { c.hsdp = true, c.collectives = HostCollectives::mpi; });
  }
  return out;
}

}  // namespace

TEST_CASE("SGD inside backward gives the bits of SGD after backward") {
  for (const Config& c : configs())
    for (Opt k : {Opt::sgd, Opt::sgd_momentum, Opt::sgd_nesterov})
      compare(c, k, true);
}

TEST_CASE("AdamW inside backward equals AdamW after backward (the same bits, so within 1e-5)") {
  for (const Config& c : configs())
    compare(c, Opt::adamw, true);
}

TEST_CASE("inside backward from a later step, or after a load: the step count goes on") {
  for (Opt kind : {Opt::sgd, Opt::adamw}) {  // without state arrays, and with
    CAPTURE(static_cast<int>(kind));
    Model m(mesh_of({}), {});
    auto opt = make_opt(kind, m.root->parameters());
    m.iteration({}, 0);
    opt->step();
    opt->zero_grad();
    CHECK(opt->steps() == 1);
    opt->run_in_backward();
    for (int k = 1; k < 3; ++k) {
      m.iteration({}, k);
      opt->step();  // the same step (nothing outside FSDP here)
      CHECK(opt->steps() == k + 1);
    }
    auto sd = opt->state_dict();
    sd.at("step").set(0, 10.0);
    opt->load_state_dict(sd);
    m.iteration({}, 3);
    CHECK(opt->steps() == 11);
    opt->run_in_backward(false);
    m.iteration({}, 4);
    opt->step();
    CHECK(opt->steps() == 12);
  }
}

TEST_CASE("inside backward: step() still updates parameters outside FSDP, as the same step") {
  const DeviceMesh mesh = mesh_of({});
  Model m(mesh, {});
  auto outside = Module::make_root("outside");
  Parameter& q = outside->add_param("q", {4});
  q.init([](std::int64_t e) { return 1.0 + static_cast<double>(e); });
  std::vector<Parameter*> params = m.root->parameters();
  params.push_back(&q);
  optim::AdamW opt(params, 0.1);
  opt.run_in_backward();
  for (int k = 0; k < 2; ++k) {
    m.iteration({}, k);
    Tensor g = Tensor::zeros({4}, DType::f32);
    g.fill(0.5);
    q.set_grad(g);
    opt.step();
    CHECK(opt.steps() == k + 1);
  }
  // Two AdamW steps of a constant gradient: each moves q by lr * (about 1) down.
  for (std::int64_t e = 0; e < 4; ++e)
    CHECK(std::fabs(q.data().at(e) -
                    (1.0 + static_cast<double>(e)) * (1 - 0.1 * 0.01) * (1 - 0.1 * 0.01) + 0.2) <
          1e-3);
  opt.run_in_backward(false);
}

TEST_CASE("inside backward: what is refused, with the reason") {
  const DeviceMesh mesh = mesh_of({});
  {
    Model m(mesh, {});
    optim::SGD opt(m.root->parameters(), 0.1);
    opt.run_in_backward();
    m.iteration({}, 0);
    // A global norm needs every gradient before any update.
    const std::string clip = test::error_of<InvalidArgument>(
        [&] { optim::clip_grad_norm(m.root->parameters(), 1.0, mesh); });
    CHECK(contains(clip, "inside backward"));
    CHECK(contains(clip, "'" + m.root->parameters().front()->fqn() + "'"));
    // The updates are waited for at the end of backward.
    m.state().set_is_last_backward(false);
    const std::string last = test::error_of<InvalidArgument>([&] {
      fsdp::forward(*m.root);
      fsdp::backward(*m.root);
    });
    CHECK(contains(last, "set_is_last_backward(true)"));
    m.state().reset_iter_state();
    // Micro-batches without sync update nothing: is_last_backward false is theirs to set.
    m.state().set_requires_gradient_sync(false);
    fsdp::forward(*m.root);
    fsdp::backward(*m.root);
    m.state().set_is_last_backward(true);
    m.state().set_requires_gradient_sync(true);
    fsdp::forward(*m.root);
    fsdp::backward(*m.root);
    for (Parameter* p : m.root->parameters())
      CHECK(!p->grad().defined());
    if (W() > 1) {  // unsharded parameters kept after backward would miss the update
      m.state().set_reshard_after_backward(false);
      const std::string kept = test::error_of<InvalidArgument>([&] {
        fsdp::forward(*m.root);
        fsdp::backward(*m.root);
      });
      CHECK(contains(kept, "set_reshard_after_backward(true)"));
      m.state().reset_iter_state();
      m.state().set_reshard_after_backward(true);
    }
    // Back to steps after backward: the gradients are shown again and step() uses them.
    opt.run_in_backward(false);
    m.iteration({}, 1);
    for (Parameter* p : m.root->parameters())
      CHECK(p->grad().defined());
    std::vector<double> before;
    for (Parameter* p : m.root->parameters())
      for (std::int64_t e = 0; e < p->data().numel(); ++e)
        before.push_back(p->data().at(e));
    opt.step();
    std::size_t i = 0, changed = 0;
    for (Parameter* p : m.root->parameters())
      for (std::int64_t e = 0; e < p->data().numel(); ++e)
        changed += p->data().at(e) != before[i++] ? 1 : 0;
    CHECK(changed == before.size());
  }
  {
    // A group's update covers all its parameters: the optimizer must hold them all.
    Model m(mesh, {});
    std::vector<Parameter*> some = m.root->parameters();
    some.erase(std::find_if(some.begin(), some.end(),
                            [](const Parameter* p) { return p->fqn() == "l0.w"; }));
    optim::SGD opt(some, 0.1);
    const std::string e = test::error_of<InvalidArgument>([&] { opt.run_in_backward(); });
    CHECK(contains(e, "'l0.w'"));
    CHECK(contains(e, "does not"));
  }
  {
    // Offloaded shards: the update inside backward runs where the reduction runs.
    auto root = Module::make_root("model");
    Module& l = root->add_module("l");
    l.add_param("w", {8});
    fsdp::FullyShardOptions o;
    o.offload_policy = fsdp::CPUOffloadPolicy{};
    fsdp::fully_shard(l, mesh, o);
    fsdp::fully_shard(*root, mesh);
    optim::SGD opt(root->parameters(), 0.1);
    CHECK(contains(test::error_of<InvalidArgument>([&] { opt.run_in_backward(); }), "offloaded"));
  }
}
