// fullshard-train-gpt: a byte-level GPT (fullshard::torch::Gpt, LibTorch) trained through the
// training session (fullshard/session/session.hpp: fully_shard on every block and on the root,
// AdamW without weight decay on biases, norms and embeddings, warm-up and cosine schedule,
// clipping, checkpoints), on the licence texts every Debian machine has
// (/usr/share/common-licenses): whole licence families held out for validation. The program
// is the data, the options and the report; the training is the session's.
#include <mpi.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "blas_kernel.hpp"
#include "bounded_comm.hpp"
#include "cli.hpp"
#include "fullshard/base/checked.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/base/text_file.hpp"
#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/runtime/runtime.hpp"
#include "fullshard/session/session.hpp"
#include "fullshard/torch.hpp"
#include "fullshard/torch/threads.hpp"
#include "memory_report.hpp"

#include <torch/cuda.h>

namespace fs = fullshard;
namespace fst = fullshard::torch;

namespace {

const char* kUsage =
    "usage: mpirun -n N fullshard-train-gpt [options]\n"
    "\n"
    "Trains a byte-level GPT-style decoder (LibTorch, fullshard::torch) through the training\n"
    "session: fully_shard on every block and on the root, AdamW (betas 0.9, 0.95; no weight\n"
    "decay on biases, LayerNorms and embeddings), warm-up and cosine decay to lr/10. Data: the "
    "licence texts of a directory (default\n"
    "/usr/share/common-licenses), each distinct text once; the families named by --val\n"
    "(a family is the name before the first '-': GPL-2 and GPL-3 are GPL) are held out for\n"
    "validation. Each step draws a global batch of random windows (the same on every rank)\n"
    "and each rank takes its slice. Prints one line per step:\n"
    "  step <i> loss <nats/byte> step_ms <t> peak_mib <fullshard pool peak>\n"
    "and every --eval-every steps (and after the last):\n"
    "  eval step <i> val_loss <nats/byte> unigram <nats/byte> ratio <val_loss/unigram>\n"
    "where unigram is the entropy of the validation bytes' own frequencies.\n"
    "\n"
    "model:\n"
    "  --d-model D           (default 256)\n"
    "  --layers L            decoder blocks (default 4)\n"
    "  --heads H             attention heads, dividing D (default 4)\n"
    "  --context T           sequence length (default 128)\n"
    "  --dropout P           (default 0)\n"
    "  --checkpoint-blocks   activation checkpointing of every block\n"
    "training:\n"
    "  --batch B             global batch in sequences, split over the ranks (default 32)\n"
    "  --steps S             (default 200)\n"
    "  --lr X                peak learning rate (default 3e-3)\n"
    "  --warmup N            linear warm-up steps, then cosine decay (default S/10)\n"
    "  --weight-decay X      (default 0.1)\n"
    "  --clip X              clip the global gradient norm (default 1; 0: off)\n"
    "  --seed N              weights and batches (default 1)\n"
    "  --optimizer-in-backward  no weight decay anywhere then (a group's update is one rule)\n"
    "fully_shard:\n"
    "  --device cpu|cuda     where the model trains (default cpu); cuda: one GPU per rank,\n"
    "                        NCCL collectives, LibTorch's current stream as the compute\n"
    "                        stream (a build against a CUDA-enabled Kokkos and a LibTorch\n"
    "                        with CUDA: docs/gpu.md); exit 77 where no GPU is visible\n"
    "  --mesh N | RxN        FSDP over N ranks, or HSDP (default: every rank)\n"
    "  --param-dtype T       mixed precision compute dtype (bf16, f16); reduction in f32\n"
    "  --reshard true|false|auto|K   reshard_after_forward of every block (default auto)\n"
    "data and evaluation:\n"
    "  --data DIR            (default /usr/share/common-licenses)\n"
    "  --val F1,F2           held-out families (default MPL,Apache)\n"
    "  --eval-every N        (default 50; 0: only after the last step)\n"
    "  --eval-windows N      validation windows per evaluation (default 64)\n"
    "  --torch-threads N     LibTorch intra-op threads per rank (default: the cores the\n"
    "                        launcher gave the rank, docs/guide/launch.md)\n"
    "checkpoints (checked before the first step: an unwritable directory exits 2):\n"
    "  --checkpoint-dir DIR  where --save-every saves (a step-<n> directory each time)\n"
    "  --save-every N        save every N steps and after the last (default 0: never)\n"
    "  --async-save          save in the background while training goes on\n"
    "  --keep-last N         keep the N newest checkpoints (default 0: all)\n"
    "  --resume              continue from the newest checkpoint in --checkpoint-dir (saved\n"
    "                        on any number of ranks) when there is one\n"
    "  --start-over          a fresh run in a --checkpoint-dir holding checkpoints (refused\n"
    "                        otherwise; they are kept: retention deletes only this run's)\n"
    "weights and batches from files (side-by-side runs, bench/torch/):\n"
    "  --init-from FILE      initial weights from a safetensors file (FQNs as names)\n"
    "  --save-to FILE        the final weights as one safetensors file\n"
    "  --batches FILE        the global batches: little-endian int64 tokens, shape\n"
    "                        [steps][batch][context + 1], instead of random windows\n"
    "  --deferred-init       build the model on the meta device, block by block, and draw\n"
    "                        only each rank's shards (the same values)\n"
    "  --write-config FILE   the session's configuration as JSON (rank 0), e.g. to train the\n"
    "                        same model through the session API, the C API or Fortran\n";

struct Config {
  fst::GptConfig model;
  int batch = 32, steps = 200, warmup = -1, eval_every = 50, eval_windows = 64, threads = 0;
  double lr = 3e-3, weight_decay = 0.1, clip = 1.0;
  std::uint64_t seed = 1;
  std::pair<int, int> mesh{0, 0};
  fs::DeviceType device = fs::DeviceType::cpu;
  std::optional<fs::DType> param_dtype;
  fs::fsdp::ReshardAfterForward reshard = fs::fsdp::ReshardAfterForward::automatic();
  std::string data = "/usr/share/common-licenses";
  std::set<std::string> val{"MPL", "Apache"};
  std::string init_from, save_to, batches, write_config;
  bool deferred = false, in_backward = false;
  fs::session::CheckpointSpec checkpoint;
  int save_every = 0;
  bool async_save = false;
};

/// `device_args`: the --device arguments taken out of argv before the Runtime (take_flag).
Config parse(int argc, char** argv, const std::vector<std::string>& device_args) {
  Config c;
  fs::apps::ArgParser a(argc, argv, device_args);
  while (a.next()) {
    const std::string& f = a.flag();
    if (f == "--d-model")
      c.model.d_model = a.int_value(1, 1 << 16);
    else if (f == "--layers")
      c.model.layers = a.int_value(1, 4096);
    else if (f == "--heads")
      c.model.heads = a.int_value(1, 4096);
    else if (f == "--context")
      c.model.context = a.int_value(2, 1 << 20);
    else if (f == "--dropout")
      c.model.dropout = a.double_value(0, 0.99);
    else if (f == "--checkpoint-blocks")
      a.no_value(), c.model.checkpoint_blocks = true;
    else if (f == "--batch")
      c.batch = a.int_value(1);
    else if (f == "--steps")
      c.steps = a.int_value(1);
    else if (f == "--lr")
      c.lr = a.double_value(0, 10);
    else if (f == "--warmup")
      c.warmup = a.int_value(0);
    else if (f == "--weight-decay")
      c.weight_decay = a.double_value(0, 10);
    else if (f == "--clip")
      c.clip = a.double_value(0, 1e30);
    else if (f == "--seed")
      c.seed = static_cast<std::uint64_t>(a.int64_value(0));
    else if (f == "--mesh")
      c.mesh = a.mesh_value();
    else if (f == "--device")
      c.device = a.device_value();
    else if (f == "--param-dtype")
      c.param_dtype = a.dtype_value();
    else if (f == "--reshard")
      c.reshard = a.reshard_value();
    else if (f == "--data")
      c.data = a.value();
    else if (f == "--val") {
      c.val.clear();
      std::stringstream ss(a.value());
      for (std::string v; std::getline(ss, v, ',');)
        if (!v.empty()) c.val.insert(v);
    } else if (f == "--eval-every")
      c.eval_every = a.int_value(0);
    else if (f == "--eval-windows")
      c.eval_windows = a.int_value(1);
    else if (f == "--torch-threads")
      c.threads = a.int_value(1, 4096);
    else if (f == "--init-from")
      c.init_from = a.value();
    else if (f == "--save-to")
      c.save_to = a.value();
    else if (f == "--batches")
      c.batches = a.value();
    else if (f == "--write-config")
      c.write_config = a.value();
    else if (f == "--optimizer-in-backward")
      a.no_value(), c.in_backward = true;
    else if (f == "--checkpoint-dir")
      c.checkpoint.dir = a.value();
    else if (f == "--save-every")
      c.save_every = a.int_value(0);
    else if (f == "--async-save")
      a.no_value(), c.async_save = true;
    else if (f == "--keep-last")
      c.checkpoint.keep_last = a.int_value(0);
    else if (f == "--resume")
      a.no_value(), c.checkpoint.resume = true;
    else if (f == "--start-over")
      a.no_value(), c.checkpoint.start_over = true;
    else if (f == "--deferred-init")
      a.no_value(), c.deferred = true;
    else
      a.unknown();
  }
  if (c.warmup < 0) c.warmup = c.steps / 10;
  if ((c.save_every > 0 || c.checkpoint.resume || c.checkpoint.start_over) &&
      c.checkpoint.dir.empty())
    throw fs::apps::UsageError{"--save-every, --resume and --start-over need --checkpoint-dir"};
  if (c.checkpoint.resume && c.checkpoint.start_over)
    throw fs::apps::UsageError{"--resume and --start-over contradict each other"};
#if !defined(FULLSHARD_GPT_HAVE_CUDA)
  if (c.device == fs::DeviceType::cuda)
    throw fs::apps::UsageError{
        "--device cuda: this fullshard-train-gpt was built without CUDA (it needs fullshard "
        "built against a CUDA-enabled Kokkos and a LibTorch with CUDA: docs/gpu.md)"};
#endif
  if (c.device == fs::DeviceType::cuda && c.deferred)
    throw fs::apps::UsageError{"--deferred-init is not supported with --device cuda yet"};
  c.model.deferred = c.deferred;
  c.model.seed = c.seed;
  if (c.warmup >= c.steps)
    throw fs::apps::UsageError{"--warmup (" + std::to_string(c.warmup) +
                               ") must be below --steps (" + std::to_string(c.steps) + ")"};
  if (c.model.d_model % c.model.heads != 0)
    throw fs::apps::UsageError{"--heads (" + std::to_string(c.model.heads) +
                               ") must divide --d-model (" + std::to_string(c.model.d_model) + ")"};
  return c;
}

// The corpus: each distinct licence text once, split by family into training and validation.
struct Corpus {
  std::vector<std::uint8_t> train, val;
  std::vector<std::string> train_files, val_files;
};

Corpus read_corpus(const Config& c) {
  namespace stdfs = std::filesystem;
  std::error_code ec;
  if (!stdfs::is_directory(c.data, ec))
    throw fs::ConfigError("--data " + c.data + ": not a directory");
  std::vector<stdfs::path> files;
  for (const auto& e : stdfs::directory_iterator(c.data))
    if (e.is_regular_file()) files.push_back(e.path());  // follows links
  std::sort(files.begin(), files.end());
  Corpus corpus;
  std::set<std::string> seen;
  std::set<std::string> families;
  for (const auto& p : files) {
    // A regular file of at most 1 GiB, opened without blocking (the library's text reader).
    const std::string text = fs::read_text_file(p.string(), "--data file");
    if (text.empty() || !seen.insert(text).second) continue;  // a link to a text read already
    const std::string name = p.filename().string();
    const std::string family = name.substr(0, name.find('-'));
    families.insert(family);
    const bool val = c.val.count(family) > 0;
    auto& to = val ? corpus.val : corpus.train;
    to.insert(to.end(), text.begin(), text.end());
    (val ? corpus.val_files : corpus.train_files).push_back(name);
  }
  for (const std::string& v : c.val)
    if (!families.count(v))
      throw fs::ConfigError("--val: no licence family '" + v + "' in " + c.data);
  const auto need = static_cast<std::size_t>(c.model.context) + 1;
  if (corpus.train.size() < need || corpus.val.size() < need)
    throw fs::ConfigError("--data " + c.data + ": the training (" +
                          std::to_string(corpus.train.size()) + " bytes) and validation (" +
                          std::to_string(corpus.val.size()) + " bytes) texts must each hold " +
                          "at least --context + 1 bytes");
  return corpus;
}

double unigram_entropy(const std::vector<std::uint8_t>& bytes) {
  std::vector<double> n(256, 0.0);
  for (std::uint8_t b : bytes)
    n[b] += 1;
  double h = 0;
  for (double k : n)
    if (k > 0) h -= k / double(bytes.size()) * std::log(k / double(bytes.size()));
  return h;
}

// `count` windows of context + 1 bytes at random offsets drawn from `gen`.
at::Tensor windows(const std::vector<std::uint8_t>& text, std::int64_t count, std::int64_t len,
                   at::Generator& gen) {
  const at::Tensor all = ::torch::from_blob(const_cast<std::uint8_t*>(text.data()),
                                            {static_cast<std::int64_t>(text.size())}, at::kByte);
  const at::Tensor starts = at::randint(static_cast<std::int64_t>(text.size()) - len, {count}, gen,
                                        at::TensorOptions().dtype(at::kLong));
  const at::Tensor idx = starts.unsqueeze(1) + at::arange(len, at::kLong).unsqueeze(0);
  return all.index({idx}).to(at::kLong);
}

// The global batches of a --batches file: [steps][batch][context + 1] int64 tokens.
/// --batches: a regular file of exactly the run's tokens, checked before anything is allocated
/// (a short file is refused naming both sizes, not found after allocating the run's batches).
std::int64_t batches_file_tokens(const Config& c) {
  namespace stdfs = std::filesystem;
  const std::string name = "--batches " + c.batches;
  std::error_code ec;
  const stdfs::file_status st = stdfs::status(c.batches, ec);
  if (!stdfs::exists(st)) throw fs::ConfigError(name + ": no such file");
  if (!stdfs::is_regular_file(st))
    throw fs::ConfigError(name + ": not a regular file" +
                          (stdfs::is_directory(st) ? " (a directory)" : " (a special file)"));
  const std::int64_t len = c.model.context + 1;
  const std::int64_t n = fs::checked_mul<fs::ConfigError>(
      fs::checked_mul<fs::ConfigError>(std::int64_t{c.steps}, std::int64_t{c.batch}, name), len,
      name);
  const std::int64_t bytes = fs::checked_mul<fs::ConfigError>(n, std::int64_t{8}, name);
  const auto size = static_cast<std::int64_t>(stdfs::file_size(c.batches, ec));
  if (ec || size != bytes)
    throw fs::ConfigError(name + ": expected exactly " + std::to_string(bytes) + " bytes (" +
                          std::to_string(c.steps) + " steps x " + std::to_string(c.batch) +
                          " sequences x " + std::to_string(len) + " int64 tokens), the file has " +
                          (ec ? "an unknown size (" + ec.message() + ")" : std::to_string(size)));
  return n;
}

at::Tensor read_batches(const Config& c) {
  const std::int64_t n = batches_file_tokens(c);
  std::ifstream in(c.batches, std::ios::binary);
  if (!in) throw fs::ConfigError("--batches " + c.batches + ": cannot open the file");
  const std::int64_t len = c.model.context + 1;
  at::Tensor t = at::empty({c.steps, c.batch, len}, at::kLong);
  in.read(reinterpret_cast<char*>(t.data_ptr<std::int64_t>()), n * 8);
  if (in.gcount() != n * 8)
    throw fs::ConfigError("--batches " + c.batches + ": the file shrank while it was read");
  if (t.min().item<std::int64_t>() < 0 || t.max().item<std::int64_t>() >= c.model.vocab) {
    const at::Tensor flat = t.reshape({-1});
    const std::int64_t at_token =
        at::logical_or(flat < 0, flat >= c.model.vocab).nonzero()[0][0].item<std::int64_t>();
    throw fs::ConfigError("--batches " + c.batches + ": token " +
                          std::to_string(flat[at_token].item<std::int64_t>()) + " (step " +
                          std::to_string(at_token / (c.batch * len) + 1) + ", sequence " +
                          std::to_string(at_token / len % c.batch) + ", position " +
                          std::to_string(at_token % len) + ") is outside the vocabulary [0, " +
                          std::to_string(c.model.vocab) + ")");
  }
  return t;
}

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) / 1024.0;
}

