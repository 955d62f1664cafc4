// The training session (fullshard/session/session.hpp) in C++: gradient accumulation against
// the whole batch, the ranks' agreement on the batch and on the configuration, asynchronous
// saves with retention, resume on another rank count, the identity of a checkpoint, and the
// checks of the checkpoint directory before the first step.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include "test/torch/torch_doctest.hpp"  // first: LibTorch, then doctest's CHECK macros

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/base/memory_ledger.hpp"
#include "fullshard/schedule/memory_account.hpp"
#include "fullshard/schedule/memory_budget.hpp"
#include "fullshard/session/session.hpp"
#include "fullshard/torch/checkpoint.hpp"
#include "fullshard/torch/residual_mlp.hpp"
#include "fullshard/torch/sharded_model.hpp"
#include "lib/session/models.hpp"
#include "lib/session/torch_host_bytes.hpp"
#include "test/torch/counting_allocator.hpp"
#include "test_support.hpp"

namespace fs = fullshard;
namespace ss = fullshard::session;
namespace fst = fullshard::torch;

namespace {

constexpr int kIn = 6, kOut = 2;

std::string config_text(const std::string& extra = {}, const std::string& optimizer = "adamw",
                        int hidden = 16) {
  return R"({"model": {"type": "residual_mlp", "inputs": 6, "hidden": )" + std::to_string(hidden) +
         R"(, "outputs": 2, "blocks": 3},
             "optimizer": {"type": ")" +
         optimizer + R"(", "lr": 0.01}, "seed": 3)" + (extra.empty() ? "" : ", " + extra) + "}";
}

ss::Config config_of(const std::string& text) {
  return ss::parse_config(text, "session-test.json");
}

fs::DeviceMesh world_mesh() {
  return fs::DeviceMesh(MPI_COMM_WORLD, {fs::test::world_size()}, {"dp"}, 60.0);
}

// Rows [first, first + rows) of step s's global batch (the same values at any rank count).
std::pair<torch::Tensor, torch::Tensor> rows_of(int s, std::int64_t first, std::int64_t rows) {
  torch::Tensor x = torch::empty({rows, kIn}, torch::kDouble);
  torch::Tensor y = torch::empty({rows, kOut}, torch::kDouble);
  for (std::int64_t i = 0; i < rows; ++i) {
    for (int j = 0; j < kIn; ++j)
      x[i][j] = std::sin(0.37 * double((first + i) * kIn + j) + 1.7 * s);
    for (int k = 0; k < kOut; ++k)
      y[i][k] = std::cos(0.11 * double((first + i) * kOut + k) + 0.9 * s);
  }
  return {x.to(torch::kFloat), y.to(torch::kFloat)};
}

// This rank's `rows` rows of step s.
std::pair<torch::Tensor, torch::Tensor> batch(int s, std::int64_t rows = 8) {
  return rows_of(s, fs::test::world_rank() * rows, rows);
}

double mean_over_ranks(double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return v / fs::test::world_size();
}

double rel(double a, double b) {
  return std::abs(a - b) / std::max(std::abs(b), 1e-30);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

int graph_false() {
  return fs::graph::ReshardAfterForward::never().value();
}

int step_dirs(const std::string& dir) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.is_directory() && e.path().filename().string().rfind("step-", 0) == 0) ++n;
  return n;
}

}  // namespace

TEST_CASE("session: accumulation over micro-batches is the whole batch's step") {
  const fs::DeviceMesh mesh = world_mesh();
  for (const std::int64_t rows : {8, 10}) {
    CAPTURE(rows);
    ss::Session whole(mesh, config_of(config_text()));
    ss::Session micro(mesh, config_of(config_text(R"("accumulation": 4)")));
    for (int s = 0; s < 3; ++s) {
      const auto [x, y] = batch(s, rows);
      const double a = whole.train_step({x}, {y});
      const double b = micro.train_step({x}, {y});
      CHECK(rel(b, a) <= 1e-5);
    }
    const auto [x, y] = batch(9, rows);
    const torch::Tensor pa = whole.predict({x})[0], pb = micro.predict({x})[0];
    CHECK((pa - pb).abs().max().item<double>() <= 1e-5 * pa.abs().max().item<double>());
    // Fewer samples than micro-batches: refused on every rank, the session still usable.
    const auto [xs, ys] = batch(0, 3);
    CHECK(error_of([&] {
            micro.train_step({xs}, {ys});
          }).find("the batch has 3 samples, fewer than \"accumulation\": 4 micro-batches") !=
          std::string::npos);
    CHECK(std::isfinite(micro.train_step({x}, {y})));
  }
}

TEST_CASE("session: a batch that differs on some ranks is refused on every rank") {
  if (fs::test::world_size() < 2) return;
  const fs::DeviceMesh mesh = world_mesh();
  const int rank = fs::test::world_rank();
  ss::Session gpt(mesh, config_of(R"({"model": {"type": "gpt", "vocab": 16, "context": 12,
                                       "d_model": 8, "heads": 2, "layers": 1}})"));
  // Token sequences of 8 on rank 0 and 6 elsewhere: each valid alone.
  const torch::Tensor ids = torch::arange(4 * (rank == 0 ? 8 : 6), torch::kLong)
                                .remainder(16)
                                .view({4, rank == 0 ? 8 : 6});
  const std::string msg = error_of([&] { gpt.train_step({ids}, {}); });
  CAPTURE(msg);
  CHECK(msg.find("train_step: the ranks' batches differ") != std::string::npos);
  CHECK(msg.find("rank 0: inputs[0] i64 (*, 8)") != std::string::npos);
  CHECK(msg.find("inputs[0] i64 (*, 6)") != std::string::npos);
  CHECK(gpt.step() == 0);
  // A batch dim that differs is the data-parallel norm: accepted.
  const torch::Tensor ok = torch::arange(8 * (rank + 2), torch::kLong).remainder(16).view({-1, 8});
  CHECK(std::isfinite(gpt.train_step({ok}, {})));
  CHECK(gpt.step() == 1);

  // One rank's batch the model does not take: every rank names that rank and why.
  ss::Session mlp(mesh, config_of(config_text()));
  auto [x, y] = batch(0);
  if (rank == 1) x = torch::zeros({8, kIn + 1});
  const std::string bad = error_of([&] { mlp.train_step({x}, {y}); });
  CAPTURE(bad);
  CHECK(bad.find("rank 1: refused (") != std::string::npos);
  // Targets with another batch dim than the inputs, on one rank.
  auto [x2, y2] = batch(0);
  if (rank == 1) y2 = y2.narrow(0, 0, 7);
  const std::string rows = error_of([&] { mlp.train_step({x2}, {y2}); });
  CAPTURE(rows);
  CHECK(rows.find("[targets[0] has 7 samples, inputs[0] 8]") != std::string::npos);
  CHECK(mlp.step() == 0);
}

