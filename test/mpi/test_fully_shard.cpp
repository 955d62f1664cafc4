// fully_shard against unsharded references computed in the test, on 1-4 ranks.
//
// Most cases use a "bag" loss whose gradient needs the unsharded parameter values: rank r's
// local loss is sum_e x(r, p, e) * p_e^2 / 2, so its gradient is x(r, p, e) * p_e. With
// integer x and p the sums over ranks are exact in f32, and the mean over ranks (one
// division) is correctly rounded, so shards and gradients are compared exactly.
//
// Every case is written once for a device tag D (test/support/test_devices.hpp) and compiled
// once per device: the host program runs in CTest on 1-4 ranks, the CUDA program (a
// CUDA-enabled Kokkos) on one GPU. Values are read through test::host_copy, so the same
// assertions hold wherever the engine keeps its bytes; D::space says where that must be.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/fsdp/state_dict.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "lib/fsdp/group_access.hpp"
#include "lib/graph/json_forms.hpp"
#include "test_devices.hpp"
#include "test_support.hpp"

using namespace fullshard;
using fsdp::FullyShardOptions;
using graph::Module;
using graph::Parameter;

namespace {

int W() {
  return test::world_size();
}
int R() {
  return test::world_rank();
}

std::uint64_t hash(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : s)
    h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}
// Initial value of element e of parameter fqn: integers in [-8, 8].
double init_value(const std::string& fqn, std::int64_t e) {
  return static_cast<double>(static_cast<std::int64_t>((hash(fqn) + 7 * e) % 17) - 8);
}
// Rank r's data for element e of fqn in micro-batch mb: integers in [-3, 3].
double x_value(int r, const std::string& fqn, std::int64_t e, int mb = 0) {
  return static_cast<double>(
      static_cast<std::int64_t>((hash(fqn) / 3 + 5 * e + 11 * r + 13 * mb) % 7) - 3);
}

// Shape of rank r's shard by torch.chunk on `dim` (independent of the library's code).
Shape chunk_shape(const Shape& s, int w, int r, int dim) {
  Shape out = s;
  const std::int64_t D = s[dim];
  const std::int64_t chunk = (D + w - 1) / w;
  out[dim] = std::max<std::int64_t>(0, std::min<std::int64_t>(chunk, D - r * chunk));
  return out;
}
// Global flat index of local flat index e of rank r's shard.
std::int64_t global_index(const Shape& s, int w, int r, int dim, std::int64_t e) {
  const Shape local = chunk_shape(s, w, r, dim);
  const std::int64_t chunk = (s[dim] + w - 1) / w;
  std::vector<std::int64_t> idx(s.size());
  for (int d = static_cast<int>(s.size()) - 1; d >= 0; --d) {
    idx[d] = e % local[d];
    e /= local[d];
  }
  idx[dim] += r * chunk;
  std::int64_t g = 0;
  for (std::size_t d = 0; d < s.size(); ++d)
    g = g * s[d] + idx[d];
  return g;
}

// A bag of parameters of many shapes under a root; callbacks implement the bag loss for
// micro-batch `mb` (a counter the test sets) and record whether forward saw full values.
struct Bag {
  /// `space`: where the device under test keeps unsharded parameters and gradients (and, by
  /// default, shards and sharded gradients: shard_space).
  explicit Bag(MemorySpace space) : space(space), shard_space(space) {}

  std::unique_ptr<Module> root = Module::make_root("model");
  MemorySpace space;
  MemorySpace shard_space;
  int mb = 0;
  int forward_mismatches = 0;
  int wrong_space = 0;  // unsharded parameters or gradients the callbacks saw elsewhere
  std::map<std::string, int> placements;  // fqn -> shard dim

  Module& add(const std::string& name, std::vector<std::pair<std::string, Shape>> params,
              Module* parent = nullptr) {
    Module& m = (parent ? *parent : *root).add_module(name);
    for (auto& [pn, shape] : params) {
      Parameter& p = m.add_param(pn, shape);
      p.init([&p](std::int64_t e) { return init_value(p.fqn(), e); });
    }
    m.on_forward([this](Module& mod) {
      for (std::size_t i = 0; i < mod.num_params(); ++i) {
        Parameter& p = mod.param(i);
        if (p.data().shape() != p.shape()) {
          ++forward_mismatches;
          continue;
        }
        wrong_space += p.data().space() != space;
        const Tensor v = test::host_copy(p.data());
        for (std::int64_t e = 0; e < v.numel(); ++e)
          if (v.at(e) != current(p.fqn(), e)) ++forward_mismatches;
      }
    });
    m.on_backward([this](Module& mod) {
      for (std::size_t i = 0; i < mod.num_params(); ++i) {
        Parameter& p = mod.param(i);
        wrong_space += p.grad().space() != space;
        Tensor g = test::host_copy(p.grad());
        const Tensor v = test::host_copy(p.data());
        for (std::int64_t e = 0; e < g.numel(); ++e)
          g.set(e, g.at(e) + x_value(R(), p.fqn(), e, mb) * v.at(e));
        test::write_back(p.grad(), g);
      }
    });
    return m;
  }

  // The values the test expects the full parameters to have now.
  std::map<std::string, std::vector<double>> values;
  double current(const std::string& fqn, std::int64_t e) const {
    auto it = values.find(fqn);
    return it == values.end() ? init_value(fqn, e) : it->second[static_cast<std::size_t>(e)];
  }

  void step(int micro_batch) {
    mb = micro_batch;
    fsdp::forward(*root);
    fsdp::backward(*root);
  }
};

// Mean over ranks of the bag-loss gradient for the given micro-batches, as f32.
float expected_grad(const Bag& bag, const std::string& fqn, std::int64_t e,
                    const std::vector<int>& mbs, double divisor) {
  float sum = 0;  // integers: exact in f32 in any order
  for (int mb : mbs)
    for (int r = 0; r < W(); ++r)
      sum += static_cast<float>(x_value(r, fqn, e, mb) * bag.current(fqn, e));
  return sum / static_cast<float>(divisor);
}

