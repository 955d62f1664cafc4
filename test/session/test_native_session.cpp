// The training session of a native model (fullshard/session/native_session.hpp) over the
// residual MLP fullshard-train and heat-surrogate train: its steps against the same model
// stepped by hand (optimizer, schedule and clipping called directly), the optimizer inside
// backward against the step after it, resume against the straight run, and the refusals
// (non-finite inputs, a wrong global batch, another model's checkpoint, configurations a
// native model cannot take).
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "error_check.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "fullshard/session/native_session.hpp"
#include "residual_mlp.hpp"
#include "test_support.hpp"

namespace fs = fullshard;
namespace ss = fullshard::session;

namespace {

constexpr int kGlobalRows = 11;  // uneven over 2-4 ranks
const fs::apps::MlpShape kShape{6, 16, 3, 2};

fs::DeviceMesh world_mesh() {
  return fs::DeviceMesh(MPI_COMM_WORLD, {fs::test::world_size()}, {"dp"}, 60.0);
}

ss::Config native_config(const std::string& optimizer = "adamw", double clip = 0.5) {
  ss::Config c;
  c.source = "native-session-test";
  c.model.type = "native";
  c.optimizer.type = optimizer;
  c.optimizer.lr = 0.01;
  c.optimizer.momentum = optimizer == "sgd" ? 0.9 : 0.0;
  c.optimizer.weight_decay = 0.01;
  c.lr_schedule.type = "warmup_cosine";
  c.lr_schedule.warmup_steps = 2;
  c.lr_schedule.total_steps = 20;
  c.lr_schedule.min_lr = 0.001;
  c.grad_clip = clip;
  return c;
}

// This rank's rows of step s's global batch (the same values at any rank count).
struct Batch {
  std::vector<float> x, t;
  std::int64_t rows = 0;
};
Batch batch_of(int s) {
  const int W = fs::test::world_size(), r = fs::test::world_rank();
  const int base = kGlobalRows / W, extra = kGlobalRows % W;
  Batch b;
  b.rows = base + (r < extra ? 1 : 0);
  const std::int64_t first = std::int64_t(r) * base + std::min(r, extra);
  for (std::int64_t i = 0; i < b.rows; ++i) {
    for (int j = 0; j < kShape.inputs; ++j)
      b.x.push_back(float(std::sin(0.37 * double((first + i) * kShape.inputs + j) + 1.7 * s)));
    for (int k = 0; k < kShape.outputs; ++k)
      b.t.push_back(float(std::cos(0.11 * double((first + i) * kShape.outputs + k) + 0.9 * s)));
  }
  return b;
}

double rel(double a, double b) {
  return std::abs(a - b) / std::max(std::abs(b), 1e-30);
}

// The same training written by hand: the model sharded every block and the root, AdamW or SGD,
// the warm-up cosine schedule and global-norm clipping called directly.
std::vector<double> by_hand(const ss::Config& c, int steps) {
  fs::DeviceMesh mesh = world_mesh();
  fs::apps::ResidualMlp net(kShape, c.seed);
  net.shard(mesh, fs::schedule::PlanOptions{});
  std::unique_ptr<fs::optim::Optimizer> opt;
  double* lr = nullptr;
  if (c.optimizer.type == "adamw") {
    auto a = std::make_unique<fs::optim::AdamW>(net.root().parameters(), c.optimizer.lr, 0.9, 0.999,
                                                1e-8, c.optimizer.weight_decay);
    lr = &a->lr;
    opt = std::move(a);
  } else {
    auto a = std::make_unique<fs::optim::SGD>(net.root().parameters(), c.optimizer.lr,
                                              c.optimizer.momentum, c.optimizer.weight_decay);
    lr = &a->lr;
    opt = std::move(a);
  }
  fs::optim::WarmupCosine schedule(c.optimizer.lr, c.lr_schedule.warmup_steps,
                                   c.lr_schedule.total_steps, c.lr_schedule.min_lr);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    const Batch b = batch_of(s);
    *lr = schedule.lr(s);
    opt->zero_grad();
    const double sse = net.forward_backward(b.x.data(), b.t.data(), b.rows, kGlobalRows);
    if (c.grad_clip > 0) fs::optim::clip_grad_norm(opt->params(), c.grad_clip, mesh);
    opt->step();
    losses.push_back(fs::apps::sum_over_mesh(sse, mesh) / (double(kGlobalRows) * kShape.outputs));
  }
  return losses;
}

