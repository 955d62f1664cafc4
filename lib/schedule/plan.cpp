// Plan: lookups and the text / Chrome-trace forms (docs/plan-format.md).
#include <algorithm>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "fullshard/base/error.hpp"
#include "fullshard/schedule/plan.hpp"
#include "lib/base/hash.hpp"
#include "lib/schedule/planner_entry.hpp"

namespace fullshard::schedule {

std::string Plan::label(const Op& op) const {
  const std::string g =
      op.group >= 0 ? groups[static_cast<std::size_t>(op.group)].name : std::string();
  const std::string k = op.k ? "/" + std::to_string(op.k) : std::string();
  switch (op.kind) {
    case OpKind::all_gather:
      return "AG(" + g + ")" + k;
    case OpKind::copy_in:
      return (op.stream == StreamKind::all_gather ? "AG.copy_in(" : "RS.copy_in(") + g + ")";
    case OpKind::copy_out:
      return "AG.copy_out(" + g + ")";
    case OpKind::forward:
      return "fwd(" + std::string(op.module()) + ")";
    case OpKind::backward:
      return "bwd(" + std::string(op.module()) + ")";
    case OpKind::reduce_scatter:
      return "RS(" + g + ")";
    case OpKind::all_reduce:
      return "AR(" + g + ")";
    case OpKind::reduce_copy_out:
      return std::string(op.variant == 1   ? "accumulate("
                         : op.variant == 2 ? "add_partial("
                         : op.variant == 3 ? "RS.copy_out+update("
                                           : "RS.copy_out(") +
             g + ")";
    case OpKind::reshard:
      return "reshard(" + g + ")" + k;
    case OpKind::grad_init:
      return "grad_init(" + g + ")";
    case OpKind::wait:
      return "wait(" + g + ")";
    case OpKind::update:
      return (op.variant == 1 ? "update_in_copy_out(" : "update(") + g + ")";
  }
  return "?";
}

std::string Plan::buffer_name(const BufferEvent& e) const {
  return std::string(fsdp::engine::buf_kind_name(e.kind)) + "[" +
         groups[static_cast<std::size_t>(e.group)].name + "]";
}

namespace {

constexpr StreamKind kStreams[] = {StreamKind::compute, StreamKind::all_gather,
                                   StreamKind::reduce_scatter, StreamKind::all_reduce};

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// "<alpha>ms+<beta>ms/B", and "(N points)" when measured points replace the line.
std::string alpha_beta_text(const AlphaBeta& ab) {
  return fmt("%.6g", ab.alpha_ms) + "ms+" + fmt("%.6g", ab.beta_ms_per_byte) + "ms/B" +
         (ab.points.size() >= 2 ? "(" + std::to_string(ab.points.size()) + " points)" : "");
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i)
    s += (i ? sep : "") + v[i];
  return s;
}

std::string pad(std::string s, std::size_t w) {
  if (s.size() < w) s.append(w - s.size(), ' ');
  return s;
}

std::string rpad(const std::string& s, std::size_t w) {
  return s.size() < w ? std::string(w - s.size(), ' ') + s : s;
}

std::string backward_prefetch_name(BackwardPrefetch b) {
  return b == BackwardPrefetch::none ? "none" : "reverse_post_forward";
}

}  // namespace

std::vector<const Op*> Plan::stream_ops(StreamKind s) const {
  std::vector<const Op*> out;
  for (const Op& op : ops)
    if (op.stream == s) out.push_back(&op);
  return out;
}

std::vector<const Op*> Plan::find(OpKind k, int group) const {
  std::vector<const Op*> out;
  for (const Op& op : ops)
    if (op.kind == k && (group == -2 || op.group == group)) out.push_back(&op);
  return out;
}

int Plan::group_index(const std::string& name) const noexcept {
  for (std::size_t g = 0; g < groups.size(); ++g)
    if (groups[g].name == name) return static_cast<int>(g);
  return -1;
}

