// fullshard-train: data-parallel training of a residual MLP with fully_shard, on a synthetic
// teacher task (MSE regression onto a fixed random network). Each rank takes its slice of the
// global batch, so with the same global batch the loss curve does not depend on the number
// of ranks (up to floating-point summation order).
//
//   mpirun -n 4 fullshard-train --layers 8 --hidden 512 --batch 256 --steps 100 --seed 1
#include <malloc.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "blas_kernel.hpp"
#include "bounded_comm.hpp"
#include "cli.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/checkpoint/safetensors.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "fullshard/runtime/blas.hpp"
#include "fullshard/runtime/runtime.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "fullshard/schedule/compute_cost.hpp"
#include "fullshard/schedule/memory_account.hpp"
#include "fullshard/schedule/memory_budget.hpp"
#include "fullshard/session/config.hpp"
#include "fullshard/session/native_session.hpp"
#include "memory_report.hpp"
#include "mlp_cost.hpp"
#include "residual_mlp.hpp"
#include "teacher.hpp"
#if defined(FULLSHARD_APPS_HAVE_CUDA)
#include "residual_mlp_cuda.hpp"
#endif

namespace {

namespace apps = fullshard::apps;
namespace schedule = fullshard::schedule;
using Clock = std::chrono::steady_clock;

const char* const kUsage =
    "usage: mpirun -n N fullshard-train [options]\n"
    "\n"
    "Trains a residual MLP (input layer, L residual blocks of two hidden x hidden layers,\n"
    "output layer) with fully_shard on every block and on the root, on a synthetic teacher\n"
    "task: inputs ~ N(0, 1), targets from a fixed random tanh network, MSE loss. Each rank\n"
    "takes its slice of the global batch. Prints one line per step:\n"
    "  step <i> loss <value> step_ms <t> comm_ms <t> peak_mib <pool peak>\n"
    "\n"
    "model and data:\n"
    "  --layers L            residual blocks (default 4)\n"
    "  --hidden H            hidden size (default 256)\n"
    "  --inputs I            input features (default 32)\n"
    "  --outputs O           outputs (default 8)\n"
    "  --batch B             global batch, split over the ranks (default 64)\n"
    "  --steps S             training steps (default 20)\n"
    "  --seed N              initial values and data (default 1)\n"
    "optimizer:\n"
    "  --optimizer adamw|sgd (default adamw)\n"
    "  --lr X                peak learning rate (default 1e-3)\n"
    "  --weight-decay X      (default 0)\n"
    "  --momentum X          SGD momentum (default 0.9)\n"
    "  --warmup N            linear warm-up steps, then cosine decay to 0 at S (default: no\n"
    "                        schedule, constant lr)\n"
    "  --clip X              clip the global gradient norm to X (default: off)\n"
    "  --non-finite P        a step whose loss or gradients hold a NaN or an infinity is\n"
    "                        never applied: skip (default: skipped, counted, a warning line;\n"
    "                        the run goes on) or stop (exit 1 naming the step); inside\n"
    "                        backward the update is applied first, so the run stops;\n"
    "                        on --device cuda the values are read every few steps, after\n"
    "                        they were applied, so the run stops there, before a checkpoint\n"
    "                        holds them\n"
    "  --max-skipped N       skipped steps before the run stops (default 10)\n"
    "  --optimizer-in-backward\n"
    "                        each group's update runs inside backward, as soon as its\n"
    "                        reduction lands, on the reduction's stream (the same values; no\n"
    "                        gradient is kept; not with --clip)\n"
    "device:\n"
    "  --device cpu|cuda     where the model trains: cpu (host memory, MPI collectives,\n"
    "                        OpenBLAS; the default) or cuda (one GPU per rank: a CUDA mesh,\n"
    "                        NCCL, cuBLAS and Kokkos kernels on the mesh's compute stream;\n"
    "                        needs a build against a CUDA-enabled Kokkos, docs/gpu.md)\n"
    "fully_shard and the schedule:\n"
    "  --mesh N | RxN        FSDP over N ranks, or HSDP: R replicas of N-rank shard groups\n"
    "                        (default: FSDP over every rank)\n"
    "  --param-dtype T       mixed precision: dtype of the unsharded parameters (bf16, f16)\n"
    "  --reduce-dtype T      dtype of the gradient reduce-scatter (default: f32 with\n"
    "                        --param-dtype, else the parameter dtype)\n"
    "  --compress-gather C   send the parameters' all-gather as 8-bit codes with a scale per\n"
    "                        block: int8 or fp8_e4m3 (default: uncompressed; changes the\n"
    "                        numbers, docs/compression.md)\n"
    "  --compress-reduce C   send the gradients' reduce-scatter as int8 codes, summed in f32\n"
    "                        (C: int8; default: uncompressed)\n"
    "  --compress-block N    elements per scale of both, a power of two (default 256)\n"
    "  --allow-compression   let --auto-plan choose int8 all-gathers and reduce-scatters\n"
    "                        when the plan predicts them faster\n"
    "  --reshard true|false|auto|K\n"
    "                        reshard_after_forward of every group (default auto)\n"
    "  --prefetch D          forward prefetch depth (default 1; 0: implicit only)\n"
    "output:\n"
    "checkpoints (docs/checkpoint-format.md):\n"
    "  --checkpoint-dir DIR  save checkpoints there (each save a new step directory; the\n"
    "                        previous one stays loadable until the new one is complete);\n"
    "                        created and proven writable before the first step (exit 2\n"
    "                        otherwise; its parent must exist), with a warning when its file\n"
    "                        system has less free space than a checkpoint\n"
    "  --keep-last K         keep the K newest checkpoints in --checkpoint-dir, deleting\n"
    "                        older step directories once a new one is complete (default 0:\n"
    "                        keep all; the one resumed from is never deleted)\n"
    "  --save-every N        save after every N-th step and after the last (default: only\n"
    "                        after the last step, when --checkpoint-dir is given)\n"
    "  --checkpoint-kind K   sharded (every rank writes its shards, default) or full (rank 0\n"
    "                        writes one consolidated file)\n"
    "  --async-save          sharded saves in the background: each rank copies its shards\n"
    "                        into host staging memory and trains on while a thread writes\n"
    "                        them; the checkpoint is committed at the first step boundary\n"
    "                        after every rank's write (the last save is waited for); the\n"
    "                        staging memory is reserved before the first step\n"
    "  --stop-after N        end this run after global step N (e.g. to fit a job's time\n"
    "                        limit; with --checkpoint-dir a checkpoint is saved there);\n"
    "                        --steps stays the total that the lr schedule spans\n"
    "  --resume DIR          continue from the checkpoint in DIR (saved on any number of\n"
    "                        ranks or mesh) up to --steps S, the total; model, --batch and\n"
    "                        --seed must be those of the saved run\n"
    "  --start-over          a fresh run in a --checkpoint-dir that holds checkpoints\n"
    "                        (refused otherwise; they are kept: --keep-last deletes only the\n"
    "                        checkpoints of this run and of the run it resumed). A run owns\n"
    "                        its --checkpoint-dir: a second run on it is refused at start\n"
    "                        (a lock with a heartbeat, docs/guide/checkpoints.md)\n"
    "  --init-from FILE      start from these weights (step 0, a fresh optimizer): a\n"
    "                        .safetensors file (each rank reads only its shards' bytes) or\n"
    "                        a fullshard checkpoint (its parameters); names and shapes must\n"
    "                        be the model's (a safetensors dtype other than the model's is\n"
    "                        converted, and the count printed)\n"
    "  --auto-plan           let the planner choose the fully_shard calls, reshard_after_forward\n"
    "                        per group, prefetch depth and reduce-scatter buffers (needs\n"
    "                        --memory-budget; replaces --prefetch and --reshard)\n"
    "  --memory-budget SIZE  the memory a rank may use, e.g. 3GiB: the whole process (default:\n"
    "                        the cgroup limit or MemAvailable shared by the node's ranks);\n"
    "                        a job whose planned peak exceeds it stops before creating the\n"
    "                        model (docs/memory.md); --auto-plan plans within it\n"
    "  --memory-check refuse|warn|off  what a job over the budget does (default refuse)\n"
    "  --trace FILE          write the plan and the measured timeline (Chrome/Perfetto JSON)\n"
    "prediction (docs/plan-format.md, \"Compute calibration JSON\"):\n"
    "  --cost FILE           the plan's cost model (fullshard-calibrate --out; default: the\n"
    "                        host defaults for the mesh)\n"
    "  --compute FILE        compute rates (fullshard-calibrate --compute-out): each module\n"
    "                        declares its measured time when the file has module times\n"
    "                        for this shape (--mlp ROWSxHIDDEN, rows per rank), else its\n"
    "                        FLOPs and bytes at the rates (the run says which)\n"
    "  --predict             print the predicted step next to the measured median (implied\n"
    "                        by --cost and --compute): the plan's ops one after the other\n"
    "                        (host streams run inline) plus the optimizer step\n"
    "  --graph-out FILE      write the model's graph JSON (the declared costs and the plan's\n"
    "                        fully_shard requests) for fullshard-plan\n"
    "  --write-config FILE   the training session's configuration as JSON (rank 0): these\n"
    "                        options as the session takes them (fullshard::session::\n"
    "                        NativeSession, \"model\": {\"type\": \"native\"})\n"
    "  --log-every N         print every N-th step line (default 1; the last step always)\n"
    "  --help                print this help\n"
    "\n"
    "Exit status: 0 on success, 2 on bad options, 1 on a runtime error, 77 with --device\n"
    "cuda where no CUDA device is visible (\"SKIPPED: no CUDA device ...\").\n";

struct Config {
  apps::MlpShape shape{32, 256, 8, 4};
  std::int64_t batch = 64;
  int steps = 20;
  std::uint64_t seed = 1;
  std::string optimizer = "adamw";
  double lr = 1e-3, weight_decay = 0.0, momentum = 0.9, clip = 0.0;
  fullshard::session::NonFiniteSpec non_finite;
  int warmup = -1;
  std::pair<int, int> mesh{0, 0};
  schedule::PlanOptions plan;
  std::optional<fullshard::DType> param_dtype, reduce_dtype;
  std::string trace;
  std::string cost_file, compute_file, graph_out, write_config;
  bool predict = false;
  bool optimizer_in_backward = false;
  int log_every = 1;
  std::string checkpoint_dir, resume_dir, init_from;
  bool start_over = false;
  int save_every = 0;
  int keep_last = 0;
  bool async_save = false;
  int stop_after = -1;
  fullshard::checkpoint::Kind checkpoint_kind = fullshard::checkpoint::Kind::sharded;
  bool help = false;
  bool auto_plan = false;
  bool allow_compression = false;
  std::size_t memory_budget = 0;
  schedule::MemoryCheck memory_check = schedule::MemoryCheck::refuse;
  fullshard::DeviceType device = fullshard::DeviceType::cpu;
};

/// `device_args`: the --device arguments taken out of argv before the Runtime (take_flag).
Config parse(int argc, char** argv, const std::vector<std::string>& device_args) {
  Config c;
  c.plan.forward_prefetch_depth = 1;
  apps::ArgParser a(argc, argv, device_args);
  while (a.next()) {
    const std::string& f = a.flag();
    if (f == "--layers")
      c.shape.blocks = a.int_value(0, 100000);
    else if (f == "--hidden")
      c.shape.hidden = a.int_value(1, 1 << 16);
    else if (f == "--inputs")
      c.shape.inputs = a.int_value(1, 1 << 16);
    else if (f == "--outputs")
      c.shape.outputs = a.int_value(1, 1 << 16);
    else if (f == "--batch")
      c.batch = a.int64_value(1, 1 << 24);
    else if (f == "--steps")
      c.steps = a.int_value(0);
    else if (f == "--seed")
      c.seed = static_cast<std::uint64_t>(a.int64_value(0));
    else if (f == "--optimizer") {
      c.optimizer = a.value();
      if (c.optimizer != "adamw" && c.optimizer != "sgd")
        throw apps::UsageError{"--optimizer expects adamw or sgd, got '" + c.optimizer + "'"};
    } else if (f == "--lr")
      c.lr = a.double_value(0.0, 1e3);
    else if (f == "--weight-decay")
      c.weight_decay = a.double_value(0.0, 1e3);
    else if (f == "--momentum")
      c.momentum = a.double_value(0.0, 0.999999);
    else if (f == "--warmup")
      c.warmup = a.int_value(0);
    else if (f == "--clip")
      c.clip = a.double_value(0.0, 1e30);
    else if (f == "--non-finite") {
      c.non_finite.policy = a.value();
      if (c.non_finite.policy != "skip" && c.non_finite.policy != "stop")
        throw apps::UsageError{"--non-finite " + c.non_finite.policy + ": expected skip or stop"};
    } else if (f == "--max-skipped")
      c.non_finite.max_skipped = a.int_value(0, 1 << 30);
    else if (f == "--mesh")
      c.mesh = a.mesh_value();
    else if (f == "--param-dtype")
      c.param_dtype = a.dtype_value();
    else if (f == "--reduce-dtype")
      c.reduce_dtype = a.dtype_value();
    else if (f == "--compress-gather" || f == "--compress-reduce") {
      const std::string v = a.value();
      auto& z = c.plan.defaults.compression;
      try {
        (f == "--compress-gather" ? z.all_gather : z.reduce_scatter) =
            fullshard::kernels::parse_quant_code(v, f);
      } catch (const fullshard::ConfigError& e) {
        throw apps::UsageError{e.what()};
      }
      if (f == "--compress-reduce" && z.reduce_scatter != fullshard::kernels::QuantCode::int8)
        throw apps::UsageError{"--compress-reduce expects int8 (fp8 is for the all-gather)"};
    } else if (f == "--compress-block") {
      const int b = a.int_value(8, 1 << 20);
      if ((b & (b - 1)) != 0)
        throw apps::UsageError{"--compress-block expects a power of two, got " + std::to_string(b)};
      c.plan.defaults.compression.block = b;
    } else if (f == "--reshard")
      c.plan.defaults.reshard_after_forward = a.reshard_value();
    else if (f == "--prefetch")
      c.plan.forward_prefetch_depth = a.int_value(0, 16);
    else if (f == "--allow-compression") {
      a.no_value();
      c.allow_compression = true;
    } else if (f == "--auto-plan") {
      a.no_value();
      c.auto_plan = true;
    } else if (f == "--memory-budget") {
      const std::string v = a.value();
      try {
        c.memory_budget = schedule::parse_byte_size(v, "--memory-budget");
      } catch (const fullshard::InvalidArgument&) {
        throw apps::UsageError{"--memory-budget: '" + v + "' is not a byte size (e.g. 512MiB)"};
      }
    } else if (f == "--memory-check") {
      const std::string v = a.value();
      if (v == "refuse")
        c.memory_check = schedule::MemoryCheck::refuse;
      else if (v == "warn")
        c.memory_check = schedule::MemoryCheck::warn;
      else if (v == "off")
        c.memory_check = schedule::MemoryCheck::off;
      else
        throw apps::UsageError{"--memory-check: '" + v + "' is not refuse, warn or off"};
    } else if (f == "--device") {
      c.device = a.device_value();
    } else if (f == "--trace")
      c.trace = a.value();
    else if (f == "--cost")
      c.cost_file = a.value();
    else if (f == "--compute")
      c.compute_file = a.value();
    else if (f == "--graph-out")
      c.graph_out = a.value();
    else if (f == "--write-config")
      c.write_config = a.value();
    else if (f == "--predict") {
      a.no_value();
      c.predict = true;
    } else if (f == "--optimizer-in-backward") {
      a.no_value();
      c.optimizer_in_backward = true;
    } else if (f == "--log-every")
      c.log_every = a.int_value(1);
    else if (f == "--checkpoint-dir")
      c.checkpoint_dir = a.value();
    else if (f == "--save-every")
      c.save_every = a.int_value(1);
    else if (f == "--keep-last")
      c.keep_last = a.int_value(0, 1 << 20);
    else if (f == "--async-save") {
      a.no_value();
      c.async_save = true;
    } else if (f == "--resume")
      c.resume_dir = a.value();
    else if (f == "--start-over")
      a.no_value(), c.start_over = true;
    else if (f == "--init-from")
      c.init_from = a.value();
    else if (f == "--stop-after")
      c.stop_after = a.int_value(0);
    else if (f == "--checkpoint-kind") {
      const std::string k = a.value();
      if (k == "sharded")
        c.checkpoint_kind = fullshard::checkpoint::Kind::sharded;
      else if (k == "full")
        c.checkpoint_kind = fullshard::checkpoint::Kind::full;
      else
        throw apps::UsageError{"--checkpoint-kind expects sharded or full, got '" + k + "'"};
    } else
      a.unknown();
  }
#if !defined(FULLSHARD_APPS_HAVE_CUDA)
  if (c.device == fullshard::DeviceType::cuda)
    throw apps::UsageError{
        "--device cuda: this fullshard-train was built without CUDA (it needs a build against "
        "a CUDA-enabled Kokkos with the CUDA toolkit's cuBLAS: scripts/build-cuda, "
        "docs/gpu.md)"};
#endif
  if (!c.init_from.empty() && !c.resume_dir.empty())
    throw apps::UsageError{
        "--init-from and --resume exclude each other (--resume restores the "
        "weights too)"};
  if (c.allow_compression && !c.auto_plan)
    throw apps::UsageError{
        "--allow-compression lets --auto-plan choose compression: give "
        "--auto-plan too (or --compress-gather / --compress-reduce)"};
  if (c.auto_plan && c.memory_budget == 0)
    throw apps::UsageError{"--auto-plan needs --memory-budget (the budget it plans for)"};
  if (c.save_every > 0 && c.checkpoint_dir.empty())
    throw apps::UsageError{"--save-every needs --checkpoint-dir"};
  if (c.keep_last > 0 && c.checkpoint_dir.empty())
    throw apps::UsageError{"--keep-last needs --checkpoint-dir"};
  if (c.start_over && c.checkpoint_dir.empty())
    throw apps::UsageError{"--start-over needs --checkpoint-dir"};
  if (c.async_save && c.checkpoint_dir.empty())
    throw apps::UsageError{"--async-save needs --checkpoint-dir"};
  if (c.async_save && c.checkpoint_kind == fullshard::checkpoint::Kind::full)
    throw apps::UsageError{
        "--async-save writes sharded checkpoints (a full one is gathered to rank 0 as it is "
        "written): drop --checkpoint-kind full or --async-save"};
  if (c.warmup >= 0 && c.warmup >= c.steps)
    throw apps::UsageError{"--warmup " + std::to_string(c.warmup) + " must be below --steps " +
                           std::to_string(c.steps)};
  if (!c.cost_file.empty() || !c.compute_file.empty()) c.predict = true;
  if (c.optimizer_in_backward && c.clip > 0)
    throw apps::UsageError{
        "--clip and --optimizer-in-backward: a global norm needs every gradient before any "
        "update, and the updates inside backward consume each group's gradient as it lands"};
  auto& mp = c.plan.defaults.mp_policy;
  mp.param_dtype = c.param_dtype;
  mp.reduce_dtype = c.reduce_dtype
                        ? c.reduce_dtype
                        : (c.param_dtype ? std::optional(fullshard::DType::f32) : std::nullopt);
  return c;
}

long minor_faults() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

double peak_rss_mib() {  // VmHWM (reset_peak_rss starts it again)
  return static_cast<double>(schedule::process_memory().peak) / (1024.0 * 1024.0);
}

/// The process's resident peak (VmHWM) starts again from its resident
/// memory now (Linux: /proc/self/clear_refs, 5); elsewhere it stays.
void reset_peak_rss() {
  std::ofstream clear("/proc/self/clear_refs");
  if (clear) clear << "5" << std::flush;
}

fullshard::DeviceMesh make_mesh(const fullshard::Runtime& rt, const Config& c) {
  const int world = rt.world_size();
  auto [R, S] = c.mesh;
  if (S == 0) R = 1, S = world;
  if (static_cast<std::int64_t>(R) * S != world)
    throw apps::UsageError{"--mesh " + std::to_string(R) + "x" + std::to_string(S) + " needs " +
                           std::to_string(static_cast<std::int64_t>(R) * S) +
                           " ranks, the job has " + std::to_string(world)};
  if (c.device == fullshard::DeviceType::cuda)  // torch's init_device_mesh("cuda", ...)
    return R == 1 ? fullshard::init_device_mesh(rt, "cuda", {S}, {"shard"})
                  : fullshard::init_device_mesh(rt, "cuda", {R, S}, {"replicate", "shard"});
  return R == 1 ? fullshard::DeviceMesh(rt, {S}, {"shard"})
                : fullshard::DeviceMesh(rt, {R, S}, {"replicate", "shard"});
}

const double kMiB = 1024.0 * 1024.0;

/// The training session's configuration for these options: a native model, its optimizer,
/// schedule, clipping, non-finite policy, precision, sharding, memory check and checkpoints;
/// the session's messages name these options.
fullshard::session::Config session_config(const Config& c) {
  fullshard::session::Config s;
  s.source = "fullshard-train's options";
  s.model.type = "native";
  s.optimizer.type = c.optimizer;
  s.optimizer.lr = c.lr;
  s.optimizer.weight_decay = c.weight_decay;
  if (c.optimizer == "sgd") s.optimizer.momentum = c.momentum;
  s.optimizer.in_backward = c.optimizer_in_backward;
  if (c.warmup >= 0) {  // linear warm-up, then cosine decay to 0 at --steps
    s.lr_schedule.type = "warmup_cosine";
    s.lr_schedule.warmup_steps = c.warmup;
    s.lr_schedule.total_steps = c.steps;
  }
  s.grad_clip = c.clip;
  s.non_finite = c.non_finite;
  s.param_dtype = c.plan.defaults.mp_policy.param_dtype;
  s.reduce_dtype = c.plan.defaults.mp_policy.reduce_dtype;
  fullshard::session::ShardingSpec& sh = s.sharding;
  sh.reshard_after_forward = c.plan.defaults.reshard_after_forward;
  sh.forward_prefetch = c.plan.forward_prefetch_depth;
  sh.compression = c.plan.defaults.compression;
  sh.cost_file = c.cost_file;
  const double mib = 1024.0 * 1024.0;
  if (c.auto_plan) {
    sh.policy = "auto";
    sh.memory_budget_mb = double(c.memory_budget) / mib;
    sh.allow_compression = c.allow_compression;
  }
  s.memory.budget_mb = double(c.memory_budget) / mib;
  s.memory.check = c.memory_check == schedule::MemoryCheck::refuse ? "refuse"
                   : c.memory_check == schedule::MemoryCheck::warn ? "warn"
                                                                   : "off";
  fullshard::session::CheckpointSpec& ck = s.checkpoint;
  ck.dir = c.checkpoint_dir;
  ck.keep_last = c.keep_last;
  ck.kind = fullshard::checkpoint::kind_name(c.checkpoint_kind);
  ck.resume = !c.resume_dir.empty();
  ck.resume_from = c.resume_dir;
  ck.start_over = c.start_over;
  s.seed = c.seed;
  s.option_names = {{"non_finite.policy", "--non-finite"},
                    {"non_finite.max_skipped", "--max-skipped"},
                    {"checkpoint.resume", "--resume " + c.checkpoint_dir},
                    {"checkpoint.start_over", "--start-over"},
                    {"memory.budget_mb", "--memory-budget"},
                    {"memory.check", "--memory-check"},
                    {"sharding.reshard_after_forward", "--reshard"},
                    {"sharding.cost_file", "--cost"},
                    {"optimizer.in_backward", "--optimizer-in-backward"}};
  return s;
}

/// One training run: set-up (constructor), restoring state (restore), steps (step), logging
/// (log_step), checkpoints (save), and the end (summary, write_trace).
class Trainer {
 public:
  /// Set-up: mesh, teacher, this rank's batch slice, the training session (the sharded model,
  /// its optimizer and schedule).
  Trainer(const fullshard::Runtime& rt, const Config& c)
      : c_(c),
        rank_(rt.rank()),
        rt_world_(rt.world()),
        mesh_(make_mesh(rt, c)),
        model_(c.shape, c.seed),
        teacher_(c.shape, c.seed + 1),
        run_identity_({{"batch", c.batch},
                       {"seed", c.seed},
                       {"optimizer", c.optimizer},
                       {"lr", c.lr},
                       {"warmup", c.warmup},
                       {"steps", c.steps}}),
        keep_timeline_(!c.trace.empty()) {
    // The files the run writes (rank 0), before anything is planned or allocated: a bad path
    // must not cost the run.
    try {
      if (!c.trace.empty()) fullshard::checkpoint::check_output_file(c.trace, "--trace", mesh_);
      if (!c.graph_out.empty())
        fullshard::checkpoint::check_output_file(c.graph_out, "--graph-out", mesh_);
      if (!c.write_config.empty())
        fullshard::checkpoint::check_output_file(c.write_config, "--write-config", mesh_);
    } catch (const fullshard::ConfigError& e) {  // agreed: every rank is here
      throw apps::UsageError{e.message()};
    }
    if (!c.compute_file.empty()) rates_ = schedule::ComputeRates::load_json(c.compute_file, rates_);
    // Costs for the largest share of the batch (the same on every rank: one plan).
    if (c.predict) {
      const std::int64_t rows = (c.batch + rt.world_size() - 1) / rt.world_size();
      const apps::CostSource source = apps::declare_costs(model_, rates_, rows);
      ranks_per_core_ = apps::job_ranks_per_core(rt.settings().timeout_s);
      if (rank_ == 0)
        std::printf("compute: %s%s (rows %lld per rank, hidden %d, inputs %d, outputs %d)\n",
                    source == apps::CostSource::measured_modules
                        ? "the measured module times of "
                        : "the FLOP model at the rates of ",
                    c.compute_file.empty() ? "the defaults" : c.compute_file.c_str(),
                    static_cast<long long>(rows), c.shape.hidden, c.shape.inputs, c.shape.outputs);
    }
    // The bandwidth of the summary's byte floor, measured before the model exists (its
    // buffers given back) so that it adds nothing to the process's peak.
    // The size a rank's shards stream (8 to 64 MiB): no more memory than the model's own.
    const double shard = double(model_.num_params()) * 4.0 / double(rt.world_size());
    memcpy_gb_per_s_ = shared_memcpy_gb_per_s(
        static_cast<std::size_t>(std::clamp(shard, double(8 << 20), double(64 << 20))));
#ifdef __GLIBC__
    malloc_trim(0);
#endif
    reset_peak_rss();
    // This rank's slice of every global batch: rows split as evenly as possible.
    const std::int64_t dp_rank = mesh_.rank();
    dp_ = rt.world_size();
    base_ = c.batch / dp_;
    const std::int64_t extra = c.batch % dp_;
    rows_ = static_cast<int>(base_ + (dp_rank < extra ? 1 : 0));
    first_row_ = dp_rank * base_ + std::min(dp_rank, extra);
    last_step_ = c.stop_after >= 0 ? std::min(c.steps, c.stop_after) : c.steps;
    // The training session: the checkpoint directory checked and claimed, the plan (or the
    // auto-planner's) and its memory account checked against the budget before anything is
    // created, the optimizer, the schedule, the resume. Refusals the ranks agreed on exit 2.
    try {
      session_ = std::make_unique<fullshard::session::NativeSession>(mesh_, model_,
                                                                     session_config(c), rows_);
    } catch (const schedule::MemoryBudgetExceeded& e) {
      throw apps::UsageError{std::string("memory: ") + e.message()};
    } catch (const fullshard::ConfigError& e) {  // agreed: every rank is here
      throw apps::UsageError{e.message()};
    } catch (const fullshard::InvalidArgument& e) {  // --resume refused (agreed), or initial values
      throw apps::UsageError{e.message()};
    } catch (const fullshard::IoError& e) {  // --resume: no checkpoint there (agreed)
      throw apps::UsageError{e.message()};
    }
    planned_ = session_->planned_memory();
    if (const schedule::AutoPlan* a = session_->auto_plan(); a && rank_ == 0)
      std::printf(
          "auto-plan: %zu fully_shard calls, prefetch %d, %d reduce-scatter buffers%s: "
          "predicted step %.3f ms, %s per rank (every block + root: %.3f ms, %s); %zu plans\n",
          a->choice.calls.size(), a->choice.forward_prefetch_depth,
          a->choice.reduce_scatter_max_input_buffers,
          a->options.defaults.compression.any() ? ", int8 compressed collectives" : "",
          a->plan.step_ms, schedule::format_bytes(a->memory_bytes).c_str(), a->baseline.step_ms,
          schedule::format_bytes(a->baseline_memory_bytes).c_str(), a->evaluations);
    if (!c.write_config.empty() && rank_ == 0) {
      std::ofstream out(c.write_config);
      out << fullshard::session::to_json(session_->config(), 2) << "\n";
      if (!out) throw fullshard::Error("--write-config: cannot write '" + c.write_config + "'");
    }
    if (!c.graph_out.empty() && rank_ == 0) {
      std::ofstream out(c.graph_out);
      out << fullshard::graph::graph_to_json(model_.root(), 1) << "\n";
      if (!out) throw fullshard::Error("--graph-out: cannot write '" + c.graph_out + "'");
    }
    session_->set_progress(
        {[this](const fullshard::session::StepMetrics& m) { fb_s_ = m.forward_backward_seconds; },
         [this](const fullshard::session::SaveMetrics& m) { report_save(m); }});
#ifdef __GLIBC__
    malloc_trim(0);
#endif
#if defined(FULLSHARD_APPS_HAVE_CUDA)
    if (c.device == fullshard::DeviceType::cuda) {
      // Losses and step times stay on the device between log points (and at most this many
      // steps).
      const int to_run = std::max(1, c.stop_after >= 0 ? std::min(c.steps, c.stop_after) : c.steps);
      slots_ = std::max(1, std::min({c.log_every, to_run, 1024}));
      cuda_ = std::make_unique<apps::CudaResidualMlp>(model_, mesh_, slots_);
    }
#endif
    params_ = model_.root().parameters();
  }

