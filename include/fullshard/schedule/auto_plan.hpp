// The auto-planner: chooses the communication groups (which modules are fully_shard'ed),
// reshard_after_forward per group, the forward prefetch depth and the reduce-scatter buffer
// count that minimise the predicted step time of Scheduler::plan subject to a per-rank
// memory budget. Deterministic (no timing, no randomness): every rank makes the same choice.
// Formats and the search: docs/plan-format.md, "Auto-plan".
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/schedule/plan.hpp"

namespace fullshard::schedule {

struct AutoPlanOptions {
  /// Per-rank memory budget in bytes: predicted memory (AutoPlan::memory_bytes) <= it.
  std::size_t memory_budget_bytes = 0;
  /// Persistent bytes per byte of sharded parameters besides the parameters and gradients
  /// (optimizer state: 2 for Adam/AdamW with f32 moments, 1 for SGD with momentum, 0: none).
  double state_bytes_per_param_byte = 0.0;
  /// Bytes per rank outside the plan's model (activations, workspace), added to the memory.
  std::size_t reserved_bytes = 0;
  /// The policies not searched (mixed precision, backward prefetch, HSDP all-reduce, cost
  /// model, ...). Its forward_prefetch_depth / reduce_scatter_max_input_buffers /
  /// defaults.reshard_after_forward are the hand-written default's (AutoPlan::baseline).
  PlanOptions base;
  /// Candidate forward prefetch depths and reduce-scatter buffer counts (each non-empty).
  std::vector<int> prefetch_depths = {0, 1, 2};
  std::vector<int> reduce_scatter_buffers = {1, 2};
  /// Search reshard_after_forward = k (1 < k < shard size, k | shard size) besides true/false.
  bool reshard_group_sizes = true;
  /// Graph requests: true (the default) keeps every fully_shard request of the graph as the
  /// user wrote it (true or an object: the module is a group; false: it never is; an
  /// object's reshard_after_forward is kept too); only modules without a request are
  /// searched. false: every non-root request is free (the requests are only the baseline).
  bool keep_requests = true;
  /// Exact search (branch and bound over every candidate) when the candidate space has at
  /// most this many points; a deterministic local search otherwise.
  std::size_t max_exhaustive = 20000;
  /// The local search stops after this many plans.
  std::size_t max_evaluations = 4000;
  /// Compression policies the search may give every group instead of base's (they change
  /// the numbers: only those the user allows; empty, the default: none). Each is searched
  /// like base's; the fastest feasible one wins, base's on a tie. The chosen policy is in
  /// each call's request ("compression") and in AutoPlan::options.
  std::vector<fsdp::CompressionPolicy> compressions;
  /// The memory a plan takes per rank, compared with memory_budget_bytes. Empty (the
  /// default): predicted_memory_bytes(plan, state_bytes_per_param_byte, reserved_bytes). A
  /// caller that checks its job with the memory account passes the account's process peak
  /// (plan_memory(plan, inputs).process_peak(), docs/memory.md), so that the planner plans
  /// within what the check will check (the search's memory bound is then the sharded
  /// parameters alone).
  std::function<std::size_t(const Plan&)> memory_of;
};

/// What the auto-planner chose: the fully_shard calls (bottom-up, as a user writes them) and
/// the policies.
struct AutoPlanChoice {
  struct Call {
    /// The module's FQN, "" for the graph's root.
    std::string fqn;
    /// The request the call makes (the user's options, reshard_after_forward chosen):
    /// fsdp::options_from_request(request, base.defaults) gives its options.
    graph::ShardRequest request;
  };
  /// Post-order (children before parents, as apply_fully_shard_requests calls them).
  std::vector<Call> calls;
  int forward_prefetch_depth = 0;
  int reduce_scatter_max_input_buffers = 1;

