// ShardedModel::measure_compute: the sharded modules' own compute times (what the planner's
// module costs stand for), recorded per training forward and backward: every sharded module
// has a forward and a backward time, their sum fits in the measured steps' wall time, and
// inference or steps after measuring stopped add nothing.
#include "torch_doctest.hpp"  // first: LibTorch, then doctest's CHECK macros

#include <chrono>
#include <set>
#include <string>

#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/torch/residual_mlp.hpp"
#include "fullshard/torch/sharded_model.hpp"
#include "test_support.hpp"

namespace fs = fullshard;
namespace fst = fullshard::torch;

TEST_CASE("torch: measure_compute records each sharded module's own forward and backward") {
  const int world = fs::test::world_size();
  fs::DeviceMesh mesh(MPI_COMM_WORLD, {world}, {"dp"}, 60.0);
  fst::ResidualMlp net(fst::ResidualMlpConfig{8, 64, 4, 3});
  fst::ShardedModel sharded(net);
  for (auto& b : net->block_list)
    sharded.fully_shard(*b, mesh);
  sharded.fully_shard(net, mesh);
  CHECK(sharded.measured_compute().iterations == 0);
  auto step = [&] {
    const torch::Tensor x = torch::randn({32, 8}), y = torch::randn({32, 4});
    torch::mse_loss(fst::call(net, x), y).backward();
  };
  step();  // the first step faults the buffers in
  sharded.measure_compute(true);
  double wall_ms = 0;
  for (int s = 0; s < 3; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    wall_ms +=
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  {  // inference is not a training iteration
    torch::NoGradGuard no_grad;
    fst::call(net, torch::randn({4, 8}));
  }
  const fst::MeasuredCompute measured = sharded.measured_compute();
  CHECK(measured.iterations == 3);
  const auto& times = measured.modules;
  std::set<std::string> names;
  double sum = 0;
  for (const auto& [fqn, t] : times) {
    CAPTURE(fqn);
    names.insert(fqn);
    CHECK(t.forward_ms > 0);
    CHECK(t.backward_ms > 0);
    sum += t.forward_ms + t.backward_ms;
  }
  CHECK(names == std::set<std::string>{"", "blocks.0", "blocks.1", "blocks.2"});
  CHECK(measured.hooks_ms > 0);
  // Each module's own time and the hooks' are disjoint parts of an iteration: their means add
  // up to at most the mean step.
  CHECK(3 * (sum + measured.hooks_ms) <= wall_ms);
  sharded.measure_compute(false);
  step();
  CHECK(sharded.measured_compute().iterations == 3);
  sharded.measure_compute(true);  // starts afresh
  CHECK(sharded.measured_compute().iterations == 0);
}