// `steps`: the micro-batches of each synchronised backward since the last zero_grad; every
// step's reduced gradient is divided, then accumulated (as the library does, in f32).
void check_shards_and_grads(Bag& bag, const std::vector<std::vector<int>>& steps, double divisor) {
  int bad_shape = 0, bad_value = 0, bad_grad = 0, bad_space = 0;
  for (Parameter* p : bag.root->parameters()) {
    if (p->data().space() != bag.shard_space || p->grad().space() != bag.shard_space) {
      if (bad_space++ == 0)
        MESSAGE(p->fqn() << ": shard in " << memory_space_name(p->data().space())
                         << " memory, gradient in " << memory_space_name(p->grad().space())
                         << " memory, expected " << memory_space_name(bag.shard_space));
    }
    const int dim = bag.placements.count(p->fqn()) ? bag.placements[p->fqn()] : 0;
    const Shape local = chunk_shape(p->shape(), W(), R(), dim);
    if (p->data().shape() != local || p->grad().shape() != local) {
      ++bad_shape;
      MESSAGE(p->fqn() << ": shard " << shape_string(p->data().shape()) << ", expected "
                       << shape_string(local));
      continue;
    }
    const Tensor data = test::host_copy(p->data()), grad = test::host_copy(p->grad());
    for (std::int64_t e = 0; e < numel(local); ++e) {
      const std::int64_t g = global_index(p->shape(), W(), R(), dim, e);
      if (data.at(e) != bag.current(p->fqn(), g)) ++bad_value;
      float expected = 0;
      for (const auto& mbs : steps)
        expected += expected_grad(bag, p->fqn(), g, mbs, divisor);
      if (grad.at(e) != expected) ++bad_grad;
    }
  }
  CHECK(bad_shape == 0);
  CHECK(bad_value == 0);
  CHECK(bad_grad == 0);
  CHECK(bad_space == 0);
  CHECK(bag.wrong_space == 0);
}

template <class D>
DeviceMesh world_mesh() {
  return D::mesh({W()}, {"dp"});
}

}  // namespace

TEST_CASE_TEMPLATE("seed example: an 8x8 linear layer, shards, gradient slices, one SGD step", D,
                   FULLSHARD_TEST_DEVICE) {
  // y = x W^T + b, local loss sum(y^2)/2 over this rank's 2 rows of a global batch of 2W
  // rows; the mean over ranks is the full-batch gradient of the mean of the local losses.
  auto root = Module::make_root("linear");
  Parameter& w = root->add_param("weight", {8, 8});
  Parameter& b = root->add_param("bias", {8});
  auto W0 = [](std::int64_t e) { return double((e * 5) % 9) - 4; };
  auto B0 = [](std::int64_t e) { return double(e % 3) - 1; };
  w.init(W0);
  b.init(B0);
  auto X = [](int r, int row, int k) { return double((r * 3 + row * 5 + k) % 5) - 2; };
  std::vector<double> y(2 * 8);
  int wrong_space = 0;
  root->on_forward([&](Module&) {
    wrong_space += (w.data().space() != D::space) + (b.data().space() != D::space);
    const Tensor wd = test::host_copy(w.data()), bd = test::host_copy(b.data());
    for (int row = 0; row < 2; ++row)
      for (int j = 0; j < 8; ++j) {
        double acc = bd.at(j);
        for (int k = 0; k < 8; ++k)
          acc += X(R(), row, k) * wd.at(j * 8 + k);
        y[row * 8 + j] = acc;
      }
  });
  root->on_backward([&](Module&) {
    wrong_space += (w.grad().space() != D::space) + (b.grad().space() != D::space);
    Tensor gw = test::host_copy(w.grad()), gb = test::host_copy(b.grad());
    for (int row = 0; row < 2; ++row)
      for (int j = 0; j < 8; ++j) {
        gb.set(j, gb.at(j) + y[row * 8 + j]);
        for (int k = 0; k < 8; ++k)
          gw.set(j * 8 + k, gw.at(j * 8 + k) + y[row * 8 + j] * X(R(), row, k));
      }
    test::write_back(w.grad(), gw);
    test::write_back(b.grad(), gb);
  });
  auto mesh = world_mesh<D>();
  auto& st = fsdp::fully_shard(*root, mesh);
  CHECK(st.is_root());
  const Shape ws = chunk_shape({8, 8}, W(), R(), 0);
  CHECK(w.data().shape() == ws);
  CHECK(w.data().space() == D::space);
  CHECK(b.data().space() == D::space);
  CHECK(b.data().shape() == chunk_shape({8}, W(), R(), 0));
  if (W() == 2) CHECK(w.data().shape() == Shape{4, 8});

  fsdp::forward(*root);
  fsdp::backward(*root);
  CHECK(wrong_space == 0);
  CHECK(w.grad().space() == D::space);
  CHECK(b.grad().space() == D::space);

  // Reference: full-batch gradient with the unsharded parameters, in double.
  std::vector<double> gw(64, 0.0), gb(8, 0.0);
  for (int r = 0; r < W(); ++r)
    for (int row = 0; row < 2; ++row)
      for (int j = 0; j < 8; ++j) {
        double acc = B0(j);
        for (int k = 0; k < 8; ++k)
          acc += X(r, row, k) * W0(j * 8 + k);
        gb[j] += acc / W();
        for (int k = 0; k < 8; ++k)
          gw[j * 8 + k] += acc * X(r, row, k) / W();
      }
  const std::int64_t row0 = std::min<std::int64_t>(8, R() * ((8 + W() - 1) / W()));
  int bad = 0;
  const Tensor w_grad = test::host_copy(w.grad()), b_grad = test::host_copy(b.grad());
  for (std::int64_t e = 0; e < w_grad.numel(); ++e)
    bad += w_grad.at(e) != float(gw[row0 * 8 + e]);
  for (std::int64_t e = 0; e < b_grad.numel(); ++e)
    bad += b_grad.at(e) != float(gb[row0 + e]);
  CHECK(bad == 0);

  // One SGD step on the shards, then unshard: the full parameters equal the reference step.
  const float lr = 0.125f;
  for (Parameter* p : {&w, &b}) {
    Tensor d = test::host_copy(p->data());
    const Tensor g = test::host_copy(p->grad());
    for (std::int64_t e = 0; e < d.numel(); ++e)
      d.set(e, float(d.at(e)) - lr * float(g.at(e)));
    test::write_back(p->data(), d);
  }
  st.unshard();
  REQUIRE(w.data().shape() == Shape{8, 8});
  CHECK(w.data().space() == D::space);
  bad = 0;
  {  // host copies (views on the host) end before the reshard
    const Tensor w_full = test::host_copy(w.data()), b_full = test::host_copy(b.data());
    for (int e = 0; e < 64; ++e)
      bad += w_full.at(e) != float(W0(e)) - lr * float(gw[e]);
    for (int e = 0; e < 8; ++e)
      bad += b_full.at(e) != float(B0(e)) - lr * float(gb[e]);
  }
  CHECK(bad == 0);
  st.reshard();
  CHECK(w.data().shape() == ws);
}