  void print_header() const {
    if (rank_ != 0) return;
    std::printf(
        "fullshard-train: %lld parameters (%.1f MiB f32), %d blocks x hidden %d, "
        "global batch %lld on %s, %zu communication groups, plan: step %.2f ms, "
        "pool peak %.2f MiB\n",
        static_cast<long long>(model_.num_params()), model_.num_params() * 4.0 / kMiB,
        c_.shape.blocks, c_.shape.hidden, static_cast<long long>(c_.batch),
        mesh_.describe().c_str(), model_.plan().groups.size(), model_.plan().step_ms,
        model_.plan().peak_bytes / kMiB);
    if (rows_ == 0 || base_ == 0)
      std::printf("warning: global batch %lld < %lld ranks: some ranks have no samples\n",
                  static_cast<long long>(c_.batch), static_cast<long long>(dp_));
    std::fflush(stdout);
  }

  /// --async-save: the staging memory of the snapshots allocated and faulted in before the
  /// first step (the first save would take the page faults: tens of ms of training).
  void reserve_async_staging() {
    if (!c_.async_save) return;
    staging_bytes_ = session_->reserve_async_staging();
    if (rank_ == 0)
      std::printf(
          "checkpoint: %.2f MiB of staging memory reserved for asynchronous saves on "
          "rank 0\n",
          double(staging_bytes_) / kMiB);
    std::fflush(stdout);
  }