std::string Plan::to_text() const {
  std::string t;
  auto line = [&](const std::string& s) { t += s + "\n"; };
  const CostModel& c = *options.cost;

  line("fullshard plan");
  line("mesh: shard=" + std::to_string(mesh.shard_size) + " replicate=" +
       std::to_string(mesh.replicate_size) + (mesh.replicate_size > 1 ? " (HSDP)" : " (FSDP)"));
  line("options: forward_prefetch_depth=" + std::to_string(options.forward_prefetch_depth) +
       " backward_prefetch=" + backward_prefetch_name(options.backward_prefetch) +
       " reduce_scatter_max_input_buffers=" +
       std::to_string(options.reduce_scatter_max_input_buffers) +
       " requires_all_reduce=" + (options.requires_all_reduce ? "true" : "false") +
       " reshard_after_backward=" + (options.reshard_after_backward ? "true" : "false") +
       " requires_gradient_sync=" + (options.requires_gradient_sync ? "true" : "false") +
       " is_last_backward=" + (options.is_last_backward ? "true" : "false"));
  if (options.fresh_gradients) line("fresh_gradients: true (grad_init writes nothing)");
  if (options.optimizer_in_backward_states >= 0)
    line("optimizer_in_backward: " + std::to_string(options.optimizer_in_backward_states) +
         " state arrays per parameter");
  if (!options.no_unshard_in_backward.empty())
    line(
        "unshard_in_backward=false: " +
        join({options.no_unshard_in_backward.begin(), options.no_unshard_in_backward.end()}, ", "));
  {
    std::vector<std::string> parts;
    for (CollectiveKind k :
         {CollectiveKind::all_gather, CollectiveKind::reduce_scatter, CollectiveKind::all_reduce})
      for (MeshDim d : {MeshDim::shard, MeshDim::replicate})
        parts.push_back(std::string(collective_kind_name(k)) + "." + mesh_dim_name(d) + "=" +
                        alpha_beta_text(c.collective(k, d)));
    parts.push_back("copy=" + fmt("%.6g", c.copy_gb_per_s()) + "GB/s");
    if (c.transport(MeshDim::shard) != Transport::mpi)  // (mpi: the text as before)
      for (CollectiveKind k : {CollectiveKind::all_gather, CollectiveKind::reduce_scatter})
        parts.push_back(std::string("shm.") + collective_kind_name(k) +
                        ".shard=" + alpha_beta_text(c.shm_collective(k, MeshDim::shard)));
    line("cost: " + join(parts, " "));
  }

  line("groups: " + std::to_string(groups.size()));
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const PlannedGroup& g = groups[i];
    line("  [" + std::to_string(i) + "] " + g.name + ": params=" + std::to_string(g.params.size()) +
         " shard=" + std::to_string(g.shard_bytes()) +
         " B/rank unsharded=" + std::to_string(g.unsharded_bytes()) +
         " B gather=" + std::to_string(g.gather_bytes()) + " B dtypes=" + dtype_name(g.orig_dtype) +
         "/" + dtype_name(g.param_dtype) + "/" + dtype_name(g.reduce_dtype) +
         (g.wire ? " compression=" + g.geometry().wire_text() : std::string()) +
         " reshard_after_forward=" + g.reshard_after_forward.to_string() +
         (options.no_unshard_in_backward.count(g.name) ? " unshard_in_backward=false" : "") +
         (g.is_root ? " root" : ""));
    line("      params: " +
         (g.params.empty() ? std::string("(none)") : join(g.param_fqns(), ", ")));
    if (!forward_prefetch[i].empty()) {
      std::vector<std::string> names;
      for (int tg : forward_prefetch[i])
        names.push_back(groups[static_cast<std::size_t>(tg)].name);
      line("      forward prefetch: " + join(names, ", "));
    }
  }

  line("schedule (per stream, in order; times in ms):");
  for (StreamKind s : kStreams) {
    auto list = stream_ops(s);
    if (list.empty()) continue;
    line("  " + std::string(stream_name(s)) + ": " + std::to_string(list.size()) + " ops");
    for (const Op* op : list) {
      std::vector<std::string> deps;
      for (int d : op->deps)
        deps.push_back("#" + std::to_string(d));
      line("    " + rpad("#" + std::to_string(op->id), 5) + " " +
           rpad(fmt("%.3f", op->start_ms), 9) + " .. " + rpad(fmt("%.3f", op->end_ms), 9) + "  " +
           pad(op_kind_name(op->kind), 15) + " " + pad(label(*op), 28) + " " +
           rpad(std::to_string(op->bytes), 10) + " B" +
           (deps.empty() ? std::string() : "  after " + join(deps, " ")));
    }
  }

  line("buffers (pool bytes in use after each event):");
  std::size_t in_use = 0;
  for (const BufferEvent& e : events) {
    in_use = e.in_use_after(in_use);
    line("    " + rpad("#" + std::to_string(e.op), 5) + " " +
         pad(e.action == BufferAction::alloc ? "alloc" : "free", 5) + " " +
         pad(buffer_name(e), 28) + " " + rpad(std::to_string(e.bytes), 10) + " B  in use " +
         std::to_string(in_use) + " B");
  }

  line("step time: " + fmt("%.3f", step_ms) + " ms");
  line("peak memory per rank: pool=" + std::to_string(peak_bytes) + " B (forward=" +
       std::to_string(forward_peak_bytes) + " B backward=" + std::to_string(backward_peak_bytes) +
       " B end=" + std::to_string(end_bytes) + " B) sharded_params=" +
       std::to_string(sharded_bytes) + " B sharded_grads=" + std::to_string(grad_bytes) + " B");
  {
    const ByteCount moved = bytes_moved();
    const ByteFloor f = byte_floor();
    const double gbps = options.cost ? options.cost->copy_gb_per_s() : 10.0;
    line("byte account per rank: " + fmt("%.0f", moved.read) + " B read + " +
         fmt("%.0f", moved.written) + " B written (" + fmt("%.3f", moved.total() / (gbps * 1e6)) +
         " ms at " + fmt("%.1f", gbps) + " GB/s); floor " + fmt("%.0f", f.total()) +
         " B = gradients " + fmt("%.0f", f.gradients) + " + optimizer " + fmt("%.0f", f.optimizer) +
         (options.optimizer_in_backward_states < 0 ? " (after backward: not planned)" : "") +
         " + all-gather " + fmt("%.0f", f.all_gather) + " + reduce-scatter " +
         fmt("%.0f", f.reduce_scatter) + " (" + fmt("%.3f", f.total() / (gbps * 1e6)) + " ms)");
  }
  if (pool_roots.size() > 1) {
    std::vector<std::string> parts;
    for (std::size_t i = 0; i < pool_roots.size(); ++i)
      parts.push_back(groups[static_cast<std::size_t>(pool_roots[i])].name + "=" +
                      std::to_string(pool_peak_bytes[i]) + " B");
    line("pool peaks per FSDP root: " + join(parts, " "));
  }
  return t;
}