TEST_CASE("session: the ranks' configurations must agree") {
  if (fs::test::world_size() < 2) return;
  const fs::DeviceMesh mesh = world_mesh();
  ss::Config c = config_of(config_text());
  if (fs::test::world_rank() == 1) c.optimizer.lr = 0.02;
  const std::string msg = error_of([&] { ss::Session s(mesh, c); });
  CAPTURE(msg);
  CHECK(msg.find("optimizer.lr") != std::string::npos);
  CHECK(msg.find("rank 1") != std::string::npos);
  // A configuration built in C++ is checked as a file is.
  ss::Config bad = config_of(config_text());
  bad.accumulation = 0;
  CHECK(error_of([&] { ss::Session s(mesh, bad); }).find("accumulation: 0 is out of range") !=
        std::string::npos);
}

TEST_CASE("session: asynchronous saves with retention, resumed on another rank count") {
  const fs::DeviceMesh mesh = world_mesh();
  fs::test::SharedTempDir tmp("fullshard-session");
  const std::string dir = tmp.path + "/ck";
  const std::string ck = R"("checkpoint": {"dir": ")" + dir + R"(", "keep_last": 2})";
  std::optional<ss::Session> run(std::in_place, mesh, config_of(config_text(ck)));
  ss::Session& s = *run;
  int commits = 0, steps = 0;
  s.set_progress({[&](const ss::StepMetrics& m) { steps = int(m.step); },
                  [&](const ss::SaveMetrics& m) { commits += m.step > 0; }});
  for (int i = 0; i < 2; ++i) {
    const auto [x, y] = batch(i);
    s.train_step({x}, {y});
  }
  s.save_async();
  CHECK(s.save_in_flight());
  const std::string twice = error_of([&] { s.save_async(); });
  CHECK(twice.find("the save of step 2 into '" + dir + "' is still in flight") !=
        std::string::npos);
  {  // training goes on while the files are written
    const auto [x, y] = batch(2);
    s.train_step({x}, {y});
  }
  while (!s.poll_save()) {
  }
  CHECK_FALSE(s.save_in_flight());
  CHECK(error_of([&] { s.wait_save(); }).find("no checkpoint save is in flight") !=
        std::string::npos);
  for (int i = 3; i < 5; ++i) {
    const auto [x, y] = batch(i);
    s.train_step({x}, {y});
    if (i == 3) s.save_async();  // step 4, written while step 5 trains
  }
  s.save();  // waits for step 4's, then saves step 5
  CHECK(commits == 3);
  CHECK(steps == 5);
  if (fs::test::world_rank() == 0) CHECK(step_dirs(dir) == 2);  // keep_last

  // The next step of this run, against a session resumed on rank 0 alone (another rank count)
  // training on every rank's rows at once.
  const auto [x, y] = batch(5);
  const double continued = mean_over_ranks(s.train_step({x}, {y}));
  MPI_Comm solo = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, fs::test::world_rank() == 0 ? 0 : MPI_UNDEFINED, 0, &solo);
  const std::string resume = R"("checkpoint": {"dir": ")" + dir + R"(", "resume": true})";
  if (solo != MPI_COMM_NULL) {  // a second run on the directory while this one lives: refused
    fs::DeviceMesh one(solo, {1}, {"dp"}, 60.0);
    const std::string second =
        error_of([&] { ss::Session other(one, config_of(config_text(resume))); });
    CAPTURE(second);
    CHECK(second.find("checkpoint directory '" + dir + "' is in use by another run, run ") !=
          std::string::npos);
    CHECK(second.find("process " + std::to_string(::getpid()) + ", heartbeat") !=
          std::string::npos);
  }
  run.reset();  // the run ends: its directory is free
  if (solo != MPI_COMM_NULL) {
    fs::DeviceMesh one(solo, {1}, {"dp"}, 60.0);
    ss::Session resumed(one, config_of(config_text(resume)));
    CHECK(resumed.step() == 5);
    const auto [xa, ya] = rows_of(5, 0, 8 * fs::test::world_size());
    CHECK(rel(resumed.train_step({xa}, {ya}), continued) <= 1e-5);
    // Another optimizer or another model: refused before anything changes.
    ss::Session sgd(one, config_of(config_text({}, "sgd")));
    const std::string opt = error_of([&] { sgd.load(dir); });
    CAPTURE(opt);
    CHECK(opt.find("was saved by another optimizer: optimizer.type = adamw there, but this "
                   "session's configuration has optimizer.type = sgd") != std::string::npos);
    CHECK(sgd.step() == 0);
    ss::Session narrow(one, config_of(config_text({}, "adamw", 8)));
    const std::string model = error_of([&] { narrow.load(dir); });
    CAPTURE(model);
    CHECK(model.find("was saved by another model: model.hidden = 16 there") != std::string::npos);
    MPI_Comm_free(&solo);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

namespace {

// A lock file as another run would have left it in `dir`, its heartbeat `age_s` seconds old
// (rank 0 writes it; every rank returns when it is there).
void plant_lock(const std::string& dir, const std::string& host, long long pid,
                const std::string& job, double age_s) {
  if (fs::test::world_rank() == 0) {
    std::filesystem::create_directories(dir);
    const std::string path = dir + "/.fullshard-lock";
    std::ofstream(path) << R"({"run": "0123456789abcdef", "job": ")" << job << R"(", "host": ")"
                        << host << R"(", "pid": )" << pid << R"(, "heartbeat_s": 2})"
                        << "\n";
    timespec when[2];
    clock_gettime(CLOCK_REALTIME, &when[0]);
    when[0].tv_sec -= static_cast<time_t>(age_s);
    when[1] = when[0];
    utimensat(AT_FDCWD, path.c_str(), when, 0);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

std::string this_host() {
  char buf[256] = {};
  gethostname(buf, sizeof buf - 1);
  return buf;
}

}  // namespace

TEST_CASE("session: a run owns its checkpoint directory; retention spares other runs") {
  const fs::DeviceMesh mesh = world_mesh();
  fs::test::SharedTempDir tmp("fullshard-owner");
  const std::string dir = tmp.path + "/ck";
  auto with = [&](const std::string& extra) {
    return config_of(
        config_text(R"("checkpoint": {"dir": ")" + dir + R"(", "keep_last": 1)" + extra + "}"));
  };
  auto train = [](ss::Session& s, int steps) {
    for (int i = 0; i < steps; ++i) {
      const auto [x, y] = batch(int(s.step()));
      s.train_step({x}, {y});
    }
  };
  std::string earlier;  // the first run's checkpoint
  {
    ss::Session first(mesh, with(""));
    train(first, 1);
    earlier = first.save();
    // Another session saving into the directory the first one owns: refused, nothing lost.
    ss::Session other(mesh, config_of(config_text()));
    const std::string into = error_of([&] { other.save(dir); });
    CAPTURE(into);
    CHECK(into.find("'" + dir + "' is the checkpoint directory of another run, run ") !=
          std::string::npos);
  }
  // A fresh run on a directory holding checkpoints: refused, naming the way on.
  const std::string fresh = error_of([&] { ss::Session again(mesh, with("")); });
  CAPTURE(fresh);
  CHECK(fresh.find("checkpoint directory '" + dir +
                   "' holds the checkpoints of an earlier run (latest: step-00000001)") !=
        std::string::npos);
  CHECK(fresh.find(R"("checkpoint": {"start_over": true})") != std::string::npos);
  {
    // Starting over beside them: keep_last 1 deletes only this run's own older checkpoints.
    ss::Session over(mesh, with(R"(, "start_over": true)"));
    for (int k = 0; k < 3; ++k) {
      train(over, 1);
      over.save();
    }
    if (fs::test::world_rank() == 0) {
      CHECK(std::filesystem::exists(earlier + "/index.json"));
      CHECK(step_dirs(dir) == 2);  // the earlier run's and this run's newest
    }
  }
  {
    // The earlier run's checkpoint still loads (step 1 of the first run).
    ss::Session check(mesh, config_of(config_text()));
    CHECK(check.load(earlier) == 1);
  }
  // Locks left behind: taken over when stale (an old heartbeat, this Slurm job requeued, a
  // process of this host that is gone), refused while the owner lives.
  const std::string resume = R"(, "resume": true)";
  plant_lock(dir, "elsewhere", 1, "", 10);  // heartbeat 10 s old, interval 2 s
  CHECK_NOTHROW(ss::Session(mesh, with(resume)));
  long long pid_max = 4194304;
  std::ifstream("/proc/sys/kernel/pid_max") >> pid_max;
  plant_lock(dir, this_host(), pid_max, "", 0);  // no process has that number
  CHECK_NOTHROW(ss::Session(mesh, with(resume)));
  plant_lock(dir, "elsewhere", 77, "4242", 0);
  setenv("SLURM_JOB_ID", "4242", 1);
  CHECK_NOTHROW(ss::Session(mesh, with(resume)));
  unsetenv("SLURM_JOB_ID");
  plant_lock(dir, "elsewhere", 77, "4242", 0);  // another job's, alive
  const std::string live = error_of([&] { ss::Session s(mesh, with(resume)); });
  CAPTURE(live);
  CHECK(live.find("is in use by another run, run 0123456789abcdef (Slurm job 4242, host "
                  "elsewhere, process 77, heartbeat 0 s ago)") != std::string::npos);
}

TEST_CASE("session: non-finite values never reach the parameters") {
  const fs::DeviceMesh mesh = world_mesh();
  const int last = fs::test::world_size() - 1;
  auto params_of = [](ss::Session& s) {
    std::vector<torch::Tensor> out;
    for (const torch::Tensor& p : s.module().parameters())
      out.push_back(p.detach().clone());
    return out;
  };
  auto same = [](const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
    bool eq = a.size() == b.size();
    for (std::size_t i = 0; eq && i < a.size(); ++i)
      eq = torch::equal(a[i], b[i]);
    return eq;
  };
  // Skip: a NaN in one rank's input skips the step on every rank, nothing applied; the next
  // steps are those of a run that never saw the bad batch.
  ss::Session s(mesh, config_of(config_text(R"("non_finite": {"max_skipped": 1})")));
  ss::Session reference(mesh, config_of(config_text()));
  const std::vector<torch::Tensor> before = params_of(s);
  {
    auto [x, y] = batch(0);
    if (fs::test::world_rank() == last) x[2][3] = std::nan("");
    CHECK(std::isnan(s.train_step({x}, {y})));
  }
  CHECK(s.step() == 0);
  CHECK(s.skipped_steps() == 1);
  CHECK(same(params_of(s), before));
  for (int k = 0; k < 2; ++k) {
    const auto [x, y] = batch(k);
    CHECK(rel(s.train_step({x}, {y}), reference.train_step({x}, {y})) <= 1e-6);
  }
  // A second bad step is one more than max_skipped 1: refused, naming the step, rank and value.
  {
    auto [x, y] = batch(2);
    if (fs::test::world_rank() == last) y[1][0] = -INFINITY;
    const std::string msg = error_of([&] { s.train_step({x}, {y}); });
    CAPTURE(msg);
    CHECK(msg.find("step 4: rank " + std::to_string(last) +
                   ": target 0 holds -inf at [1, 0] (found before the forward); the step was "
                   "not applied (2 steps skipped, more than \"non_finite\": {\"max_skipped\": "
                   "1})") != std::string::npos);
  }
  // Stop: the first bad step is refused. A finite batch whose loss overflows: after backward.
  ss::Session stop(mesh, config_of(config_text(R"("non_finite": {"policy": "stop"})")));
  {
    const auto [x, y] = batch(0);
    const std::string msg = error_of([&] { stop.train_step({x * 1e30}, {y}); });
    CAPTURE(msg);
    CHECK(msg.find("step 1: rank 0: the loss is not finite") != std::string::npos);
    CHECK(msg.find("the step was not applied (\"non_finite\": {\"policy\": \"stop\"})") !=
          std::string::npos);
    CHECK(stop.skipped_steps() == 1);
  }
  // Inside backward the update is applied before the check: the run stops, saying so.
  ss::Session inside(mesh, config_of(R"({"model": {"type": "residual_mlp", "inputs": 6,
                                                  "hidden": 16, "outputs": 2, "blocks": 3},
                                       "optimizer": {"in_backward": true}})"));
  {
    const auto [x, y] = batch(0);
    const std::string msg = error_of([&] { inside.train_step({x * 1e30}, {y}); });
    CAPTURE(msg);
    CHECK(msg.find("the optimizer inside backward applied the step before it could be checked, "
                   "so the run stops") != std::string::npos);
  }
  // Weights holding a NaN: refused from a checkpoint at resume and from a safetensors file.
  fs::test::SharedTempDir tmp("fullshard-nonfinite");
  {
    ss::Session bad(mesh, config_of(config_text()));
    {
      torch::NoGradGuard no_grad;
      for (torch::Tensor p : bad.module().parameters())
        if (p.numel() > 0) p.view(-1)[0] = std::nan("");
    }
    bad.save(tmp.path + "/ck");
    bad.export_safetensors(tmp.path + "/bad.safetensors");
  }
  const std::string resumed = error_of([&] {
    ss::Session r(mesh, config_of(config_text(R"("checkpoint": {"dir": ")" + tmp.path +
                                              R"(/ck", "resume": true})")));
  });
  CAPTURE(resumed);
  CHECK(resumed.find("the checkpoint's (" + tmp.path +
                     "/ck/step-00000000) parameters hold a non-finite value: '") !=
        std::string::npos);
  ss::Session fresh(mesh, config_of(config_text()));
  const std::string imported =
      error_of([&] { fresh.import_safetensors(tmp.path + "/bad.safetensors"); });
  CAPTURE(imported);
  CHECK(imported.find("the imported (" + tmp.path +
                      "/bad.safetensors) parameters hold a non-finite value: '") !=
        std::string::npos);
  // The refused values are in the parameters now: nothing trains or saves them until weights
  // holding finite values replace them.
  const auto [x0, y0] = batch(0);
  const std::string blocked = error_of([&] { fresh.train_step({x0}, {y0}); });
  CAPTURE(blocked);
  CHECK(blocked.find("train_step: the parameters hold the values of the safetensors file '" +
                     tmp.path + "/bad.safetensors', which were refused") != std::string::npos);
  CHECK(error_of([&] { fresh.save(tmp.path + "/never"); }).find("save: the parameters hold") !=
        std::string::npos);
  ss::Session good(mesh, config_of(config_text()));
  good.export_safetensors(tmp.path + "/good.safetensors");
  fresh.import_safetensors(tmp.path + "/good.safetensors");
  CHECK(rel(fresh.train_step({x0}, {y0}), good.train_step({x0}, {y0})) <= 1e-6);
  // The same after a refused load into a running session.
  const std::string loaded = error_of([&] { fresh.load(tmp.path + "/ck"); });
  CHECK(loaded.find("parameters hold a non-finite value") != std::string::npos);
  CHECK(error_of([&] { fresh.evaluate({x0}, {y0}); })
            .find("evaluate: the parameters hold the values of the checkpoint '" + tmp.path +
                  "/ck/step-00000000', which were refused") != std::string::npos);
  // With clipping the check rides on the norm's all-reduce, and still names rank and cause.
  ss::Session clipped(mesh, config_of(config_text(R"("grad_clip": 0.5,
                                                     "non_finite": {"policy": "stop"})")));
  const std::string overflow = error_of([&] { clipped.train_step({x0 * 1e30}, {y0}); });
  CAPTURE(overflow);
  CHECK(overflow.find("step 1: rank 0: the loss is not finite") != std::string::npos);
}

TEST_CASE("session: grad_clip scales the step by max_norm over the global gradient norm") {
  // One SGD step without momentum moves each parameter by -lr g: the unclipped session's moves
  // give the global gradient norm; the clipped session's must be those moves times
  // max_norm / (norm + 1e-6).
  const fs::DeviceMesh mesh = world_mesh();
  auto text = [](const std::string& extra) {
    return R"({"model": {"type": "residual_mlp", "inputs": 6, "hidden": 16, "outputs": 2,
                         "blocks": 3},
               "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0}, "seed": 3)" +
           extra + "}";
  };
  ss::Session plain(mesh, config_of(text(""))),
      clipped(mesh, config_of(text(R"(, "grad_clip": 0.05)")));
  auto params_of = [](ss::Session& s) {
    std::vector<torch::Tensor> out;
    for (const torch::Tensor& p : s.module().parameters())
      out.push_back(p.detach().clone());
    return out;
  };
  const std::vector<torch::Tensor> before = params_of(plain);
  const auto [x, y] = batch(0);
  plain.train_step({x}, {y});
  clipped.train_step({x}, {y});
  const std::vector<torch::Tensor> after_plain = params_of(plain), after_clip = params_of(clipped);
  double sq = 0;  // this rank's shards' share of |lr g|^2 (tied weights: none in this model)
  for (std::size_t i = 0; i < before.size(); ++i)
    sq += (after_plain[i] - before[i]).to(torch::kDouble).pow(2).sum().item<double>();
  MPI_Allreduce(MPI_IN_PLACE, &sq, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  const double norm = std::sqrt(sq) / 0.1;
  REQUIRE(norm > 0.05 * 2);  // the clip applies
  const double coef = 0.05 / (norm + 1e-6);
  double worst = 0;
  for (std::size_t i = 0; i < before.size(); ++i) {
    if (before[i].numel() == 0) continue;
    const torch::Tensor want = before[i] + (after_plain[i] - before[i]) * coef;
    worst = std::max(worst, (after_clip[i] - want).abs().max().item<double>() /
                                std::max(want.abs().max().item<double>(), 1e-30));
  }
  CAPTURE(norm);
  CHECK(worst <= 1e-6);
}

TEST_CASE("session: a configuration path that is not a regular file is refused, not waited on") {
  const fs::DeviceMesh mesh = world_mesh();
  fs::test::SharedTempDir tmp("fullshard-fifo");
  const std::string fifo = tmp.path + "/config.json";
  if (fs::test::world_rank() == 0) REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  MPI_Barrier(MPI_COMM_WORLD);
  // Opening a FIFO for reading would wait for a writer forever, on every rank.
  const std::string msg = error_of([&] { ss::read_config(mesh, fifo); });
  CAPTURE(msg);
  CHECK(msg.find(fifo + ": cannot read the configuration (it is not a regular file but a FIFO)") !=
        std::string::npos);
  const std::string dir = error_of([&] { ss::read_config(mesh, tmp.path); });
  CHECK(dir.find("it is not a regular file but a directory") != std::string::npos);
  // A file one rank cannot read (a node-local path): every rank names that rank and why.
  if (fs::test::world_size() > 1) {
    const int last = fs::test::world_size() - 1;
    const std::string good = tmp.path + "/good.json", missing = tmp.path + "/missing.json";
    if (fs::test::world_rank() == 0) std::ofstream(good) << config_text();
    MPI_Barrier(MPI_COMM_WORLD);
    const std::string msg =
        error_of([&] { ss::read_config(mesh, fs::test::world_rank() == last ? missing : good); });
    CAPTURE(msg);
    CHECK(msg.find("rank " + std::to_string(last) +
                   " has 1 entry, the first \"configuration "
                   "refused: " +
                   missing) != std::string::npos);
    CHECK(msg.find("rank 0 has ") != std::string::npos);
  }
}

TEST_CASE("session: the checkpoint directory is checked before the first step") {
  const fs::DeviceMesh mesh = world_mesh();
  const std::string unwritable = "/proc/fullshard-session-test";
  const std::string msg = error_of([&] {
    ss::Session s(mesh, config_of(config_text(R"("checkpoint": {"dir": ")" + unwritable + "\"}")));
  });
  CAPTURE(msg);
  CHECK(msg.find("checkpoint directory '" + unwritable + "'") != std::string::npos);
  if (fs::test::world_size() < 2) return;
  // "ck" relative to a working directory of each rank's own: not one directory.
  char own[] = "/tmp/fullshard-session-rank-XXXXXX";
  REQUIRE(mkdtemp(own) != nullptr);
  const std::filesystem::path cwd = std::filesystem::current_path();
  std::filesystem::current_path(own);
  const std::string local = error_of(
      [&] { ss::Session s(mesh, config_of(config_text(R"("checkpoint": {"dir": "ck"})"))); });
  std::filesystem::current_path(cwd);
  std::filesystem::remove_all(own);
  CAPTURE(local);
  CHECK(local.find("checkpoint directory 'ck' is not shared by the ranks that write it: rank 1") !=
        std::string::npos);
}

TEST_CASE("session: reshard_after_forward k, compression and list groups") {
  const fs::DeviceMesh mesh = world_mesh();
  const int world = fs::test::world_size();
  ss::Session blocks(mesh, config_of(config_text()));
  const std::string k = world % 2 == 0 ? "2" : "false";
  ss::Session other(mesh,
                    config_of(config_text(R"("sharding": {"reshard_after_forward": )" + k + "}")));
  CHECK(other.config().sharding.reshard_after_forward.value() ==
        (world % 2 == 0 ? 2 : graph_false()));
  CHECK(blocks.plan().groups == 4);  // three blocks and the root
  for (int s = 0; s < 3; ++s) {
    const auto [x, y] = batch(s);
    const double a = blocks.train_step({x}, {y});
    CHECK(rel(other.train_step({x}, {y}), a) <= 1e-5);
  }
  // Compressed collectives: int8 all-gathers and reduce-scatters; the first loss (the initial
  // model's, through quantised parameters) within 2 % of the uncompressed one, but not equal.
  ss::Session int8(mesh, config_of(config_text(R"("sharding": {"compression": {"all_gather":
                                                  "int8", "reduce_scatter": "int8"}})")));
  ss::Session plain(mesh, config_of(config_text()));
  const auto [x0, y0] = batch(0);
  const double q = int8.train_step({x0}, {y0}), p = plain.train_step({x0}, {y0});
  CHECK(rel(q, p) <= 0.02);
  if (world > 1) CHECK(q != p);  // (one rank gathers nothing: nothing is quantised)
  // List groups (FSDP2's fully_shard([blocks.0, blocks.1])): one group fewer, the same numbers.
  ss::Session listed(mesh, config_of(config_text(R"("sharding": {"groups": [["blocks.0",
                                                    "blocks.1"]]})")));
  CHECK(listed.plan().groups == 3);  // blocks 0 and 1 together, block 2, the root
  ss::Session reference(mesh, config_of(config_text()));
  for (int s = 0; s < 3; ++s) {
    const auto [x, y] = batch(s);
    const double a = reference.train_step({x}, {y});
    CHECK(rel(listed.train_step({x}, {y}), a) <= 1e-5);
  }
  const auto [xp, yp] = batch(7);
  const torch::Tensor pa = reference.predict({xp})[0], pb = listed.predict({xp})[0];
  CHECK((pa - pb).abs().max().item<double>() <= 1e-5 * pa.abs().max().item<double>());
  // A module the model does not have is named.
  const std::string msg = error_of([&] {
    ss::Session s(mesh, config_of(config_text(R"("sharding": {"groups": [["blocks.7"]]})")));
  });
  CAPTURE(msg);
  CHECK(msg.find("blocks.7") != std::string::npos);
}

