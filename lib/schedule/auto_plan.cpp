// The auto-planner (fullshard/schedule/auto_plan.hpp): a search over fully_shard calls and
// plan policies, each candidate costed by the scheduler on the caller's graph with the
// candidate's calls as a typed table (detail::replan_calls): the graph is not changed.
//
// Candidate = (which free modules are fully_shard'ed, reshard_after_forward per sharded
// module whose value is not fixed, forward prefetch depth, reduce-scatter buffer count).
// Objective: feasible (memory <= budget) first; then the lowest predicted step time, then the
// lowest memory, then the first in enumeration order. Small spaces: exact branch and bound
// (per grouping, lower bounds on step time and memory that hold for every policy); large
// ones: a deterministic local search from structured seeds.
#include "fullshard/schedule/auto_plan.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "fullshard/base/error.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "lib/fsdp/group_rules.hpp"
#include "lib/graph/json_forms.hpp"
#include "lib/schedule/planner_entry.hpp"

namespace fullshard::schedule {

namespace {

constexpr std::size_t kNoBound = std::numeric_limits<std::size_t>::max();

/// The memory a plan is held to: the caller's measure (AutoPlanOptions::memory_of) or the
/// planner's own.
std::size_t plan_memory_bytes(const Plan& plan, const AutoPlanOptions& o) {
  return o.memory_of ? o.memory_of(plan)
                     : predicted_memory_bytes(plan, o.state_bytes_per_param_byte, o.reserved_bytes);
}

std::string display_name(const std::string& fqn) {
  return fqn.empty() ? "<root>" : fqn;
}

using Options = std::shared_ptr<const fsdp::FullyShardOptions>;

const graph::ShardRequest kNoOptions;  // `true`: fully_shard with the defaults

// One module of the graph, as the search sees it.
struct Slot {
  const graph::Module* module = nullptr;
  const graph::ShardRequest* original = nullptr;  // the graph's request (null: none)
  // The request the call makes, before reshard_after_forward: the graph's when it asks for
  // fully_shard, else kNoOptions.
  const graph::ShardRequest* base = &kNoOptions;
  // The options of `base` (the user's object as written, or the defaults: also the
  // baseline's call), parsed once; a plain slot shares the search's defaults.
  Options parsed;
  // Per value of the search's reshard list: `parsed` with that reshard_after_forward (made
  // on first use; plain slots use the search's shared list).
  std::vector<Options> by_value;
  bool can_on = false;
  bool can_off = true;
  bool reshard_fixed = false;
  std::size_t depth = 0;
};

struct Config {
  std::vector<std::uint8_t> on;                    // per slot
  std::vector<fsdp::ReshardAfterForward> reshard;  // per slot
  int prefetch = 0;
  int rs = 1;
};

struct Score {
  bool evaluated = false;
  bool feasible = false;
  double step_ms = 0.0;
  std::size_t memory = 0;
};

// a strictly better than b?
bool better(const Score& a, const Score& b) {
  if (!b.evaluated) return a.evaluated;
  if (!a.evaluated) return false;
  if (a.feasible != b.feasible) return a.feasible;
  if (a.feasible) {
    if (a.step_ms != b.step_ms) return a.step_ms < b.step_ms;
    return a.memory < b.memory;
  }
  if (a.memory != b.memory) return a.memory < b.memory;
  return a.step_ms < b.step_ms;
}

class Search {
 public:
  Search(const graph::Module& root, MeshShape mesh, const AutoPlanOptions& o)
      : root_(root), mesh_(mesh), o_(o) {
    if (o.memory_budget_bytes == 0)
      throw InvalidArgument("auto_plan: the memory budget must be > 0 bytes");
    if (o.prefetch_depths.empty() || o.reduce_scatter_buffers.empty())
      throw InvalidArgument(
          "auto_plan: prefetch_depths and reduce_scatter_buffers need at least one value");
    for (int d : o.prefetch_depths)
      if (d < 0)
        throw InvalidArgument("auto_plan: prefetch_depths: " + std::to_string(d) +
                              " is not a depth >= 0");
    for (int k : o.reduce_scatter_buffers)
      if (k < 1)
        throw InvalidArgument("auto_plan: reduce_scatter_buffers: " + std::to_string(k) +
                              " is not a count >= 1");
    if (!(o.state_bytes_per_param_byte >= 0) || !std::isfinite(o.state_bytes_per_param_byte))
      throw InvalidArgument("auto_plan: state_bytes_per_param_byte must be a finite number >= 0");
    if (mesh.shard_size < 1 || mesh.replicate_size < 1)
      throw InvalidArgument("auto_plan: mesh sizes must be >= 1");
    const int W = mesh.shard_size;
    values_.push_back(fsdp::ReshardAfterForward::always());
    if (W > 1) values_.push_back(fsdp::ReshardAfterForward::never());
    if (o.reshard_group_sizes)
      for (int k = 2; k < W; ++k)
        if (W % k == 0) values_.push_back(fsdp::ReshardAfterForward::group_size(k));
    prefetch_ = o.prefetch_depths;
    rs_ = o.reduce_scatter_buffers;

    // Groups the base policies name must exist in every candidate: their modules are fixed.
    std::set<std::string> named(o.base.no_unshard_in_backward.begin(),
                                o.base.no_unshard_in_backward.end());
    for (const auto& [name, targets] : o.base.backward_prefetch_targets) {
      named.insert(name);
      named.insert(targets.begin(), targets.end());
    }

    std::map<const graph::Module*, std::size_t> params_below;
    auto& graph = const_cast<graph::Module&>(root);  // (read only: the walks are non-const)
    auto post = graph.modules_postorder();
    for (const graph::Module* m : post) {
      std::size_t n = m->num_params();
      for (std::size_t c = 0; c < m->num_children(); ++c)
        n += params_below[&m->child(c)];
      params_below[m] = n;
    }
    defaults_ = std::make_shared<const fsdp::FullyShardOptions>(o.base.defaults);
    // The graph's list groups stay as they are: on, their reshard_after_forward searched
    // through their first module's call; their other modules make no call of their own.
    lists_ = fsdp::detail::graph_list_groups(root);
    table_.lists = &lists_;
    std::map<const graph::Module*, bool> list_member;  // -> first module of its list
    for (const auto& l : lists_)
      for (std::size_t i = 0; i < l.modules.size(); ++i)
        list_member[l.modules[i]] = i == 0;
    for (const graph::Module* m : graph.modules_preorder()) {
      Slot s;
      s.module = m;
      s.original = m->fully_shard_request();
      s.depth = m->depth();
      const auto member = list_member.find(m);
      const bool req = m->requests_fully_shard();
      const bool explicit_false = s.original && !s.original->shard;
      const bool has_params = params_below[m] > 0;
      if (req) s.base = s.original;
      const bool fixed = m->is_root() || o.keep_requests || named.count(display_name(m->fqn())) ||
                         member != list_member.end();
      if (member != list_member.end()) {
        s.can_on = member->second;
        s.can_off = !member->second;
      } else if (m->is_root() && !(o.keep_requests && explicit_false)) {
        s.can_on = true;
        s.can_off = false;
      } else if (named.count(display_name(m->fqn()))) {
        s.can_on = true;
        s.can_off = false;
      } else if (fixed && (req || explicit_false)) {
        s.can_on = req;
        s.can_off = !req;
      } else {
        s.can_on = has_params;
        s.can_off = true;
      }
      s.reshard_fixed = fixed && req && s.original->reshard_after_forward.has_value();
      // The options of the user's requests, once.
      s.parsed = s.base->sets_no_option()
                     ? defaults_
                     : std::make_shared<const fsdp::FullyShardOptions>(
                           fsdp::options_from_request(*s.base, o.base.defaults));
      slots_.push_back(std::move(s));
    }
    for (std::size_t i = 0; i < slots_.size(); ++i)
      if (slots_[i].can_on && slots_[i].can_off) free_.push_back(i);
  }

