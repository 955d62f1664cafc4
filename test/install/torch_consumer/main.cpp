// Shards a small LibTorch model with the installed fullshard::torch and takes one step.
#include <torch/torch.h>

#include <cstdio>
#include <fullshard/fullshard.hpp>
#include <fullshard/torch.hpp>

namespace fst = fullshard::torch;

struct NetImpl : torch::nn::Module {
  NetImpl()
      : a(register_module("a", torch::nn::Linear(6, 6))),
        b(register_module("b", torch::nn::Linear(6, 1))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return fst::call(b, torch::relu(fst::call(a, x)));
  }
  torch::nn::Linear a, b;
};

int main(int argc, char** argv) {
  fullshard::Runtime rt(argc, argv);
  fullshard::DeviceMesh mesh(rt, {rt.world_size()}, {"dp"});
  torch::manual_seed(0);
  auto net = std::make_shared<NetImpl>();
  fst::ShardedModel sharded(net);
  sharded.fully_shard(net->a, mesh);
  sharded.fully_shard(net->b, mesh);
  sharded.fully_shard(*net, mesh);
  fst::call(net, torch::randn({4, 6})).sum().backward();
  const bool ok = net->a->weight.size(0) == (6 + rt.world_size() - 1) / rt.world_size() &&
                  net->a->weight.grad().sizes() == net->a->weight.sizes();
  if (rt.rank() == 0) std::printf("torch consumer: %s\n", ok ? "ok" : "WRONG SHAPES");
  return ok ? 0 : 1;
}