TEST_CASE_TEMPLATE("uneven dim-0 sizes 1, 3, 5, 7, 13, a 3-D and an empty parameter", D,
                   FULLSHARD_TEST_DEVICE) {
  Bag bag(D::space);
  Module& a = bag.add("a", {{"p1", {1}}, {"p3", {3, 4}}, {"p5", {5}}});
  Module& b = bag.add("b", {{"p7", {7, 2}}, {"p13", {13}}, {"cube", {5, 3, 2}}, {"empty", {0, 3}}});
  auto mesh = world_mesh<D>();
  fsdp::fully_shard(a, mesh);
  fsdp::fully_shard(b, mesh);
  fsdp::fully_shard(*bag.root, mesh);
  bag.step(0);
  CHECK(bag.forward_mismatches == 0);
  check_shards_and_grads(bag, {{0}}, W());
}

TEST_CASE_TEMPLATE("a Shard(1) parameter", D, FULLSHARD_TEST_DEVICE) {
  Bag bag(D::space);
  bag.add("m", {{"cols", {3, 12}}, {"rows", {5, 2}}});
  bag.placements["m.cols"] = 1;
  FullyShardOptions o;
  o.shard_placement_fn = [](const Parameter& p) -> std::optional<Placement> {
    if (p.name() == "cols") return Placement::Shard(1);
    return std::nullopt;
  };
  auto mesh = world_mesh<D>();
  fsdp::fully_shard(bag.root->module("m"), mesh, o);
  fsdp::fully_shard(*bag.root, mesh);
  bag.step(0);
  CHECK(bag.forward_mismatches == 0);
  check_shards_and_grads(bag, {{0}}, W());
}

TEST_CASE_TEMPLATE("bf16 param_dtype with f32 reduce_dtype", D, FULLSHARD_TEST_DEVICE) {
  auto root = Module::make_root();
  Parameter& p = root->add_param("w", {6, 5});
  auto V = [](std::int64_t e) { return 1.0 + double(e) / 64.0 + 1.0 / 1024.0; };  // not bf16-exact
  p.init(V);
  int wrong_dtype = 0, wrong_value = 0, wrong_space = 0;
  root->on_forward([&](Module&) {
    wrong_dtype += p.data().dtype() != DType::bf16;
    wrong_space += p.data().space() != D::space;
    const Tensor v = test::host_copy(p.data());
    for (std::int64_t e = 0; e < 30; ++e)
      wrong_value += v.at(e) != double(bf16_to_float(float_to_bf16(float(V(e)))));
  });
  root->on_backward([&](Module&) {
    Tensor g = test::host_copy(p.grad());  // bf16, the compute dtype
    wrong_dtype += g.dtype() != DType::bf16;
    wrong_space += p.grad().space() != D::space;
    const Tensor v = test::host_copy(p.data());
    for (std::int64_t e = 0; e < 30; ++e)
      g.set(e, v.at(e) * (R() + 1));
    test::write_back(p.grad(), g);
  });
  FullyShardOptions o;
  o.mp_policy.param_dtype = DType::bf16;
  o.mp_policy.reduce_dtype = DType::f32;
  auto mesh = world_mesh<D>();
  fsdp::fully_shard(*root, mesh, o);
  fsdp::forward(*root);
  fsdp::backward(*root);
  CHECK(wrong_dtype == 0);
  CHECK(wrong_value == 0);
  CHECK(wrong_space == 0);
  CHECK(p.grad().dtype() == DType::f32);
  CHECK(p.grad().space() == D::space);
  const Shape local = chunk_shape({6, 5}, W(), R(), 0);
  REQUIRE(p.grad().shape() == local);
  const Tensor grad = test::host_copy(p.grad());
  double worst = 0;
  for (std::int64_t e = 0; e < numel(local); ++e) {
    const std::int64_t g = global_index({6, 5}, W(), R(), 0, e);
    double ref = 0;  // each rank's bf16 gradient, summed in f32 (exact here), mean over ranks
    for (int r = 0; r < W(); ++r)
      ref +=
          bf16_to_float(float_to_bf16(float(bf16_to_float(float_to_bf16(float(V(g)))) * (r + 1))));
    ref /= W();
    worst = std::max(worst, std::fabs(grad.at(e) - ref) / std::fabs(ref));
  }
  CHECK(worst <= 1e-6);
}

TEST_CASE_TEMPLATE("CPUOffloadPolicy: sharded state in host memory, the host path's gradients", D,
                   FULLSHARD_TEST_DEVICE) {
  for (const bool pin : {true, false}) {
    Bag bag(D::space);
    bag.shard_space = MemorySpace::host;  // sharded parameters and gradients stay on the host
    bag.add("a", {{"w", {7, 3}}, {"b", {5}}});
    bag.add("b", {{"w", {4, 4}}});
    FullyShardOptions o;
    o.offload_policy = fsdp::CPUOffloadPolicy{pin};
    auto mesh = world_mesh<D>();
    for (std::size_t i = 0; i < bag.root->num_children(); ++i)
      fsdp::fully_shard(bag.root->child(i), mesh, o);
    auto& st = fsdp::fully_shard(*bag.root, mesh, o);
    REQUIRE(st.options().offload_policy.has_value());
    CHECK(st.options().offload_policy->pin_memory == pin);
    bag.step(0);
    CHECK(bag.forward_mismatches == 0);
    check_shards_and_grads(bag, {{0}}, W());
    for (Parameter* p : bag.root->parameters()) {
      CHECK(p->data().space() == MemorySpace::host);
      CHECK(p->grad().space() == MemorySpace::host);
    }
  }
  // From a graph request: true, "cpu", {"pin_memory": false}; bad values name the path.
  FullyShardOptions d;
  CHECK(fsdp::options_from_request(graph::shard_request_from_json(
                                       nlohmann::json::parse(R"({"offload_policy": true})"), "m"),
                                   d)
            .offload_policy->pin_memory);
  CHECK(fsdp::options_from_request(graph::shard_request_from_json(
                                       nlohmann::json::parse(R"({"offload_policy": "cpu"})"), "m"),
                                   d)
            .offload_policy.has_value());
  CHECK_FALSE(fsdp::options_from_request(
                  graph::shard_request_from_json(
                      nlohmann::json::parse(R"({"offload_policy": {"pin_memory": false}})"), "m"),
                  d)
                  .offload_policy->pin_memory);
  CHECK_FALSE(
      fsdp::options_from_request(
          graph::shard_request_from_json(nlohmann::json::parse(R"({"offload_policy": null})"), "m"),
          d)
          .offload_policy.has_value());
  CHECK_THROWS_WITH_AS(fsdp::options_from_request(
                           graph::shard_request_from_json(
                               nlohmann::json::parse(R"({"offload_policy": {"pin": true}})"), "m"),
                           d),
                       doctest::Contains("m.offload_policy.pin: unknown CPUOffloadPolicy field"),
                       ConfigError);
  CHECK_THROWS_WITH_AS(
      fsdp::options_from_request(graph::shard_request_from_json(
                                     nlohmann::json::parse(R"({"offload_policy": "gpu"})"), "m"),
                                 d),
      doctest::Contains("m.offload_policy: expected null, true, false, \"cpu\""), ConfigError);
  CHECK_THROWS_WITH_AS(
      fsdp::options_from_request(
          graph::shard_request_from_json(
              nlohmann::json::parse(R"({"offload_policy": {"pin_memory": 1}})"), "m"),
          d),
      doctest::Contains("m.offload_policy.pin_memory: expected true or false"), ConfigError);
}