  /// --resume (the session loaded it: model, optimizer and step) or --init-from (weights
  /// only); returns the first step.
  int restore() {
    if (!c_.resume_dir.empty()) return resumed();
    if (!c_.init_from.empty()) init_from();
    return 0;
  }

  /// One training step on global batch `step`; returns the loss (and records the times).
  double step(int step, int first_step) {
    teacher_.batch(static_cast<std::int64_t>(step) * c_.batch + first_row_, rows_, x_, t_);
    const long faults0 = minor_faults();
    const auto t0 = Clock::now();
    const fullshard::comm::Traffic traffic0 = mesh_.traffic();
    fb_s_ = -1;
    // The global mean loss; NaN when the session skipped the step (a non-finite value).
    const double loss = session_->train_step(x_.data(), t_.data(), rows_, c_.batch);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    const double fb = fb_s_ >= 0 ? fb_s_ * 1e3 : ms;
    if (step > first_step) count_traffic_since(traffic0);

    // Communication time of this step: collectives on the channel streams (inline progress
    // runs them on this thread, so they add to the step time).
    auto& timeline = model_.executor().timeline();
    const double comm = timeline.busy_us(ops_seen_, /*communication=*/true) / 1e3;
    if (c_.predict && step > first_step) {
      const std::vector<fullshard::schedule::MeasuredOp> ops = timeline.ops();
      for (std::size_t i = ops_seen_; i < ops.size(); ++i)
        measured_kind_ms_[ops[i].stream == schedule::StreamKind::compute ? kind_of(ops[i].label)
                                                                         : "collectives"] +=
            (ops[i].end_us - ops[i].start_us) / 1e3;
      ++measured_steps_;
    }
    if (keep_timeline_)
      ops_seen_ = timeline.size();
    else
      timeline.clear();

    step_ms_.push_back(ms);
    fb_ms_.push_back(fb);
    faults_.push_back(static_cast<double>(minor_faults() - faults0));
    opt_ms_.push_back(ms - fb);
    comm_ms_.push_back(comm);
    if (std::isfinite(loss)) {                              // a skipped step has none
      if (!std::isfinite(first_loss_)) first_loss_ = loss;  // the first step applied
      last_loss_ = loss;
    }
    return loss;
  }

#if defined(FULLSHARD_APPS_HAVE_CUDA)
  bool on_cuda() const noexcept {
    return cuda_ != nullptr;
  }