TEST_CASE("session: the optimizer inside backward is the step after it, without sharded grads") {
  const fs::DeviceMesh mesh = world_mesh();
  for (const std::string optimizer : {R"("type": "sgd", "momentum": 0.9)", R"("type": "adamw")"}) {
    CAPTURE(optimizer);
    auto text = [&](bool in_backward) {
      return R"({"model": {"type": "residual_mlp", "inputs": 6, "hidden": 16, "outputs": 2,
                 "blocks": 3}, "seed": 3, "optimizer": {)" +
             optimizer + R"(, "lr": 0.01, "in_backward": )" + (in_backward ? "true" : "false") +
             "}}";
    };
    ss::Session after(mesh, config_of(text(false)));
    ss::Session inside(mesh, config_of(text(true)));
    const auto held = [] { return fs::memory_ledger::counts().now_of(fs::MemoryPart::gradients); };
    for (int s = 0; s < 3; ++s) {
      const auto [x, y] = batch(s);
      // The library's byte count: the step inside backward leaves no sharded gradient behind;
      // the step after backward holds its shards of the gradient until the next step.
      const std::uint64_t before = held();
      const double b = inside.train_step({x}, {y});
      CHECK(held() == before);
      const double a = after.train_step({x}, {y});
      if (s == 0) CHECK(held() > before);
      CHECK(rel(b, a) <= 1e-6);
    }
    CHECK(inside.step() == 3);
    const std::vector<torch::Tensor> pa = after.module().parameters(),
                                     pb = inside.module().parameters();
    REQUIRE(pa.size() == pb.size());
    for (std::size_t i = 0; i < pa.size(); ++i) {
      if (pa[i].numel() == 0) continue;  // an empty shard (2 output rows over 3 ranks)
      const double scale = std::max(1e-30, pa[i].abs().max().item<double>());
      CHECK((pa[i] - pb[i]).abs().max().item<double>() <= 1e-6 * scale);
    }
    // Its checkpoint is the same as the step after backward's: either loads into the other.
    fs::test::SharedTempDir tmp("fullshard-in-backward");
    const std::string dir = tmp.path + "/ck";
    inside.save(dir);
    ss::Session resumed(mesh, config_of(text(false)));
    CHECK(resumed.load(dir) == 3);
    const auto [x, y] = batch(3);
    CHECK(rel(resumed.train_step({x}, {y}), after.train_step({x}, {y})) <= 1e-6);
  }
}

