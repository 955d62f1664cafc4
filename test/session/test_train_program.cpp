// fullshard-train is an adapter over the training session (NativeSession): the configuration it
// gave the session (--write-config), trained here through the session's C++ API on the same
// model and data stream (apps::Teacher) and ranks, gives the losses the program printed, within
// 1e-6 step by step, for AdamW and SGD. test/apps/train_program_run.sh ran the program (the
// fixtures).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "fullshard/session/native_session.hpp"
#include "residual_mlp.hpp"
#include "teacher.hpp"
#include "test_support.hpp"

namespace fs = fullshard;
namespace ss = fullshard::session;

TEST_CASE("fullshard-train: its losses are the session's on the same configuration") {
  for (const std::string optimizer : {"adamw", "sgd"}) {
    CAPTURE(optimizer);
    const std::string dir = std::string(FULLSHARD_TRAIN_RUN_DIR) + "-" + optimizer;
    const int world = fs::test::world_size(), rank = fs::test::world_rank();
    fs::DeviceMesh mesh(MPI_COMM_WORLD, {world}, {"shard"}, 60.0);
    ss::Config c = ss::read_config(mesh, dir + "/config.json");
    // What the program configured (not vacuous: the schedule, clipping, decay).
    CHECK(c.model.type == "native");
    CHECK(c.optimizer.type == optimizer);
    CHECK(c.optimizer.weight_decay == doctest::Approx(0.01));
    CHECK(c.grad_clip == doctest::Approx(0.5));
    CHECK(c.lr_schedule.type == "warmup_cosine");
    CHECK(c.lr_schedule.warmup_steps == 2);

    std::vector<double> expected;
    {
      std::ifstream in(dir + "/losses.txt");
      for (double v = 0; in >> v;)
        expected.push_back(v);
    }
    REQUIRE(expected.size() == 6);
    // The flags of train_program_run.sh: the model's shape, the global batch.
    const fs::apps::MlpShape shape{8, 32, 4, 2};
    const std::int64_t batch = 18;
    const std::int64_t base = batch / world, extra = batch % world;
    const int rows = int(base + (rank < extra ? 1 : 0));
    const std::int64_t first = rank * base + std::min<std::int64_t>(rank, extra);
    fs::apps::ResidualMlp net(shape, c.seed);
    const fs::apps::Teacher teacher(shape, c.seed + 1);
    ss::NativeSession s(mesh, net, c, rows);
    std::vector<float> x, t;
    for (std::size_t i = 0; i < expected.size(); ++i) {
      CAPTURE(i);
      teacher.batch(std::int64_t(i) * batch + first, rows, x, t);
      const double loss = s.train_step(x.data(), t.data(), rows, batch);
      CHECK(std::abs(loss - expected[i]) <= 1e-6 * std::abs(expected[i]));
    }
  }
}
