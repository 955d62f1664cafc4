// fullshard-plan: plans one training iteration of a module graph without running it.
// Runs as a plain program (no mpiexec): it creates no Runtime and no communicator, and calls
// no MPI function (the graph, groups and scheduler code it uses need none).
//
//   fullshard-plan --graph model.json --mesh 2x4 --prefetch 1 --trace plan.json
//   fullshard-plan --graph model.json --mesh 4 --auto --memory-budget 40GiB
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "fullshard/schedule/compute_cost.hpp"
#include "fullshard/schedule/memory_account.hpp"
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
    "  --fresh-gradients       the callbacks assign each first gradient: no zeroing before\n"
    "                          backward (fresh_gradients true; fullshard-train on the host)\n"
    "  --optimizer-in-backward S\n"
    "                          each reduction ends with the optimizer's update, S state\n"
    "                          arrays per parameter: 0 SGD, 1 SGD with momentum, 2 AdamW\n"
    "  --param-dtype T         mixed precision: dtype of the unsharded parameters (f32, bf16, "
    "...)\n"
    "  --reduce-dtype T        mixed precision: dtype of the gradient reduction\n"
    "  --cost FILE             cost model JSON (docs/plan-format.md); default: host defaults\n"
    "  --network dgx-h100|FILE two-level network (NVLink in a node, InfiniBand across nodes;\n"
    "                          docs/plan-format.md): the cost model of every collective, and\n"
    "                          the bytes each rank moves per link level; replaces --cost's\n"
    "                          collectives\n"
    "  --copy-gb-per-s X       copy kernel bandwidth with --network (default 1500)\n"
    "  --trace FILE            write the plan as a Chrome/Perfetto trace (JSON)\n"
    "\n"
    "memory per rank (docs/memory.md; printed after the plan):\n"
    "  --optimizer-states S    state arrays per parameter of an optimizer after backward: 0\n"
    "                          SGD (default), 1 SGD with momentum, 2 AdamW\n"
    "  --transport shm|mpi     the shard dim's host collectives: node-local shared memory\n"
    "                          (default; its windows are counted) or MPI\n"
    "  --nodes K               nodes the shard dim spans (default 1; shm: two levels)\n"
    "  --activations SIZE      activations and the front end's scratch per rank (default 0)\n"
    "  --baseline SIZE         the process before the model (default 0)\n"
    "  --time                  print how long planning took\n"
    "\n"
    "auto-plan (docs/plan-format.md, \"Auto-plan\"):\n"
    "  --auto                  choose the fully_shard calls, reshard_after_forward per group,\n"
    "                          the prefetch depth and the reduce-scatter buffer count that\n"
    "                          minimise the predicted step time within --memory-budget; prints\n"
    "                          the choice (C++ and graph-JSON requests) next to the hand-written\n"
    "                          default (the graph's requests, or every block + root)\n"
    "  --memory-budget SIZE    per-rank budget, e.g. 40GiB, 512MiB (required with --auto):\n"
    "                          sharded parameters + gradients + optimizer state + pool peak\n"
    "                          + --reserve\n"
    "  --state-multiple M      optimizer state bytes per sharded parameter byte (default 0;\n"
    "                          2 for Adam with f32 moments)\n"
    "  --reserve SIZE          bytes per rank outside the model (activations; default 0)\n"
    "  --auto-regroup          the graph's requests are only the default: every module is free\n"
    "                          (default: the graph's requests are kept as written)\n"
    "  --choice FILE           write the chosen requests as JSON\n"
    "  --help                  print this help\n"
    "\n"
    "Exit status: 0 on success, 2 on bad input (options, graph, cost file).\n";

using fullshard::apps::one_line;
using fullshard::apps::UsageError;

