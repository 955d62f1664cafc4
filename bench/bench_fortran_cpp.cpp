// The C++ side of fullshard-bench-fortran: the same residual MLP, sharding and optimizer as
// the configuration the Fortran program gives the C API, written with the C++ front end and
// called from Fortran (bind(C)), so that the two steps alternate in one run.
#include <torch/torch.h>

#include <memory>

#include "fullshard/fullshard.hpp"
#include "fullshard/torch.hpp"

namespace {

namespace fs = fullshard;
namespace fst = fullshard::torch;

struct CppModel {
  CppModel(int hidden, int inputs, int outputs, int blocks)
      : mesh(MPI_COMM_WORLD, {world()}, {"dp"}, 600.0),
        net((torch::manual_seed(0), fst::ResidualMlpConfig{inputs, hidden, outputs, blocks})),
        sharded(net),
        opt(net->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.0)) {
    for (auto& b : net->block_list)
      sharded.fully_shard(*b, mesh);
    sharded.fully_shard(net, mesh);
  }
  static int world() {
    int n = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
  }
  fs::DeviceMesh mesh;
  fst::ResidualMlp net;
  fst::ShardedModel sharded;
  torch::optim::AdamW opt;
};

std::unique_ptr<CppModel> model;

}  // namespace

extern "C" {

void bench_cpp_init(int hidden, int inputs, int outputs, int blocks) {
  model = std::make_unique<CppModel>(hidden, inputs, outputs, blocks);
}

// One step on x (rows, inputs) and y (rows, outputs), C order (Fortran's x(inputs, rows)).
double bench_cpp_step(const float* x, const float* y, int rows, int inputs, int outputs) {
  const torch::Tensor xt = torch::from_blob(const_cast<float*>(x), {rows, inputs});
  const torch::Tensor yt = torch::from_blob(const_cast<float*>(y), {rows, outputs});
  model->opt.zero_grad();
  torch::Tensor loss = torch::mse_loss(fst::call(model->net, xt), yt);
  loss.backward();
  model->opt.step();
  return loss.item<double>();
}

void bench_cpp_free() {
  model.reset();
}

void bench_set_threads(int n) {
  torch::set_num_threads(n);
}
}
