// The residual MLP twice: written by hand over CBLAS (apps/common, fullshard-train's model)
// and with LibTorch (fullshard::torch::ResidualMlp), both fully_shard'ed, started from one
// safetensors file, fed the same batches and stepped by the same optimizer (fullshard's
// AdamW on each model's graph): the same losses step by step.
#include "torch_doctest.hpp"  // first: LibTorch, then doctest's CHECK macros

#include <cmath>
#include <string>

#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/checkpoint/safetensors.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "fullshard/schedule/plan.hpp"
#include "fullshard/torch.hpp"
#include "residual_mlp.hpp"
#include "test_support.hpp"

namespace fs = fullshard;
namespace fst = fullshard::torch;

TEST_CASE("torch: the LibTorch residual MLP and the hand-written one give the same losses") {
  const int world = fs::test::world_size(), rank = fs::test::world_rank();
  fs::DeviceMesh mesh(fs::test::runtime(), {world}, {"dp"});
  const fs::apps::MlpShape shape{7, 10, 5, 2};  // dims not divisible by 3 or 4 ranks
  constexpr int64_t kRows = 12;                 // the global batch: 12 / W rows per rank
  const int64_t rows = kRows / world;

  // The hand-written model's initial weights as one safetensors file.
  fs::test::SharedTempDir dir("fullshard-torch-mlp");
  fs::apps::ResidualMlp hand(shape, 3);
  hand.shard(mesh, fs::schedule::PlanOptions{});
  const std::string init = dir.path + "/init.safetensors";
  {
    fs::checkpoint::SaveOptions so;
    so.kind = fs::checkpoint::Kind::full;
    const std::string step_dir =
        fs::checkpoint::save(dir.path + "/ckpt", hand.root(), nullptr, 0, {}, {}, so);
    if (rank == 0) fs::checkpoint::checkpoint_to_safetensors(step_dir, init);
    MPI_Barrier(MPI_COMM_WORLD);
  }

  // The LibTorch model from that file; the hand-written model's reduction: gradients of
  // sum / (global rows * outputs), summed over the ranks (divide factor 1).
  torch::manual_seed(5);
  fst::ResidualMlp net(
      fst::ResidualMlpConfig{shape.inputs, shape.hidden, shape.outputs, shape.blocks});
  fst::ShardedModel sharded(net);
  for (auto& b : net->block_list)
    sharded.fully_shard(*b, mesh).set_gradient_divide_factor(1.0);
  sharded.fully_shard(net, mesh).set_gradient_divide_factor(1.0);
  fs::checkpoint::load_safetensors(init, sharded.graph());

  fs::optim::AdamW opt_hand(hand.root().parameters(), 1e-2);
  fs::optim::AdamW opt_torch(sharded.graph().parameters(), 1e-2);
  const double scale = 1.0 / double(kRows * shape.outputs);
  double worst = 0, first = 0, last = 0;
  for (int step = 0; step < 10; ++step) {
    torch::manual_seed(300 + step);
    const torch::Tensor x = torch::randn({kRows, shape.inputs}).narrow(0, rank * rows, rows);
    const torch::Tensor t = torch::randn({kRows, shape.outputs}).narrow(0, rank * rows, rows);
    const torch::Tensor xc = x.contiguous(), tc = t.contiguous();

    opt_hand.zero_grad();
    const double sse = hand.forward_backward(xc.data_ptr<float>(), tc.data_ptr<float>(),
                                             static_cast<int>(rows), kRows);
    opt_hand.step();

    opt_torch.zero_grad();
    const torch::Tensor loss = (fst::call(net, xc) - tc).pow(2).sum() * scale;
    loss.backward();
    opt_torch.step();

    double local[2] = {sse * scale, loss.item<double>()}, sum[2] = {0, 0};
    MPI_Allreduce(local, sum, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    CAPTURE(step);
    const double rel = std::abs(sum[1] - sum[0]) / std::abs(sum[0]);
    worst = std::max(worst, rel);
    CHECK(rel <= 1e-5);
    (step == 0 ? first : last) = sum[0];
  }
  MESSAGE("worst relative loss difference over 10 steps: " << worst);
  // Training moved the weights: the losses compared are not of one untrained model.
  CHECK(last < first);
}