TEST_CASE_TEMPLATE("two micro-batches without gradient sync, then one with, equal one large batch",
                   D, FULLSHARD_TEST_DEVICE) {
  Bag bag(D::space);
  Module& l0 = bag.add("l0", {{"w", {7, 3}}});
  bag.add("l1", {{"w", {5}}});
  auto mesh = world_mesh<D>();
  auto& s0 = fsdp::fully_shard(l0, mesh);
  auto& root = fsdp::fully_shard(*bag.root, mesh);
  (void)s0;
  root.set_requires_gradient_sync(false);
  bag.step(0);
  bag.step(1);
  root.set_requires_gradient_sync(true);
  bag.step(2);
  CHECK(bag.forward_mismatches == 0);
  check_shards_and_grads(bag, {{0, 1, 2}}, W());
}

TEST_CASE_TEMPLATE("a custom gradient divide factor, and gradients accumulate across steps", D,
                   FULLSHARD_TEST_DEVICE) {
  Bag bag(D::space);
  Module& l0 = bag.add("l0", {{"w", {9, 2}}});
  auto mesh = world_mesh<D>();
  auto& s = fsdp::fully_shard(l0, mesh);
  auto& root = fsdp::fully_shard(*bag.root, mesh);
  s.set_gradient_divide_factor(2.0);
  bag.step(0);
  check_shards_and_grads(bag, {{0}}, 2.0);
  bag.step(1);  // no zero_grad: the sharded gradients accumulate
  check_shards_and_grads(bag, {{0}, {1}}, 2.0);
  root.zero_grad();
  bag.step(1);
  check_shards_and_grads(bag, {{1}}, 2.0);
  CHECK_THROWS_WITH_AS(s.set_gradient_divide_factor(0.0), doctest::Contains("must be > 0"),
                       InvalidArgument);
}

TEST_CASE_TEMPLATE(
    "zero_grad keeps the gradient storage for the next step; a gradient the user holds "
    "keeps its values",
    D, FULLSHARD_TEST_DEVICE) {
  Bag bag(D::space);
  Module& l0 = bag.add("l0", {{"w", {12, 2}}});
  auto mesh = world_mesh<D>();
  fsdp::fully_shard(l0, mesh);
  auto& root = fsdp::fully_shard(*bag.root, mesh);
  Parameter& w = l0.param(0);
  bag.step(0);
  REQUIRE(w.grad().owner());
  const std::weak_ptr<void> storage = w.grad().owner();
  root.zero_grad();
  CHECK(!w.grad().defined());
  CHECK(!storage.expired());  // set aside, not freed
  bag.step(1);
  CHECK(w.grad().owner() == storage.lock());  // reused: nobody held it
  check_shards_and_grads(bag, {{1}}, W());

  const Tensor held = w.grad();
  const Tensor before = test::host_copy(held);
  root.zero_grad();
  bag.step(0);
  CHECK(w.grad().owner() != held.owner());  // held by the user: a new tensor
  const Tensor after = test::host_copy(held);
  for (std::int64_t e = 0; e < before.numel(); ++e)
    CHECK(after.at(e) == before.at(e));
  check_shards_and_grads(bag, {{0}}, W());
}

TEST_CASE_TEMPLATE("ignored parameters are neither sharded nor reduced", D, FULLSHARD_TEST_DEVICE) {
  auto root = Module::make_root();
  Module& m = root->add_module("m");
  Parameter& w = m.add_param("w", {4, 2});
  Parameter& frozen = m.add_param("frozen", {3, 3});
  w.init([](std::int64_t e) { return double(e); });
  frozen.init([](std::int64_t e) { return double(e) + 0.5; });
  Tensor my_grad = Tensor::zeros({3, 3}, DType::f32);
  frozen.set_grad(my_grad);
  m.on_backward([&](Module&) {
    Tensor g = test::host_copy(w.grad());
    for (std::int64_t e = 0; e < g.numel(); ++e)
      g.set(e, 1.0);
    test::write_back(w.grad(), g);
    Tensor f = test::host_copy(frozen.grad());
    for (std::int64_t e = 0; e < 9; ++e)
      f.set(e, R() + e);  // local, never reduced
    test::write_back(frozen.grad(), f);
  });
  FullyShardOptions o;
  o.ignored_params = {"m.frozen"};
  auto mesh = world_mesh<D>();
  auto& st = fsdp::fully_shard(*root, mesh, o);
  CHECK(st.group_fqns() == std::vector<std::string>{"m.w"});
  CHECK(frozen.data().shape() == Shape{3, 3});
  fsdp::forward(*root);
  fsdp::backward(*root);
  CHECK(frozen.data().shape() == Shape{3, 3});
  CHECK(test::host_copy(frozen.data()).at(4) == 4.5);
  CHECK(frozen.grad().data() == my_grad.data());
  CHECK(test::host_copy(frozen.grad()).at(2) == R() + 2);
  CHECK(w.grad().shape() == chunk_shape({4, 2}, W(), R(), 0));
  CHECK(w.grad().space() == D::space);
  const Tensor w_grad = test::host_copy(w.grad());
  for (std::int64_t e = 0; e < w_grad.numel(); ++e)
    CHECK(w_grad.at(e) == 1.0);
  auto sd = fsdp::sharded_state_dict(*root);
  CHECK(sd.at("m.frozen").placement().is_replicate());
  CHECK_THROWS_WITH_AS(fsdp::fully_shard(root->add_module("x"), mesh,
                                         [] {
                                           FullyShardOptions bad;
                                           bad.ignored_params = {"nope"};
                                           return bad;
                                         }()),
                       doctest::Contains("ignored parameter 'nope' does not exist"),
                       InvalidArgument);
}

