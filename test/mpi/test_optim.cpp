// Optimizers on fully_shard'ed parameters against references computed here on the full
// (unsharded) parameters, on 1-4 ranks.
//
// Rank r's local gradient of element e is an exact multiple of 1/4 (test::sample), so the
// library's reduced gradient is the f32 sum over ranks divided once by the world size; the
// references use that value and the same update formulas in double, rounded to f32 after
// each step as the library stores them.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/fsdp/state_dict.hpp"
#include "fullshard/optim/optimizer.hpp"
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

// Rank r's local gradient of element e of fqn at iteration k.
double local_grad(int r, const std::string& fqn, std::int64_t e, int k) {
  return test::sample(r, static_cast<std::size_t>(e), test::name_salt(fqn) + 1000 * k, true);
}
// The reduced gradient: mean over ranks, summed exactly and divided once in f32.
float reduced_grad(const std::string& fqn, std::int64_t e, int k, int ranks) {
  float sum = 0;
  for (int r = 0; r < ranks; ++r)
    sum += static_cast<float>(local_grad(r, fqn, e, k));
  return sum / static_cast<float>(ranks);
}

bool close(double got, double want, double rel = 1e-6) {
  return std::fabs(got - want) <= rel * std::max(1.0, std::fabs(want));
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "<no InvalidArgument>";
}
bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Params of shapes (7,3) and (5,) in l0, (13,) in l1; each layer and the root fully_shard'ed.
struct Model {
  std::unique_ptr<Module> root = Module::make_root("model");
  int k = 0;
  std::map<std::string, std::vector<double>> full;  // initial full values (f32-rounded)

  explicit Model(const DeviceMesh& mesh) {
    Module& l0 = root->add_module("l0");
    Module& l1 = root->add_module("l1");
    l0.add_param("w", {7, 3});
    l0.add_param("b", {5});
    l1.add_param("w", {13});
    for (Parameter* p : root->parameters()) {
      p->init([](std::int64_t e) { return 0.37 * static_cast<double>(e % 11) - 1.3; });
      for (std::int64_t e = 0; e < p->data().numel(); ++e)
        full[p->fqn()].push_back(p->data().at(e));
    }
    for (Module* m : {&l0, &l1})
      m->on_backward([this](Module& mod) {
        for (std::size_t i = 0; i < mod.num_params(); ++i) {
          Parameter& p = mod.param(i);
          Tensor g = p.grad();
          for (std::int64_t e = 0; e < g.numel(); ++e)
            g.set(e, g.at(e) + local_grad(R(), p.fqn(), e, k));
        }
      });
    fsdp::fully_shard(l0, mesh);
    fsdp::fully_shard(l1, mesh);
    fsdp::fully_shard(*root, mesh);
  }

  void iteration(int iter) {
    k = iter;
    fsdp::forward(*root);
    fsdp::backward(*root);
  }

  // Global flat index of local element e of p (Shard(0): rows from the global offset).
  std::int64_t global(const std::map<std::string, ShardedTensor>& sd, const Parameter& p,
                      std::int64_t e) const {
    const ShardedTensor& st = sd.at(p.fqn());
    const std::int64_t inner = numel(p.shape()) / p.shape()[0];
    return st.global_offset()[0] * inner + e;
  }

  // Counts local shard elements that differ from the reference `ref` (full values).
  int mismatches(const std::map<std::string, std::vector<double>>& ref) {
    auto sd = fsdp::sharded_state_dict(*root);
    int bad = 0;
    for (Parameter* p : root->parameters())
      for (std::int64_t e = 0; e < p->data().numel(); ++e) {
        const double want = ref.at(p->fqn())[static_cast<std::size_t>(global(sd, *p, e))];
        if (!close(p->data().at(e), want)) {
          if (bad < 5)
            MESSAGE(p->fqn() << "[" << global(sd, *p, e) << "]: " << p->data().at(e)
                             << ", expected " << want);
          ++bad;
        }
      }
    return bad;
  }
};

DeviceMesh world_mesh() {
  return DeviceMesh(test::runtime(), {W()}, {"dp"});
}

}  // namespace

TEST_CASE("SGD with momentum and weight decay: two steps against the full reference") {
  for (bool nesterov : {false, true}) {
    CAPTURE(nesterov);
    DeviceMesh mesh = world_mesh();
    Model model(mesh);
    const double lr = 0.1, mom = 0.9, wd = 0.01;
    optim::SGD opt(model.root->parameters(), lr, mom, wd, nesterov);
    auto ref = model.full;
    std::map<std::string, std::vector<double>> buf;
    for (int k = 0; k < 2; ++k) {
      opt.zero_grad();
      model.iteration(k);
      opt.step();
      for (auto& [fqn, v] : ref) {
        auto& b = buf[fqn];
        if (b.empty()) b.resize(v.size());
        for (std::size_t e = 0; e < v.size(); ++e) {
          double d = static_cast<double>(reduced_grad(fqn, static_cast<std::int64_t>(e), k, W())) +
                     wd * v[e];
          const double nb = k == 0 ? d : mom * b[e] + d;
          b[e] = static_cast<float>(nb);
          d = nesterov ? d + mom * nb : nb;
          v[e] = static_cast<float>(v[e] - lr * d);
        }
      }
      CHECK(model.mismatches(ref) == 0);
    }
    CHECK(opt.steps() == 2);
  }
}

