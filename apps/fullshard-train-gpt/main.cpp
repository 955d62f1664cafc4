// fullshard-train-gpt: a byte-level GPT (fullshard::torch::Gpt, LibTorch) trained with
// fully_shard on every block and on the root, on the licence texts every Debian machine has
// (/usr/share/common-licenses): whole licence families held out for validation.
#include <mpi.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "blas_kernel.hpp"
#include "cli.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/checkpoint/safetensors.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "fullshard/runtime/runtime.hpp"
#include "fullshard/torch.hpp"
#include "fullshard/torch/gpt.hpp"
#include "fullshard/torch/threads.hpp"

#include <torch/cuda.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

namespace fs = fullshard;
namespace fst = fullshard::torch;

namespace {

const char* kUsage =
    "usage: mpirun -n N fullshard-train-gpt [options]\n"
    "\n"
    "Trains a byte-level GPT-style decoder (LibTorch, fullshard::torch) with fully_shard on\n"
    "every block and on the root. Data: the licence texts of a directory (default\n"
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
    "                        launcher gave the rank, see README)\n"
    "weights and batches from files (side-by-side runs, bench/torch/):\n"
    "  --init-from FILE      initial weights from a safetensors file (FQNs as names)\n"
    "  --save-to FILE        the final weights as one safetensors file\n"
    "  --batches FILE        the global batches: little-endian int64 tokens, shape\n"
    "                        [steps][batch][context + 1], instead of random windows\n"
    "  --no-shard            plain LibTorch on one rank (no fully_shard; the reference of\n"
    "                        the cost of sharding; the same batches and optimizer)\n"
    "  --deferred-init       build the model on the meta device, block by block, and draw\n"
    "                        only each rank's shards (other values than the default's)\n";

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
  std::string init_from, save_to, batches;
  bool no_shard = false, deferred = false;
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
    else if (f == "--no-shard")
      a.no_value(), c.no_shard = true;
    else if (f == "--deferred-init")
      a.no_value(), c.deferred = true;
    else
      a.unknown();
  }
  if (c.warmup < 0) c.warmup = c.steps / 10;
  if (c.no_shard && c.deferred)
    throw fs::apps::UsageError{"--deferred-init needs a sharded run (not --no-shard)"};
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
  if (c.no_shard && !c.save_to.empty())
    throw fs::apps::UsageError{"--save-to needs a sharded run (not --no-shard)"};
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
    std::ifstream in(p, std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
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
at::Tensor read_batches(const Config& c) {
  std::ifstream in(c.batches, std::ios::binary);
  if (!in) throw fs::ConfigError("--batches " + c.batches + ": cannot open the file");
  const std::int64_t len = c.model.context + 1;
  const std::int64_t n = std::int64_t{c.steps} * c.batch * len;
  at::Tensor t = at::empty({c.steps, c.batch, len}, at::kLong);
  in.read(reinterpret_cast<char*>(t.data_ptr<std::int64_t>()), n * 8);
  if (in.gcount() != n * 8 || in.peek() != std::char_traits<char>::eof())
    throw fs::ConfigError("--batches " + c.batches + ": expected exactly " + std::to_string(n * 8) +
                          " bytes (" + std::to_string(c.steps) + " steps x " +
                          std::to_string(c.batch) + " sequences x " + std::to_string(len) +
                          " int64 tokens)");
  if (t.min().item<std::int64_t>() < 0 || t.max().item<std::int64_t>() >= c.model.vocab)
    throw fs::ConfigError("--batches " + c.batches + ": tokens outside [0, " +
                          std::to_string(c.model.vocab) + ")");
  return t;
}

// The model's weights as one safetensors file: a full checkpoint beside it, converted.
void save_safetensors(const std::string& path, fs::graph::Module& graph, int rank) {
  const std::string dir = path + ".ckpt";
  fs::checkpoint::SaveOptions so;
  so.kind = fs::checkpoint::Kind::full;
  const std::string step_dir = fs::checkpoint::save(dir, graph, nullptr, 0, {}, {}, so);
  if (rank == 0) {
    fs::checkpoint::checkpoint_to_safetensors(step_dir, path);
    std::filesystem::remove_all(dir);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) / 1024.0;
}

int run(const Config& c, fs::Runtime& rt) {
  const int world = rt.world_size(), rank = rt.rank();
  if (c.threads > 0) ::torch::set_num_threads(c.threads);
  const int threads = c.threads > 0 ? c.threads : fst::use_launcher_cores(rt);
  const auto [reps, shard] = c.mesh.first > 0 ? c.mesh : std::pair{1, world};
  if (reps * shard != world)
    throw fs::apps::UsageError{"--mesh " + std::to_string(reps) + "x" + std::to_string(shard) +
                               " needs " + std::to_string(reps * shard) + " ranks, not " +
                               std::to_string(world)};
  if (c.no_shard && world != 1)
    throw fs::apps::UsageError{"--no-shard runs on one rank, not " + std::to_string(world)};
  if (c.batch % world != 0)
    throw fs::apps::UsageError{"--batch " + std::to_string(c.batch) + " must be divisible by the " +
                               std::to_string(world) + " ranks"};
  const Corpus corpus = read_corpus(c);
  const double unigram = unigram_entropy(corpus.val);

  fs::DeviceMesh mesh = reps > 1
                            ? fs::DeviceMesh(rt, c.device, {reps, shard}, {"replicate", "shard"})
                            : fs::DeviceMesh(rt, c.device, {world}, {"dp"});
  // The rank's GPU: the Runtime bound it (device 0 of what the rank sees).
  const c10::Device device =
      c.device == fs::DeviceType::cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  ::torch::manual_seed(c.seed);  // the same initial weights on every rank
  fst::Gpt model(c.model);
  if (device.is_cuda()) model->to(device);  // drawn on the host: the CPU run's weights
  fst::ShardedModel sharded(model);         // with --no-shard only the mirror (safetensors)
  fs::fsdp::FSDPModule* root = nullptr;
  if (!c.no_shard) {
    fs::fsdp::FullyShardOptions opts;
    opts.reshard_after_forward = c.reshard;
    if (c.param_dtype) {
      opts.mp_policy.param_dtype = c.param_dtype;
      opts.mp_policy.reduce_dtype = fs::DType::f32;
    }
    for (fst::GptBlock& b : model->block_list)
      sharded.fully_shard(b, mesh, opts);
    fs::fsdp::FullyShardOptions root_opts = opts;
    root_opts.reshard_after_forward = fs::fsdp::ReshardAfterForward::automatic();
    root = &sharded.fully_shard(*model, mesh, root_opts);
  }
  auto pool_peak_mib = [&] { return root ? double(root->pool_peak_bytes()) / (1 << 20) : 0.0; };

  if (!c.init_from.empty()) {
    fs::checkpoint::load_safetensors(c.init_from, sharded.graph());
  } else if (c.deferred) {  // each rank fills its rows: the values do not depend on the ranks
    sharded.initialize([&](const fst::LocalShard& s) { model->init_weights(s); });
  }
  const at::Tensor file_batches = c.batches.empty() ? at::Tensor() : read_batches(c);

  std::vector<at::Tensor> params;  // each tensor once (the shards)
  for (const at::Tensor& p : model->parameters())
    if (std::none_of(params.begin(), params.end(),
                     [&](const at::Tensor& q) { return q.is_same(p); }))
      params.push_back(p);
  // No weight decay on biases, LayerNorm weights and the embeddings, as GPT-2.
  std::vector<at::Tensor> decay, no_decay;
  for (const auto& np : model->named_parameters()) {
    if (std::none_of(params.begin(), params.end(),
                     [&](const at::Tensor& q) { return q.is_same(np.value()); }))
      continue;
    const bool matrix = np.key().find("blocks.") == 0 &&
                        np.key().find(".weight") != std::string::npos &&
                        np.key().find(".ln") == std::string::npos;
    (matrix ? decay : no_decay).push_back(np.value());
  }
  ::torch::optim::AdamW opt(
      {::torch::optim::OptimizerParamGroup(
           decay,
           std::make_unique<::torch::optim::AdamWOptions>(
               ::torch::optim::AdamWOptions(c.lr).betas({0.9, 0.95}).weight_decay(c.weight_decay))),
       ::torch::optim::OptimizerParamGroup(
           no_decay,
           std::make_unique<::torch::optim::AdamWOptions>(
               ::torch::optim::AdamWOptions(c.lr).betas({0.9, 0.95}).weight_decay(0.0)))});
  const fs::optim::WarmupCosine schedule(c.lr, c.warmup, c.steps, c.lr / 10);
  const std::vector<fs::graph::Parameter*> graph_params = sharded.graph().parameters();

  std::int64_t n_params = 0;
  for (const fs::graph::Parameter* p : graph_params)
    n_params += p->numel();
  if (rank == 0)
    std::printf(
        "fullshard-train-gpt: %lld parameters, d_model %lld, %lld blocks x %lld heads, context "
        "%lld; global batch %d on %d ranks (%s), %d LibTorch threads per rank; %zu training "
        "bytes (%zu texts), %zu validation bytes (%zu texts), unigram entropy %.4f nats/byte\n",
        static_cast<long long>(n_params), static_cast<long long>(c.model.d_model),
        static_cast<long long>(c.model.layers), static_cast<long long>(c.model.heads),
        static_cast<long long>(c.model.context), c.batch, world, mesh.describe().c_str(), threads,
        corpus.train.size(), corpus.train_files.size(), corpus.val.size(), corpus.val_files.size(),
        unigram);

  at::Generator data_gen = at::detail::createCPUGenerator(c.seed + 1000);
  const std::int64_t len = c.model.context + 1;
  const int local = c.batch / world;
  auto evaluate = [&](int step) {
    ::torch::NoGradGuard no_grad;
    model->eval();
    at::Generator g = at::detail::createCPUGenerator(c.seed + 7);  // the same windows each time
    const at::Tensor all = windows(corpus.val, c.eval_windows * world, len, g);
    double sum = 0;
    const int per_rank = c.eval_windows;
    for (int at = 0; at < per_rank; at += local) {
      const int n = std::min(local, per_rank - at);
      const at::Tensor w = all.narrow(0, rank * per_rank + at, n).to(device);
      sum += model->loss(w).item<double>() * n;
    }
    double total = 0;
    MPI_Allreduce(&sum, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    const double val = total / (double(per_rank) * world);
    model->train();
    if (rank == 0)
      std::printf("eval step %d val_loss %.4f unigram %.4f ratio %.3f\n", step, val, unigram,
                  val / unigram);
    std::fflush(stdout);
    return val;
  };

  std::vector<double> times;
  double first_loss = 0, last_loss = 0, last_val = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int step = 1; step <= c.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    const double lr = schedule.lr(step - 1);
    for (auto& group : opt.param_groups())
      static_cast<::torch::optim::AdamWOptions&>(group.options()).lr(lr);
    const at::Tensor batch = file_batches.defined()
                                 ? file_batches[step - 1]
                                 : windows(corpus.train, c.batch, len, data_gen);  // every rank
    opt.zero_grad();
    const at::Tensor loss = model->loss(batch.narrow(0, rank * local, local).to(device));
    // fst::call(model, ...) for the root: Gpt::loss calls forward, which calls the blocks;
    // the root's hooks run around it here.
    loss.backward();
    if (c.clip > 0 && root) fs::optim::clip_grad_norm(graph_params, c.clip, mesh);
    if (c.clip > 0 && !root) ::torch::nn::utils::clip_grad_norm_(params, c.clip);
    opt.step();
    double l = loss.item<double>(), mean = 0;
    MPI_Allreduce(&l, &mean, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    mean /= world;
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    times.push_back(ms);
    if (step == 1) first_loss = mean;
    last_loss = mean;
    if (rank == 0)
      std::printf("step %d loss %.9f step_ms %.3f peak_mib %.2f\n", step, mean, ms,
                  pool_peak_mib());
    std::fflush(stdout);
    if ((c.eval_every > 0 && step % c.eval_every == 0) || step == c.steps)
      last_val = evaluate(step);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!c.save_to.empty()) save_safetensors(c.save_to, sharded.graph(), rank);
  std::sort(times.begin(), times.end());
  if (rank == 0)
    std::printf(
        "summary: %d steps in %.1f s, loss %.4f -> %.4f, val_loss %.4f = %.3f x the "
        "unigram entropy, median step %.2f ms, pool peak %.2f MiB, max RSS %.1f MiB\n",
        c.steps, secs, first_loss, last_loss, last_val, last_val / unigram, times[times.size() / 2],
        pool_peak_mib(), peak_rss_mib());
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