  /// The calls as C++ (fsdp::fully_shard over `mesh_name` with options derived from
  /// `defaults_name`, then the policies on the FSDP modules), for a graph named `root_name`.
  std::string to_cpp(const Plan& plan, const std::string& root_name = "root",
                     const std::string& mesh_name = "mesh",
                     const std::string& defaults_name = "defaults") const;
  /// {"fully_shard": [{"module": "<fqn or <root>>", "fully_shard": request as in a graph
  /// file}, ...], "forward_prefetch_depth": d,
  ///  "reduce_scatter_max_input_buffers": k}, as text (`indent` < 0: on one line).
  std::string to_json(int indent = -1) const;
  bool operator==(const AutoPlanChoice& o) const;
  bool operator!=(const AutoPlanChoice& o) const { return !(*this == o); }
};

/// One evaluated configuration.
struct AutoPlanCandidate {
  double step_ms = 0.0;
  /// sharded + gradient + optimizer-state bytes + pool peak + reserved.
  std::size_t memory_bytes = 0;
  std::size_t peak_bytes = 0;
  std::size_t groups = 0;
};

struct AutoPlan {
  AutoPlanChoice choice;
  /// base with the chosen prefetch depth and reduce-scatter buffer count: plan `root` with
  /// these after apply_auto_plan and you get `plan` (same fingerprint).
  PlanOptions options;
  /// The plan of the choice; it refers to the graph auto_plan was called with.
  Plan plan;
  std::size_t memory_bytes = 0;
  /// The hand-written default: the graph's requests when it has any besides the root's,
  /// else every child of the module with the most children plus the root (FSDP2's "every
  /// block + root"), with base's policies. Its plan refers to the graph as well.
  AutoPlanChoice baseline_choice;
  Plan baseline;
  std::size_t baseline_memory_bytes = 0;
  /// Whether the search was exact (every candidate considered, branch and bound).
  bool exact = false;
  /// Plans made by the search; candidates in the space (0 when too many to count).
  std::size_t evaluations = 0;
  std::size_t space = 0;
};

/// Chooses groups and policies for `root` on `mesh` (see AutoPlanOptions). The graph is not
/// changed: candidates are planned from typed calls; apply_auto_plan applies the choice.
/// Errors: InvalidArgument for a zero budget or empty candidate lists; AutoPlanInfeasible
/// when no candidate fits; the errors of Scheduler::plan for a bad graph (a bad request
/// object before any candidate is planned).
AutoPlan auto_plan(const graph::Module& root, MeshShape mesh, const AutoPlanOptions& options);

/// No candidate fits the budget: what() says so with the smallest memory the search found
/// (exact search: the smallest of every candidate).
class AutoPlanInfeasible : public InvalidArgument {
 public:
  AutoPlanInfeasible(const std::string& what, std::size_t smallest_bytes)
      : InvalidArgument(what), smallest_bytes_(smallest_bytes) {}
  std::size_t smallest_bytes() const noexcept { return smallest_bytes_; }

 private:
  std::size_t smallest_bytes_;
};

/// Sets the fully_shard requests of `root` to those of `choice` (the modules of its calls get
/// their request, every other module none), so that fsdp::apply_fully_shard_requests makes
/// the chosen calls and Scheduler::plan(root, mesh, AutoPlan::options) gives AutoPlan::plan.
/// InvalidArgument naming a call's FQN that is not a module of `root`.
void apply_auto_plan(graph::Module& root, const AutoPlanChoice& choice);

/// Predicted memory per rank of a plan (see AutoPlanCandidate::memory_bytes).
std::size_t predicted_memory_bytes(const Plan& plan, double state_bytes_per_param_byte,
                                   std::size_t reserved_bytes);

/// "40GiB", "512MiB", "1.5GB", "123456" (bytes): the byte count; InvalidArgument naming
/// `what` for anything else.
std::size_t parse_byte_size(const std::string& text, const std::string& what = "size");
/// 1536 -> "1.50 KiB" (binary units).
std::string format_bytes(std::size_t bytes);

}  // namespace fullshard::schedule