  // ---- candidates ----

  Config base_config() const {
    Config c;
    c.on.assign(slots_.size(), 0);
    c.reshard.assign(slots_.size(), values_.front());
    for (std::size_t i = 0; i < slots_.size(); ++i)
      c.on[i] = slots_[i].can_on && !slots_[i].can_off;
    c.prefetch = prefetch_.front();
    c.rs = rs_.front();
    return c;
  }

  bool searchable(std::size_t i) const { return !slots_[i].reshard_fixed && values_.size() > 1; }

  // The options of slot i's call with reshard_after_forward v (the slot's own when fixed).
  const Options& options_for(std::size_t i, fsdp::ReshardAfterForward v) {
    Slot& s = slots_[i];
    if (s.reshard_fixed) return s.parsed;
    const auto at =
        static_cast<std::size_t>(std::find(values_.begin(), values_.end(), v) - values_.begin());
    std::vector<Options>& list = s.parsed == defaults_ ? plain_by_value_ : s.by_value;
    if (list.empty()) list.resize(values_.size());
    if (!list[at]) {
      auto o = std::make_shared<fsdp::FullyShardOptions>(*s.parsed);
      o->reshard_after_forward = v;
      list[at] = std::move(o);
    }
    return list[at];
  }

  // The candidate's calls as the planner's table (no module's request is touched).
  void apply(const Config& c) {
    table_.calls.resize(slots_.size());
    for (std::size_t i = 0; i < slots_.size(); ++i)
      table_.calls[i] = c.on[i] ? &options_for(i, c.reshard[i]) : nullptr;
  }