TEST_CASE_TEMPLATE("communication groups of the seed's m1..m4 example", D, FULLSHARD_TEST_DEVICE) {
  // model[m1[a] -> m2[b] -> m3[c] -> m4[d]]: fully_shard(m2), fully_shard(m3), then the root.
  auto build = [] {
    auto root = Module::make_root();
    for (auto [m, p] : {std::pair{"m1", "a"}, {"m2", "b"}, {"m3", "c"}, {"m4", "d"}})
      root->add_module(m).add_param(p, {5, 2});
    return root;
  };
  auto mesh = world_mesh<D>();
  auto root = build();
  auto& g2 = fsdp::fully_shard(root->module("m2"), mesh);
  auto& g3 = fsdp::fully_shard(root->module("m3"), mesh);
  auto& g0 = fsdp::fully_shard(*root, mesh);
  CHECK(g0.group_fqns() == std::vector<std::string>{"m1.a", "m4.d"});
  CHECK(g2.group_fqns() == std::vector<std::string>{"m2.b"});
  CHECK(g3.group_fqns() == std::vector<std::string>{"m3.c"});
  CHECK(g0.is_root());
  CHECK_FALSE(g2.is_root());
  CHECK(fsdp::fsdp_state(root->module("m1")) == nullptr);

  // The same grouping from a graph file.
  auto json = graph::parse_graph_json(R"({"name": "model", "fully_shard": true, "modules": [
      {"name": "m1", "params": {"a": {"shape": [5, 2]}}},
      {"name": "m2", "fully_shard": true, "params": {"b": {"shape": [5, 2]}}},
      {"name": "m3", "fully_shard": {"reshard_after_forward": false}, "params": {"c": {"shape": [5, 2]}}},
      {"name": "m4", "params": {"d": {"shape": [5, 2]}}}]})",
                                      "m1m4.json");
  CHECK(fsdp::apply_fully_shard_requests(*json, mesh) == 3);
  CHECK(fsdp::fsdp_state(*json)->group_fqns() == std::vector<std::string>{"m1.a", "m4.d"});
  CHECK(fsdp::fsdp_state(json->module("m3"))->group_fqns() == std::vector<std::string>{"m3.c"});

  // A list forms one group.
  auto root2 = build();
  auto& pair = fsdp::fully_shard({&root2->module("m2"), &root2->module("m3")}, mesh);
  CHECK(pair.group_fqns() == std::vector<std::string>{"m2.b", "m3.c"});
  CHECK(fsdp::detail::group_name(*fsdp::fsdp_state(root2->module("m3"))) ==
        fsdp::detail::group_name(pair));
  CHECK(fsdp::detail::group_name(pair) == "m2+m3");
}

TEST_CASE_TEMPLATE("list groups run once per pass; reshard policies; explicit prefetch", D,
                   FULLSHARD_TEST_DEVICE) {
  Bag bag(D::space);
  Module& a = bag.add("a", {{"w", {6}}});
  Module& b = bag.add("b", {{"w", {4, 3}}});
  Module& c = bag.add("c", {{"w", {3}}});
  auto mesh = world_mesh<D>();
  fsdp::fully_shard({&a, &b}, mesh);
  auto& sc = fsdp::fully_shard(c, mesh, [] {
    FullyShardOptions o;
    o.reshard_after_forward = false;
    return o;
  }());
  auto& root = fsdp::fully_shard(*bag.root, mesh);
  root.set_modules_to_forward_prefetch({&c});
  sc.set_modules_to_backward_prefetch({&a});
  bag.step(0);
  CHECK(bag.forward_mismatches == 0);
  check_shards_and_grads(bag, {{0}}, W());
  bag.step(1);
  check_shards_and_grads(bag, {{0}, {1}}, W());
}

TEST_CASE_TEMPLATE("reshard_after_forward as a group size gives the same gradients", D,
                   FULLSHARD_TEST_DEVICE) {
  for (int k : {1, 2, W()}) {
    if (W() % k != 0) continue;
    CAPTURE(k);
    Bag bag(D::space);
    Module& l0 = bag.add("l0", {{"w", {9, 2}}, {"v", {3}}});
    Module& l1 = bag.add("l1", {{"w", {5}}});
    auto mesh = world_mesh<D>();
    FullyShardOptions o;
    o.reshard_after_forward = fsdp::ReshardAfterForward::group_size(k);
    fsdp::fully_shard(l0, mesh, o);
    fsdp::fully_shard(l1, mesh, o);
    fsdp::fully_shard(*bag.root, mesh);
    bag.step(0);
    CHECK(bag.forward_mismatches == 0);
    check_shards_and_grads(bag, {{0}}, W());
  }
  if (W() == 4) {
    Bag bag(D::space);
    Module& l0 = bag.add("l0", {{"w", {9, 2}}});
    FullyShardOptions o;
    o.reshard_after_forward = fsdp::ReshardAfterForward::group_size(3);
    auto mesh = world_mesh<D>();
    CHECK_THROWS_WITH_AS(
        fsdp::fully_shard(l0, mesh, o),
        doctest::Contains("reshard_after_forward=3 must divide the shard group size 4"),
        InvalidArgument);
  }
}