  /// --device cuda: one training step enqueued on the GPU (the same data and order as step());
  /// the losses and step times come back to the host only at the log points, the checkpoint
  /// saves and every `slots_` steps (fetch), which also prints the step line.
  void cuda_step(int step, int first_step) {
    if (step < window_first_ || step >= window_first_ + window_steps_) upload_window(step);
    const int slot = (step - first_step) % slots_;
    const long faults0 = minor_faults();
    const auto t0 = Clock::now();
    const fullshard::comm::Traffic traffic0 = mesh_.traffic();
    cuda_->mark_start(slot);
    session_->begin_external_step();  // the schedule's rate, gradients cleared
    cuda_->forward_backward(step - window_first_, c_.batch, slot);
    const auto t_fb = Clock::now();
    session_->finish_external_step();  // clipping, the optimizer
    cuda_->mark_end(slot);
    const auto t_opt = Clock::now();
    if (step > first_step) count_traffic_since(traffic0);
    // On the GPU the timeline holds the host's time issuing each op (what comm_ms reports).
    auto& timeline = model_.executor().timeline();
    comm_ms_.push_back(timeline.busy_us(ops_seen_, /*communication=*/true) / 1e3);
    if (keep_timeline_)
      ops_seen_ = timeline.size();
    else
      timeline.clear();
    fb_ms_.push_back(std::chrono::duration<double, std::milli>(t_fb - t0).count());
    opt_ms_.push_back(std::chrono::duration<double, std::milli>(t_opt - t_fb).count());
    faults_.push_back(static_cast<double>(minor_faults() - faults0));
    ++pending_;
    const bool log = (step + 1) % c_.log_every == 0 || step + 1 == last_step_;
    const bool save =
        !c_.checkpoint_dir.empty() &&
        ((c_.save_every > 0 && (step + 1) % c_.save_every == 0) || step + 1 == last_step_);
    if (log || save || pending_ == slots_) fetch(step, first_step);
    if (log && rank_ == 0) {
      std::printf("step %d loss %.9g step_ms %.3f comm_ms %.3f peak_mib %.2f\n", step + 1,
                  last_loss_, step_ms_.back(), comm_ms_.back(),
                  model_.executor().measured_peak_bytes() / kMiB);
      std::fflush(stdout);
    }
  }

