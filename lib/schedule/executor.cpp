#include <nlohmann/json.hpp>

#include "fullshard/schedule/executor.hpp"

#include "fullshard/base/error.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"

namespace fullshard::schedule {

// ---- Timeline ---------------------------------------------------------------------------

Timeline::Timeline() : origin_(std::chrono::steady_clock::now()) {}

void Timeline::record(const std::string& label, StreamKind stream,
                      std::chrono::steady_clock::time_point start,
                      std::chrono::steady_clock::time_point end) {
  using us = std::chrono::duration<double, std::micro>;
  std::lock_guard<std::mutex> lock(m_);
  ops_.push_back({label, stream, us(start - origin_).count(), us(end - origin_).count()});
}

std::vector<MeasuredOp> Timeline::ops() const {
  std::lock_guard<std::mutex> lock(m_);
  return ops_;
}

std::size_t Timeline::size() const {
  std::lock_guard<std::mutex> lock(m_);
  return ops_.size();
}

double Timeline::busy_us(std::size_t first, bool communication) const {
  std::lock_guard<std::mutex> lock(m_);
  double sum = 0;
  for (std::size_t i = first; i < ops_.size(); ++i)
    if ((ops_[i].stream != StreamKind::compute) == communication)
      sum += ops_[i].end_us - ops_[i].start_us;
  return sum;
}

void Timeline::clear() {
  std::lock_guard<std::mutex> lock(m_);
  ops_.clear();
  origin_ = std::chrono::steady_clock::now();
}

std::string Timeline::to_chrome_trace(int pid, const std::string& name) const {
  using nlohmann::json;
  json ev = json::array();
  ev.push_back({{"name", "process_name"},
                {"ph", "M"},
                {"pid", pid},
                {"tid", 0},
                {"args", {{"name", name}}}});
  for (StreamKind s : {StreamKind::compute, StreamKind::all_gather, StreamKind::reduce_scatter,
                       StreamKind::all_reduce})
    ev.push_back({{"name", "thread_name"},
                  {"ph", "M"},
                  {"pid", pid},
                  {"tid", static_cast<int>(s)},
                  {"args", {{"name", stream_name(s)}}}});
  for (const MeasuredOp& op : ops())
    ev.push_back({{"name", op.label},
                  {"ph", "X"},
                  {"pid", pid},
                  {"tid", static_cast<int>(op.stream)},
                  {"ts", op.start_us},
                  {"dur", op.end_us - op.start_us}});
  return json{{"traceEvents", ev}, {"displayTimeUnit", "ms"}}.dump();
}

// ---- Executor ---------------------------------------------------------------------------

namespace {

// The communication streams, whose work the timeline records.
const StreamKind kCommStreams[] = {StreamKind::all_gather, StreamKind::reduce_scatter,
                                   StreamKind::all_reduce};

// Stream bookkeeping tasks (records, waits) are not operations of the plan.
bool bookkeeping(const std::string& label) {
  return label.rfind("record on stream", 0) == 0 || label.rfind("wait on stream", 0) == 0;
}

std::vector<fsdp::FSDPModule*> roots_of(graph::Module& root) {
  std::vector<fsdp::FSDPModule*> out;
  for (graph::Module* m : root.modules_preorder())
    if (fsdp::FSDPModule* s = fsdp::fsdp_state(*m); s && s->is_root()) out.push_back(s);
  return out;
}

}  // namespace

std::vector<fsdp::FSDPModule*> apply_plan_policies(graph::Module& root, const Plan& plan) {
  // Plan group i -> the FSDP module of its first module.
  std::vector<fsdp::FSDPModule*> states;
  for (const PlannedGroup& g : plan.groups) {
    graph::Module& m = root.module(g.modules.front()->fqn());
    fsdp::FSDPModule* st = fsdp::fsdp_state(m);
    if (!st || st->group_fqns() != g.param_fqns())
      throw InvalidArgument("running a plan: module '" + g.name +
                            "' is not fully_shard'ed as the plan says; apply the plan's "
                            "fully_shard calls (fsdp::apply_fully_shard_requests, or "
                            "ShardedModel::apply_plan) first");
    states.push_back(st);
  }
  for (std::size_t i = 0; i < states.size(); ++i) {
    std::vector<graph::Module*> targets;
    for (int t : plan.forward_prefetch[i])
      targets.push_back(&states[static_cast<std::size_t>(t)]->module());
    if (!targets.empty()) states[i]->set_modules_to_forward_prefetch(targets);
    if (plan.options.backward_prefetch == BackwardPrefetch::none)
      states[i]->set_modules_to_backward_prefetch({});
    states[i]->set_unshard_in_backward(true);
  }
  // The plan's resolved policies (group indices; the options' names were checked by it).
  for (int g : plan.no_unshard_in_backward)
    states[static_cast<std::size_t>(g)]->set_unshard_in_backward(false);
  for (const auto& [group, to] : plan.backward_prefetch_targets) {
    std::vector<graph::Module*> targets;
    for (int t : to)
      targets.push_back(&states[static_cast<std::size_t>(t)]->module());
    states[static_cast<std::size_t>(group)]->set_modules_to_backward_prefetch(targets);
  }
  for (fsdp::FSDPModule* r : roots_of(root)) {
    r->set_reduce_scatter_max_input_buffers(plan.options.reduce_scatter_max_input_buffers);
    r->set_requires_all_reduce(plan.options.requires_all_reduce);
    r->set_reshard_after_backward(plan.options.reshard_after_backward);
    r->set_requires_gradient_sync(plan.options.requires_gradient_sync);
    r->set_is_last_backward(plan.options.is_last_backward);
    if (plan.options.fresh_gradients) r->set_fresh_gradients(true);
  }
  return states;
}

Executor::Executor(graph::Module& root, const DeviceMesh& mesh, const Plan& plan)
    : root_(&root), mesh_(mesh) {
  apply_plan_policies(root, plan);
  for (const StreamKind k : kCommStreams) {
    mesh_.stream(k).set_recorder([this, k](const std::string& label,
                                           std::chrono::steady_clock::time_point t0,
                                           std::chrono::steady_clock::time_point t1) {
      if (!bookkeeping(label)) timeline_.record(label, k, t0, t1);
    });
  }
  reset_measurement();
}

Executor::~Executor() {
  for (const StreamKind k : kCommStreams)
    mesh_.stream(k).set_recorder(nullptr);
}

void Executor::forward() {
  fsdp::forward(*root_, compute_recorder());
}
void Executor::backward() {
  fsdp::backward(*root_, compute_recorder());
}

fsdp::ComputeRecorder Executor::compute_recorder() {
  return [this](const std::string& label, std::chrono::steady_clock::time_point t0,
                std::chrono::steady_clock::time_point t1) {
    timeline_.record(label, StreamKind::compute, t0, t1);
  };
}

void Executor::step() {
  forward();
  backward();
}

std::size_t Executor::measured_peak_bytes() const {
  std::size_t peak = 0;
  for (fsdp::FSDPModule* r : roots_of(*root_))
    peak += r->pool_peak_bytes();
  return peak;
}

void Executor::reset_measurement() {
  timeline_.clear();
  for (fsdp::FSDPModule* r : roots_of(*root_))
    r->reset_pool_peak();
}

}  // namespace fullshard::schedule
