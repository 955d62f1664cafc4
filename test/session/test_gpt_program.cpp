// fullshard-train-gpt is an adapter over the training session: the configuration it gave the
// session (--write-config), trained here through the session's C++ API on the same batches
// (--batches) and ranks, gives the losses the program printed, within 1e-6 step by step.
// test/torch/gpt_program_run.sh ran the program (the fixture).
#include "test/torch/torch_doctest.hpp"  // first: LibTorch, then doctest's CHECK macros

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "fullshard/session/session.hpp"
#include "test_support.hpp"

namespace fs = fullshard;
namespace ss = fullshard::session;

TEST_CASE("fullshard-train-gpt: its losses are the session's on the same configuration") {
  const std::string dir = FULLSHARD_GPT_RUN_DIR;
  const int world = fs::test::world_size(), rank = fs::test::world_rank();
  fs::DeviceMesh mesh(MPI_COMM_WORLD, {world}, {"dp"}, 60.0);
  ss::Session s(mesh, ss::read_config(mesh, dir + "/config.json"));
  const ss::Config& c = s.config();
  // What the program configured (not vacuous: the GPT-2 optimizer, dropout, clipping).
  CHECK(c.model.type == "gpt");
  CHECK(c.model.dropout == doctest::Approx(0.1));
  CHECK(c.optimizer.beta2 == doctest::Approx(0.95));
  CHECK(c.optimizer.no_weight_decay.size() == 5);
  CHECK(c.grad_clip == doctest::Approx(0.5));
  CHECK(c.lr_schedule.type == "warmup_cosine");

  std::vector<double> expected;
  {
    std::ifstream in(dir + "/losses.txt");
    for (double v = 0; in >> v;)
      expected.push_back(v);
  }
  REQUIRE(expected.size() == 6);
  const std::int64_t len = c.model.context + 1, batch = 8;
  const auto steps = std::int64_t(expected.size());
  torch::Tensor batches = torch::empty({steps, batch, len}, torch::kLong);
  {
    std::ifstream in(dir + "/batches.bin", std::ios::binary);
    in.read(reinterpret_cast<char*>(batches.data_ptr<std::int64_t>()), batches.numel() * 8);
    REQUIRE(in.gcount() == batches.numel() * 8);
  }
  const std::int64_t local = batch / world;
  for (std::int64_t k = 0; k < steps; ++k) {
    CAPTURE(k);
    double loss = s.train_step({batches[k].narrow(0, rank * local, local)}, {});
    MPI_Allreduce(MPI_IN_PLACE, &loss, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    loss /= world;
    const double want = expected[std::size_t(k)];
    CHECK(std::abs(loss - want) <= 1e-6 * std::abs(want));
  }
}