  /// The loss of the last step fetched (fetch() ran at every save point).
  double last_loss() const noexcept {
    return last_loss_;
  }

#endif

  /// The step line (every --log-every steps and the last), and the divergence check.
  void log_step(int step, double loss) {
    memory_.sample();                          // the steady state's parts: after the first step
    if (rank_ == 0 && !std::isfinite(loss)) {  // skipped by --non-finite (it said why)
      std::printf("step %d skipped (non-finite; %lld skipped so far)\n", step + 1,
                  static_cast<long long>(session_->skipped_steps()));
    } else if (rank_ == 0 && ((step + 1) % c_.log_every == 0 || step + 1 == last_step_)) {
      std::printf("step %d loss %.9g step_ms %.3f comm_ms %.3f peak_mib %.2f\n", step + 1, loss,
                  step_ms_.back(), comm_ms_.back(), model_.executor().measured_peak_bytes() / kMiB);
    }
    std::fflush(stdout);
  }

  /// Saves after every --save-every steps and after the last one (with --checkpoint-dir).
  void maybe_save(int step, double loss) {
    if (!c_.checkpoint_dir.empty() &&
        ((c_.save_every > 0 && (step + 1) % c_.save_every == 0) || step + 1 == last_step_))
      save(step + 1, loss);
  }

  /// Collective: every rank copies at once (as many busy cores as ranks), so each sees the
  /// memory bandwidth it shares with the others during a step. Bytes read plus written per
  /// second, fastest of five memcpy calls of `bytes` (GB/s).
  static double shared_memcpy_gb_per_s(std::size_t bytes) {
    std::vector<char> a(bytes, 1), b(bytes, 0);  // written first: no page faults in the timing
    MPI_Barrier(MPI_COMM_WORLD);
    double best = 1e300;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = Clock::now();
      std::memcpy(b.data(), a.data(), bytes);
      best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    MPI_Barrier(MPI_COMM_WORLD);
    return 2.0 * static_cast<double>(bytes) / std::max(best, 1e-9) / 1e9;
  }

  /// The bytes a step must move per rank (docs/plan-format.md, "The byte floor"): the
  /// backward's gradient writes (F, the unsharded parameters in the compute dtype), the
  /// optimizer's reads and writes of this rank's f32 shards (P: SGD 3P, with momentum 5P,
  /// AdamW 7P) and, on a shard group of more than one rank, each all-gather's writes of the
  /// unsharded parameters and the reduce-scatter's reads of the gradients (F each).
  void print_floor(double step_ms, double gb_per_s) const {
    const schedule::Plan& plan = model_.plan();
    const int passes = c_.optimizer == "adamw" ? 7 : (c_.momentum > 0 ? 5 : 3);
    const schedule::ByteFloor floor = plan.byte_floor(passes);
    const double F = floor.gradients, gather = floor.all_gather, reduce = floor.reduce_scatter;
    const double total = floor.total();
    const double floor_ms = total / (gb_per_s * 1e6);
    const schedule::ByteCount moved = plan.bytes_moved();
    std::printf(
        "byte floor per rank and step: %.1f MiB = gradient writes %.1f + optimizer %.1f (%dP) + "
        "all-gather writes %.1f (%.2f x F) + reduce-scatter reads %.1f; %.2f ms at %.1f GB/s "
        "(memcpy, bytes read + written, every one of the %d ranks copying); measured median step "
        "%.3f ms "
        "= %.2f x the floor's time\n",
        total / kMiB, F / kMiB, floor.optimizer / kMiB, passes, gather / kMiB,
        F > 0 ? gather / F : 0.0, reduce / kMiB, floor_ms, gb_per_s, static_cast<int>(dp_), step_ms,
        floor_ms > 0 ? step_ms / floor_ms : 0.0);
    // The plan's own copies, collectives and updates (the optimizer after backward not in it).
    std::printf(
        "byte account of the plan per rank and step: %.1f MiB read + %.1f MiB written = %.1f MiB: "
        "%.2f ms at %.1f GB/s%s\n",
        moved.read / kMiB, moved.written / kMiB, moved.total() / kMiB,
        moved.total() / (gb_per_s * 1e6), gb_per_s,
        c_.optimizer_in_backward ? "" : "; the optimizer after backward adds its passes above");
    if (c_.predict && measured_steps_ > 0) {  // the callbacks stand for the GEMMs
      const auto of = [&](const char* k) {
        const auto it = measured_kind_ms_.find(k);
        return it == measured_kind_ms_.end() ? 0.0 : it->second / measured_steps_;
      };
      const double fixed = step_ms - of("fwd") - of("bwd");
      std::printf(
          "fixed cost: %.3f ms (the step minus its forward and backward callbacks, %.3f ms) = "
          "%.2f x the floor's time\n",
          fixed, of("fwd") + of("bwd"), floor_ms > 0 ? fixed / floor_ms : 0.0);
    }
  }

  /// What the products ran on: the BLAS, its kernel and how it was chosen, its threads, the
  /// CPU (a generic kernel makes a step up to 3x slower).
  void print_blas() const {
    const fullshard::BlasInfo blas = fullshard::loaded_blas();
    const std::string choice = apps::blas_kernel_choice();
    std::printf("BLAS: %s%s on a CPU with %s%s\n", blas.describe().c_str(),
                choice.empty() ? "" : (", " + choice).c_str(),
                fullshard::cpu_features().names().c_str(),
                blas.better_kernel.empty()
                    ? ""
                    : (" (a generic kernel: " + blas.better_kernel + " is faster)").c_str());
  }

  /// The memory account, measured against planned (docs/memory.md). Collective.
  void print_memory() {
    memory_.print(mesh_, rt_world_, planned_, model_.activations_held());
  }

