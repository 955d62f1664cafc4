// Optimizers, gradient clipping, state dicts and checkpoints on the shards of each device
// (test/support/test_devices.hpp): compiled once per device, as the engine tests. The host
// program runs on 1-2 ranks in CTest; the CUDA program (test-gpu.optim.devices) checks that the
// state lives in device memory, that the kernels on the compute stream compute what the host
// loop computes, and that device shards save and load through the same files as host shards.
//
// References are computed here per local element from host copies of the shard and its
// gradient before the step, with the update formulas of the header in double rounded to f32:
// bit for bit on the host (the library's loop is the same code), within 1e-6 relative on the
// device (nvcc contracts multiply-adds into FMAs).
#include <doctest/doctest.h>
#include <mpi.h>
#include <stdlib.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/fsdp/state_dict.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "test_devices.hpp"
#include "test_support.hpp"

using namespace fullshard;
using graph::Module;
using graph::Parameter;

namespace {

int R() {
  return test::world_rank();
}

// Params (7,3) and (5,) in l0, (13,) in l1, every layer and the root fully_shard'ed on `mesh`.
struct Model {
  std::unique_ptr<Module> root = Module::make_root("model");
  int k = 0;
  explicit Model(const DeviceMesh& mesh, double shift = 0.0) {
    Module& l0 = root->add_module("l0");
    Module& l1 = root->add_module("l1");
    l0.add_param("w", {7, 3});
    l0.add_param("b", {5});
    l1.add_param("w", {13});
    for (Parameter* p : root->parameters())
      p->init([shift](std::int64_t e) { return 0.37 * static_cast<double>(e % 11) - 1.3 + shift; });
    for (Module* m : {&l0, &l1})
      m->on_backward([this](Module& mod) {
        for (std::size_t i = 0; i < mod.num_params(); ++i) {
          Parameter& p = mod.param(i);
          Tensor h = test::host_copy(p.grad());
          for (std::int64_t e = 0; e < h.numel(); ++e)
            h.set(e, h.at(e) + test::sample(R(), static_cast<std::size_t>(e),
                                            test::name_salt(p.fqn()) + 1000 * k, true));
          test::write_back(p.grad(), h);
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
  std::vector<Parameter*> params() const { return root->parameters(); }
};

}  // namespace

TEST_CASE_TEMPLATE("SGD (momentum, nesterov, weight decay) on the device's shards", D,
                   FULLSHARD_TEST_DEVICE) {
  DeviceMesh mesh = D::mesh({test::world_size()}, {"dp"});
  Model model(mesh);
  const double lr = 0.05, mom = 0.9, wd = 0.01;
  optim::SGD opt(model.params(), lr, mom, wd, true);
  std::map<std::string, std::vector<double>> buf;
  for (int k = 0; k < 3; ++k) {
    opt.zero_grad();
    model.iteration(k);
    std::map<std::string, std::vector<double>> want;
    for (Parameter* p : model.params()) {
      CHECK(p->data().space() == D::space);
      CHECK(p->grad().space() == D::space);
      auto w = test::host_values(p->data());
      const auto g = test::host_values(p->grad());
      auto& b = buf[p->fqn()];
      const bool fresh = b.empty();
      b.resize(w.size());
      for (std::size_t e = 0; e < w.size(); ++e) {
        double d = static_cast<double>(static_cast<float>(g[e])) + wd * w[e];
        const double bb = fresh ? d : mom * b[e] + d;
        b[e] = static_cast<float>(bb);
        d = d + mom * bb;
        w[e] = static_cast<float>(w[e] - lr * d);
      }
      want[p->fqn()] = w;
    }
    opt.step();
    for (Parameter* p : model.params()) {
      CHECK(test::mismatches<D>(p->fqn(), test::host_values(p->data()), want[p->fqn()]) == 0);
      const auto views = opt.state_views();
      const Tensor& st = views.at(p->fqn() + ".momentum_buffer");
      CHECK(st.space() == D::space);  // the state lives where the shard lives
      CHECK(test::mismatches<D>(p->fqn() + ".momentum_buffer", test::host_values(st),
                                buf[p->fqn()]) == 0);
    }
  }
}

TEST_CASE_TEMPLATE("AdamW and clip_grad_norm on the device's shards; state dict round trip", D,
                   FULLSHARD_TEST_DEVICE) {
  DeviceMesh mesh = D::mesh({test::world_size()}, {"dp"});
  Model model(mesh);
  const double lr = 0.01, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1, max_norm = 0.5;
  optim::AdamW opt(model.params(), lr, b1, b2, eps, wd);
  std::map<std::string, std::vector<double>> m, v;
  for (int k = 0; k < 3; ++k) {
    opt.zero_grad();
    model.iteration(k);
    // The norm of the full gradient: local sums of squares, summed over the ranks here.
    double local = 0;
    for (Parameter* p : model.params())
      for (double x : test::host_values(p->grad()))
        local += x * x;
    double total = 0;
    MPI_Allreduce(&local, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    const double coef = max_norm / (std::sqrt(total) + 1e-6);
    REQUIRE(coef < 1.0);  // the clipping scales
    std::map<std::string, std::vector<double>> want, grads;
    const double t = k + 1;
    const double bc1 = 1 - std::pow(b1, t), bc2_sqrt = std::sqrt(1 - std::pow(b2, t));
    for (Parameter* p : model.params()) {
      auto w = test::host_values(p->data());
      auto g = test::host_values(p->grad());
      for (double& x : g)
        x = static_cast<float>(x * coef);
      grads[p->fqn()] = g;
      auto& mm = m[p->fqn()];
      auto& vv = v[p->fqn()];
      mm.resize(w.size());
      vv.resize(w.size());
      for (std::size_t e = 0; e < w.size(); ++e) {
        double pw = w[e] * (1 - lr * wd);
        const double md = b1 * mm[e] + (1 - b1) * g[e];
        const double vd = b2 * vv[e] + (1 - b2) * g[e] * g[e];
        mm[e] = static_cast<float>(md);
        vv[e] = static_cast<float>(vd);
        pw -= lr / bc1 * md / (std::sqrt(vd) / bc2_sqrt + eps);
        w[e] = static_cast<float>(pw);
      }
      want[p->fqn()] = w;
    }
    const double norm = optim::clip_grad_norm(model.params(), max_norm, mesh);
    CHECK(std::fabs(norm - std::sqrt(total)) <= 1e-12 * std::sqrt(total));
    for (Parameter* p : model.params())
      CHECK(test::mismatches<D>(p->fqn() + ".grad", test::host_values(p->grad()),
                                grads[p->fqn()]) == 0);
    opt.step();
    for (Parameter* p : model.params()) {
      CHECK(test::mismatches<D>(p->fqn(), test::host_values(p->data()), want[p->fqn()]) == 0);
      CHECK(test::mismatches<D>(p->fqn() + ".exp_avg",
                                test::host_values(opt.state_views().at(p->fqn() + ".exp_avg")),
                                m[p->fqn()]) == 0);
    }
  }

  // state_dict(): host copies; loading them (host tensors) puts the state back on the device.
  const auto sd = opt.state_dict();
  for (const auto& [key, t] : sd)
    CHECK(t.space() == MemorySpace::host);
  Model other(mesh, 0.25);
  optim::AdamW opt2(other.params(), lr, b1, b2, eps, wd);
  opt2.load_state_dict(sd);
  CHECK(opt2.steps() == 3);
  const auto views2 = opt2.state_views();
  for (Parameter* p : other.params())
    for (const char* s : {"exp_avg", "exp_avg_sq"}) {
      const std::string key = p->fqn() + "." + s;
      const Tensor& st = views2.at(key);
      CHECK(st.space() == D::space);
      CHECK(test::mismatches<D>(key, test::host_values(st), test::host_values(sd.at(key))) == 0);
    }
  // The model's shards: sharded (views of device storage) and full state dicts both load.
  fsdp::load_sharded_state_dict(*other.root, fsdp::sharded_state_dict(*model.root));
  const auto full = fsdp::full_state_dict(*model.root);
  Model third(mesh, 0.5);
  fsdp::load_full_state_dict(*third.root, full);
  const auto a = model.params(), b = other.params(), c = third.params();
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(test::host_values(b[i]->data()) == test::host_values(a[i]->data()));
    CHECK(test::host_values(c[i]->data()) == test::host_values(a[i]->data()));
  }
}

TEST_CASE_TEMPLATE("checkpoints of the device's shards: the host path's files, loaded both ways", D,
                   FULLSHARD_TEST_DEVICE) {
  DeviceMesh mesh = D::mesh({test::world_size()}, {"dp"});
  DeviceMesh host_mesh = test::HostDevice::mesh({test::world_size()}, {"dp"});
  for (checkpoint::Kind kind : {checkpoint::Kind::sharded, checkpoint::Kind::full}) {
    CAPTURE(static_cast<int>(kind));
    test::SharedTempDir dir("fullshard-optim-devices");
    Model model(mesh);
    optim::AdamW opt(model.params(), 0.01);
    for (int k = 0; k < 2; ++k) {
      opt.zero_grad();
      model.iteration(k);
      opt.step();
    }
    checkpoint::SaveOptions so;
    so.kind = kind;
    checkpoint::save(dir.path, *model.root, &opt, 2, "{}", "", so);
    // Into the device's model and into a host model: the same values, the state where the
    // shard lives.
    for (const DeviceMesh* into : {&mesh, &host_mesh}) {
      Model fresh(*into, 0.75);
      optim::AdamW opt2(fresh.params(), 0.01);
      const checkpoint::Loaded ck = checkpoint::load(dir.path, *fresh.root, &opt2);
      CHECK(ck.step == 2);
      CHECK(opt2.steps() == 2);
      const auto a = model.params(), b = fresh.params();
      const auto sa = opt.state_views(), sb = opt2.state_views();
      REQUIRE(sa.size() == sb.size());
      for (std::size_t i = 0; i < a.size(); ++i) {
        CHECK(test::host_values(b[i]->data()) == test::host_values(a[i]->data()));
        for (const char* s : {"exp_avg", "exp_avg_sq"}) {
          const std::string key = a[i]->fqn() + "." + s;
          CHECK(sb.at(key).space() == b[i]->data().space());
          CHECK(test::host_values(sb.at(key)) == test::host_values(sa.at(key)));
        }
      }
    }
  }
}