ByteCount Plan::bytes_moved(const Op& op) const {
  ByteCount c;
  if (op.group < 0) return c;
  const PlannedGroup& pg = groups[static_cast<std::size_t>(op.group)];
  const transport::Geometry g = pg.geometry(mesh.replicate_size);
  const transport::Kind k = transport::group_kind(
      options.cost ? options.cost->transport(MeshDim::shard) : transport::Kind::mpi, g);
  const transport::Fusions f = transport::fusions(k, g);
  const double W = g.world, gsn = static_cast<double>(g.shard_numel);
  const double p = static_cast<double>(dtype_size(g.param_dtype));
  const double o = static_cast<double>(dtype_size(g.orig_dtype));
  const double r = static_cast<double>(dtype_size(g.reduce_dtype));
  const double arena = static_cast<double>(g.arena_numel) * p;
  const double slot = static_cast<double>(g.gather_slot_bytes());
  const double bytes = static_cast<double>(op.bytes);
  switch (op.kind) {
    case OpKind::all_gather:
      if (op.k > 0) return {bytes, W * slot};  // from the kept slices: W slots received
      if (f.gather_in_copy_out) return c;      // shared memory: a publish
      return {slot, W * slot};
    case OpKind::copy_in:
      if (op.stream == StreamKind::all_gather) return {gsn * o, bytes};
      if (f.reduce_reads_in_place) return c;
      return {arena, bytes};
    case OpKind::copy_out:  // every slot (or the shards) into the unsharded parameters
      return {W == 1 ? gsn * (g.cast() ? p : o) : W * slot, bytes};
    case OpKind::grad_init:
      return {0.0, bytes};
    case OpKind::reduce_scatter:
      if (g.compressed_reduce()) {
        const double packed = static_cast<double>(g.packed_slot_bytes());
        return {W * gsn * r + W * packed, W * packed + gsn * (f.copy_out_in_reduce ? o : r)};
      }
      if (k == transport::Kind::shm || k == transport::Kind::two_level)  // peers' gradients
        // (its folded copy-out running the update writes no gradient)
        return {W * gsn * p, f.copy_out_in_reduce ? (op.variant == 1 ? 0.0 : gsn * o) : gsn * r};
      return {W * gsn * r, gsn * r};
    case OpKind::all_reduce:
      return {gsn * r, gsn * r};
    case OpKind::reduce_copy_out:
      if (op.variant == 1 || op.variant == 2) return {2 * gsn * r, gsn * r};  // HSDP's sums
      if (f.copy_out_in_reduce) return c;
      return {gsn * r, op.variant == 3 ? 0.0 : bytes};  // running the update: no gradient
    case OpKind::update: {  // parameters and states read and written, gradients read unless
                            // fused (variant 1: the op's bytes leave them out)
      const double written = gsn * 4.0 * (1 + options.optimizer_in_backward_states);
      return {bytes - written, written};
    }
    case OpKind::forward:
    case OpKind::backward:
    case OpKind::reshard:
    case OpKind::wait:
      return c;
  }
  return c;
}

