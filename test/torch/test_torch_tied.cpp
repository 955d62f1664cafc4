// A weight registered in two modules (an output head tied to the token embedding): LibTorch's
// parameters() lists it twice, ShardedModel::parameters() once, and an optimizer given the
// latter steps it once, as unsharded LibTorch training with each tensor once does.
#include "torch_doctest.hpp"  // first: LibTorch, then doctest's CHECK macros

#include <vector>

#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/torch/sharded_model.hpp"
#include "test_support.hpp"

namespace fs = fullshard;
namespace fst = fullshard::torch;

namespace {

constexpr int kVocab = 8, kDim = 4, kBatch = 3, kTime = 5;

struct HeadImpl : torch::nn::Module {
  explicit HeadImpl(const torch::Tensor& tied) { weight = register_parameter("weight", tied); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, weight.t()); }
  torch::Tensor weight;
};
TORCH_MODULE(Head);

struct TiedImpl : torch::nn::Module {
  TiedImpl()
      : tok(register_module("tok", torch::nn::Embedding(kVocab, kDim))),
        mix(register_module("mix", torch::nn::Linear(kDim, kDim))),
        head(register_module("head", Head(tok->weight))) {}
  torch::Tensor forward(const torch::Tensor& ids) { return head(torch::tanh(mix(tok(ids)))); }
  torch::nn::Embedding tok;
  torch::nn::Linear mix;
  Head head;
};
TORCH_MODULE(Tied);

torch::Tensor ids_of(int rank) {
  return torch::arange(kBatch * kTime, torch::kLong)
      .mul(rank + 3)
      .remainder(kVocab)
      .view({kBatch, kTime});
}

torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& ids) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}),
                                              ids.roll(1, 1).reshape({-1}));
}

}  // namespace

TEST_CASE("torch: a tied weight reaches the optimizer once and is stepped once") {
  const int rank = fs::test::world_rank(), world = fs::test::world_size();
  fs::DeviceMesh mesh(MPI_COMM_WORLD, {world}, {"dp"}, 60.0);
  torch::manual_seed(11);
  Tied reference;
  torch::manual_seed(11);
  Tied net;
  // The reference: unsharded, every rank's batch at once, each tensor once.
  std::vector<torch::Tensor> all;
  for (int r = 0; r < world; ++r)
    all.push_back(ids_of(r));
  const torch::Tensor ids = torch::cat(all);
  std::vector<torch::Tensor> unique = {reference->tok->weight, reference->mix->weight,
                                       reference->mix->bias};
  torch::optim::SGD ref_opt(unique, torch::optim::SGDOptions(0.5));
  ref_opt.zero_grad();
  loss_of(reference(ids), ids).backward();
  ref_opt.step();

  fst::ShardedModel sharded(net);
  sharded.fully_shard(net, mesh);        // the tied modules in the root's group
  CHECK(net->parameters().size() == 4);  // LibTorch: the tied weight once per module
  const std::vector<torch::Tensor> params = sharded.parameters();
  REQUIRE(params.size() == 3);
  CHECK(params[0].is_same(net->tok->weight));
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.5));
  opt.zero_grad();
  loss_of(fst::call(net, ids_of(rank)), ids_of(rank)).backward();
  opt.step();

  const torch::Tensor want = reference->tok->weight.detach().chunk(world)[std::size_t(rank)];
  const torch::Tensor got = net->tok->weight.detach();
  REQUIRE(got.sizes() == want.sizes());
  const double diff = (got - want).abs().max().item<double>() / want.abs().max().item<double>();
  CAPTURE(diff);
  CHECK(diff <= 1e-5);
}