std::size_t byte_size(const std::string& v, const char* flag) {
  try {
    return schedule::parse_byte_size(v, flag);
  } catch (const fullshard::InvalidArgument&) {
    throw UsageError{std::string(flag) + ": '" + v +
                     "' is not a byte size (e.g. 40GiB, 512MiB, 1.5GB, 123456)"};
  }
}

std::string mib(std::size_t b) {
  return schedule::format_bytes(b);
}

// The auto-plan next to the hand-written default, then the chosen calls.
void print_auto(const schedule::AutoPlan& a, const schedule::MeshShape& mesh,
                const schedule::AutoPlanOptions& o) {
  std::printf("auto-plan: mesh %dx%d (replicate x shard), budget %s per rank, %s (%zu plans%s)\n",
              mesh.replicate_size, mesh.shard_size, mib(o.memory_budget_bytes).c_str(),
              a.exact ? "exact search" : "local search", a.evaluations,
              a.exact ? (", " + std::to_string(a.space) + " candidates").c_str() : "");
  const bool has_baseline = !a.baseline_choice.calls.empty();
  std::printf("%-26s %-22s %s\n", "", "hand-written default", "auto-plan");
  auto row = [&](const char* name, const std::string& l, const std::string& r) {
    std::printf("%-26s %-22s %s\n", name, has_baseline ? l.c_str() : "-", r.c_str());
  };
  auto num = [](double v, const char* unit) {
    char b[64];
    std::snprintf(b, sizeof b, "%.3f %s", v, unit);
    return std::string(b);
  };
  const schedule::Plan& B = a.baseline;
  const schedule::Plan& P = a.plan;
  row("fully_shard calls", std::to_string(a.baseline_choice.calls.size()),
      std::to_string(a.choice.calls.size()));
  row("forward prefetch depth", std::to_string(a.baseline_choice.forward_prefetch_depth),
      std::to_string(a.choice.forward_prefetch_depth));
  row("reduce-scatter buffers", std::to_string(a.baseline_choice.reduce_scatter_max_input_buffers),
      std::to_string(a.choice.reduce_scatter_max_input_buffers));
  row("predicted step time", num(B.step_ms, "ms"), num(P.step_ms, "ms"));
  row("pool peak", mib(B.peak_bytes), mib(P.peak_bytes));
  row("sharded params + grads", mib(B.sharded_bytes + B.grad_bytes),
      mib(P.sharded_bytes + P.grad_bytes));
  row("memory per rank", mib(a.baseline_memory_bytes), mib(a.memory_bytes));
  row("fits the budget", a.baseline_memory_bytes <= o.memory_budget_bytes ? "yes" : "no", "yes");
  std::printf("\nchosen fully_shard calls (C++):\n%s", a.choice.to_cpp(P).c_str());
  const nlohmann::json j = nlohmann::json::parse(a.choice.to_json());
  std::printf("\nchosen requests (graph JSON):\n{\"fully_shard\": [\n");
  for (std::size_t i = 0; i < j["fully_shard"].size(); ++i)
    std::printf("  %s%s\n", j["fully_shard"][i].dump().c_str(),
                i + 1 < j["fully_shard"].size() ? "," : "");
  std::printf("], \"forward_prefetch_depth\": %d, \"reduce_scatter_max_input_buffers\": %d}\n",
              a.choice.forward_prefetch_depth, a.choice.reduce_scatter_max_input_buffers);
  std::printf("\nstep time: %.3f ms\npeak memory per rank (pool): %zu B\n", P.step_ms,
              P.peak_bytes);
}