TEST_CASE_TEMPLATE("HSDP on a 2-D mesh gives the FSDP gradients", D, FULLSHARD_TEST_DEVICE) {
  if (W() % 2 != 0) {
    MESSAGE("needs an even number of ranks");
    return;
  }
  Bag bag(D::space);
  Module& l0 = bag.add("l0", {{"w", {7, 2}}});
  bag.add("l1", {{"w", {5}}});
  DeviceMesh mesh = D::mesh({2, W() / 2}, {"replicate", "shard"});
  fsdp::fully_shard(l0, mesh);
  auto& root = fsdp::fully_shard(*bag.root, mesh);
  bag.step(0);
  // Shards follow the shard dim; gradients are the mean over all W ranks.
  const int S = W() / 2, r = R() % S;
  int bad = 0;
  for (Parameter* p : bag.root->parameters()) {
    const Shape local = chunk_shape(p->shape(), S, r, 0);
    REQUIRE(p->grad().shape() == local);
    CHECK(p->grad().space() == D::space);
    const Tensor grad = test::host_copy(p->grad());
    for (std::int64_t e = 0; e < numel(local); ++e)
      bad += grad.at(e) !=
             expected_grad(bag, p->fqn(), global_index(p->shape(), S, r, 0, e), {0}, W());
  }
  CHECK(bad == 0);
  // Deferred all-reduce: accumulate two micro-batches, all-reduce with the second.
  root.zero_grad();
  root.set_requires_all_reduce(false);
  bag.step(0);
  root.set_requires_all_reduce(true);
  bag.step(1);
  bad = 0;
  for (Parameter* p : bag.root->parameters()) {
    const Tensor grad = test::host_copy(p->grad());
    for (std::int64_t e = 0; e < grad.numel(); ++e)
      bad += grad.at(e) !=
             expected_grad(bag, p->fqn(), global_index(p->shape(), S, r, 0, e), {0, 1}, W());
  }
  CHECK(bad == 0);
  CHECK(bag.wrong_space == 0);
}

TEST_CASE_TEMPLATE("reset_iter_state after an exception in a forward callback", D,
                   FULLSHARD_TEST_DEVICE) {
  Bag bag(D::space);
  Module& l0 = bag.add("l0", {{"w", {5, 2}}});
  Module& l1 = bag.add("l1", {{"w", {3}}});
  auto mesh = world_mesh<D>();
  fsdp::fully_shard(l0, mesh);
  auto& s1 = fsdp::fully_shard(l1, mesh);
  auto& root = fsdp::fully_shard(*bag.root, mesh);
  bool fail = true;
  auto ok_forward = l1.forward_callback();
  l1.on_forward([&](Module& m) {
    if (fail) throw std::runtime_error("user callback failed");
    ok_forward(m);
  });
  CHECK_THROWS_WITH(fsdp::forward(*bag.root), "user callback failed");
  CHECK_THROWS_WITH_AS(s1.reset_iter_state(), doctest::Contains("root FSDP module"),
                       InvalidArgument);
  root.reset_iter_state();
  for (Parameter* p : bag.root->parameters())
    CHECK(p->data().shape() == chunk_shape(p->shape(), W(), R(), 0));
  fail = false;
  bag.step(0);
  CHECK(bag.forward_mismatches == 0);
  check_shards_and_grads(bag, {{0}}, W());
}

TEST_CASE_TEMPLATE("reset_iter_state after an exception in a backward callback", D,
                   FULLSHARD_TEST_DEVICE) {
  Bag bag(D::space);
  Module& l0 = bag.add("l0", {{"w", {5, 2}}});
  Module& l1 = bag.add("l1", {{"w", {3}}});
  auto mesh = world_mesh<D>();
  fsdp::fully_shard(l0, mesh);
  fsdp::fully_shard(l1, mesh);
  auto& root = fsdp::fully_shard(*bag.root, mesh);
  bool fail = true;
  auto ok_backward = l0.backward_callback();
  l0.on_backward([&](Module& m) {
    if (fail) throw std::runtime_error("backward failed");
    ok_backward(m);
  });
  fsdp::forward(*bag.root);
  CHECK_THROWS_WITH(fsdp::backward(*bag.root), "backward failed");  // l1 already reduced
  root.reset_iter_state();
  root.zero_grad();  // the failed iteration's gradients are discarded
  fail = false;
  bag.step(0);
  CHECK(bag.forward_mismatches == 0);
  check_shards_and_grads(bag, {{0}}, W());
}

TEST_CASE_TEMPLATE(
    "one rank: the shards are the parameters, backward adds into the sharded gradients, and a "
    "failed backward drops only gradients that started from zero",
    D, FULLSHARD_TEST_DEVICE) {
  Bag bag(D::space);
  Module& l0 = bag.add("l0", {{"w", {6, 3}}});
  Module& l1 = bag.add("l1", {{"w", {4}}});
  auto mesh = world_mesh<D>();
  fsdp::fully_shard(l0, mesh);
  fsdp::fully_shard(l1, mesh);
  auto& root = fsdp::fully_shard(*bag.root, mesh);
  Parameter& w = l0.param(0);
  const void* seen_data = nullptr;
  const void* seen_grad = nullptr;
  bool fail = false;
  auto forward = l0.forward_callback();
  auto backward = l0.backward_callback();
  l0.on_forward([&](Module& m) {
    seen_data = w.data().data();
    forward(m);
  });
  l0.on_backward([&](Module& m) {
    if (fail) throw std::runtime_error("backward failed");
    seen_grad = w.grad().data();
    backward(m);
  });
  bag.step(0);
  CHECK(bag.forward_mismatches == 0);
  check_shards_and_grads(bag, {{0}}, W());
  // One rank: no unsharded copy of either (W > 1: the gathered parameters and the unsharded
  // gradients are buffers of their own).
  CHECK((seen_data == w.data().data()) == (W() == 1));
  CHECK((seen_grad == w.grad().data()) == (W() == 1));
  bag.step(1);  // no zero_grad: gradients that hold values take the buffered path
  check_shards_and_grads(bag, {{0}, {1}}, W());
  CHECK(seen_grad != w.grad().data());

  // A failed backward into gradients that held values leaves them as they were.
  const Tensor before = test::host_copy(w.grad());
  fail = true;
  fsdp::forward(*bag.root);
  CHECK_THROWS_WITH(fsdp::backward(*bag.root), "backward failed");
  root.reset_iter_state();
  REQUIRE(w.grad().defined());
  const Tensor after = test::host_copy(w.grad());
  for (std::int64_t e = 0; e < before.numel(); ++e)
    CHECK(after.at(e) == before.at(e));

  // From zero, a failed backward drops what it added into (one rank: l0's sharded gradients).
  root.zero_grad();
  fsdp::forward(*bag.root);
  CHECK_THROWS_WITH(fsdp::backward(*bag.root), "backward failed");
  root.reset_iter_state();
  CHECK(!w.grad().defined());
  CHECK(l1.param(0).grad().defined());  // reduced before l0's backward failed
  root.zero_grad();
  fail = false;
  bag.step(2);
  check_shards_and_grads(bag, {{2}}, W());
  CHECK((seen_grad == w.grad().data()) == (W() == 1));

  // Micro-batches without sync: no gradient is shown until the synchronised backward (one
  // rank: the sums are in the sharded gradients, whose divide factor cannot change then).
  root.zero_grad();
  root.set_requires_gradient_sync(false);
  bag.step(0);
  CHECK(!w.grad().defined());
  if (W() == 1)
    CHECK_THROWS_WITH_AS(fsdp::fsdp_state(l0)->set_gradient_divide_factor(2.0),
                         doctest::Contains("accumulating gradients without sync"), InvalidArgument);
  root.set_requires_gradient_sync(true);
  bag.step(1);
  check_shards_and_grads(bag, {{0, 1}}, W());
}