  // The baseline's calls: the requests as written (`base` is the user's object, or none).
  void apply_baseline(const Config& c) {
    table_.calls.resize(slots_.size());
    for (std::size_t i = 0; i < slots_.size(); ++i)
      table_.calls[i] = c.on[i] ? &slots_[i].parsed : nullptr;
  }

  // The request of slot i's call (the slot is on in c).
  graph::ShardRequest request(const Config& c, std::size_t i) const {
    const Slot& s = slots_[i];
    graph::ShardRequest r = *s.base;
    if (!s.reshard_fixed) r.reshard_after_forward = c.reshard[i];
    return r;
  }

  PlanOptions options(const Config& c) const {
    PlanOptions p = o_.base;
    p.forward_prefetch_depth = c.prefetch;
    p.reduce_scatter_max_input_buffers = c.rs;
    return p;
  }

  // The plan of a candidate, in the searcher's one plan (each replan reuses its memory).
  const Plan& plan(const Config& c) {
    apply(c);
    ++evaluations_;
    detail::replan_calls(scratch_, root_, mesh_, options(c), &table_);
    return scratch_;
  }

  // The plans of the baseline and the choice, each its own (not the search's scratch).
  Plan baseline_plan(const Config& c, const PlanOptions& options) {
    apply_baseline(c);
    Plan p;
    detail::replan_calls(p, root_, mesh_, options, &table_);
    return p;
  }
  Plan final_plan(const Config& c) {
    apply(c);
    Plan p;
    detail::replan_calls(p, root_, mesh_, options(c), &table_);
    return p;
  }

  Score score(const Plan& p) const {
    Score s;
    s.evaluated = true;
    s.step_ms = p.step_ms;
    s.memory = plan_memory_bytes(p, o_);
    s.feasible = s.memory <= o_.memory_budget_bytes;
    return s;
  }

  Score evaluate(const Config& c) {
    const Score s = score(plan(c));
    min_memory_ = std::min(min_memory_, s.memory);
    if (better(s, best_score_)) {
      best_score_ = s;
      best_ = c;
    }
    return s;
  }

  // ---- exact search ----

