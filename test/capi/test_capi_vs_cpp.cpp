// The C API against the C++ front end for the same configuration: the same model, sharding
// and optimizer written in C++ (fullshard::torch, fullshard's AdamW on the graph parameters,
// as the session steps them) gives the same losses step by step (within 1e-6), the same
// predictions and the same parameters (the C API's safetensors export loaded into a C++
// model); LibTorch's AdamW on ShardedModel::parameters() (f32 arithmetic, where fullshard's
// computes each element in f64) stays within 1e-5.
#include "test/torch/torch_doctest.hpp"  // first: LibTorch, then doctest's CHECK macros

#include <torch/optim/adamw.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "fullshard/checkpoint/safetensors.hpp"
#include "fullshard/fullshard.h"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "fullshard/torch/residual_mlp.hpp"
#include "fullshard/torch/sharded_model.hpp"
#include "test_support.hpp"

namespace fs = fullshard;
namespace fst = fullshard::torch;

namespace {

constexpr int kIn = 6, kOut = 2, kBatch = 8, kSteps = 10;

const char* kConfig =
    R"({"model": {"type": "residual_mlp", "inputs": 6, "hidden": 16, "outputs": 2, "blocks": 3},
        "optimizer": {"type": "adamw", "lr": 0.01, "beta1": 0.9, "beta2": 0.99,
                      "eps": 1e-8, "weight_decay": 0.05},
        "seed": 5})";

// Batch of step s on rank r, the same for both.
std::pair<torch::Tensor, torch::Tensor> batch(int s, int r) {
  torch::Tensor x = torch::sin(
      torch::arange(kBatch * kIn, torch::kFloat).view({kBatch, kIn}) * 0.37 + s * 1.7 + r * 0.3);
  torch::Tensor y = torch::stack({torch::tanh(x.sum(1)), x.select(1, 0) * x.select(1, 1)}, 1);
  return {x.contiguous(), y.contiguous()};
}

fullshard_array array_of(const torch::Tensor& t) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  return fullshard_array_contiguous(t.data_ptr(), FULLSHARD_FLOAT32, int(t.dim()), shape.data());
}

void require_ok(fullshard_status s) {
  if (s != FULLSHARD_OK) std::fprintf(stderr, "%s\n", fullshard_last_error());
  INFO(fullshard_last_error());
  REQUIRE(s == FULLSHARD_OK);
}

}  // namespace

TEST_CASE("the C API equals the C++ front end: losses, predictions, parameters") {
  const int rank = fs::test::world_rank(), world = fs::test::world_size();
  require_ok(fullshard_init(MPI_COMM_WORLD));
  fullshard_mesh cmesh{0};
  const int shape[1] = {world};
  require_ok(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", &cmesh));
  fullshard_model cmodel{0};
  require_ok(fullshard_model_create_from_json(cmesh, kConfig, "vs_cpp.json", &cmodel));

  // The same in C++.
  fs::DeviceMesh mesh(fs::test::runtime(), {world}, {"dp"});
  // The C API builds on the meta device and fills each rank's rows from the seed.
  auto make = [&](fst::ResidualMlp& net) {
    net = fst::ResidualMlp(fst::ResidualMlpConfig{kIn, 16, kOut, 3, /*deferred=*/true});
    auto sharded = std::make_unique<fst::ShardedModel>(net);
    for (auto& b : net->block_list)
      sharded->fully_shard(*b, mesh);
    sharded->fully_shard(net, mesh);
    sharded->initialize(net->initializer(5));
    return sharded;
  };
  fst::ResidualMlp net(nullptr), torch_net(nullptr);
  const auto sharded = make(net), torch_sharded = make(torch_net);
  fs::optim::AdamW opt(sharded->graph().parameters(), 0.01, 0.9, 0.99, 1e-8, 0.05);
  torch::optim::AdamW torch_opt(
      torch_sharded->parameters(),
      torch::optim::AdamWOptions(0.01).betas({0.9, 0.99}).eps(1e-8).weight_decay(0.05));

  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s, rank);
    fullshard_array in = array_of(x), tg = array_of(y);
    double closs = 0;
    require_ok(fullshard_train_step(cmodel, 1, &in, 1, &tg, &closs));
    opt.zero_grad();
    torch::Tensor loss = torch::mse_loss(fst::call(net, x), y);
    loss.backward();
    opt.step();
    torch_opt.zero_grad();
    torch::Tensor torch_loss = torch::mse_loss(fst::call(torch_net, x), y);
    torch_loss.backward();
    torch_opt.step();
    CAPTURE(s);
    CHECK(closs == doctest::Approx(loss.item<double>()).epsilon(1e-6));
    CHECK(closs == doctest::Approx(torch_loss.item<double>()).epsilon(1e-5));
  }
  {  // LibTorch's AdamW: the same rule in f32 arithmetic. Each update moves an element by about
     // lr, so the rounding is relative to the updates' sum where a tensor's values are smaller.
    const auto a = net->named_parameters(), b = torch_net->named_parameters();
    for (std::size_t i = 0; i < a.size(); ++i) {
      CAPTURE(a[i].key());
      if (a[i].value().numel() == 0) continue;
      const double scale = std::max(0.01 * kSteps, a[i].value().abs().max().item<double>());
      CHECK((a[i].value() - b[i].value()).abs().max().item<double>() <= 1e-5 * scale);
    }
  }

  auto [x, y] = batch(100, rank);
  torch::Tensor cout = torch::empty({kBatch, kOut});
  fullshard_array in = array_of(x), out = array_of(cout);
  require_ok(fullshard_predict(cmodel, 1, &in, 1, &out));
  torch::Tensor want;
  {
    torch::NoGradGuard no_grad;
    want = fst::call(net, x);
  }
  CHECK((cout - want).abs().max().item<double>() <= 1e-6 * want.abs().max().item<double>());

  // The parameters: the C API's export, loaded into a third (sharded) C++ model.
  const std::string file = "test_capi_vs_cpp_np" + std::to_string(world) + ".safetensors";
  require_ok(fullshard_export_safetensors(cmodel, file.c_str()));
  fst::ResidualMlp loaded(fst::ResidualMlpConfig{kIn, 16, kOut, 3});
  fst::ShardedModel loaded_sharded(loaded);
  for (auto& b : loaded->block_list)
    loaded_sharded.fully_shard(*b, mesh);
  loaded_sharded.fully_shard(loaded, mesh);
  fs::checkpoint::load_safetensors(file, loaded_sharded.graph());
  const auto a = net->named_parameters(), b = loaded->named_parameters();
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CAPTURE(a[i].key());
    REQUIRE(a[i].value().sizes() == b[i].value().sizes());
    if (a[i].value().numel() == 0) continue;  // an empty shard (torch.chunk) on this rank
    const double scale = std::max(1e-30, a[i].value().abs().max().item<double>());
    CHECK((a[i].value() - b[i].value()).abs().max().item<double>() <= 1e-6 * scale);
  }

  require_ok(fullshard_model_free(&cmodel));
  require_ok(fullshard_mesh_free(&cmesh));
  require_ok(fullshard_finalize());
}
