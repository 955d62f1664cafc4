// fullshard-plan: plans one training iteration of a module graph without running it.
// Runs as a plain program (no mpiexec): it creates no Runtime and no communicator, and calls
// no MPI function (the graph, groups and scheduler code it uses need none).
//
//   fullshard-plan --graph model.json --mesh 2x4 --prefetch 1 --trace plan.json
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "cli.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "fullshard/schedule/plan.hpp"

namespace {

using fullshard::ConfigError;
namespace schedule = fullshard::schedule;

const char* const kUsage =
    "usage: fullshard-plan --graph G.json --mesh N|RxN [options]\n"
    "\n"
    "Plans one training iteration (forward + backward) of the module graph G.json under\n"
    "FSDP on N ranks (--mesh N) or HSDP on R replicas of N-rank shard groups (--mesh RxN):\n"
    "the communication groups, the ops per stream with predicted times, the pool buffers\n"
    "and the predicted step time and peak memory per rank. No MPI is used.\n"
    "\n"
    "options:\n"
    "  --graph FILE            module graph (docs/graph-format.md); required\n"
    "  --mesh N | RxN          shard group size N, replicate size R (default 1); required\n"
    "  --prefetch D            forward prefetch depth: 0 implicit only (default), D >= 1\n"
    "                          issues the next D groups' all-gathers in each pre-forward\n"
    "  --backward-prefetch P   reverse (default: reverse post-forward order) or none\n"
    "  --reshard true|false|K  default reshard_after_forward of every group (default:\n"
    "                          automatic: false for the root group, true for the others)\n"
    "  --max-rs-buffers K      reduce-scatter input buffers in flight (default 1)\n"
    "  --no-all-reduce         HSDP: defer the replicate all-reduce (requires_all_reduce false)\n"
    "  --no-reshard-after-backward\n"
    "                          keep every group's unsharded parameters after its backward\n"
    "                          (reshard_after_backward false)\n"
    "  --no-gradient-sync      a gradient-accumulation micro-batch: no reduce-scatter or\n"
    "                          all-reduce, the gradients stay unsharded\n"
    "                          (requires_gradient_sync false)\n"
    "  --no-unshard-in-backward NAME\n"
    "                          no backward all-gather or backward prefetch of group NAME (module\n"
    "                          FQN or <root>; unshard_in_backward false); repeatable\n"
    "  --not-last-backward     the root's end of backward does not wait for the pending\n"
    "                          reduce-scatters (is_last_backward false)\n"
    "  --param-dtype T         mixed precision: dtype of the unsharded parameters (f32, bf16, "
    "...)\n"
    "  --reduce-dtype T        mixed precision: dtype of the gradient reduction\n"
    "  --cost FILE             cost model JSON (docs/plan-format.md); default: host defaults\n"
    "  --trace FILE            write the plan as a Chrome/Perfetto trace (JSON)\n"
    "  --help                  print this help\n"
    "\n"
    "Exit status: 0 on success, 2 on bad input (options, graph, cost file).\n";

using fullshard::apps::one_line;
using fullshard::apps::UsageError;

int run(int argc, char** argv) {
  std::optional<std::string> graph_path, cost_path, trace_path;
  std::optional<schedule::MeshShape> mesh;
  schedule::PlanOptions opt;

  fullshard::apps::ArgParser args(argc, argv);
  while (args.next()) {
    const std::string& flag = args.flag();
    auto value = [&] { return args.value(); };
    auto no_value = [&] { args.no_value(); };
    if (flag == "--help") {
      no_value();
      std::fputs(kUsage, stdout);
      return 0;
    } else if (flag == "--graph") {
      graph_path = value();
    } else if (flag == "--mesh") {
      const auto [replicate, shard] = args.mesh_value();
      mesh = schedule::MeshShape{shard, replicate};
    } else if (flag == "--prefetch") {
      opt.forward_prefetch_depth = args.int_value(0);
    } else if (flag == "--backward-prefetch") {
      const std::string v = value();
      if (v == "reverse")
        opt.backward_prefetch = schedule::BackwardPrefetch::reverse_post_forward;
      else if (v == "none")
        opt.backward_prefetch = schedule::BackwardPrefetch::none;
      else
        throw UsageError{"--backward-prefetch expects reverse or none, got '" + v + "'"};
    } else if (flag == "--reshard") {
      opt.defaults.reshard_after_forward = args.reshard_value();
    } else if (flag == "--max-rs-buffers") {
      opt.reduce_scatter_max_input_buffers = args.int_value(1);
    } else if (flag == "--no-all-reduce") {
      no_value();
      opt.requires_all_reduce = false;
    } else if (flag == "--no-reshard-after-backward") {
      no_value();
      opt.reshard_after_backward = false;
    } else if (flag == "--no-gradient-sync") {
      no_value();
      opt.requires_gradient_sync = false;
    } else if (flag == "--no-unshard-in-backward") {
      opt.no_unshard_in_backward.insert(value());
    } else if (flag == "--not-last-backward") {
      no_value();
      opt.is_last_backward = false;
    } else if (flag == "--param-dtype") {
      opt.defaults.mp_policy.param_dtype = args.dtype_value();
    } else if (flag == "--reduce-dtype") {
      opt.defaults.mp_policy.reduce_dtype = args.dtype_value();
    } else if (flag == "--cost") {
      cost_path = value();
    } else if (flag == "--trace") {
      trace_path = value();
    } else {
      throw UsageError{"unknown option '" + flag + "' (see --help)"};
    }
  }
  if (!graph_path) throw UsageError{"--graph is required (see --help)"};
  if (!mesh) throw UsageError{"--mesh is required (see --help)"};

  auto root = fullshard::graph::load_graph_json(*graph_path);
  if (cost_path)
    opt.cost = schedule::CostModel::load_json(*cost_path, schedule::CostModel::defaults(*mesh));
  const schedule::Plan plan = schedule::Scheduler::plan(*root, *mesh, opt);
  std::fputs(plan.to_text().c_str(), stdout);
  if (trace_path) {
    std::ofstream out(*trace_path, std::ios::binary);
    if (out) out << plan.to_chrome_trace().dump(1) << "\n";
    if (!out) throw ConfigError(*trace_path + ": cannot write the trace file");
    std::printf("trace: %s\n", trace_path->c_str());
  }
  std::printf("fingerprint: %016llx\n", static_cast<unsigned long long>(plan.fingerprint()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "fullshard-plan: error: %s\n", one_line(e.message).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fullshard-plan: error: %s\n", one_line(e.what()).c_str());
  }
  return 2;
}