  // Points of the space, or kNoBound when more than `cap`.
  std::size_t space(std::size_t cap) const {
    if (free_.size() > 20) return kNoBound;
    const std::size_t P = prefetch_.size() * rs_.size();
    std::size_t total = 0;
    const Config b = base_config();
    for (std::uint64_t mask = 0; mask < (std::uint64_t(1) << free_.size()); ++mask) {
      std::size_t n = P;
      for (std::size_t i = 0; i < slots_.size(); ++i) {
        bool on = b.on[i];
        for (std::size_t f = 0; f < free_.size(); ++f)
          if (free_[f] == i) on = (mask >> f) & 1;
        if (on && searchable(i)) {
          n *= values_.size();
          if (n > cap) return kNoBound;
        }
      }
      total += n;
      if (total > cap) return kNoBound;
    }
    return total;
  }

  Config grouping(std::uint64_t mask) const {
    Config c = base_config();
    for (std::size_t f = 0; f < free_.size(); ++f)
      c.on[free_[f]] = (mask >> f) & 1;
    return c;
  }

  // Every policy of grouping `g` (index order: prefetch, reduce-scatter buffers, then the
  // reshard values of the searchable sharded modules, the last one fastest).
  template <class F>
  void for_each_policy(const Config& g, F&& fn) const {
    std::vector<std::size_t> var;
    for (std::size_t i = 0; i < slots_.size(); ++i)
      if (g.on[i] && searchable(i)) var.push_back(i);
    std::size_t combos = 1;
    for (std::size_t v = 0; v < var.size(); ++v)
      combos *= values_.size();
    for (int pf : prefetch_)
      for (int rs : rs_)
        for (std::size_t idx = 0; idx < combos; ++idx) {
          Config c = g;
          c.prefetch = pf;
          c.rs = rs;
          std::size_t rest = idx;
          for (std::size_t v = var.size(); v-- > 0;) {
            c.reshard[var[v]] = values_[rest % values_.size()];
            rest /= values_.size();
          }
          if (!fn(c)) return;
        }
  }

  // Lower bounds valid for every policy of the grouping of plan `p`: the compute stream runs
  // every module's forward and backward, every group's forward copy-out and gradient zeroing;
  // the all-gather stream every group's forward all-gather; the reduce-scatter stream every
  // reduce-scatter. Memory: the persistent bytes
  // plus, for each group, its gather buffer and unsharded parameters (held together at its
  // forward copy-out; a one-rank group without a cast holds neither: its shards are its
  // parameters, engine::Group::shards_are_params).
  std::pair<double, std::size_t> bounds(const Plan& p) const {
    double compute = 0, ag = 0, rs = 0;
    for (const Op& op : p.ops) {
      const double d = op.end_ms - op.start_ms;
      if (op.kind == OpKind::forward || op.kind == OpKind::backward ||
          op.kind == OpKind::grad_init ||
          (op.kind == OpKind::copy_out && op.phase == Phase::forward))
        compute += d;
      else if (op.kind == OpKind::all_gather && op.phase == Phase::forward)
        ag += d;
      else if (op.kind == OpKind::reduce_scatter)
        rs += d;
    }
    std::size_t group = 0;
    for (const PlannedGroup& g : p.groups)
      if (g.layout.arena_numel > 0 && !(g.shard_size() == 1 && g.param_dtype == g.orig_dtype))
        group = std::max(group, g.gather_bytes() + g.unsharded_bytes());
    // What every policy of this grouping holds: the planner's persistent bytes, or under a
    // caller's measure only the sharded parameters (its gradients and state may differ).
    const std::size_t persistent =
        o_.memory_of ? p.sharded_bytes
                     : predicted_memory_bytes(p, o_.state_bytes_per_param_byte, o_.reserved_bytes) -
                           p.peak_bytes;
    return {std::max({compute, ag, rs}), persistent + group};
  }