TEST_CASE("SGD without momentum keeps no state") {
  DeviceMesh mesh = world_mesh();
  Model model(mesh);
  optim::SGD opt(model.root->parameters(), 0.5);
  model.iteration(0);
  opt.step();
  auto ref = model.full;
  for (auto& [fqn, v] : ref)
    for (std::size_t e = 0; e < v.size(); ++e)
      v[e] = static_cast<float>(v[e] - 0.5 * static_cast<double>(reduced_grad(
                                                 fqn, static_cast<std::int64_t>(e), 0, W())));
  CHECK(model.mismatches(ref) == 0);
  auto sd = opt.state_dict();
  CHECK(sd.size() == 1);
  CHECK(sd.count("step") == 1);
}

TEST_CASE("AdamW: three steps against the full reference; state dict round trip") {
  DeviceMesh mesh = world_mesh();
  Model model(mesh);
  const double lr = 0.01, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
  optim::AdamW opt(model.root->parameters(), lr, b1, b2, eps, wd);
  auto ref = model.full;
  std::map<std::string, std::vector<double>> m, v;
  for (int k = 0; k < 3; ++k) {
    opt.zero_grad();
    model.iteration(k);
    opt.step();
    const double t = k + 1;
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (auto& [fqn, p] : ref) {
      auto& mm = m[fqn];
      auto& vv = v[fqn];
      if (mm.empty()) mm.assign(p.size(), 0.0), vv.assign(p.size(), 0.0);
      for (std::size_t e = 0; e < p.size(); ++e) {
        const double g = reduced_grad(fqn, static_cast<std::int64_t>(e), k, W());
        double pw = p[e] * (1 - lr * wd);
        const double md = b1 * mm[e] + (1 - b1) * g;
        const double vd = b2 * vv[e] + (1 - b2) * g * g;
        mm[e] = static_cast<float>(md);
        vv[e] = static_cast<float>(vd);
        pw -= lr / bc1 * md / (std::sqrt(vd) / std::sqrt(bc2) + eps);
        p[e] = static_cast<float>(pw);
      }
    }
    CHECK(model.mismatches(ref) == 0);
  }

  // State dict: keys, local shapes, values sliced like the parameters.
  auto sd = opt.state_dict();
  auto shards = fsdp::sharded_state_dict(*model.root);
  CHECK(sd.size() == 1 + 2 * model.root->parameters().size());
  REQUIRE(sd.count("step") == 1);
  CHECK(sd.at("step").at(0) == 3.0);
  int bad = 0;
  for (Parameter* p : model.root->parameters())
    for (const char* name : {"exp_avg", "exp_avg_sq"}) {
      const std::string key = p->fqn() + "." + name;
      REQUIRE(sd.count(key) == 1);
      CHECK(sd.at(key).shape() == p->data().shape());
      const auto& want = std::string(name) == "exp_avg" ? m.at(p->fqn()) : v.at(p->fqn());
      for (std::int64_t e = 0; e < sd.at(key).numel(); ++e)
        bad += !close(sd.at(key).at(e), want[static_cast<std::size_t>(model.global(shards, *p, e))],
                      1e-5);
    }
  CHECK(bad == 0);
  CHECK(sd.count("l0.w.exp_avg") == 1);

  // Round trip: a second optimizer loaded from sd makes the same next step as the first.
  optim::AdamW opt2(model.root->parameters(), lr, b1, b2, eps, wd);
  opt2.load_state_dict(sd);
  CHECK(opt2.steps() == 3);
  std::vector<std::vector<float>> saved;
  for (Parameter* p : model.root->parameters()) {
    const float* d = p->data().data_as<float>();
    saved.emplace_back(d, d + p->data().numel());
  }
  opt.step();  // the gradients of the last iteration are still there
  std::vector<std::vector<float>> after1;
  auto params = model.root->parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const float* d = params[i]->data().data_as<float>();
    after1.emplace_back(d, d + params[i]->data().numel());
    std::copy(saved[i].begin(), saved[i].end(), params[i]->data().data_as<float>());
  }
  opt2.step();
  bad = 0;
  for (std::size_t i = 0; i < params.size(); ++i)
    for (std::int64_t e = 0; e < params[i]->data().numel(); ++e)
      bad += params[i]->data().data_as<float>()[e] != after1[i][static_cast<std::size_t>(e)];
  CHECK(bad == 0);

  // Bad loads: each names the key, nothing is written.
  auto before = opt2.state_dict();
  auto unchanged = [&] {
    auto now = opt2.state_dict();
    if (now.size() != before.size()) return false;
    for (auto& [k, t] : now)
      for (std::int64_t e = 0; e < t.numel(); ++e)
        if (t.at(e) != before.at(k).at(e)) return false;
    return true;
  };
  {
    auto bad_sd = sd;
    bad_sd.erase("l1.w.exp_avg_sq");
    CHECK(contains(error_of([&] { opt2.load_state_dict(bad_sd); }), "l1.w.exp_avg_sq"));
    CHECK(unchanged());
  }
  {
    auto bad_sd = sd;
    bad_sd["l9.w.exp_avg"] = Tensor::zeros({1}, DType::f32);
    CHECK(contains(error_of([&] { opt2.load_state_dict(bad_sd); }), "l9.w.exp_avg"));
    CHECK(unchanged());
  }
  {
    auto bad_sd = sd;
    bad_sd["l0.b.exp_avg"] = Tensor::zeros({99}, DType::f32);
    CHECK(contains(error_of([&] { opt2.load_state_dict(bad_sd); }), "l0.b.exp_avg"));
    CHECK(unchanged());
  }
  {
    auto bad_sd = sd;
    bad_sd.erase("step");
    CHECK(contains(error_of([&] { opt2.load_state_dict(bad_sd); }), "step"));
    CHECK(unchanged());
  }
}