// The memory account of rank 0 (docs/memory.md): each part in bytes, then the process peak.
void print_memory(const schedule::Plan& plan, schedule::MemoryInputs in) {
  // Inside backward the plan's own state count is the optimizer's.
  if (plan.options.optimizer_in_backward_states >= 0)
    in.optimizer_states = plan.options.optimizer_in_backward_states;
  const schedule::MemoryAccount a = schedule::plan_memory(plan, in);
  std::printf("memory per rank (%d optimizer state arrays, %s, %d node%s):\n", in.optimizer_states,
              in.shared_memory && plan.mesh.shard_size > 1 ? "shared memory" : "MPI", in.nodes,
              in.nodes == 1 ? "" : "s");
  const auto part = [](const char* name, std::size_t bytes) {
    std::printf("  %-16s %12s (%zu B)\n", name, mib(bytes).c_str(), bytes);
  };
  part("baseline", a.baseline);
  part("shards", a.shards);
  part("gradients", a.gradients);
  part("optimizer state", a.optimizer_state);
  part("pool", a.pool);
  part("windows", a.windows);
  part("activations", a.activations);
  part("process peak", a.process_peak());
}

// Bytes each rank moves per link level over the iteration (the plan's collectives).
void print_links(const schedule::Plan& p, const schedule::TwoLevelNetwork& n) {
  schedule::TwoLevelNetwork::LinkBytes total;
  for (const schedule::Op& op : p.ops) {
    schedule::CollectiveKind k;
    schedule::MeshDim d = schedule::MeshDim::shard;
    double bytes = double(op.bytes);
    if (op.kind == schedule::OpKind::all_gather) {
      k = schedule::CollectiveKind::all_gather;
      if (op.k > 1 && p.mesh.shard_size > 1) bytes = bytes * (op.k - 1) / (p.mesh.shard_size - 1);
    } else if (op.kind == schedule::OpKind::reduce_scatter) {
      k = schedule::CollectiveKind::reduce_scatter;
    } else if (op.kind == schedule::OpKind::all_reduce) {
      k = schedule::CollectiveKind::all_reduce;
      d = schedule::MeshDim::replicate;
    } else {
      continue;
    }
    const auto b = n.link_bytes(p.mesh, k, d, bytes);
    total.nvlink += b.nvlink;
    total.infiniband += b.infiniband;
  }
  const auto s = n.span(p.mesh, schedule::MeshDim::shard);
  const auto r = n.span(p.mesh, schedule::MeshDim::replicate);
  std::printf(
      "network: %d GPUs per node; shard group %d GPUs x %d nodes, replicate group %d x %d\n"
      "bytes per rank per iteration: NVLink %s, InfiniBand %s\n",
      n.gpus_per_node, s.first, s.second, r.first, r.second,
      mib(static_cast<std::size_t>(total.nvlink)).c_str(),
      mib(static_cast<std::size_t>(total.infiniband)).c_str());
}