  void exact() {
    std::vector<std::uint64_t> skipped_for_memory;
    const std::uint64_t n = std::uint64_t(1) << free_.size();
    for (std::uint64_t mask = 0; mask < n; ++mask) {
      const Config g = grouping(mask);
      bool first = true;
      bool memory_pruned = false;
      for_each_policy(g, [&](const Config& c) {
        const Plan& p = plan(c);
        const Score s = score(p);
        min_memory_ = std::min(min_memory_, s.memory);
        if (better(s, best_score_)) {
          best_score_ = s;
          best_ = c;
        }
        if (first) {
          first = false;
          const auto [time_lb, memory_lb] = bounds(p);
          if (memory_lb > o_.memory_budget_bytes) {
            memory_pruned = true;
            return false;
          }
          if (best_score_.feasible && time_lb > best_score_.step_ms) return false;
        }
        return true;
      });
      if (memory_pruned) skipped_for_memory.push_back(mask);
    }
    if (!best_score_.feasible)  // the exact smallest memory: every candidate
      for (std::uint64_t mask : skipped_for_memory)
        for_each_policy(grouping(mask), [&](const Config& c) {
          evaluate(c);
          return true;
        });
  }

  // ---- local search ----

  void local() {
    const std::size_t cap = std::max<std::size_t>(o_.max_evaluations, 1);
    auto budget_left = [&] { return evaluations_ < cap; };
    // Seeds: the fixed modules only, then per depth every free module of that depth, and the
    // hand-written default; each with uniform policies.
    std::vector<Config> seeds;
    seeds.push_back(base_config());
    std::size_t max_depth = 0;
    for (std::size_t f : free_)
      max_depth = std::max(max_depth, slots_[f].depth);
    for (std::size_t d = 1; d <= max_depth; ++d) {
      Config c = base_config();
      bool any = false;
      for (std::size_t f : free_)
        if (slots_[f].depth == d) c.on[f] = any = true;
      if (any) seeds.push_back(c);
    }
    if (auto b = baseline_config()) seeds.push_back(*b);
    for (const Config& seed : seeds)
      for (const fsdp::ReshardAfterForward v : values_)
        for (int pf : prefetch_)
          for (int rs : rs_) {
            if (!budget_left()) return;
            Config c = seed;
            std::fill(c.reshard.begin(), c.reshard.end(), v);
            c.prefetch = pf;
            c.rs = rs;
            evaluate(c);
          }
    // First-improvement hill climbing from the best, in a fixed order of moves.
    bool improved = true;
    while (improved && budget_left()) {
      improved = false;
      auto attempt = [&](const Config& c) {
        if (!budget_left()) return false;
        const Score before = best_score_;
        evaluate(c);
        if (better(best_score_, before)) improved = true;
        return true;
      };
      for (std::size_t i = 0; i < slots_.size(); ++i) {
        if (!best_.on[i] || !searchable(i)) continue;
        for (const fsdp::ReshardAfterForward v : values_) {
          if (v == best_.reshard[i]) continue;
          Config c = best_;
          c.reshard[i] = v;
          if (!attempt(c)) return;
        }
      }
      for (std::size_t f : free_) {
        Config c = best_;
        c.on[f] = !c.on[f];
        if (!attempt(c)) return;
      }
      for (int pf : prefetch_)
        for (int rs : rs_) {
          if (pf == best_.prefetch && rs == best_.rs) continue;
          Config c = best_;
          c.prefetch = pf;
          c.rs = rs;
          if (!attempt(c)) return;
        }
    }
  }

  // ---- the hand-written default ----

  // The graph's requests as written when any module but the root has one; else every child
  // of the module with the most children, plus the root. Unset when the fixed requests
  // exclude it (keep_requests and a block the user excluded).
  std::optional<Config> baseline_config() const {
    Config c = base_config();
    bool has_requests = false;
    for (std::size_t i = 1; i < slots_.size(); ++i)
      if (slots_[i].module->requests_fully_shard()) has_requests = true;
    std::size_t widest = 0;
    for (std::size_t i = 0; i < slots_.size(); ++i)
      if (slots_[i].module->num_children() > slots_[widest].module->num_children()) widest = i;
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      bool want = false;
      if (has_requests)
        want = s.module->requests_fully_shard() || s.module->is_root();
      else
        want = s.module->is_root() || s.module->parent() == slots_[widest].module;
      if (want && !s.can_on) return std::nullopt;
      if (!want && !s.can_off) want = true;
      c.on[i] = want;
    }
    return c;
  }