TEST_CASE_TEMPLATE("a group prefetched in backward but never used is resharded at the end", D,
                   FULLSHARD_TEST_DEVICE) {
  Bag bag(D::space);
  Module& l0 = bag.add("l0", {{"w", {6}}});
  Module& l1 = bag.add("l1", {{"w", {4}}});
  auto mesh = world_mesh<D>();
  fsdp::fully_shard(l0, mesh);
  auto& s1 = fsdp::fully_shard(l1, mesh);
  auto& root = fsdp::fully_shard(*bag.root, mesh);
  s1.set_modules_to_backward_prefetch({&l0});
  fsdp::forward(*bag.root);
  {
    auto r = fsdp::backward_scope(*bag.root);
    auto b1 = fsdp::backward_scope(l1);  // prefetches l0, whose backward never runs
  }
  CHECK(fsdp::fsdp_state(l0)->is_sharded());
  CHECK(root.pool_bytes_in_use() == 0);
}

TEST_CASE_TEMPLATE("unshard(async) and the pool returns every transient buffer", D,
                   FULLSHARD_TEST_DEVICE) {
  Bag bag(D::space);
  Module& l0 = bag.add("l0", {{"w", {11, 3}}});
  auto mesh = world_mesh<D>();
  auto& s0 = fsdp::fully_shard(l0, mesh);
  fsdp::fully_shard(*bag.root, mesh);
  auto h = s0.unshard(true);
  h.wait();
  Parameter& w = l0.param("w");
  CHECK(w.data().shape() == Shape{11, 3});
  CHECK(w.data().space() == D::space);
  {  // the host copy (on the host: a view) must not outlive the unsharded buffer's use
    const Tensor full = test::host_copy(w.data());
    for (std::int64_t e = 0; e < 33; ++e)
      CHECK(full.at(e) == init_value("l0.w", e));
  }
  s0.reshard();
  bag.step(0);
  bag.step(0);
  check_shards_and_grads(bag, {{0}, {0}}, W());
  // Every pooled buffer (gathers, unsharded parameters, gradients, reduce-scatter buffers) is
  // back in the pool after the iteration; the peak is what one iteration needs.
  const fsdp::FSDPModule& root = *fsdp::fsdp_state(*bag.root);
  CHECK(root.pool_bytes_in_use() == 0);
  CHECK(root.pool_peak_bytes() > 0);
}

TEST_CASE_TEMPLATE("state dicts: sharded and full, saved and loaded back", D,
                   FULLSHARD_TEST_DEVICE) {
  Bag bag(D::space);
  Module& l0 = bag.add("l0", {{"w", {7, 3}}, {"b", {5}}});
  bag.add("l1", {{"w", {2, 2, 2}}});
  auto mesh = world_mesh<D>();
  fsdp::fully_shard(l0, mesh);
  fsdp::fully_shard(*bag.root, mesh);

  auto sd = fsdp::sharded_state_dict(*bag.root);
  REQUIRE(sd.size() == 3);
  const ShardedTensor& st = sd.at("l0.w");
  CHECK(st.global_shape() == Shape{7, 3});
  CHECK(st.local.shape() == chunk_shape({7, 3}, W(), R(), 0));
  CHECK(st.global_offset()[0] == std::min<std::int64_t>(7, R() * ((7 + W() - 1) / W())));
  // The sub-module's own state dict has relative keys.
  CHECK(fsdp::sharded_state_dict(l0).count("w") == 1);

  auto full = fsdp::full_state_dict(*bag.root);
  REQUIRE(full.size() == 3);
  int bad = 0;
  for (auto& [key, t] : full) {
    REQUIRE(t.shape() == bag.root->find_param(key).shape());
    const Tensor h = test::host_copy(t);
    for (std::int64_t e = 0; e < h.numel(); ++e)
      bad += h.at(e) != init_value(key, e);
  }
  CHECK(bad == 0);
  auto full0 = fsdp::full_state_dict(*bag.root, true);
  CHECK(full0.size() == (R() == 0 ? 3u : 0u));

  // Keep copies of the shards, scribble over the parameters, load the copies back.
  std::map<std::string, ShardedTensor> saved;
  for (auto& [k, v] : sd) {
    Tensor copy = Tensor::empty(v.local.shape(), v.local.dtype());
    copy_bytes(copy, v.local);
    saved[k] = {copy, v.layout};
    Tensor live = test::host_copy(v.local);
    live.fill(99.0);
    test::write_back(v.local, live);
  }
  fsdp::load_sharded_state_dict(*bag.root, saved);
  bag.step(0);
  CHECK(bag.forward_mismatches == 0);
  check_shards_and_grads(bag, {{0}}, W());

  // Load full tensors with new values: each rank takes its shard.
  std::map<std::string, Tensor> next;
  for (auto& [k, t] : full) {
    Tensor n = Tensor::empty(t.shape(), t.dtype());
    for (std::int64_t e = 0; e < n.numel(); ++e) {
      n.set(e, double(e % 5));
      bag.values[k].push_back(double(e % 5));
    }
    next[k] = n;
  }
  fsdp::load_full_state_dict(*bag.root, next);
  fsdp::fsdp_state(*bag.root)->zero_grad();
  bag.step(0);
  CHECK(bag.forward_mismatches == 0);
  check_shards_and_grads(bag, {{0}}, W());

  // Bad state dicts are refused before anything is written.
  auto missing = saved;
  missing.erase("l1.w");
  CHECK_THROWS_WITH_AS(fsdp::load_sharded_state_dict(*bag.root, missing),
                       doctest::Contains("missing key 'l1.w'"), InvalidArgument);
  auto extra = next;
  extra["l2.w"] = next.at("l1.w");
  CHECK_THROWS_WITH_AS(fsdp::load_full_state_dict(*bag.root, extra),
                       doctest::Contains("unexpected key 'l2.w'"), InvalidArgument);
  auto wrong = next;
  wrong["l0.b"] = Tensor::zeros({6}, DType::f32);
  wrong["l1.w"] = Tensor::zeros({2, 2, 2}, DType::f32);  // would change values if written
  CHECK_THROWS_WITH_AS(fsdp::load_full_state_dict(*bag.root, wrong),
                       doctest::Contains("'l0.b' is a f32 tensor of shape (6,), expected f32 (5,)"),
                       InvalidArgument);
  auto after = fsdp::full_state_dict(*bag.root);
  CHECK(test::host_copy(after.at("l1.w")).at(3) == 3.0);  // nothing was loaded
}

