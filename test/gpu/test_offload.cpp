// CPUOffloadPolicy against the same model without it, on each device (an engine test:
// test/support/test_devices.hpp). The host program (CTest fsdp.offload.np1-2) checks that the
// policy keeps today's behaviour on a CPU mesh (bit for bit); the CUDA program
// (test-gpu.fsdp.offload, CTest gpu.fsdp.offload.np1, which exits 77 SKIPPED without a GPU)
// checks the GPU path: sharded parameters, sharded gradients and optimizer state in host
// memory (page-locked exactly when pin_memory is set), the collectives and unsharded
// parameters on the device, and the same numbers as the run without offload:
// - gradients bit for bit at the first step (the same copy kernels write them, into host
//   memory instead of device memory);
// - parameters after SGD / AdamW steps within 1e-6 relative on the device (the host loop
//   against the device kernels, which nvcc contracts into FMAs), bit for bit on the host;
// - state dicts and checkpoints read the host shards: the same values.
// Every case runs with and without pin_memory, with and without mixed precision (bf16
// parameters, f32 reduction), with gradient accumulation (two micro-batches per step).
#include <doctest/doctest.h>
#include <mpi.h>
#include <stdlib.h>

#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/fsdp/state_dict.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "lib/tensor/staging.hpp"
#include "test_devices.hpp"
#include "test_support.hpp"

using namespace fullshard;
using fsdp::FullyShardOptions;
using graph::Module;
using graph::Parameter;

namespace {

int R() {
  return test::world_rank();
}

struct Config {
  std::optional<fsdp::CPUOffloadPolicy> offload;
  bool mixed = false;  // param_dtype bf16, reduce_dtype f32
};

FullyShardOptions options_of(const Config& c) {
  FullyShardOptions o;
  o.offload_policy = c.offload;
  if (c.mixed) {
    o.mp_policy.param_dtype = DType::bf16;
    o.mp_policy.reduce_dtype = DType::f32;
  }
  return o;
}

// Params (7,3) and (5,) in l0, (13,) in l1, (4,) in the root; l0, l1 and the root
// fully_shard'ed (l0 and l1 reshard after forward, so backward gathers them again from the
// shards). The backward adds a sample to each gradient and a quarter of the unsharded value
// (so the gradients depend on what the all-gather delivered).
struct Model {
  std::unique_ptr<Module> root = Module::make_root("model");
  int k = 0;
  Model(const DeviceMesh& mesh, const Config& c, double shift = 0.0) {
    Module& l0 = root->add_module("l0");
    Module& l1 = root->add_module("l1");
    l0.add_param("w", {7, 3});
    l0.add_param("b", {5});
    l1.add_param("w", {13});
    root->add_param("head", {4});
    for (Parameter* p : root->parameters())
      p->init([shift](std::int64_t e) { return 0.37 * static_cast<double>(e % 11) - 1.3 + shift; });
    for (Module* m : {&l0, &l1, root.get()})
      m->on_backward([this](Module& mod) {
        for (std::size_t i = 0; i < mod.num_params(); ++i) {
          Parameter& p = mod.param(i);
          const Tensor v = test::host_copy(p.data());
          Tensor h = test::host_copy(p.grad());
          for (std::int64_t e = 0; e < h.numel(); ++e)
            h.set(e, h.at(e) + 0.25 * v.at(e) +
                         test::sample(R(), static_cast<std::size_t>(e),
                                      test::name_salt(p.fqn()) + 1000 * k, false));
          test::write_back(p.grad(), h);
        }
      });
    const FullyShardOptions o = options_of(c);
    fsdp::fully_shard(l0, mesh, o);
    fsdp::fully_shard(l1, mesh, o);
    fsdp::fully_shard(*root, mesh, o);
  }
  // One step's gradients: two micro-batches (the second accumulates into the sharded
  // gradients).
  void gradients(int step) {
    for (int mb = 0; mb < 2; ++mb) {
      k = 2 * step + mb;
      fsdp::forward(*root);
      fsdp::backward(*root);
    }
  }
  std::vector<Parameter*> params() const { return root->parameters(); }
};

// Where the offloaded model's sharded tensors must live: host memory, page-locked on a CUDA
// mesh exactly when pin_memory (on a CPU mesh the policy changes nothing: never pinned).
template <class D>
int misplaced(const Tensor& t, bool pin) {
  if (t.space() != MemorySpace::host) return 1;
  const bool want_pinned = pin && D::space == MemorySpace::device;
  return ::fullshard::detail::is_pinned_host(t.data()) != want_pinned ? 1 : 0;
}

std::unique_ptr<optim::Optimizer> make_optimizer(bool adamw, const std::vector<Parameter*>& ps) {
  if (adamw) return std::make_unique<optim::AdamW>(ps, 0.01, 0.9, 0.999, 1e-8, 0.1);
  return std::make_unique<optim::SGD>(ps, 0.05, 0.9, 0.01, true);
}

}  // namespace