// The straight run's loss of step `steps` (counted from 1) by hand.
double by_session_reference(const ss::Config& c, int steps) {
  return by_hand(c, steps).back();
}

std::vector<double> by_session(ss::NativeSession& s, int first, int last) {
  std::vector<double> losses;
  for (int i = first; i < last; ++i) {
    const Batch b = batch_of(i);
    losses.push_back(s.train_step(b.x.data(), b.t.data(), b.rows, kGlobalRows));
  }
  return losses;
}

}  // namespace

TEST_CASE("native session: the steps equal the same training written by hand") {
  for (const std::string optimizer : {"adamw", "sgd"}) {
    CAPTURE(optimizer);
    const ss::Config c = native_config(optimizer);
    const std::vector<double> ref = by_hand(c, 6);
    fs::DeviceMesh mesh = world_mesh();
    fs::apps::ResidualMlp net(kShape, c.seed);
    ss::NativeSession s(mesh, net, c, kGlobalRows);
    CHECK(s.num_params() == net.num_params());
    CHECK(s.optimizer_tensors() == net.root().parameters().size());
    CHECK(s.plan().groups == kShape.blocks + 1);
    CHECK(s.plan().process_peak_bytes > 0);
    const std::vector<double> got = by_session(s, 0, 6);
    for (std::size_t i = 0; i < ref.size(); ++i) {
      CAPTURE(i);
      CHECK(std::isfinite(got[i]));
      CHECK(rel(got[i], ref[i]) <= 1e-6);
    }
    CHECK(s.step() == 6);
    // evaluate: the mean squared error of the predictions, every rank's rows.
    const Batch b = batch_of(9);
    std::vector<float> y(b.t.size());
    s.predict(b.x.data(), b.rows, y.data());
    double sums[2] = {0, double(b.t.size())};
    for (std::size_t i = 0; i < y.size(); ++i)
      sums[0] += (double(y[i]) - b.t[i]) * (double(y[i]) - b.t[i]);
    MPI_Allreduce(MPI_IN_PLACE, sums, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    CHECK(rel(s.evaluate(b.x.data(), b.t.data(), b.rows), sums[0] / sums[1]) <= 1e-12);
  }
}

TEST_CASE("native session: the optimizer inside backward equals the step after it") {
  for (const std::string optimizer : {"adamw", "sgd"}) {
    CAPTURE(optimizer);
    ss::Config c = native_config(optimizer, 0.0);
    const std::vector<double> ref = by_hand(c, 5);
    c.optimizer.in_backward = true;
    fs::DeviceMesh mesh = world_mesh();
    fs::apps::ResidualMlp net(kShape, c.seed);
    ss::NativeSession s(mesh, net, c, kGlobalRows);
    const std::vector<double> got = by_session(s, 0, 5);
    for (std::size_t i = 0; i < ref.size(); ++i) {
      CAPTURE(i);
      CHECK(rel(got[i], ref[i]) <= 1e-6);
    }
    // No sharded gradient is held: the updates used them inside backward.
    for (fs::graph::Parameter* p : net.root().parameters())
      CHECK_FALSE(p->grad().defined());
  }
}

TEST_CASE("native session: resume equals the straight run; another model's checkpoint refused") {
  fs::test::SharedTempDir tmp("fullshard-native");
  const std::string dir = tmp.path + "/ck";
  ss::Config c = native_config();
  std::vector<double> straight;
  {
    fs::DeviceMesh mesh = world_mesh();
    fs::apps::ResidualMlp net(kShape, c.seed);
    ss::NativeSession s(mesh, net, c, kGlobalRows);
    straight = by_session(s, 0, 3);
    s.save_async(dir);
    CHECK(s.save_in_flight());
    const std::vector<double> more = by_session(s, 3, 6);
    straight.insert(straight.end(), more.begin(), more.end());
    s.wait_save();
  }
  {
    ss::Config r = c;
    r.checkpoint.dir = dir;
    r.checkpoint.resume = true;
    fs::DeviceMesh mesh = world_mesh();
    fs::apps::ResidualMlp net(kShape, c.seed + 7);  // other initial values: the checkpoint's win
    ss::NativeSession s(mesh, net, r, kGlobalRows);
    CHECK(s.step() == 3);
    const std::vector<double> resumed = by_session(s, 3, 6);
    for (std::size_t i = 0; i < resumed.size(); ++i) {
      CAPTURE(i);
      CHECK(rel(resumed[i], straight[3 + i]) <= 1e-6);
    }
  }
  {
    fs::apps::MlpShape wider = kShape;
    wider.hidden = 24;
    fs::DeviceMesh mesh = world_mesh();
    fs::apps::ResidualMlp net(wider, c.seed);
    ss::NativeSession s(mesh, net, c, kGlobalRows);
    const std::string e = fs::test::error_of<fs::InvalidArgument>([&] { s.load(dir); });
    CHECK(e.find("was saved by another model: model.hidden = 16 there, but this session's "
                 "configuration has model.hidden = 24") != std::string::npos);
  }
}

TEST_CASE("native session: a non-finite input skips the step or stops, naming the rank") {
  const int last = fs::test::world_size() - 1;
  for (const std::string policy : {"skip", "stop"}) {
    CAPTURE(policy);
    ss::Config c = native_config();
    c.non_finite.policy = policy;
    fs::DeviceMesh mesh = world_mesh();
    fs::apps::ResidualMlp net(kShape, c.seed);
    ss::NativeSession s(mesh, net, c, kGlobalRows);
    by_session(s, 0, 1);
    Batch b = batch_of(1);
    if (fs::test::world_rank() == last) b.x[1] = std::numeric_limits<float>::quiet_NaN();
    auto step = [&] { return s.train_step(b.x.data(), b.t.data(), b.rows, kGlobalRows); };
    if (policy == "skip") {
      CHECK(std::isnan(step()));
      CHECK(s.skipped_steps() == 1);
      CHECK(s.step() == 1);
    } else {
      const std::string e = fs::test::error_of<fs::InvalidArgument>([&] { step(); });
      CHECK(e.find("rank " + std::to_string(last) + ": the input holds nan at [0, 1]") !=
            std::string::npos);
    }
  }
}

TEST_CASE("native session: a wrong global batch and configurations it cannot take") {
  fs::DeviceMesh mesh = world_mesh();
  {
    fs::apps::ResidualMlp net(kShape, 0);
    ss::NativeSession s(mesh, net, native_config(), kGlobalRows);
    const Batch b = batch_of(0);
    const std::string e = fs::test::error_of<fs::InvalidArgument>(
        [&] { s.train_step(b.x.data(), b.t.data(), b.rows, kGlobalRows + 1); });
    CHECK(
        e.find("the ranks passed 11 rows together, but global_rows is 12 (nothing was applied)") !=
        std::string::npos);
    CHECK(s.step() == 0);
  }
  {
    fs::apps::ResidualMlp net(kShape, 0);
    ss::Config c = native_config();
    c.model.type = "residual_mlp";
    c.model.inputs = 6, c.model.outputs = 3, c.model.hidden = {16}, c.model.blocks = 2;
    const std::string e =
        fs::test::error_of<fs::ConfigError>([&] { ss::NativeSession s(mesh, net, c); });
    CAPTURE(e);
    CHECK(
        e.find("its configuration says \"model\": {\"type\": \"native\"}, not \"residual_mlp\"") !=
        std::string::npos);
  }
  {
    fs::apps::ResidualMlp net(kShape, 0);
    ss::Config c = native_config();
    c.accumulation = 2;
    const std::string e =
        fs::test::error_of<fs::ConfigError>([&] { ss::NativeSession s(mesh, net, c); });
    CHECK(e.find("accumulation: 2: a native model takes one batch per step") != std::string::npos);
  }
  {
    // The root policy: one group.
    fs::apps::ResidualMlp net(kShape, 0);
    ss::Config c = native_config();
    c.sharding.policy = "root";
    ss::NativeSession s(mesh, net, c, kGlobalRows);
    CHECK(s.plan().groups == 1);
  }
}

TEST_CASE("native session: checkpoint kind, resume_from, the program's metadata, weights only") {
  fs::test::SharedTempDir tmp("fullshard-native-ck");
  const std::string dir = tmp.path + "/ck";
  ss::Config c = native_config();
  c.checkpoint.dir = dir;
  c.checkpoint.kind = "full";
  c.checkpoint.keep_last = 1;
  std::vector<double> straight;
  std::vector<ss::SaveMetrics> saves;
  {
    fs::DeviceMesh mesh = world_mesh();
    fs::apps::ResidualMlp net(kShape, c.seed);
    ss::NativeSession s(mesh, net, c, kGlobalRows);
    s.set_progress({{}, [&](const ss::SaveMetrics& m) { saves.push_back(m); }});
    s.set_checkpoint_metadata(
        nlohmann::json{{"data", {{"batch", kGlobalRows}, {"seed", 5}}}}.dump());
    CHECK(fs::test::error_of<fs::InvalidArgument>([&] {
            s.set_checkpoint_metadata(R"({"session": 1})");
          }).find("without the key \"session\"") != std::string::npos);
    straight = by_session(s, 0, 2);
    s.save();  // step 2
    const std::vector<double> more = by_session(s, 2, 4);
    straight.insert(straight.end(), more.begin(), more.end());
    s.save();  // step 4; keep_last 1 removes step 2
  }
  REQUIRE(saves.size() == 2);
  CHECK(saves[1].step == 4);
  CHECK_FALSE(saves[1].asynchronous);
  const std::string step4 = saves[1].step_dir;
  CHECK_FALSE(std::filesystem::exists(saves[0].step_dir));
  {
    // Resumed from step 4's directory by name: its metadata comes back, it is never removed.
    ss::Config r = c;
    r.checkpoint.resume = true;
    r.checkpoint.resume_from = step4;
    fs::DeviceMesh mesh = world_mesh();
    fs::apps::ResidualMlp net(kShape, c.seed + 1);
    ss::NativeSession s(mesh, net, r, kGlobalRows);
    CHECK(s.step() == 4);
    CHECK(s.last_loaded().step_dir == step4);
    CHECK(s.last_loaded().kind == fs::checkpoint::Kind::full);
    CHECK(nlohmann::json::parse(s.last_loaded().metadata)["data"]["seed"] == 5);
    CHECK(rel(by_session(s, 4, 5)[0], by_session_reference(c, 5)) <= 1e-6);
    s.save();  // step 5: keep_last 1, but the step resumed from stays
    CHECK(std::filesystem::exists(step4));
  }
  {
    // Weights only: step 0, a fresh optimizer; the predictions are the checkpoint's.
    fs::DeviceMesh mesh = world_mesh();
    fs::apps::ResidualMlp a(kShape, c.seed + 2);
    ss::NativeSession sa(mesh, a, native_config(), kGlobalRows);
    const fs::checkpoint::Loaded l = sa.load_parameters(step4);
    CHECK(l.step == 4);
    CHECK(sa.step() == 0);
    fs::apps::ResidualMlp b(kShape, c.seed + 3);
    ss::NativeSession sb(mesh, b, native_config(), kGlobalRows);
    sb.load(step4);
    const Batch x = batch_of(7);
    std::vector<float> ya(x.t.size()), yb(x.t.size());
    sa.predict(x.x.data(), x.rows, ya.data());
    sb.predict(x.x.data(), x.rows, yb.data());
    CHECK(ya == yb);
  }
}

TEST_CASE("native session: a program's option names in the advice; async save metrics") {
  fs::test::SharedTempDir tmp("fullshard-native-async");
  ss::Config c = native_config();
  c.non_finite.policy = "stop";
  c.option_names = {{"non_finite.policy", "--non-finite"}};
  CHECK(c.setting("non_finite.policy", "\"skip\"") == "--non-finite");
  CHECK(c.setting("checkpoint.resume", "true") == "\"checkpoint\": {\"resume\": true}");
  fs::DeviceMesh mesh = world_mesh();
  fs::apps::ResidualMlp net(kShape, c.seed);
  ss::NativeSession s(mesh, net, c, kGlobalRows);
  std::vector<ss::SaveMetrics> saves;
  s.set_progress({{}, [&](const ss::SaveMetrics& m) { saves.push_back(m); }});
  const std::uint64_t staging = s.reserve_async_staging();
  by_session(s, 0, 1);
  s.save_async(tmp.path + "/ck");
  s.wait_save();
  REQUIRE(saves.size() == 1);
  CHECK(saves[0].asynchronous);
  CHECK(saves[0].staging_bytes == staging);
  CHECK(saves[0].write_seconds >= 0);
  Batch b = batch_of(1);
  b.t[0] = std::numeric_limits<float>::infinity();
  const std::string e = fs::test::error_of<fs::InvalidArgument>(
      [&] { s.train_step(b.x.data(), b.t.data(), b.rows, kGlobalRows); });
  CHECK(e.find("(--non-finite stop)") != std::string::npos);
}

TEST_CASE("native session: one rank's wrong arguments are refused on every rank") {
  const int W = fs::test::world_size(), last = W - 1;
  const bool me = fs::test::world_rank() == last;
  fs::DeviceMesh mesh = world_mesh();
  fs::apps::ResidualMlp net(kShape, 0);
  ss::NativeSession s(mesh, net, native_config(), kGlobalRows);
  const Batch b = batch_of(0);
  // Its arrays missing: every rank names the rank; nothing is applied.
  std::string e = fs::test::error_of<fs::InvalidArgument>([&] {
    s.train_step(me ? nullptr : b.x.data(), b.t.data(), std::max<std::int64_t>(b.rows, 1),
                 kGlobalRows);
  });
  CHECK(e.find("train_step: rank " + std::to_string(last) + " passed") != std::string::npos);
  CHECK(s.step() == 0);
  if (W > 1) {  // another global batch on one rank
    e = fs::test::error_of<fs::InvalidArgument>(
        [&] { s.train_step(b.x.data(), b.t.data(), b.rows, me ? kGlobalRows + 2 : kGlobalRows); });
    CHECK(e.find("the ranks passed different global_rows") != std::string::npos);
    CHECK(s.step() == 0);
  }
  std::vector<float> y(b.t.size() + 1);
  e = fs::test::error_of<fs::InvalidArgument>(
      [&] { s.predict(b.x.data(), me ? -1 : b.rows, y.data()); });
  CHECK(e.find("predict: rank " + std::to_string(last) + " passed -1 rows") != std::string::npos);
  // The session still trains afterwards.
  CHECK(std::isfinite(s.train_step(b.x.data(), b.t.data(), b.rows, kGlobalRows)));
  CHECK(s.step() == 1);
  // A cost file no rank can read: named on every rank.
  ss::Config c = native_config();
  c.sharding.cost_file = "/nonexistent/fullshard-cost.json";
  fs::apps::ResidualMlp other(kShape, 0);
  e = fs::test::error_of<fs::ConfigError>([&] { ss::NativeSession t(mesh, other, c); });
  CHECK(e.find("sharding.cost_file: rank 0: ") != std::string::npos);
}
