// One configuration through the three front ends on the same ranks: the C++ session here,
// the C API (test/capi/test_capi_session.c, "save" mode) and the Fortran module
// (test/fortran/test_fortran_session.f90, "save" mode), whose losses those runs wrote to
// files. The three must agree within 1e-6 step by step. The C and Fortran runs step the
// optimizer inside backward ("in_backward": true), the session here after backward: the
// optimizer inside backward reaches C and Fortran, with the same numbers.
#include "test/torch/torch_doctest.hpp"  // first: LibTorch, then doctest's CHECK macros

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "fullshard/session/session.hpp"
#include "test_support.hpp"

namespace fs = fullshard;
namespace ss = fullshard::session;

namespace {

constexpr int kIn = 6, kOut = 2, kGlobal = 12, kSteps = 6;

// The global loss of step s, this rank training on its rows of the 12-row global batch.
double step(ss::Session& s, int k) {
  const int world = fs::test::world_size(), rows = kGlobal / world;
  const int first = fs::test::world_rank() * rows;
  torch::Tensor x = torch::empty({rows, kIn}), y = torch::empty({rows, kOut});
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < kIn; ++j)
      x[i][j] = float(std::sin(0.37 * double((first + i) * kIn + j) + 1.7 * k));
    for (int o = 0; o < kOut; ++o)
      y[i][o] = float(std::cos(0.11 * double((first + i) * kOut + o) + 0.9 * k));
  }
  double loss = s.train_step({x}, {y}) / world;
  MPI_Allreduce(MPI_IN_PLACE, &loss, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return loss;
}

std::vector<double> read_losses(const std::string& path) {
  std::ifstream in(path);
  std::vector<double> out;
  double v = 0;
  while (in >> v)
    out.push_back(v);
  return out;
}

}  // namespace

TEST_CASE("front ends: the C++ session, the C API and the Fortran module give the same losses") {
  const int world = fs::test::world_size();
  REQUIRE(kGlobal % world == 0);
  fs::DeviceMesh mesh(MPI_COMM_WORLD, {world}, {"dp"}, 60.0);
  ss::Session s(mesh, ss::parse_config(
                          R"({"model": {"type": "residual_mlp", "inputs": 6, "hidden": 16,
                                        "outputs": 2, "blocks": 3},
                              "optimizer": {"type": "adamw", "lr": 0.01}, "seed": 3})",
                          "front-ends.json"));
  std::vector<double> cpp;
  for (int k = 0; k < kSteps; ++k)
    cpp.push_back(step(s, k));
  for (const std::string& path :
       {std::string(FULLSHARD_C_LOSSES), std::string(FULLSHARD_F_LOSSES)}) {
    CAPTURE(path);
    const std::vector<double> other = read_losses(path);
    REQUIRE(other.size() == cpp.size());
    for (int k = 0; k < kSteps; ++k) {
      CAPTURE(k);
      CHECK(std::abs(other[std::size_t(k)] - cpp[std::size_t(k)]) <=
            1e-6 * std::abs(cpp[std::size_t(k)]));
    }
  }
}