TEST_CASE("session: an f64 model trains with LibTorch's optimizer, close to the f32 one") {
  const fs::DeviceMesh mesh = world_mesh();
  ss::Session f32(mesh, config_of(config_text()));
  ss::Session f64(mesh, config_of(config_text(R"("dtype": "f64")")));
  CHECK((f64.input_dtype() == torch::kDouble));
  CHECK(f64.optimizer_tensors() == f32.optimizer_tensors());
  for (int s = 0; s < 3; ++s) {
    const auto [x, y] = batch(s);
    const double a = f32.train_step({x}, {y});
    CHECK(rel(f64.train_step({x.to(torch::kDouble)}, {y.to(torch::kDouble)}), a) <= 1e-5);
  }
  // An input of another float dtype is named, not handed to LibTorch's matrix product.
  const auto [x, y] = batch(3);
  CHECK(error_of([&] { f64.train_step({x}, {y}); })
            .find("input 0 is Float; the model takes Double (Session::input_dtype(): convert "
                  "it first)") != std::string::npos);
  CHECK(f64.step() == 3);
}

TEST_CASE("session: optimizer.no_weight_decay updates the named parameters without decay") {
  const fs::DeviceMesh mesh = world_mesh();
  // One AdamW step: p' = p (1 - lr wd) - u with the same u with and without decay, so a bias
  // left out of the decay ends lr wd b0 above the decayed one, and the matrices agree.
  const double lr = 0.01, wd = 0.5;
  for (const std::string dtype : {"f32", "f64"}) {  // fullshard's AdamW, LibTorch's
    CAPTURE(dtype);
    auto text = [&](const std::string& no_decay) {
      return R"({"model": {"type": "residual_mlp", "inputs": 6, "hidden": 16, "outputs": 2,
                 "blocks": 3}, "seed": 3, "dtype": ")" +
             dtype + R"(", "optimizer": {"type": "adamw", "lr": 0.01, "weight_decay": 0.5)" +
             no_decay + "}}";
    };
    ss::Session all(mesh, config_of(text("")));
    ss::Session some(mesh, config_of(text(R"(, "no_weight_decay": ["*.bias"])")));
    const torch::ScalarType t = all.input_dtype();
    std::vector<std::pair<std::string, torch::Tensor>> before;
    for (const auto& np : all.module().named_parameters())
      before.emplace_back(np.key(), np.value().detach().clone());
    const auto [x, y] = batch(0);
    CHECK(rel(some.train_step({x.to(t)}, {y.to(t)}), all.train_step({x.to(t)}, {y.to(t)})) <= 1e-6);
    const auto pa = all.module().named_parameters(), pb = some.module().named_parameters();
    int biases = 0;
    for (const auto& [name, b0] : before) {
      CAPTURE(name);
      if (b0.numel() == 0) continue;  // an empty shard
      const torch::Tensor diff = pb[name] - pa[name];
      const double scale = std::max(1e-30, b0.abs().max().item<double>());
      if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0) {
        ++biases;
        CHECK((diff - lr * wd * b0).abs().max().item<double>() <= 1e-5 * scale);
        CHECK(diff.abs().max().item<double>() >= 1e-3 * scale);  // the decay was left out
      } else {
        CHECK(diff.abs().max().item<double>() <= 1e-6 * scale);
      }
    }
    CHECK(biases > 0);
  }
  // A pattern that names nothing, and a group inside backward with both kinds: refused.
  CHECK(error_of([&] {
          ss::Session s(mesh, config_of(R"({"model": {"type": "residual_mlp", "inputs": 6,
                                                      "hidden": 16, "outputs": 2, "blocks": 3},
                                           "optimizer": {"no_weight_decay": ["*.beta"]}})"));
        }).find("optimizer.no_weight_decay: \"*.beta\" matches no parameter") != std::string::npos);
  const std::string mixed = error_of([&] {
    ss::Session s(mesh, config_of(R"({"model": {"type": "residual_mlp", "inputs": 6, "hidden": 16,
                                     "outputs": 2, "blocks": 3},
                                   "optimizer": {"no_weight_decay": ["*.bias"],
                                                 "in_backward": true}})"));
  });
  CAPTURE(mixed);
  CHECK(mixed.find("(with weight decay) and '") != std::string::npos);
  CHECK(mixed.find(".bias' (without)") != std::string::npos);
}