int run(int argc, char** argv) {
  std::optional<std::string> graph_path, cost_path, trace_path, network_arg, choice_path;
  std::optional<schedule::MeshShape> mesh;
  schedule::PlanOptions opt;
  bool auto_mode = false, timing = false;
  schedule::AutoPlanOptions ao;
  bool have_budget = false;
  schedule::MemoryInputs memory;
  memory.shared_memory = true;
  double copy_gb_per_s = 1500.0;

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
      mesh = schedule::MeshShape::hsdp(replicate, shard);
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
    } else if (flag == "--fresh-gradients") {
      no_value();
      opt.fresh_gradients = true;
    } else if (flag == "--optimizer-in-backward") {
      opt.optimizer_in_backward_states = args.int_value(0, 2);
    } else if (flag == "--param-dtype") {
      opt.defaults.mp_policy.param_dtype = args.dtype_value();
    } else if (flag == "--reduce-dtype") {
      opt.defaults.mp_policy.reduce_dtype = args.dtype_value();
    } else if (flag == "--cost") {
      cost_path = value();
    } else if (flag == "--trace") {
      trace_path = value();
    } else if (flag == "--network") {
      network_arg = value();
    } else if (flag == "--copy-gb-per-s") {
      copy_gb_per_s = args.double_value(1e-6, 1e9);
    } else if (flag == "--time") {
      no_value();
      timing = true;
    } else if (flag == "--auto") {
      no_value();
      auto_mode = true;
    } else if (flag == "--memory-budget") {
      ao.memory_budget_bytes = byte_size(value(), "--memory-budget");
      have_budget = true;
    } else if (flag == "--state-multiple") {
      ao.state_bytes_per_param_byte = args.double_value(0, 1e6);
    } else if (flag == "--reserve") {
      ao.reserved_bytes = byte_size(value(), "--reserve");
    } else if (flag == "--auto-regroup") {
      no_value();
      ao.keep_requests = false;
    } else if (flag == "--choice") {
      choice_path = value();
    } else if (flag == "--optimizer-states") {
      memory.optimizer_states = args.int_value(0, 2);
    } else if (flag == "--transport") {
      const std::string v = value();
      if (v != "shm" && v != "mpi")
        throw UsageError{"--transport expects shm or mpi, got '" + v + "'"};
      memory.shared_memory = v == "shm";
    } else if (flag == "--nodes") {
      memory.nodes = args.int_value(1);
    } else if (flag == "--activations") {
      memory.activations = byte_size(value(), "--activations");
    } else if (flag == "--baseline") {
      memory.baseline = byte_size(value(), "--baseline");
    } else {
      throw UsageError{"unknown option '" + flag + "' (see --help)"};
    }
  }
  if (!graph_path) throw UsageError{"--graph is required (see --help)"};
  if (!mesh) throw UsageError{"--mesh is required (see --help)"};
  if (auto_mode && !have_budget) throw UsageError{"--auto needs --memory-budget (see --help)"};
  if (!auto_mode && (have_budget || choice_path || !ao.keep_requests))
    throw UsageError{"--memory-budget, --choice and --auto-regroup need --auto (see --help)"};

  auto root = fullshard::graph::load_graph_json(*graph_path);
  if (cost_path)
    opt.cost = schedule::CostModel::load_json(*cost_path, schedule::CostModel::defaults(*mesh));
  std::optional<schedule::TwoLevelNetwork> network;
  if (network_arg) {
    network = *network_arg == "dgx-h100" ? schedule::TwoLevelNetwork::dgx_h100()
                                         : schedule::TwoLevelNetwork::load_json(
                                               *network_arg, schedule::TwoLevelNetwork::dgx_h100());
    opt.cost = network->cost_model(*mesh, copy_gb_per_s);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<schedule::AutoPlan> chosen;
  std::optional<schedule::Plan> hand;
  if (auto_mode) {
    ao.base = opt;
    chosen.emplace(schedule::auto_plan(*root, *mesh, ao));
  } else {
    hand.emplace(schedule::Scheduler::plan(*root, *mesh, opt));
  }
  const double elapsed_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const schedule::Plan& plan = chosen ? chosen->plan : *hand;
  if (chosen)
    print_auto(*chosen, *mesh, ao);
  else
    std::fputs(plan.to_text().c_str(), stdout);
  if (network) print_links(plan, *network);
  print_memory(plan, memory);
  std::printf("serial step time: %.3f ms (every op on one thread, as the host's inline progress)\n",
              schedule::serial_step_ms(plan));
  if (timing)
    std::printf("%s time: %.3f ms (%zu modules%s)\n", chosen ? "auto-plan" : "planning", elapsed_ms,
                root->modules_preorder().size(),
                chosen ? (", " + std::to_string(chosen->evaluations) + " plans").c_str() : "");
  if (choice_path) {
    std::ofstream out(*choice_path, std::ios::binary);
    if (out) out << chosen->choice.to_json(1) << "\n";
    if (!out) throw ConfigError(*choice_path + ": cannot write the choice file");
    std::printf("choice: %s\n", choice_path->c_str());
  }
  if (trace_path) {
    std::ofstream out(*trace_path, std::ios::binary);
    if (out) out << nlohmann::json::parse(plan.to_chrome_trace()).dump(1) << "\n";
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