ByteCount Plan::bytes_moved() const {
  ByteCount sum;
  for (const Op& op : ops) {
    const ByteCount c = bytes_moved(op);
    sum.read += c.read;
    sum.written += c.written;
  }
  return sum;
}

ByteFloor Plan::byte_floor(int optimizer_passes) const {
  ByteFloor f;
  const int passes = optimizer_passes >= 0 ? optimizer_passes
                     : options.optimizer_in_backward_states >= 0
                         ? 3 + 2 * options.optimizer_in_backward_states
                         : 0;
  for (const PlannedGroup& g : groups)
    f.gradients += static_cast<double>(g.unsharded_bytes());
  f.optimizer = passes * static_cast<double>(sharded_bytes);
  if (mesh.shard_size > 1) {
    for (const Op& op : ops)  // each all-gather writes the unsharded parameters once
      if (op.kind == OpKind::all_gather)
        f.all_gather +=
            static_cast<double>(groups[static_cast<std::size_t>(op.group)].unsharded_bytes());
    f.reduce_scatter = f.gradients;
  }
  return f;
}

std::string Plan::to_chrome_trace() const {
  using nlohmann::json;
  json ev = json::array();
  ev.push_back({{"name", "process_name"},
                {"ph", "M"},
                {"pid", 0},
                {"tid", 0},
                {"args", {{"name", "fullshard plan"}}}});
  for (StreamKind s : kStreams) {
    const int tid = static_cast<int>(s);
    ev.push_back({{"name", "thread_name"},
                  {"ph", "M"},
                  {"pid", 0},
                  {"tid", tid},
                  {"args", {{"name", stream_name(s)}}}});
    ev.push_back({{"name", "thread_sort_index"},
                  {"ph", "M"},
                  {"pid", 0},
                  {"tid", tid},
                  {"args", {{"sort_index", tid}}}});
  }
  for (const Op& op : ops) {
    json args = {{"op", op.id},
                 {"kind", op_kind_name(op.kind)},
                 {"bytes", op.bytes},
                 {"group", op.group >= 0 ? groups[static_cast<std::size_t>(op.group)].name : ""},
                 {"module", std::string(op.module())},
                 {"phase", op.phase == Phase::forward ? "forward" : "backward"},
                 {"deps", op.deps.to_vector()}};
    ev.push_back({{"name", label(op)},
                  {"cat", op_kind_name(op.kind)},
                  {"ph", "X"},
                  {"pid", 0},
                  {"tid", static_cast<int>(op.stream)},
                  {"ts", op.start_ms * 1000.0},
                  {"dur", (op.end_ms - op.start_ms) * 1000.0},
                  {"args", args}});
  }
  double ts = 0.0;
  ev.push_back({{"name", "pool bytes in use"},
                {"ph", "C"},
                {"pid", 0},
                {"ts", 0.0},
                {"args", {{"bytes", 0}}}});
  std::size_t in_use = 0;
  for (const BufferEvent& e : events) {
    in_use = e.in_use_after(in_use);
    ts = std::max(ts, ops[static_cast<std::size_t>(e.op)].start_ms * 1000.0);
    ev.push_back({{"name", "pool bytes in use"},
                  {"ph", "C"},
                  {"pid", 0},
                  {"ts", ts},
                  {"args", {{"bytes", in_use}}}});
  }
  char fp[32];
  std::snprintf(fp, sizeof fp, "%016llx", static_cast<unsigned long long>(fingerprint()));
  return json{{"traceEvents", ev},
              {"displayTimeUnit", "ms"},
              {"otherData",
               {{"generator", "fullshard-plan"},
                {"fingerprint", fp},
                {"step_ms", step_ms},
                {"peak_bytes", peak_bytes},
                {"sharded_bytes", sharded_bytes},
                {"grad_bytes", grad_bytes}}}}
      .dump();
}