TEST_CASE("clip_grad_norm on a 1-D mesh: full-gradient norm and scaling") {
  DeviceMesh mesh = world_mesh();
  Model model(mesh);
  model.iteration(0);
  double sq = 0;
  for (auto& [fqn, v] : model.full)
    for (std::size_t e = 0; e < v.size(); ++e) {
      const double g = reduced_grad(fqn, static_cast<std::int64_t>(e), 0, W());
      sq += g * g;
    }
  const double ref_norm = std::sqrt(sq);
  auto params = model.root->parameters();
  // Large max_norm: returns the norm, gradients unchanged.
  std::vector<std::vector<float>> g0;
  for (Parameter* p : params) {
    const float* d = p->grad().data_as<float>();
    g0.emplace_back(d, d + p->grad().numel());
  }
  CHECK(close(optim::clip_grad_norm(params, 2 * ref_norm, mesh), ref_norm, 1e-9));
  int bad = 0;
  for (std::size_t i = 0; i < params.size(); ++i)
    for (std::int64_t e = 0; e < params[i]->grad().numel(); ++e)
      bad += params[i]->grad().at(e) != g0[i][static_cast<std::size_t>(e)];
  CHECK(bad == 0);
  // Half the norm: scaled by max_norm / (norm + 1e-6); the new norm is about max_norm.
  const double max_norm = ref_norm / 2;
  CHECK(close(optim::clip_grad_norm(params, max_norm, mesh), ref_norm, 1e-9));
  const double coef = max_norm / (ref_norm + 1e-6);
  for (std::size_t i = 0; i < params.size(); ++i)
    for (std::int64_t e = 0; e < params[i]->grad().numel(); ++e)
      bad += !close(params[i]->grad().at(e), g0[i][static_cast<std::size_t>(e)] * coef);
  CHECK(bad == 0);
  CHECK(close(optim::clip_grad_norm(params, 1e9, mesh), max_norm, 1e-5));
  CHECK(contains(error_of([&] { optim::clip_grad_norm(params, -1.0, mesh); }), "max_norm"));
}

TEST_CASE("local_sum_squares and local_all_finite against a scan of the local shards") {
  DeviceMesh mesh = world_mesh();
  Model model(mesh);
  model.iteration(0);
  auto params = model.root->parameters();
  auto reference = [&](bool grads) {
    double sq = 0;
    for (Parameter* p : params) {
      const Tensor& t = grads ? p->grad() : p->data();
      for (std::int64_t e = 0; e < t.numel(); ++e)
        sq += t.at(e) * t.at(e);
    }
    return sq;
  };
  CHECK(close(optim::local_sum_squares(params, mesh), reference(true), 1e-12));
  CHECK(close(optim::local_sum_squares(params, mesh, optim::Values::parameters), reference(false),
              1e-12));
  CHECK(optim::local_all_finite(params, mesh));
  CHECK(optim::local_all_finite(params, mesh, optim::Values::parameters));
  // One non-finite element anywhere (in the eight-lane body, in the tail) is found, and the
  // largest finite values are not mistaken for one.
  for (Parameter* p : params) {
    Tensor g = p->grad();
    for (std::int64_t e : {std::int64_t{0}, g.numel() / 2, g.numel() - 1}) {
      if (e < 0 || g.numel() == 0) continue;
      const double keep = g.at(e);
      for (double v : {double(std::numeric_limits<float>::quiet_NaN()),
                       double(std::numeric_limits<float>::infinity()),
                       -double(std::numeric_limits<float>::infinity())}) {
        g.set(e, v);
        CAPTURE(p->fqn());
        CAPTURE(e);
        CHECK_FALSE(optim::local_all_finite(params, mesh));
        CHECK_FALSE(std::isfinite(optim::local_sum_squares(params, mesh)));
      }
      g.set(e, double(std::numeric_limits<float>::max()));
      CHECK(optim::local_all_finite(params, mesh));
      g.set(e, keep);
    }
  }
  CHECK(optim::local_all_finite(params, mesh));
}

