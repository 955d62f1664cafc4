// The C++ side of fullshard-bench-fortran: the training session (fullshard/session) with the
// configuration the Fortran program gives the C API, called from Fortran (bind(C)), so that
// the two steps alternate in one run and their ratio is the Fortran module's and C API's
// overhead over the session they adapt.
#include <torch/torch.h>

#include <memory>
#include <string>

#include "fullshard/fullshard.hpp"
#include "fullshard/session/session.hpp"

namespace {

namespace fs = fullshard;

int world() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

struct CppModel {
  CppModel(int hidden, int inputs, int outputs, int blocks)
      : mesh(MPI_COMM_WORLD, {world()}, {"dp"}, 600.0),
        session(mesh,
                fs::session::parse_config(
                    R"({"model": {"type": "residual_mlp", "inputs": )" + std::to_string(inputs) +
                        R"(, "hidden": )" + std::to_string(hidden) + R"(, "outputs": )" +
                        std::to_string(outputs) + R"(, "blocks": )" + std::to_string(blocks) +
                        R"(}, "optimizer": {"type": "adamw", "lr": 0.001}})",
                    "bench")) {}
  fs::DeviceMesh mesh;
  fs::session::Session session;
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
  return model->session.train_step({xt}, {yt});
}

void bench_cpp_free() {
  model.reset();
}

void bench_set_threads(int n) {
  torch::set_num_threads(n);
}
}