TEST_CASE_TEMPLATE("errors name the module and the parameter", D, FULLSHARD_TEST_DEVICE) {
  auto mesh = world_mesh<D>();
  auto root = Module::make_root();
  Module& m = root->add_module("m");
  m.add_param("w", {4, 3});
  fsdp::fully_shard(m, mesh);
  CHECK_THROWS_WITH_AS(fsdp::fully_shard(m, mesh),
                       doctest::Contains("fully_shard has already been applied to module 'm'"),
                       InvalidArgument);

  // Top-down: the root's group already holds m2's parameter.
  auto top = Module::make_root();
  top->add_module("m2").add_param("b", {3});
  fsdp::fully_shard(*top, mesh);
  CHECK_THROWS_WITH_AS(
      fsdp::fully_shard(top->module("m2"), mesh),
      doctest::Contains("parameter 'm2.b' is already in the communication group of module 'model'"),
      InvalidArgument);

  Module& mixed = root->add_module("mixed");
  mixed.add_param("a", {4});
  mixed.add_param("h", {4}, DType::bf16);
  CHECK_THROWS_WITH_AS(
      fsdp::fully_shard(mixed, mesh),
      doctest::Contains("parameters 'mixed.a' (f32) and 'mixed.h' (bf16) have different dtypes"),
      InvalidArgument);

  if (W() > 1) {
    Module& odd = root->add_module("odd");
    odd.add_param("w", {2, W() + 1});
    FullyShardOptions o;
    o.shard_placement_fn = [](const Parameter&) {
      return std::optional<Placement>(Placement::Shard(1));
    };
    CHECK_THROWS_WITH_AS(fsdp::fully_shard(odd, mesh, o),
                         doctest::Contains("parameter 'odd.w': Shard(1) needs dim 1"),
                         InvalidArgument);
  }
  DeviceMesh three = D::mesh({1, 1, W()}, {"a", "b", "c"});
  CHECK_THROWS_WITH_AS(fsdp::fully_shard(root->add_module("t"), three), doctest::Contains("3 dims"),
                       InvalidArgument);

  // fully_shard on a parent after a submodule already ran forward.
  auto r2 = Module::make_root();
  Module& leaf = r2->add_module("leaf");
  leaf.add_param("w", {4});
  fsdp::fully_shard(leaf, mesh);
  fsdp::forward(leaf);
  CHECK_THROWS_WITH_AS(fsdp::fully_shard(*r2, mesh), doctest::Contains("bottom-up"),
                       InvalidArgument);

  // A bad request is refused where the graph is read, naming the file and the JSON path.
  CHECK_THROWS_WITH_AS(
      graph::parse_graph_json(
          R"({"modules": [{"name": "x", "fully_shard": {"reshard": true}, "params": {"w": {"shape": [2]}}}]})",
          "bad.json"),
      doctest::Contains("bad.json: modules[0].fully_shard.reshard: unknown fully_shard option"),
      ConfigError);
}

TEST_CASE_TEMPLATE("ranks that declare different models are told so before the first collective", D,
                   FULLSHARD_TEST_DEVICE) {
  if (W() < 2) return;  // needs two ranks to disagree
  auto mesh = world_mesh<D>();
  const int rank = test::world_rank();
  auto catch_config = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  {  // the last rank's layer is wider (the 32-vs-64 hidden-size case that crashed in MPI)
    auto root = Module::make_root("model");
    auto& l = root->add_module("l0");
    const std::int64_t h = rank == W() - 1 ? 64 : 32;
    l.add_param("w", {h, 8});
    fsdp::fully_shard(l, mesh);
    fsdp::fully_shard(*root, mesh);
    const std::string msg = catch_config([&] { fsdp::forward(*root); });
    CHECK(msg.find("differs across ranks") != std::string::npos);
    CHECK(msg.find("group l0") != std::string::npos);
    CHECK(msg.find("l0.w (32, 8) f32") != std::string::npos);  // rank 0's version, on every rank
    if (rank == W() - 1) CHECK(msg.find("l0.w (64, 8) f32") != std::string::npos);
  }
  {  // one rank forms an extra group
    auto root = Module::make_root("model");
    auto& a = root->add_module("a");
    a.add_param("w", {4});
    auto& b = root->add_module("b");
    b.add_param("w", {4});
    fsdp::fully_shard(a, mesh);
    if (rank == 0) fsdp::fully_shard(b, mesh);
    fsdp::fully_shard(*root, mesh);
    const std::string msg = catch_config([&] { fsdp::forward(*root); });
    CHECK(msg.find("differs across ranks") != std::string::npos);
    CHECK(msg.find("entries") != std::string::npos);
  }
  {  // the same declarations agree: one step runs
    auto root = Module::make_root("model");
    auto& l = root->add_module("l0");
    l.add_param("w", {6, 2});
    fsdp::fully_shard(l, mesh);
    fsdp::fully_shard(*root, mesh);
    CHECK(catch_config([&] {
            fsdp::forward(*root);
            fsdp::backward(*root);
          }).empty());
  }
}

#if !defined(FULLSHARD_TEST_DEVICE_CUDA)
TEST_CASE("a parameter in device memory on a CPU mesh is an error naming it and both devices") {
  DeviceMesh mesh(test::runtime(), {W()}, {"dp"});
  auto root = Module::make_root();
  Parameter& p = root->add_module("m").add_param("w", {4});
  p.set_data(Tensor::zeros({4}, DType::f32, MemorySpace::device));
  CHECK_THROWS_WITH_AS(fsdp::fully_shard(root->module("m"), mesh),
                       doctest::Contains("parameter 'm.w' is in device memory (cuda) but the mesh"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(fsdp::fully_shard(root->module("m"), mesh),
                       doctest::Contains("is a cpu mesh (host memory)"), InvalidArgument);
}
#endif