TEST_CASE("clip_grad_norm under HSDP reduces over the shard dim only") {
  if (W() % 2 != 0) {
    MESSAGE("needs an even number of ranks");
    return;
  }
  DeviceMesh mesh(test::runtime(), {2, W() / 2}, {"replicate", "shard"});
  Model model(mesh);
  model.iteration(1);
  double sq = 0;
  for (auto& [fqn, v] : model.full)
    for (std::size_t e = 0; e < v.size(); ++e) {
      const double g = reduced_grad(fqn, static_cast<std::int64_t>(e), 1, W());
      sq += g * g;
    }
  const double ref_norm = std::sqrt(sq);
  CHECK(close(optim::clip_grad_norm(model.root->parameters(), ref_norm / 4, mesh), ref_norm, 1e-9));
  CHECK(close(optim::clip_grad_norm(model.root->parameters(), 1e9, mesh),
              ref_norm / 4 * ref_norm / (ref_norm + 1e-6), 1e-5));
}

TEST_CASE("WarmupCosine values and bad arguments") {
  optim::WarmupCosine s(1.0, 10, 110, 0.1);
  CHECK(s.lr(0) == 0.0);
  CHECK(close(s.lr(5), 0.5, 1e-15));
  CHECK(close(s.lr(10), 1.0, 1e-15));
  CHECK(close(s.lr(60), 0.55, 1e-12));
  CHECK(close(s.lr(35), 0.1 + 0.9 * 0.5 * (1 + std::cos(3.14159265358979323846 / 4)), 1e-12));
  CHECK(close(s.lr(110), 0.1, 1e-15));
  CHECK(close(s.lr(500), 0.1, 1e-15));
  optim::WarmupCosine nowarm(2.0, 0, 4);
  CHECK(close(nowarm.lr(0), 2.0, 1e-15));
  CHECK(close(nowarm.lr(2), 1.0, 1e-12));
  CHECK_THROWS_AS(s.lr(-1), InvalidArgument);
  CHECK_THROWS_AS(optim::WarmupCosine(1.0, 10, 10), InvalidArgument);
  CHECK_THROWS_AS(optim::WarmupCosine(1.0, -1, 10), InvalidArgument);
  CHECK_THROWS_AS(optim::WarmupCosine(1.0, 1, 10, 2.0), InvalidArgument);
  CHECK_THROWS_AS(optim::WarmupCosine(-1.0, 1, 10, -2.0), InvalidArgument);
}

TEST_CASE("optimizer argument errors") {
  auto root = Module::make_root("model");
  Parameter& a = root->add_param("a", {4});
  Parameter& d = root->add_module("m").add_param("d", {4}, DType::f64);
  a.init([](std::int64_t) { return 1.0; });
  CHECK(contains(error_of([&] { optim::AdamW({&a, &d}, 0.1); }), "m.d"));
  CHECK(contains(error_of([&] { optim::SGD({&a, &a}, 0.1); }), "'a'"));
  CHECK_THROWS_AS(optim::SGD({&a}, 0.1, 0.0, 0.0, true), InvalidArgument);
  CHECK_THROWS_AS(optim::SGD({&a}, -0.1), InvalidArgument);
  CHECK_THROWS_AS(optim::AdamW({&a}, 0.1, 1.0), InvalidArgument);
  CHECK_THROWS_AS(optim::SGD({nullptr}, 0.1), InvalidArgument);
  // Without FSDP: full tensors; a gradient of the wrong shape is rejected before any write.
  optim::SGD opt({&a}, 0.5);
  opt.step();  // no gradient: skipped
  CHECK(a.data().at(0) == 1.0);
  a.set_grad(Tensor::zeros({3}, DType::f32));
  CHECK(contains(error_of([&] { opt.step(); }), "'a'"));
  Tensor g = Tensor::zeros({4}, DType::f32);
  g.fill(2.0);
  a.set_grad(g);
  opt.step();
  CHECK(a.data().at(3) == 0.0);
  opt.zero_grad();
  CHECK(a.grad().at(3) == 0.0);
}