// The session's configuration of the options: what the program trains, stated once.
fs::session::Config session_config(const Config& c) {
  fs::session::Config s;
  s.source = "fullshard-train-gpt options";
  fs::session::ModelSpec& m = s.model;
  m.type = "gpt";
  m.vocab = c.model.vocab;
  m.context = c.model.context;
  m.d_model = c.model.d_model;
  m.heads = c.model.heads;
  m.layers = c.model.layers;
  m.mlp_ratio = c.model.mlp_ratio;
  m.dropout = c.model.dropout;
  m.checkpoint_blocks = c.model.checkpoint_blocks;
  m.deferred_init = c.deferred;
  s.loss = "next_token";
  fs::session::OptimizerSpec& o = s.optimizer;
  o.type = "adamw";
  o.lr = c.lr;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.weight_decay = c.in_backward ? 0.0 : c.weight_decay;
  // As GPT-2: weight decay on the blocks' matrices only.
  if (!c.in_backward && c.weight_decay > 0)
    o.no_weight_decay = {"tok.*", "pos.*", "ln_f.*", "*.bias", "*.ln*"};
  o.in_backward = c.in_backward;
  s.lr_schedule.type = "warmup_cosine";
  s.lr_schedule.warmup_steps = c.warmup;
  s.lr_schedule.total_steps = c.steps;
  s.lr_schedule.min_lr = c.lr / 10;
  s.grad_clip = c.in_backward ? 0.0 : c.clip;
  if (c.param_dtype) {
    s.param_dtype = c.param_dtype;
    s.reduce_dtype = fs::DType::f32;
  }
  s.sharding.reshard_after_forward = c.reshard;
  s.checkpoint = c.checkpoint;
  s.seed = c.seed;
  s.threads = c.threads;
  // The session's advice names this program's options.
  s.option_names = {{"checkpoint.resume", "--resume"},
                    {"checkpoint.start_over", "--start-over"},
                    {"model.deferred_init", "--deferred-init"}};
  return s;
}