  // The baseline's requests: as written (true, the user's objects) and base's policies.
  AutoPlanChoice baseline_choice(const Config& c) const {
    AutoPlanChoice ch;
    for (const graph::Module* m : postorder()) {
      const std::size_t i = index_of(m);
      if (!c.on[i]) continue;
      ch.calls.push_back({m->fqn(), *slots_[i].base});
    }
    ch.forward_prefetch_depth = o_.base.forward_prefetch_depth;
    ch.reduce_scatter_max_input_buffers = o_.base.reduce_scatter_max_input_buffers;
    return ch;
  }

  AutoPlanChoice choice(const Config& c) const {
    AutoPlanChoice ch;
    for (const graph::Module* m : postorder()) {
      const std::size_t i = index_of(m);
      if (c.on[i]) ch.calls.push_back({m->fqn(), request(c, i)});
    }
    ch.forward_prefetch_depth = c.prefetch;
    ch.reduce_scatter_max_input_buffers = c.rs;
    return ch;
  }

  std::vector<graph::Module*> postorder() const {
    return const_cast<graph::Module&>(root_).modules_postorder();
  }

  std::size_t index_of(const graph::Module* m) const {
    if (index_.empty())
      for (std::size_t i = 0; i < slots_.size(); ++i)
        index_[slots_[i].module] = i;
    return index_.at(m);
  }

  std::size_t evaluations() const noexcept { return evaluations_; }
  const Score& best_score() const noexcept { return best_score_; }
  const Config& best() const noexcept { return best_; }
  std::size_t min_memory() const noexcept { return min_memory_; }

 private:
  const graph::Module& root_;
  MeshShape mesh_;
  const AutoPlanOptions& o_;
  Options defaults_;
  std::vector<Options> plain_by_value_;  // options_for's list for the plain slots
  std::vector<fsdp::detail::GraphListGroup> lists_;
  std::vector<Slot> slots_;
  detail::RequestTable table_;
  std::vector<std::size_t> free_;
  std::vector<fsdp::ReshardAfterForward> values_;
  std::vector<int> prefetch_, rs_;
  mutable std::map<const graph::Module*, std::size_t> index_;
  Config best_;
  Score best_score_;
  std::size_t min_memory_ = kNoBound;
  std::size_t evaluations_ = 0;
  Plan scratch_;
};

std::string cpp_module(const std::string& root_name, const std::string& fqn) {
  if (fqn.empty()) return root_name;
  return root_name + ".module(\"" + fqn + "\")";
}

}  // namespace

std::size_t predicted_memory_bytes(const Plan& plan, double state_bytes_per_param_byte,
                                   std::size_t reserved_bytes) {
  const double state = std::ceil(double(plan.sharded_bytes) * state_bytes_per_param_byte);
  return plan.sharded_bytes + plan.grad_bytes + static_cast<std::size_t>(state) + plan.peak_bytes +
         reserved_bytes;
}

namespace {

AutoPlan auto_plan_one(const graph::Module& root, MeshShape mesh, const AutoPlanOptions& options) {
  Search s(root, mesh, options);
  AutoPlan out;
  out.space = s.space(options.max_exhaustive);
  out.exact = out.space != kNoBound;
  if (out.space == kNoBound) out.space = 0;
  if (out.exact)
    s.exact();
  else
    s.local();

  // The baseline (planned after the search so that its plan is the last thing computed on
  // the baseline's requests; it does not take part in the choice).
  if (auto b = s.baseline_config()) {
    const PlanOptions& bo = options.base;
    out.baseline_choice = s.baseline_choice(*b);
    out.baseline = s.baseline_plan(*b, bo);
    out.baseline_memory_bytes = plan_memory_bytes(out.baseline, options);
  }
  out.evaluations = s.evaluations();

  if (!s.best_score().feasible) {
    const std::size_t smallest = s.min_memory();
    throw AutoPlanInfeasible(
        "auto_plan: no choice of groups and policies fits the memory budget of " +
            format_bytes(options.memory_budget_bytes) + " (" +
            std::to_string(options.memory_budget_bytes) + " B) per rank on mesh " +
            std::to_string(mesh.replicate_size) + "x" + std::to_string(mesh.shard_size) +
            "; the smallest " + (out.exact ? "feasible" : "found") + " peak is " +
            format_bytes(smallest) + " (" + std::to_string(smallest) + " B)" +
            (out.exact ? "" : " (local search: not exhaustive)"),
        smallest);
  }
  out.choice = s.choice(s.best());
  out.options = s.options(s.best());
  out.plan = s.final_plan(s.best());
  out.memory_bytes = plan_memory_bytes(out.plan, options);
  return out;
}

}  // namespace