std::uint64_t fnv1a64(const std::string& s) noexcept {
  return fullshard::fnv1a64(s);
}

std::uint64_t Plan::fingerprint() const {
  return fnv1a64(to_text());
}

}  // namespace fullshard::schedule

namespace fullshard::detail {

void resolve_policy_groups(schedule::Plan& p) {
  auto resolve = [&p](const std::string& name, const char* option) {
    if (const int g = p.group_index(name); g >= 0) return g;
    std::string names;
    for (const auto& g : p.groups)
      names += (names.empty() ? "" : ", ") + g.name;
    throw InvalidArgument(std::string("Scheduler::plan: ") + option + ": no group named '" + name +
                          "' (groups: " + (names.empty() ? "none" : names) + ")");
  };
  p.no_unshard_in_backward.clear();
  for (const std::string& name : p.options.no_unshard_in_backward)
    p.no_unshard_in_backward.push_back(resolve(name, "no_unshard_in_backward"));
  std::sort(p.no_unshard_in_backward.begin(), p.no_unshard_in_backward.end());
  p.backward_prefetch_targets.clear();
  for (const auto& [name, targets] : p.options.backward_prefetch_targets) {
    auto& [group, to] = p.backward_prefetch_targets.emplace_back();
    group = resolve(name, "backward_prefetch_targets");
    for (const std::string& t : targets)
      to.push_back(resolve(t, "backward_prefetch_targets"));
  }
  std::sort(p.backward_prefetch_targets.begin(), p.backward_prefetch_targets.end());
}

}  // namespace fullshard::detail