int run(const Config& c, fs::Runtime& rt) {
  const int world = rt.world_size(), rank = rt.rank();
  const int threads = c.threads > 0 ? c.threads : fst::use_launcher_cores(rt);
  const auto [reps, shard] = c.mesh.first > 0 ? c.mesh : std::pair{1, world};
  if (reps * shard != world)
    throw fs::apps::UsageError{"--mesh " + std::to_string(reps) + "x" + std::to_string(shard) +
                               " needs " + std::to_string(reps * shard) + " ranks, not " +
                               std::to_string(world)};
  if (c.batch % world != 0)
    throw fs::apps::UsageError{"--batch " + std::to_string(c.batch) + " must be divisible by the " +
                               std::to_string(world) + " ranks"};
  if (c.in_backward && (c.clip > 0 || c.weight_decay > 0) && rank == 0)
    std::printf(
        "fullshard-train-gpt: --optimizer-in-backward: no clipping (a global norm needs "
        "every gradient before any update) and no weight decay (a block's update is one "
        "rule, and its LayerNorms are not decayed)\n");
  const Corpus corpus = read_corpus(c);
  const double unigram = unigram_entropy(corpus.val);

  fs::DeviceMesh mesh = reps > 1
                            ? fs::DeviceMesh(rt, c.device, {reps, shard}, {"replicate", "shard"})
                            : fs::DeviceMesh(rt, c.device, {world}, {"dp"});
  // Every file the run writes or reads by size, before anything is built: a bad path must not
  // cost the run.
  if (!c.save_to.empty()) fs::checkpoint::check_output_file(c.save_to, "--save-to", mesh);
  if (!c.write_config.empty())
    fs::checkpoint::check_output_file(c.write_config, "--write-config", mesh);
  if (!c.batches.empty()) batches_file_tokens(c);
  fs::session::Session session(mesh, session_config(c));
  if (!c.write_config.empty() && rank == 0) {
    std::ofstream out(c.write_config);
    out << fs::session::to_json(session.config(), 2) << "\n";
    if (!out) throw fs::ConfigError("--write-config " + c.write_config + ": cannot write the file");
  }
  if (!c.init_from.empty()) {
    try {
      session.import_safetensors(c.init_from);
    } catch (const fs::InvalidArgument& e) {  // refused on every rank: exit 2, not an abort
      throw fs::ConfigError(std::string("--init-from: ") + e.message());
    }
  }
  const at::Tensor file_batches = c.batches.empty() ? at::Tensor() : read_batches(c);
  const c10::Device device = session.device();
  fs::fsdp::FSDPModule& root = session.sharded().state(session.module());
  auto pool_peak_mib = [&] { return double(root.pool_peak_bytes()) / (1 << 20); };
  // The program's own sums (the loss over the ranks), under the library's timeout.
  fs::apps::BoundedComm sums(mesh.control_world(), "gpt.report", mesh.timeout_s());
  auto mean_over_ranks = [&](double v, const char* what) {
    sums.allreduce(&v, 1, MPI_DOUBLE, MPI_SUM, what);
    return v / world;
  };

  if (rank == 0)
    std::printf(
        "fullshard-train-gpt: %lld parameters, d_model %lld, %lld blocks x %lld heads, context "
        "%lld; global batch %d on %d ranks (%s), %d LibTorch threads per rank; %zu training "
        "bytes (%zu texts), %zu validation bytes (%zu texts), unigram entropy %.4f nats/byte\n",
        static_cast<long long>(session.num_params()), static_cast<long long>(c.model.d_model),
        static_cast<long long>(c.model.layers), static_cast<long long>(c.model.heads),
        static_cast<long long>(c.model.context), c.batch, world, mesh.describe().c_str(), threads,
        corpus.train.size(), corpus.train_files.size(), corpus.val.size(), corpus.val_files.size(),
        unigram);
  if (rank == 0 && session.step() > 0)
    std::printf("resumed at step %lld from %s\n", static_cast<long long>(session.step()),
                c.checkpoint.dir.c_str());
  if (rank == 0)
    session.set_progress({nullptr, [](const fs::session::SaveMetrics& m) {
                            std::printf("saved step %lld into %s%s\n",
                                        static_cast<long long>(m.step), m.step_dir.c_str(),
                                        m.asynchronous ? " (asynchronous)" : "");
                          }});

  at::Generator data_gen = at::detail::createCPUGenerator(c.seed + 1000);
  const std::int64_t len = c.model.context + 1;
  const int local = c.batch / world;
  auto evaluate = [&](std::int64_t step) {
    at::Generator g = at::detail::createCPUGenerator(c.seed + 7);  // the same windows each time
    const at::Tensor all = windows(corpus.val, c.eval_windows * world, len, g);
    double sum = 0;
    const int per_rank = c.eval_windows;
    for (int at = 0; at < per_rank; at += local) {
      const int n = std::min(local, per_rank - at);
      const at::Tensor w = all.narrow(0, rank * per_rank + at, n).to(device);
      sum += session.evaluate({w}, {}) * n;
    }
    const double val = mean_over_ranks(sum, "validation loss (MPI_Iallreduce)") / per_rank;
    if (rank == 0)
      std::printf("eval step %lld val_loss %.4f unigram %.4f ratio %.3f\n",
                  static_cast<long long>(step), val, unigram, val / unigram);
    std::fflush(stdout);
    return val;
  };

  std::vector<double> times;
  double first_loss = 0, last_loss = 0, last_val = 0;
  fs::apps::MemoryReport memory;
  const auto t0 = std::chrono::steady_clock::now();
  // The windows of the steps a resumed run already took are drawn (and dropped): the same
  // batches as a straight run.
  for (std::int64_t skipped = 0; !file_batches.defined() && skipped < session.step(); ++skipped)
    windows(corpus.train, c.batch, len, data_gen);
  while (session.step() < c.steps) {
    const std::int64_t step = session.step() + 1;
    const auto start = std::chrono::steady_clock::now();
    const at::Tensor batch = file_batches.defined()
                                 ? file_batches[step - 1]
                                 : windows(corpus.train, c.batch, len, data_gen);  // every rank
    const double loss =
        mean_over_ranks(session.train_step({batch.narrow(0, rank * local, local).to(device)}, {}),
                        "training loss (MPI_Iallreduce)");
    session.poll_save();
    if (std::isnan(loss)) {  // a non-finite value: the session skipped the step on every rank
      if (rank == 0)
        std::printf("step %lld skipped (a non-finite value; %lld skipped so far)\n",
                    static_cast<long long>(step), static_cast<long long>(session.skipped_steps()));
      continue;
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    times.push_back(ms);
    memory.sample();
    if (times.size() == 1) first_loss = loss;
    last_loss = loss;
    if (rank == 0)
      std::printf("step %lld loss %.9f step_ms %.3f peak_mib %.2f\n", static_cast<long long>(step),
                  loss, ms, pool_peak_mib());
    std::fflush(stdout);
    if (c.save_every > 0 && (step % c.save_every == 0 || step == c.steps)) {
      if (c.async_save) {
        if (session.save_in_flight()) session.wait_save();
        session.save_async();
      } else {
        session.save();
      }
    }
    if ((c.eval_every > 0 && step % c.eval_every == 0) || step == c.steps)
      last_val = evaluate(step);
  }
  if (session.save_in_flight()) session.wait_save();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!c.save_to.empty()) session.export_safetensors(c.save_to);
  if (times.empty()) {
    if (rank == 0)
      std::printf("summary: nothing to train: the checkpoint is at step %lld of %d\n",
                  static_cast<long long>(session.step()), c.steps);
    return 0;
  }
  // The account of host memory (a CUDA mesh's tensors are the device's). The activations are
  // the session's measure of the first step (LibTorch's host bytes).
  if (device.is_cpu())
    memory.print(mesh, rt.world(), session.planned_memory(), session.planned_memory().activations);
  std::sort(times.begin(), times.end());
  if (rank == 0)
    std::printf(
        "summary: %zu steps in %.1f s, loss %.4f -> %.4f, val_loss %.4f = %.3f x the "
        "unigram entropy, median step %.2f ms, pool peak %.2f MiB, max RSS %.1f MiB\n",
        times.size(), secs, first_loss, last_loss, last_val, last_val / unigram,
        times[times.size() / 2], pool_peak_mib(), peak_rss_mib());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  fs::apps::run_on_best_blas_kernel(argv);
  if (fs::apps::take_help(argc, argv)) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  // Kokkos 3 reads --device (its device number): parsed here after the Runtime instead.
  const std::vector<std::string> device_args = fs::apps::take_flag(argc, argv, "--device");
#if defined(FULLSHARD_GPT_HAVE_CUDA)
  // --device cuda without a visible GPU: skipped (exit 77, what scripts/gpu-run expects),
  // asked before the Runtime starts (a CUDA-enabled Kokkos cannot start without a device).
  if (fs::apps::asks_for_cuda(device_args) && ::torch::cuda::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device visible: fullshard-train-gpt --device cuda needs a GPU\n");
    return 77;
  }
#endif
  std::optional<fs::Runtime> rt;
  try {
    rt.emplace(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fullshard-train-gpt: %s\n", fs::apps::one_line(e.what()).c_str());
    return fs::apps::startup_exit_code(e, 1);
  }
  try {
    return run(parse(argc, argv, device_args), *rt);
  } catch (const fs::apps::UsageError& e) {
    if (rt->rank() == 0)
      std::fprintf(stderr, "fullshard-train-gpt: %s (see --help)\n", e.message.c_str());
    return 2;
  } catch (const fs::ConfigError& e) {
    if (rt->rank() == 0)
      std::fprintf(stderr, "fullshard-train-gpt: %s\n", fs::apps::one_line(e.what()).c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fullshard-train-gpt: rank %d: %s\n", rt->rank(),
                 fs::apps::one_line(e.what()).c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}