AutoPlan auto_plan(const graph::Module& root, MeshShape mesh, const AutoPlanOptions& options) {
  if (options.compressions.empty()) return auto_plan_one(root, mesh, options);
  // base's compression first (it wins ties), then each allowed one, searched alike.
  std::optional<AutoPlan> best;
  std::exception_ptr infeasible;
  for (std::size_t i = 0; i <= options.compressions.size(); ++i) {
    AutoPlanOptions o = options;
    o.compressions.clear();
    if (i > 0) o.base.defaults.compression = options.compressions[i - 1];
    try {
      AutoPlan a = auto_plan_one(root, mesh, o);
      if (!best || a.plan.step_ms < best->plan.step_ms) {
        if (i > 0)  // the calls carry the chosen policy (applied without base's defaults)
          for (AutoPlanChoice::Call& c : a.choice.calls) {
            c.request.compression = o.base.defaults.compression;
          }
        if (best) a.evaluations += best->evaluations;
        best = std::move(a);
      } else {
        best->evaluations += a.evaluations;
      }
    } catch (const AutoPlanInfeasible&) {
      if (!infeasible) infeasible = std::current_exception();
    }
  }
  if (!best) std::rethrow_exception(infeasible);
  return std::move(*best);
}

void apply_auto_plan(graph::Module& root, const AutoPlanChoice& choice) {
  std::vector<std::pair<graph::Module*, const graph::ShardRequest*>> set;
  for (std::size_t i = 0; i < choice.calls.size(); ++i) {
    graph::Module* m = root.find_module(choice.calls[i].fqn);
    if (!m)
      throw InvalidArgument("apply_auto_plan: calls[" + std::to_string(i) + "]: no module '" +
                            choice.calls[i].fqn + "' in the graph");
    set.emplace_back(m, &choice.calls[i].request);
  }
  for (graph::Module* m : root.modules_preorder())
    m->clear_fully_shard_request();
  for (const auto& [m, r] : set)
    m->set_fully_shard_request(*r);
}

bool AutoPlanChoice::operator==(const AutoPlanChoice& o) const {
  if (calls.size() != o.calls.size() || forward_prefetch_depth != o.forward_prefetch_depth ||
      reduce_scatter_max_input_buffers != o.reduce_scatter_max_input_buffers)
    return false;
  for (std::size_t i = 0; i < calls.size(); ++i)
    if (calls[i].fqn != o.calls[i].fqn || calls[i].request != o.calls[i].request) return false;
  return true;
}

std::string AutoPlanChoice::to_json(int indent) const {
  nlohmann::json calls_json = nlohmann::json::array();
  for (const Call& c : calls)
    calls_json.push_back(
        {{"module", display_name(c.fqn)}, {"fully_shard", graph::shard_request_json(c.request)}});
  return nlohmann::json{{"fully_shard", calls_json},
                        {"forward_prefetch_depth", forward_prefetch_depth},
                        {"reduce_scatter_max_input_buffers", reduce_scatter_max_input_buffers}}
      .dump(indent);
}