TEST_CASE_TEMPLATE("CPUOffloadPolicy: SGD and AdamW steps on host shards equal the run without", D,
                   FULLSHARD_TEST_DEVICE) {
  DeviceMesh mesh = D::mesh({test::world_size()}, {"dp"});
  for (const bool pin : {true, false})
    for (const bool mixed : {false, true})
      for (const bool adamw : {false, true}) {
        CAPTURE(pin);
        CAPTURE(mixed);
        CAPTURE(adamw);
        Model ref(mesh, {std::nullopt, mixed});
        Model off(mesh, {fsdp::CPUOffloadPolicy{pin}, mixed});
        auto opt_ref = make_optimizer(adamw, ref.params());
        auto opt_off = make_optimizer(adamw, off.params());
        const auto a = ref.params(), b = off.params();
        for (int step = 0; step < 3; ++step) {
          CAPTURE(step);
          opt_ref->zero_grad();
          opt_off->zero_grad();
          ref.gradients(step);
          off.gradients(step);
          for (std::size_t i = 0; i < a.size(); ++i) {
            CHECK(a[i]->data().space() == D::space);
            CHECK(a[i]->grad().space() == D::space);
            CHECK(misplaced<D>(b[i]->data(), pin) == 0);
            CHECK(misplaced<D>(b[i]->grad(), pin) == 0);
            // The first step's gradients come from equal parameters through the same
            // kernels: bit for bit; later ones from parameters equal to rounding.
            CHECK(test::mismatches<D>(b[i]->fqn() + ".grad", test::host_values(b[i]->grad()),
                                      test::host_values(a[i]->grad()), step == 0) == 0);
          }
          if (adamw) {
            const double na = optim::clip_grad_norm(a, 0.5, mesh);
            const double nb = optim::clip_grad_norm(b, 0.5, mesh);
            CHECK(std::fabs(na - nb) <= 1e-6 * na);
          }
          opt_ref->step();
          opt_off->step();
          for (std::size_t i = 0; i < a.size(); ++i)
            CHECK(test::mismatches<D>(b[i]->fqn(), test::host_values(b[i]->data()),
                                      test::host_values(a[i]->data())) == 0);
          const auto sa = opt_ref->state_views(), sb = opt_off->state_views();
          REQUIRE(sa.size() == sb.size());
          for (const auto& [key, t] : sb) {
            CHECK(t.space() == MemorySpace::host);  // the optimizer state follows the shard
            CHECK(sa.at(key).space() == D::space);
            CHECK(test::mismatches<D>(key, test::host_values(t), test::host_values(sa.at(key))) ==
                  0);
          }
        }
        // State dicts read the host shards: views of host memory, the same values.
        const auto sda = fsdp::sharded_state_dict(*ref.root);
        const auto sdb = fsdp::sharded_state_dict(*off.root);
        for (const auto& [key, st] : sdb) {
          CHECK(misplaced<D>(st.local, pin) == 0);
          CHECK(test::mismatches<D>(key, test::host_values(st.local),
                                    test::host_values(sda.at(key).local)) == 0);
        }
        const auto fa = fsdp::full_state_dict(*ref.root);
        const auto fb = fsdp::full_state_dict(*off.root);
        for (const auto& [key, t] : fb)
          CHECK(test::mismatches<D>(key, test::host_values(t), test::host_values(fa.at(key))) == 0);
        // ... and load into host shards: a fresh offloaded model holds exactly those values
        // and trains on from them as the model they came from.
        Model again(mesh, {fsdp::CPUOffloadPolicy{pin}, mixed}, 0.5);
        fsdp::load_full_state_dict(*again.root, fb);
        const auto c = again.params();
        for (std::size_t i = 0; i < c.size(); ++i) {
          CHECK(misplaced<D>(c[i]->data(), pin) == 0);
          CHECK(test::mismatches<D>(c[i]->fqn(), test::host_values(c[i]->data()),
                                    test::host_values(b[i]->data()), true) == 0);
        }
        opt_off->zero_grad();
        off.gradients(3);
        again.gradients(3);
        const auto bb = off.params();
        for (std::size_t i = 0; i < c.size(); ++i)
          CHECK(test::mismatches<D>(c[i]->fqn() + ".grad", test::host_values(c[i]->grad()),
                                    test::host_values(bb[i]->grad()), true) == 0);
      }
}

TEST_CASE_TEMPLATE("CPUOffloadPolicy: checkpoints of host shards load into either model", D,
                   FULLSHARD_TEST_DEVICE) {
  DeviceMesh mesh = D::mesh({test::world_size()}, {"dp"});
  for (const bool pin : {true, false}) {
    CAPTURE(pin);
    test::SharedTempDir dir("fullshard-offload");
    Model off(mesh, {fsdp::CPUOffloadPolicy{pin}, false});
    optim::AdamW opt(off.params(), 0.01);
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      off.gradients(step);
      opt.step();
    }
    checkpoint::save(dir.path, *off.root, &opt, 2);
    // Into a model without offload (device shards on a CUDA mesh) and into an offloaded one
    // (host shards, still page-locked after the load when pin_memory is set): the same values,
    // the optimizer state where each shard lives.
    for (const bool offload : {false, true}) {
      CAPTURE(offload);
      Model fresh(mesh,
                  {offload ? std::optional<fsdp::CPUOffloadPolicy>(fsdp::CPUOffloadPolicy{pin})
                           : std::nullopt,
                   false},
                  0.75);
      optim::AdamW opt2(fresh.params(), 0.01);
      const checkpoint::Loaded ck = checkpoint::load(dir.path, *fresh.root, &opt2);
      CHECK(ck.step == 2);
      const auto a = off.params(), b = fresh.params();
      const auto sa = opt.state_views(), sb = opt2.state_views();
      for (std::size_t i = 0; i < a.size(); ++i) {
        if (offload)
          CHECK(misplaced<D>(b[i]->data(), pin) == 0);
        else
          CHECK(b[i]->data().space() == D::space);
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