  void summary(int first_step, double total_s) {
    print_memory();
    const double memcpy_gb_per_s = memcpy_gb_per_s_;
    if (rank_ != 0) return;
    const int steps_run = std::max(0, last_step_ - first_step);
    auto median = [](std::vector<double> v) {
      if (v.empty()) return 0.0;
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double heap = apps::heap_in_use_mib();
    std::printf(
        "summary: %d steps in %.2f s, loss %.6g -> %.6g, median step %.3f ms "
        "(comm %.3f ms), pool peak %.2f MiB (plan %.2f MiB), max RSS %.1f MiB%s%s\n",
        steps_run, total_s, first_loss_, last_loss_, median(step_ms_), median(comm_ms_),
        model_.executor().measured_peak_bytes() / kMiB, model_.plan().peak_bytes / kMiB,
        peak_rss_mib(), heap >= 0 ? (", heap in use " + apps::fmt_mib(heap) + " MiB").c_str() : "",
        session_->skipped_steps() > 0
            ? (", " + std::to_string(session_->skipped_steps()) + " steps skipped (non-finite)")
                  .c_str()
            : "");
    print_blas();
    if (steps_run > 1) {
      std::vector<double> after_first(step_ms_.begin() + 1, step_ms_.end());
      print_floor(median(after_first), memcpy_gb_per_s);
    }
    if (c_.predict) print_prediction(median);
    // Bytes per step against FSDP's reference: every parameter all-gathered in forward and
    // again in backward, and its gradient reduce-scattered once (3x the parameter bytes).
    if (steps_run > 1) {
      const double n = steps_run - 1, pbytes = model_.num_params() * 4.0;
      // An int8 reduce-scatter (--compress-reduce) is an all-to-all of packed chunks.
      const double ag = step_traffic_.all_gather / n,
                   rs = (step_traffic_.reduce_scatter + step_traffic_.all_to_all) / n,
                   ar = step_traffic_.all_reduce / n;
      std::printf(
          "communicated per step (rank 0, steps %d..%d): %.3f MiB = %.3f x the f32 "
          "parameter bytes (all-gather %.3f x, reduce-scatter %.3f x, all-reduce "
          "%.3f x); FSDP reference 3 x (2 x with reshard_after_forward=false)\n",
          first_step + 2, last_step_, (ag + rs + ar) / kMiB, (ag + rs + ar) / pbytes, ag / pbytes,
          rs / pbytes, ar / pbytes);
    }
    std::fflush(stdout);
  }

  /// --predict: the plan's ops one after the other (the host runs its streams inline) plus the
  /// optimizer step over this rank's shards, against the measured median of the steps after
  /// the first (which also faults in the buffers).
  template <class Median>
  void print_prediction(const Median& median) const {
    const schedule::Plan& plan = model_.plan();
    const double serial = schedule::serial_step_ms(plan);
    const double elements = static_cast<double>(plan.sharded_bytes) / sizeof(float);
    // Inside backward the updates are the plan's (its update operations).
    const double opt = c_.optimizer_in_backward ? 0.0 : rates_.optimizer_ms(c_.optimizer, elements);
    // More ranks than cores: a rank also waits for its core-mates' modules (beyond one
    // scheduler slice, or where they do not fit into its collectives) and optimizer
    // (schedule::core_wait_ms; whole-core rates only).
    std::vector<double> modules;
    double collectives = 0.0;
    for (const schedule::Op& op : plan.ops) {
      if (op.kind == schedule::OpKind::forward || op.kind == schedule::OpKind::backward)
        modules.push_back(op.end_ms - op.start_ms);
      if (op.stream != schedule::StreamKind::compute) collectives += op.end_ms - op.start_ms;
    }
    const double slice = apps::scheduler_slice_ms();
    const double wait = rates_.whole_core() ? schedule::core_wait_ms(ranks_per_core_, modules,
                                                                     collectives, opt, slice)
                                            : 0.0;
    const double predicted = serial + opt + wait;
    auto after_first = [&](std::vector<double> v) {
      if (v.size() > 1) v.erase(v.begin());
      return median(v);
    };
    const double measured = after_first(step_ms_);
    std::printf(
        "prediction: step %.3f ms = plan %.3f ms (its ops one after the other; streams "
        "overlapped: %.3f ms) + optimizer %.3f ms (%.0f elements per rank) + core wait %.3f ms "
        "(%.2f ranks per core, scheduler slice %.2f ms); measured median "
        "%.3f ms (zero_grad + forward + backward %.3f ms, optimizer %.3f ms, %.0f page faults; "
        "steps after the first): error %+.1f %%\n",
        predicted, serial, plan.step_ms, opt, elements, wait, ranks_per_core_, slice, measured,
        after_first(fb_ms_), after_first(opt_ms_), after_first(faults_),
        measured > 0 ? 100.0 * (predicted - measured) / measured : 0.0);
    // Per kind of op, predicted against the measured mean per step: the modules' forward and
    // backward, the communication streams' ops (collectives and the copies on their
    // streams), and the compute stream's copies (which the executor does not record).
    std::map<std::string, double> planned;
    for (const schedule::Op& op : plan.ops) {
      const std::string k = kind_of(plan.label(op));
      planned[op.stream != schedule::StreamKind::compute ? "collectives"
              : k == "fwd" || k == "bwd"                 ? k
                                                         : "copies"] += op.end_ms - op.start_ms;
    }
    auto measured_of = [&](const std::string& k) {
      const auto it = measured_kind_ms_.find(k);
      return it == measured_kind_ms_.end() || measured_steps_ == 0 ? 0.0
                                                                   : it->second / measured_steps_;
    };
    std::printf(
        "prediction by kind (predicted / measured ms per step): forward %.3f / %.3f, backward "
        "%.3f / %.3f, communication streams %.3f (+ core wait %.3f) / %.3f, compute-stream "
        "copies %.3f / (not recorded)\n",
        planned["fwd"], measured_of("fwd"), planned["bwd"], measured_of("bwd"),
        planned["collectives"], wait, measured_of("collectives"), planned["copies"]);
  }

  static std::string kind_of(const std::string& label) {
    return label.substr(0, label.find('('));
  }

  /// --trace: the plan and rank 0's measured timeline in one Chrome/Perfetto file.
  void write_trace() {
    if (!keep_timeline_ || rank_ != 0) return;
    auto trace = nlohmann::json::parse(model_.plan().to_chrome_trace());
    const auto measured = nlohmann::json::parse(
        model_.executor().timeline().to_chrome_trace(1, "fullshard-train rank 0 (measured)"));
    for (const auto& ev : measured.at("traceEvents"))
      trace["traceEvents"].push_back(ev);
    std::ofstream out(c_.trace);
    out << trace.dump() << "\n";
    if (!out) throw fullshard::Error("--trace: cannot write '" + c_.trace + "'");
    std::printf("trace: %s (pid 0: the plan, pid 1: measured on rank 0)\n", c_.trace.c_str());
  }

  int last_step() const noexcept {
    return last_step_;
  }

  /// --async-save, at every step boundary while a save is in flight (collective): commits it
  /// once every rank's background write is done.
  void poll_async_save(int steps_done) {
    if (!session_->save_in_flight()) return;
    const auto t0 = Clock::now();
    session_->poll_save();
    async_held_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
    report_async_save(steps_done);
  }

  /// Waits for the save in flight, if any (collective), and reports it.
  void finish_async_save(int steps_done) {
    if (!session_->save_in_flight()) return;
    const auto t0 = Clock::now();
    session_->wait_save();
    async_held_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
    report_async_save(steps_done);
  }

  /// The session's report of a committed save (asynchronous: printed by report_async_save).
  void report_save(const fullshard::session::SaveMetrics& m) {
    if (m.asynchronous) committed_ = m;
  }

  void report_async_save(int steps_done) {
    if (!committed_) return;
    const fullshard::session::SaveMetrics m = *committed_;
    committed_.reset();
    if (rank_ != 0) return;
    std::printf(
        "checkpoint: step %lld saved to %s (background write %.3f s on rank 0, committed at "
        "step %d; training held %.3f s)\n",
        static_cast<long long>(m.step), m.step_dir.c_str(), m.write_seconds, steps_done,
        async_held_s_);
    std::fflush(stdout);
  }

 private:
#if defined(FULLSHARD_APPS_HAVE_CUDA)
  /// The batches of steps [step, step + W) generated on the host (Teacher::batch, as the CPU
  /// path) and copied to the device at once, W as many as fit 256 MiB.
  void upload_window(int step) {
    const std::size_t per_step =
        static_cast<std::size_t>(rows_) * (c_.shape.inputs + c_.shape.outputs) * sizeof(float);
    const int cap = static_cast<int>(
        std::max<std::size_t>(1, (std::size_t{256} << 20) / std::max<std::size_t>(1, per_step)));
    window_first_ = step;
    window_steps_ = std::max(1, std::min(cap, last_step_ - step));
    std::vector<float> xs, ts;
    xs.reserve(static_cast<std::size_t>(window_steps_) * rows_ * c_.shape.inputs);
    ts.reserve(static_cast<std::size_t>(window_steps_) * rows_ * c_.shape.outputs);
    for (int k = 0; k < window_steps_; ++k) {
      teacher_.batch(static_cast<std::int64_t>(step + k) * c_.batch + first_row_, rows_, x_, t_);
      xs.insert(xs.end(), x_.begin(), x_.end());
      ts.insert(ts.end(), t_.begin(), t_.end());
    }
    cuda_->upload(xs.data(), ts.data(), rows_, window_steps_);
  }

  /// The pending steps' losses (summed over the ranks: one all-reduce) and GPU step times.
  void fetch(int step, int first_step) {
    const int n = pending_;
    const int first = (step + 1 - n - first_step) % slots_;
    std::vector<double> sse = cuda_->sse(first, n);
    const std::vector<double> ms = cuda_->step_ms(first, n);
    // The parameters too: a non-finite gradient applied since the last fetch (one pass on the
    // GPU, folded into the losses' all-reduce).
    sse.push_back(
        fullshard::optim::local_all_finite(params_, mesh_, fullshard::optim::Values::parameters)
            ? 0.0
            : std::numeric_limits<double>::quiet_NaN());
    mesh_.world_comm()
        .all_reduce(sse.data(), sse.data(), sse.size(), fullshard::DType::f64,
                    fullshard::comm::ReduceOp::sum,
                    mesh_.stream(fullshard::comm::StreamKind::compute))
        .wait();
    // Read here, after the steps were applied: a bad one stops the run (whatever --non-finite
    // says) before a checkpoint holds it (the save points fetch first).
    const std::string read_late =
        " (on --device cuda the losses and parameters are read every few steps, after the steps "
        "were applied, so the run stops here, before a checkpoint holds them; lower --lr, or "
        "resume from the last checkpoint)";
    for (int k = 0; k < n; ++k) {
      const int s = step + 1 - n + k;
      const double loss = sse[static_cast<std::size_t>(k)] / (double(c_.batch) * c_.shape.outputs);
      if (!std::isfinite(loss))
        throw fullshard::Error("step " + std::to_string(s + 1) + ": the loss is " +
                               std::to_string(loss) + read_late);
      step_ms_.push_back(ms[static_cast<std::size_t>(k)]);
      if (s == first_step) first_loss_ = loss;
      last_loss_ = loss;
    }
    if (!std::isfinite(sse.back()))
      throw fullshard::Error("step " + std::to_string(step + 1) +
                             ": the parameters hold a non-finite value (a gradient holding one "
                             "was applied)" +
                             read_late);
    pending_ = 0;
  }

#endif

  /// The session resumed from --resume: the data stream must continue (batch, seed), the
  /// schedule may change (a warning); returns the first step.
  int resumed() {
    const fullshard::checkpoint::Loaded& ck = session_->last_loaded();
    const nlohmann::json saved =
        nlohmann::json::parse(ck.metadata).value("fullshard-train", nlohmann::json::object());
    for (const char* key : {"batch", "seed", "optimizer"})
      if (saved.contains(key) && saved[key] != run_identity_[key])
        throw apps::UsageError{std::string("--resume ") + c_.resume_dir +
                               ": the checkpoint was "
                               "saved with --" +
                               key + " " + saved[key].dump() + ", this run has " +
                               run_identity_[key].dump() + " (the data would not continue)"};
    for (const char* key : {"lr", "warmup", "steps"})
      if (rank_ == 0 && saved.contains(key) && saved[key] != run_identity_[key])
        std::printf(
            "warning: --resume: the checkpoint's run had --%s %s, this run has %s: the "
            "learning-rate schedule changes from here\n",
            key, saved[key].dump().c_str(), run_identity_[key].dump().c_str());
    // Where the data stream stopped (later than the session's step after skipped steps).
    const int first_step = static_cast<int>(saved.value("data_step", ck.step));
    if (c_.stop_after >= 0 && c_.stop_after <= first_step)
      throw apps::UsageError{"--stop-after " + std::to_string(c_.stop_after) +
                             ": the checkpoint is already at step " + std::to_string(first_step)};
    if (first_step > c_.steps)
      throw apps::UsageError{"--resume " + c_.resume_dir + ": the checkpoint is at step " +
                             std::to_string(first_step) + ", beyond --steps " +
                             std::to_string(c_.steps)};
    if (rank_ == 0) {
      std::printf("resumed from %s at step %d (%s checkpoint, %.2f MiB read by rank 0 in %.3f s)\n",
                  ck.step_dir.c_str(), first_step, fullshard::checkpoint::kind_name(ck.kind),
                  ck.bytes_read / kMiB, session_->last_load_seconds());
      std::fflush(stdout);
    }
    return first_step;
  }

  // The model's weights from a safetensors file (each rank reads its shards' bytes) or from a
  // fullshard checkpoint directory (parameters only); step 0, a fresh optimizer.
  void init_from() {
    const auto t0 = Clock::now();
    struct stat st {};
    const bool dir = ::stat(c_.init_from.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
    std::string what;
    std::uint64_t bytes = 0;
    std::size_t tensors = 0;
    if (dir) {
      const fullshard::checkpoint::Loaded ck = session_->load_parameters(c_.init_from);
      what = ck.step_dir + " (" + fullshard::checkpoint::kind_name(ck.kind) +
             " checkpoint, parameters only)";
      bytes = ck.bytes_read;
      tensors = params_.size();
    } else {
      // e.g. bf16 weights into the f32 model, as torch's load_state_dict
      const fullshard::checkpoint::SafetensorsLoaded l =
          session_->import_safetensors(c_.init_from, /*cast=*/true);
      what = c_.init_from + " (safetensors" +
             (l.cast ? ", " + std::to_string(l.cast) + " tensors cast to the model's dtype" : "") +
             ")";
      bytes = l.bytes_read;
      tensors = l.tensors;
    }
    if (rank_ == 0) {
      std::printf("initialised from %s: %zu tensors, %.2f MiB read by rank 0 in %.3f s\n",
                  what.c_str(), tensors, bytes / kMiB,
                  std::chrono::duration<double>(Clock::now() - t0).count());
      std::fflush(stdout);
    }
  }

  void save(int steps_done, double loss) {
    const auto t0 = Clock::now();
    // The data stream's position: a skipped step is not counted in the session's step.
    nlohmann::json identity = run_identity_;
    identity["data_step"] = steps_done;
    session_->set_checkpoint_metadata(
        nlohmann::json{{"fullshard-train", identity}, {"loss", loss}}.dump());
    if (c_.async_save) {
      finish_async_save(steps_done);  // the one before, if still in flight
      session_->save_async();
      async_held_s_ = std::chrono::duration<double>(Clock::now() - t0).count();
      if (rank_ == 0) {
        std::printf(
            "checkpoint: step %d staged in %.3f s (%.2f MiB of staging memory on rank 0), "
            "writing in the background\n",
            steps_done, async_held_s_, staging_bytes_ / kMiB);
        std::fflush(stdout);
      }
      if (steps_done == last_step_) finish_async_save(steps_done);
      return;
    }
    const std::string where = session_->save();
    if (rank_ == 0) {
      std::printf("checkpoint: step %d saved to %s in %.3f s\n", steps_done, where.c_str(),
                  std::chrono::duration<double>(Clock::now() - t0).count());
      std::fflush(stdout);
    }
  }

  const Config& c_;
  const int rank_;
  const MPI_Comm rt_world_;  // the job's ranks (the memory summary's sums)
  const fullshard::DeviceMesh mesh_;
  apps::ResidualMlp model_;
  const apps::Teacher teacher_;
  // The planned memory account (check_memory), and the largest RssAnon / RssShmem sampled
  // after each step.
  schedule::MemoryAccount planned_;
  apps::MemoryReport memory_;
  double memcpy_gb_per_s_ = 0.0;  // shared_memcpy_gb_per_s() at start
  // What a resumed run must share with the saved one for the data stream and the schedule to
  // continue where they stopped (the model itself is checked by checkpoint::load).
  const nlohmann::json run_identity_;
  const bool keep_timeline_;
  std::vector<fullshard::graph::Parameter*> params_;
#if defined(FULLSHARD_APPS_HAVE_CUDA)
  // --device cuda: the model's CUDA compute, its device slots, the uploaded steps' window,
  // and the steps whose loss is still on the device.
  std::unique_ptr<apps::CudaResidualMlp> cuda_;
  int slots_ = 1, window_first_ = 0, window_steps_ = 0, pending_ = 0;
#endif
  // The training session over model_ (destroyed before it): the optimizer, the schedule,
  // clipping, the non-finite check, checkpoints.
  std::unique_ptr<fullshard::session::NativeSession> session_;
  double fb_s_ = -1;  // the last step's forward and backward (the session's metrics)
  schedule::ComputeRates rates_;
  double ranks_per_core_ = 1.0;  // of this job (--predict)
  std::int64_t dp_ = 1, base_ = 0, first_row_ = 0;
  int rows_ = 0;
  int last_step_ = 0;
  // --async-save: the staging reserved, the commit the session reported and not yet printed,
  // and the time the training thread spent on the save (snapshot, polls, commit).
  std::uint64_t staging_bytes_ = 0;
  std::optional<fullshard::session::SaveMetrics> committed_;
  double async_held_s_ = 0;
  std::vector<float> x_, t_;
  std::vector<double> step_ms_, comm_ms_;
  // Parts of each step: zero_grad + forward + backward, and the optimizer (with clipping).
  std::vector<double> fb_ms_, opt_ms_, faults_;
  // --predict: measured time per kind of op (label up to '(') over the steps after the first.
  std::map<std::string, double> measured_kind_ms_;
  int measured_steps_ = 0;
  double first_loss_ = std::numeric_limits<double>::quiet_NaN(), last_loss_ = 0;
  std::size_t ops_seen_ = 0;
  // Bytes of the training steps after the first (which also initialises): checkpoint saves
  // and loads are not counted.
  // Adds the bytes moved since `before` to step_traffic_ (steps after the first).
  void count_traffic_since(const fullshard::comm::Traffic& before) {
    const fullshard::comm::Traffic now = mesh_.traffic();
    step_traffic_.all_gather += now.all_gather - before.all_gather;
    step_traffic_.reduce_scatter += now.reduce_scatter - before.reduce_scatter;
    step_traffic_.all_reduce += now.all_reduce - before.all_reduce;
    step_traffic_.all_to_all += now.all_to_all - before.all_to_all;
  }
  fullshard::comm::Traffic step_traffic_;
};

int train(const fullshard::Runtime& rt, const Config& c) {
  Trainer run(rt, c);
  run.print_header();
  const int first_step = run.restore();
  run.reserve_async_staging();
  const auto t_start = Clock::now();
  for (int step = first_step; step < run.last_step(); ++step) {
#if defined(FULLSHARD_APPS_HAVE_CUDA)
    if (run.on_cuda()) {
      run.cuda_step(step, first_step);  // prints its step line at the log points
      run.poll_async_save(step + 1);
      run.maybe_save(step, run.last_loss());
      continue;
    }
#endif
    const double loss = run.step(step, first_step);
    run.log_step(step, loss);
    run.poll_async_save(step + 1);
    run.maybe_save(step, loss);
  }
  run.summary(first_step, std::chrono::duration<double>(Clock::now() - t_start).count());
  run.write_trace();
  return 0;
}

}  // namespace

// The options every rank must share (flag, value): a rank given different ones would
// desynchronise the collectives or train on other data.
std::vector<apps::OptionValue> option_values(const Config& c) {
  auto num = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%.17g", v);
    return std::string(b);
  };
  auto dtype = [](const std::optional<fullshard::DType>& t) {
    return t ? std::string(fullshard::dtype_name(*t)) : std::string("(default)");
  };
  auto code = [](const std::optional<fullshard::kernels::QuantCode>& q) {
    return q ? std::string(fullshard::kernels::quant_code_name(*q)) : std::string("off");
  };
  return {{"--layers", std::to_string(c.shape.blocks)},
          {"--hidden", std::to_string(c.shape.hidden)},
          {"--inputs", std::to_string(c.shape.inputs)},
          {"--outputs", std::to_string(c.shape.outputs)},
          {"--batch", std::to_string(c.batch)},
          {"--steps", std::to_string(c.steps)},
          {"--seed", std::to_string(c.seed)},
          {"--optimizer", c.optimizer},
          {"--lr", num(c.lr)},
          {"--weight-decay", num(c.weight_decay)},
          {"--momentum", num(c.momentum)},
          {"--warmup", std::to_string(c.warmup)},
          {"--clip", num(c.clip)},
          {"--non-finite", c.non_finite.policy},
          {"--max-skipped", std::to_string(c.non_finite.max_skipped)},
          {"--mesh", std::to_string(c.mesh.first) + "x" + std::to_string(c.mesh.second)},
          {"--param-dtype", dtype(c.param_dtype)},
          {"--reduce-dtype", dtype(c.reduce_dtype)},
          {"--compress-gather", code(c.plan.defaults.compression.all_gather)},
          {"--compress-reduce", code(c.plan.defaults.compression.reduce_scatter)},
          {"--compress-block", std::to_string(c.plan.defaults.compression.block)},
          {"--reshard", c.plan.defaults.reshard_after_forward.to_string()},
          {"--prefetch", std::to_string(c.plan.forward_prefetch_depth)},
          {"--auto-plan", c.auto_plan ? "on" : "off"},
          {"--allow-compression", c.allow_compression ? "on" : "off"},
          {"--cost", c.cost_file},
          {"--compute", c.compute_file},
          {"--predict", c.predict ? "on" : "off"},
          {"--optimizer-in-backward", c.optimizer_in_backward ? "on" : "off"},
          {"--memory-budget", std::to_string(c.memory_budget)},
          {"--memory-check", std::to_string(static_cast<int>(c.memory_check))},
          {"--checkpoint-dir", c.checkpoint_dir},
          {"--save-every", std::to_string(c.save_every)},
          {"--keep-last", std::to_string(c.keep_last)},
          {"--async-save", c.async_save ? "on" : "off"},
          {"--checkpoint-kind",
           c.checkpoint_kind == fullshard::checkpoint::Kind::full ? "full" : "sharded"},
          {"--resume", c.resume_dir},
          {"--start-over", c.start_over ? "on" : "off"},
          {"--init-from", c.init_from},
          {"--stop-after", std::to_string(c.stop_after)},
          {"--device", fullshard::device_type_name(c.device)}};
}

int main(int argc, char** argv) {
  apps::run_on_best_blas_kernel(argv);
#ifdef __GLIBC__
  // Tensors of a step (the model's activations and optimizer scratch; fully_shard keeps its
  // own sharded-gradient storage across zero_grad) come back to the heap instead of being
  // unmapped and faulted in again page by page in every step (1.6 us per 4 KiB page on a
  // Firecracker VM).
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
  const bool help = apps::take_help(argc, argv);
  // Kokkos 3 reads --device (its device number): parsed here after the Runtime instead.
  const std::vector<std::string> device_args = apps::take_flag(argc, argv, "--device");
#if defined(FULLSHARD_APPS_HAVE_CUDA)
  // --device cuda without a visible GPU: skipped (exit 77, what scripts/gpu-run expects),
  // asked before the Runtime starts (a CUDA-enabled Kokkos cannot start without a device).
  if (!help && apps::asks_for_cuda(device_args)) {
    std::string why;
    if (apps::cuda_device_count(why) == 0) {
      std::printf("SKIPPED: no CUDA device (%s): fullshard-train --device cuda needs a GPU\n",
                  why.c_str());
      return 77;
    }
  }
#endif
  std::optional<fullshard::Runtime> rt;
  try {
    rt.emplace(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fullshard-train: %s\n", e.what());
    return apps::startup_exit_code(e, 1);
  }
  const int rank = rt->rank();
  try {
    if (help) {
      if (rank == 0) std::fputs(kUsage, stdout);
      return 0;
    }
    // Every rank parses its own arguments; then the ranks compare them (an MPMD launch can
    // give ranks different ones), so that a rank refusing its options or differing from the
    // others is reported on every rank, exit 2, before any collective of the model.
    std::optional<apps::UsageError> refused;
    Config c;
    try {
      c = parse(argc, argv, device_args);
    } catch (const apps::UsageError& e) {
      refused = e;
    }
    {
      apps::BoundedComm world(rt->world(), "train.world", rt->settings().timeout_s);
      std::vector<apps::OptionValue> values = option_values(refused ? Config{} : c);
      values.insert(values.begin(), {"(options accepted)", refused ? "no" : "yes"});
      try {
        apps::agree_on_options(world, values);
      } catch (const apps::OptionMismatch& e) {
        std::fprintf(stderr, "fullshard-train: rank %d: %s\n", rank,
                     refused ? (refused->message + " (see --help)").c_str()
                     : e.flag == "(options accepted)"
                         ? "another rank refused its options (see its message)"
                         : e.message.c_str());
        return 2;
      }
    }
    if (refused) throw *refused;
    return train(*rt, c);
  } catch (const apps::UsageError& e) {
    // Every rank parses the same arguments, so every rank gets here: no one is left waiting.
    if (rank == 0) std::fprintf(stderr, "fullshard-train: %s (see --help)\n", e.message.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fullshard-train: rank %d: %s\n", rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);  // other ranks may be inside a collective
    return 1;
  }
}