std::string AutoPlanChoice::to_cpp(const Plan& plan, const std::string& root_name,
                                   const std::string& mesh_name,
                                   const std::string& defaults_name) const {
  std::ostringstream s;
  s << "// fully_shard bottom-up (" << calls.size() << " calls), then the policies\n";
  s << "auto opts = [&](fsdp::ReshardAfterForward r) {\n"
    << "  fsdp::FullyShardOptions o = " << defaults_name << ";\n"
    << "  o.reshard_after_forward = r;\n"
    << "  return o;\n"
    << "};\n";
  for (const Call& c : calls) {
    std::string r = "fsdp::ReshardAfterForward::automatic()";
    graph::ShardRequest extra = c.request;
    if (extra.reshard_after_forward) {
      const fsdp::ReshardAfterForward v = *extra.reshard_after_forward;
      if (v.reshards() || v.keeps_unsharded())
        r = v.reshards() ? "fsdp::ReshardAfterForward(true)" : "fsdp::ReshardAfterForward(false)";
      else if (!v.is_automatic())
        r = "fsdp::ReshardAfterForward::group_size(" + std::to_string(v.value()) + ")";
      extra.reshard_after_forward.reset();
    }
    s << "fsdp::fully_shard(" << cpp_module(root_name, c.fqn) << ", " << mesh_name << ", opts(" << r
      << "));";
    if (!extra.sets_no_option() || !extra.group_with.empty())
      s << "  // and the request's " << graph::shard_request_json(extra).dump();
    s << "\n";
  }
  for (std::size_t g = 0; g < plan.groups.size(); ++g) {
    if (plan.forward_prefetch[g].empty()) continue;
    const graph::Module& m = *plan.groups[g].modules.front();
    s << "fsdp::fsdp_state(" << cpp_module(root_name, m.fqn())
      << ")->set_modules_to_forward_prefetch({";
    for (std::size_t t = 0; t < plan.forward_prefetch[g].size(); ++t) {
      const auto& tm =
          *plan.groups[static_cast<std::size_t>(plan.forward_prefetch[g][t])].modules.front();
      s << (t ? ", " : "") << "&" << cpp_module(root_name, tm.fqn());
    }
    s << "});\n";
  }
  if (reduce_scatter_max_input_buffers != 1)
    for (int r : plan.pool_roots)
      s << "fsdp::fsdp_state("
        << cpp_module(root_name, plan.groups[static_cast<std::size_t>(r)].modules.front()->fqn())
        << ")->set_reduce_scatter_max_input_buffers(" << reduce_scatter_max_input_buffers << ");\n";
  return s.str();
}

std::size_t parse_byte_size(const std::string& text, const std::string& what) {
  auto bad = [&]() -> InvalidArgument {
    return InvalidArgument(what + ": '" + text +
                           "' is not a byte size (e.g. 40GiB, 512MiB, 1.5GB, 123456)");
  };
  std::size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.'))
    ++i;
  if (i == 0) throw bad();
  const std::string number = text.substr(0, i);
  if (std::count(number.begin(), number.end(), '.') > 1 || number == ".") throw bad();
  const std::string unit = text.substr(i);
  static const std::pair<const char*, double> kUnits[] = {{"", 1.0},
                                                          {"B", 1.0},
                                                          {"KB", 1e3},
                                                          {"MB", 1e6},
                                                          {"GB", 1e9},
                                                          {"TB", 1e12},
                                                          {"KiB", 1024.0},
                                                          {"MiB", 1048576.0},
                                                          {"GiB", 1073741824.0},
                                                          {"TiB", 1099511627776.0},
                                                          {"K", 1024.0},
                                                          {"M", 1048576.0},
                                                          {"G", 1073741824.0},
                                                          {"T", 1099511627776.0}};
  for (const auto& [name, scale] : kUnits)
    if (unit == name) {
      const double v = std::stod(number) * scale;
      if (!std::isfinite(v) || v >= 1.8e19) throw bad();
      return static_cast<std::size_t>(std::llround(v));
    }
  throw bad();
}

std::string format_bytes(std::size_t bytes) {
  static const char* const kNames[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%zu B", bytes);
  else
    std::snprintf(buf, sizeof buf, "%.2f %s", v, kNames[u]);
  return buf;
}

}  // namespace fullshard::schedule