TEST_CASE("session: the plan's prediction is calibrated by the modules' measured times") {
  const fs::DeviceMesh mesh = world_mesh();
  ss::Session s(mesh, config_of(config_text(R"("sharding": {"calibrate_steps": 2})")));
  ss::Session micro(mesh, config_of(config_text(R"("sharding": {"calibrate_steps": 2},
                                                   "accumulation": 2)")));
  ss::Session off(mesh, config_of(config_text(R"("sharding": {"calibrate_steps": 0})")));
  const ss::PlanPrediction before = s.plan();
  CHECK(before.calibrated_iterations == 0);
  CHECK(before.optimizer_ms == 0);
  CHECK(before.communication_scale == 1);
  for (int k = 0; k < 4; ++k) {
    const auto [x, y] = batch(k);
    s.train_step({x}, {y});
    micro.train_step({x}, {y});
    off.train_step({x}, {y});
    // Steps 2 and 3 (after the first) are measured; the prediction changes after the third.
    CHECK(s.plan().calibrated_iterations == (k < 2 ? 0 : 2));
  }
  // A step of two micro-batches is not the plan's one forward and backward: not calibrated.
  CHECK(micro.plan().calibrated_iterations == 0);
  CHECK(off.plan().calibrated_iterations == 0);
  CHECK(off.plan().step_ms == before.step_ms);
  const ss::PlanPrediction& after = s.plan();
  // The optimizer's measured step is part of the predicted one; the cost model was scaled.
  CHECK(after.optimizer_ms > 0);
  CHECK(after.step_ms > after.optimizer_ms);
  CHECK(after.step_ms != before.step_ms);
  CHECK(after.communication_scale > 0);
  CHECK(after.communication_scale != 1);
  CHECK(after.peak_bytes == before.peak_bytes);
  CHECK(after.groups == before.groups);
}

TEST_CASE("session: a checkpoint of LibTorch's SGD loads into the session's optimizer") {
  const fs::DeviceMesh mesh = world_mesh();
  fs::test::SharedTempDir tmp("fullshard-torch-sgd");
  const std::string dir = tmp.path + "/ck";
  // The session's model and data, trained two steps by LibTorch's SGD (no momentum: it names a
  // momentum buffer it never makes) and saved with fullshard::torch::save_checkpoint.
  fst::ResidualMlp net(fst::ResidualMlpConfig{kIn, 16, kOut, 3, /*deferred=*/true});
  fst::ShardedModel sharded(net);
  for (auto& b : net->block_list)
    sharded.fully_shard(*b, mesh);
  sharded.fully_shard(net, mesh);
  sharded.initialize(net->initializer(3));
  torch::optim::SGD opt(sharded.parameters(), torch::optim::SGDOptions(0.01));
  for (int k = 0; k < 2; ++k) {
    const auto [x, y] = batch(k);
    opt.zero_grad();
    torch::mse_loss(fst::call(net, x), y).backward();
    opt.step();
  }
  fst::save_checkpoint(dir, sharded, &opt, 2);
  const auto [x, y] = batch(2);
  double want = 0;
  {
    torch::NoGradGuard no_grad;
    want = torch::mse_loss(fst::call(net, x), y).item<double>();
  }
  ss::Session s(mesh, config_of(config_text("", "sgd")));
  CHECK(s.load(dir) == 2);
  CHECK(rel(s.train_step({x}, {y}), want) <= 1e-6);
}

TEST_CASE("session: parameter counts from the keys; a whole build too large is refused first") {
  const fs::DeviceMesh mesh = world_mesh();
  // The count from the keys equals the parameters built, for every family, both builds.
  for (const std::string model :
       {R"({"type": "mlp", "inputs": 6, "hidden": [16, 12], "outputs": 2})",
        R"({"type": "residual_mlp", "inputs": 6, "hidden": 16, "outputs": 2, "blocks": 3})",
        R"({"type": "gpt", "vocab": 16, "context": 8, "d_model": 16, "heads": 2, "layers": 2})",
        R"({"type": "conv_autoencoder", "channels": 2, "out_channels": 3, "width": 4,
            "levels": 2})"})
    for (const bool deferred : {true, false}) {
      CAPTURE(model);
      CAPTURE(deferred);
      ss::Config c = config_of(R"({"model": )" + model + "}");
      c.model.deferred_init = deferred;
      ss::Session s(mesh, c);
      CHECK(ss::parameter_count(c.model, "test") == s.num_params());
    }
  // A GPT of 2 GiB in f32, built whole on every rank, against a budget 512 MiB above the
  // largest rank's resident memory: refused before anything is built.
  double resident = double(fs::schedule::process_memory().resident);
  MPI_Allreduce(MPI_IN_PLACE, &resident, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  const std::string budget = std::to_string(int(resident / (1 << 20)) + 512);
  const std::string big = R"({"model": {"type": "gpt", "d_model": 2048, "heads": 8, "layers": 10,
                                        "deferred_init": false},
                              "memory": {"budget_mb": )" +
                          budget + "}}";
  const std::string msg = error_of([&] { ss::Session s(mesh, config_of(big)); });
  CAPTURE(msg);
  CHECK(msg.find("the model (model.type = gpt, model.vocab = 256, model.context = 128, "
                 "model.d_model = 2048, model.heads = 8, model.layers = 10, model.mlp_ratio = 4) "
                 "has 504373248 parameters, 1.88 GiB in Float, which every rank builds whole "
                 "before sharding") != std::string::npos);
  CHECK(msg.find("memory.budget_mb") != std::string::npos);
  // Unchecked ("memory": {"check": "off"}), a tensor LibTorch cannot allocate (3 TiB on any
  // machine; the tensors before it are 4 MiB) is named by the model's keys too.
  const std::string huge = error_of([&] {
    ss::Session s(mesh, config_of(R"({"model": {"type": "gpt", "vocab": 2, "context": 2,
                                                 "d_model": 524288, "heads": 1, "layers": 1,
                                                 "deferred_init": false},
                                      "memory": {"check": "off"}})"));
  });
  CAPTURE(huge);
  CHECK(huge.find("model.d_model = 524288, model.heads = 1, model.layers = 1, model.mlp_ratio = "
                  "4) cannot be built: LibTorch could not allocate memory (tried to allocate "
                  "3298534883328 bytes)") != std::string::npos);
}

TEST_CASE("session: the first step measures LibTorch's activations into the memory account") {
  const int blocks = 3, hidden = 64;
  const std::int64_t rows = 32;
  ss::Session s(world_mesh(), config_of(config_text({}, "adamw", hidden)));
  // Not declared: the account at creation has none, the planned process peak is without them.
  CHECK(s.planned_memory().activations == 0);
  const std::int64_t planned_before = s.plan().process_peak_bytes;
  CHECK(planned_before == std::int64_t(s.planned_memory().process_peak()));
  // The test's own count of LibTorch's bytes over the step: its allocator wraps the session's
  // (every allocation passes through both) and is taken out again after the step.
  // It lives to the end of the process (tensors it allocated may outlive the session).
  c10::Allocator* const session_allocator = c10::GetCPUAllocator();
  auto& count = *new fs::test::CountingAllocator(session_allocator);
  c10::SetCPUAllocator(&count, /*priority=*/100);
  const auto [x, y] = batch(0, rows);
  const std::int64_t held = count.now();
  count.reset_peak();
  s.train_step({x}, {y});
  const std::int64_t step_bytes = count.peak() - held;
  c10::SetCPUAllocator(session_allocator, /*priority=*/100);
  const std::size_t activations = s.planned_memory().activations;
  INFO("measured " << activations << " B; the test counted " << step_bytes << " B");
  // At least each block's saved input (rows x hidden f32); at most what LibTorch allocated
  // in the whole call (the session measures from the forward, after the batch's checks).
  CHECK(activations >= std::size_t(blocks * rows * hidden * 4));
  CHECK(std::int64_t(activations) <= step_bytes);
  // The planned process peak holds them from now on; what no part holds is measured from the
  // second step on.
  CHECK(s.planned_memory().untracked == 0);
  CHECK(s.plan().process_peak_bytes - planned_before == std::int64_t(activations));
  CHECK(s.plan().process_peak_bytes == std::int64_t(s.planned_memory().process_peak()));
  // Later steps keep the largest measured.
  for (int k = 1; k < 3; ++k) {
    const auto [xk, yk] = batch(k, rows);
    s.train_step({xk}, {yk});
    CHECK(s.planned_memory().activations >= activations);
    // No more than the process's anonymous memory now (the step's peak has passed; the heap
    // glibc keeps from it stays).
    const std::size_t untracked = s.planned_memory().untracked;
    CHECK(untracked <= fs::schedule::process_memory().anonymous);
    CHECK(s.plan().process_peak_bytes - planned_before ==
          std::int64_t(s.planned_memory().activations + untracked));
  }
}

TEST_CASE("session: the LibTorch counter samples the process's memory once a new peak is written") {
  ss::TorchHostBytes* const counter = ss::TorchHostBytes::get();
  REQUIRE(counter != nullptr);
  counter->reset_peak();
  const std::int64_t before = counter->anonymous_peak();
  const std::int64_t mib = std::int64_t(1) << 20;
  {
    // 64 MiB (above glibc's largest mmap threshold: new pages) make a new peak; the sample is
    // taken at the next allocation, after the tensor's pages are written.
    at::Tensor big = at::empty({64 * mib / 4}, at::kFloat);
    big.fill_(1.0f);
    const at::Tensor next = at::empty({16}, at::kFloat);
    const std::int64_t grown = counter->anonymous_peak() - before;
    INFO("the sample grew by " << grown << " B");
    CHECK(grown >= 63 * mib);
    CHECK(grown < 96 * mib);
  }
}

TEST_CASE("session: a LibTorch model's parts of the account are the plan's, byte for byte") {
  for (const char* optimizer : {"sgd", "adamw"}) {
    CAPTURE(optimizer);
    ss::Session s(world_mesh(), config_of(config_text({}, optimizer, 64)));
    const fs::schedule::MemoryAccount& planned = s.planned_memory();
    // The steady state: from the second step on (the first makes the pool's blocks and moves
    // the shards into the all-gather windows).
    for (int k = 0; k < 3; ++k) {
      if (k == 1) fs::memory_ledger::reset_peaks();
      const auto [x, y] = batch(k, 16);
      s.train_step({x}, {y});
    }
    const fs::schedule::MemoryAccount m =
        fs::schedule::measured_memory(fs::memory_ledger::counts());
    CHECK(m.shards == planned.shards);
    // The gradients' storage is reused from step to step (none allocated beside it).
    CHECK(m.gradients == planned.gradients);
    CHECK(m.optimizer_state == planned.optimizer_state);
    CHECK(m.pool == planned.pool);
    // On shared memory (every rank on this node): the gradient windows LibTorch's gradients
    // are copied into before each reduce-scatter.
    CHECK(m.windows == planned.windows);
    if (fs::test::world_size() > 1 && s.mesh().shm("dp")) CHECK(planned.windows > 0);
  }
}
