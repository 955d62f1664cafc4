#include <nlohmann/json.hpp>

#include "lib/session/session_core.hpp"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <set>
#include <utility>

#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/format.hpp"
#include "fullshard/checkpoint/safetensors.hpp"
#include "fullshard/schedule/compute_cost.hpp"
#include "fullshard/schedule/memory_account.hpp"
#include "fullshard/schedule/memory_budget.hpp"
#include "lib/base/message_of.hpp"
#include "lib/mesh/agreement.hpp"

namespace fullshard::session {

namespace sch = fullshard::schedule;

namespace {

// The lines of a configuration a checkpoint must have been saved with to load into this
// session: the model's shape (not how it was initialised or where its file was) and dtype,
// and the optimizer's type (its state is of that kind).
std::vector<std::string> identity_lines(const std::vector<std::string>& canonical) {
  std::vector<std::string> out;
  for (const std::string& l : canonical) {
    const bool model = l.rfind("model.", 0) == 0 && l.rfind("model.file ", 0) != 0 &&
                       l.rfind("model.deferred_init ", 0) != 0 &&
                       l.rfind("model.checkpoint_blocks ", 0) != 0 &&
                       l.rfind("model.dropout ", 0) != 0;
    if (model || l.rfind("dtype ", 0) == 0 || l.rfind("optimizer.type ", 0) == 0) out.push_back(l);
  }
  return out;
}

}  // namespace

SessionCore::SessionCore(const DeviceMesh& m, Config c, bool native,
                         const std::vector<std::string>& model_identity)
    : cfg(std::move(c)), mesh(m) {
  // A configuration built in C++ is checked as a file is, and the ranks agree on it.
  std::string error;
  std::vector<std::string> lines;
  try {
    lines = canonical_lines(cfg);
  } catch (const ConfigError& e) {
    error = e.message();
  }
  std::vector<std::string> items = {error.empty() ? "configuration valid"
                                                  : "configuration refused: " + error};
  items.insert(items.end(), lines.begin(), lines.end());
  items.insert(items.end(), model_identity.begin(), model_identity.end());
  const std::string source = cfg.source.empty() ? "<session configuration>" : cfg.source;
  agree_across_ranks(mesh, items, "the configuration " + source);
  if (!error.empty()) throw ConfigError(error);
  // The session takes the kind of model the configuration names (before anything is claimed).
  if (native && cfg.model.type != "native")
    throw ConfigError(cfg.source +
                      ": model.type: a NativeSession trains the model the program gives; its "
                      "configuration says \"model\": {\"type\": \"native\"}, not \"" +
                      cfg.model.type + "\" (fullshard::session::Session builds that)");
  if (native && cfg.dtype != DType::f32)
    throw ConfigError(cfg.source + ": dtype: a native model's parameters are f32, not " +
                      dtype_name(cfg.dtype));
  if (!native && cfg.model.type == "native")
    throw ConfigError(cfg.source +
                      ": model.type: native models are given by the program "
                      "(fullshard::session::NativeSession); a Session builds mlp, "
                      "residual_mlp, gpt, conv_autoencoder or torchscript");
  cfg.canonical = lines;
  std::vector<std::string> id = identity_lines(lines);
  id.insert(id.end(), model_identity.begin(), model_identity.end());
  identity = id;
  non_finite.emplace(
      cfg.non_finite, cfg.setting("non_finite.policy", "\"stop\"", "stop"),
      cfg.setting("non_finite.max_skipped", std::to_string(cfg.non_finite.max_skipped),
                  std::to_string(cfg.non_finite.max_skipped)));
  control = BoundedComm::duplicate(mesh.control_world(), "session", mesh.timeout_s());

  // Before anything is built: a bad checkpoint directory must not cost a whole job.
  if (!cfg.checkpoint.dir.empty()) {
    free_bytes = checkpoint::check_directory(cfg.checkpoint.dir, mesh).free_bytes;
    checkpoint::ClaimOptions co;
    // Resuming another directory's checkpoint is a fresh run here.
    co.resume = cfg.checkpoint.resume && (cfg.checkpoint.resume_from.empty() ||
                                          in_checkpoint_dir(cfg.checkpoint.resume_from));
    co.start_over = cfg.checkpoint.start_over;
    co.resume_hint = cfg.setting("checkpoint.resume", "true");
    co.start_over_hint = cfg.setting("checkpoint.start_over", "true");
    claim = std::make_unique<checkpoint::DirectoryClaim>(cfg.checkpoint.dir, mesh, co);
  }
}

SessionCore::~SessionCore() {
  release();
}

void SessionCore::release() noexcept {
  pending = checkpoint::AsyncSave();
  in_flight = false;
  opt.reset();
}

sch::PlanOptions SessionCore::plan_options_of_config() {
  sch::PlanOptions o;
  // The plan has each group's update inside its reduction (its state arrays in the account).
  if (cfg.optimizer.in_backward) o.optimizer_in_backward_states = state_arrays(cfg.optimizer);
  o.forward_prefetch_depth = cfg.sharding.forward_prefetch;
  o.defaults.reshard_after_forward = cfg.sharding.reshard_after_forward;
  o.defaults.mp_policy.param_dtype = cfg.param_dtype;
  o.defaults.mp_policy.reduce_dtype = cfg.reduce_dtype;
  o.defaults.compression = cfg.sharding.compression;
  // The collectives as this mesh runs them (shared memory where the ranks share a node), or
  // the calibrated model of sharding.cost_file.
  o.cost = sch::mesh_defaults(mesh);
  if (!cfg.sharding.cost_file.empty()) {
    // Every rank reads it; one that cannot is named on every rank.
    std::string error;
    try {
      // Over the plain defaults, as fullshard-plan reads the same file.
      o.cost = sch::CostModel::load_json(cfg.sharding.cost_file,
                                         sch::CostModel::defaults(sch::MeshShape::of(mesh)));
    } catch (const std::exception& e) {
      error = fullshard::detail::message_of(e);
    }
    int first = error.empty() ? mesh.size() : mesh.rank();
    control->allreduce(&first, 1, MPI_INT, MPI_MIN, "cost file (MPI_Iallreduce)");
    if (first < mesh.size()) {
      control->bcast(error, first, "cost file (MPI_Ibcast)");
      throw ConfigError(cfg.source + ": " + cfg.name_of("sharding.cost_file") + ": rank " +
                        std::to_string(first) + ": " + error);
    }
  }
  return o;
}

void SessionCore::add_allowed_compressions(sch::AutoPlanOptions& ao) const {
  if (!cfg.sharding.allow_compression) return;
  graph::CompressionPolicy z;  // int8 codes both ways, at the configured block
  z.all_gather = z.reduce_scatter = kernels::QuantCode::int8;
  z.block = cfg.sharding.compression.block;
  ao.compressions.push_back(z);
}

void SessionCore::request_groups(graph::Module& g, const std::vector<std::string>& blocks) {
  // List groups: each list's first module asks for the group with the others; a module of a
  // list is not a group of its own.
  std::set<std::string> listed;
  for (const auto& group : cfg.sharding.groups)
    for (const std::string& name : group) {
      if (g.find_module(name) == nullptr)
        throw ConfigError(cfg.source + ": sharding.groups: the model has no module '" + name + "'");
      listed.insert(name);
    }
  const bool root_only = cfg.sharding.policy == "root";
  for (graph::Module* m : g.modules_preorder())
    if (m != &g && (root_only || listed.count(m->fqn()))) m->set_fully_shard_request(false);
  if (!root_only)
    for (const std::string& name : blocks)
      if (!listed.count(name)) g.module(name).set_fully_shard_request(true);
  for (const auto& group : cfg.sharding.groups) {
    graph::ShardRequest r;
    r.group_with.assign(group.begin() + 1, group.end());
    g.module(group.front()).set_fully_shard_request(r);
  }
  g.set_fully_shard_request(true);
}

sch::MemoryInputs SessionCore::memory_inputs(std::size_t activations) const {
  sch::MemoryInputs in;
  in.optimizer_states = state_arrays(cfg.optimizer);
  const std::string shard_dim = mesh.names().back();
  // On two levels the dim's node-local part is the split's (DeviceMesh::shm is null there).
  in.shared_memory = mesh.shm(shard_dim) != nullptr || mesh.node_split(shard_dim) != nullptr;
  if (const NodeSplit* split = mesh.node_split(shard_dim)) in.nodes = split->nodes();
  in.rank = mesh.coordinate(shard_dim);
  in.activations = activations;
  in.baseline = baseline_resident > 0 ? baseline_resident : sch::process_memory().resident;
  return in;
}

void SessionCore::check_memory(const sch::Plan& p, std::size_t activations,
                               const std::string& advice) {
  const MemorySpec& m = cfg.memory;
  planned = sch::plan_memory(p, memory_inputs(activations));
  // The account is of host memory; a CUDA mesh's parameters live on the device.
  if (mesh.device_type() != DeviceType::cpu) return;
  plan.process_peak_bytes = static_cast<std::int64_t>(planned.process_peak());
  if (m.check == "off") return;
  BoundedComm comm(mesh.control_world(), "session.memory", mesh.timeout_s());
  const sch::MemoryBudget budget =
      sch::rank_memory_budget(comm, static_cast<std::size_t>(m.budget_mb * 1024.0 * 1024.0),
                              cfg.name_of("memory.budget_mb"));
  sch::check_memory_budget(comm, planned, budget,
                           m.check == "warn" ? sch::MemoryCheck::warn : sch::MemoryCheck::refuse,
                           advice);
}

void SessionCore::record_plan(const sch::Plan& p, bool serial) {
  // A host mesh runs its collectives inline: the ops one after the other, not overlapped.
  plan.step_ms = (serial ? sch::serial_step_ms(p) : p.step_ms) + plan.optimizer_ms;
  plan.peak_bytes = std::int64_t(p.peak_bytes);
  plan.sharded_bytes = std::int64_t(p.sharded_bytes);
  plan.groups = std::int64_t(p.groups.size());
}

bool SessionCore::in_checkpoint_dir(const std::string& path) {
  if (cfg.checkpoint.dir.empty()) return false;
  // Rank 0's file system decides for every rank (the claim's calls are collective).
  int inside = 0;
  if (mesh.rank() == 0) {
    namespace stdfs = std::filesystem;
    std::error_code ec;
    const stdfs::path dir = stdfs::weakly_canonical(cfg.checkpoint.dir, ec);
    const stdfs::path p = stdfs::weakly_canonical(path, ec);
    inside = p == dir || p.parent_path() == dir;
  }
  control->bcast(&inside, 1, MPI_INT, 0, "checkpoint directory (MPI_Ibcast)");
  return inside != 0;
}

void SessionCore::start(graph::Module& model_root, std::unique_ptr<SessionOptimizer> optimizer) {
  root = &model_root;
  graph_params = model_root.parameters();
  check_parameters_finite("initial");
  if (free_bytes && mesh.rank() == 0) {
    // One checkpoint (f32 parameters and optimizer state); with keep_last K, K kept and the
    // new one being written.
    double elements = 0;
    for (const graph::Parameter* p : graph_params)
      elements += double(p->numel());
    const int keep = cfg.checkpoint.keep_last;
    const double need =
        elements * 4.0 * (1 + state_arrays(cfg.optimizer)) * (keep > 0 ? keep + 1 : 1);
    if (double(*free_bytes) < need)
      std::fprintf(stderr,
                   "fullshard: warning: checkpoint directory %s has %.2f MiB free, but a "
                   "checkpoint needs about %.2f MiB\n",
                   cfg.checkpoint.dir.c_str(), double(*free_bytes) / (1 << 20), need / (1 << 20));
  }
  opt = std::move(optimizer);
  if (cfg.lr_schedule.type == "warmup_cosine")
    schedule.emplace(cfg.optimizer.lr, cfg.lr_schedule.warmup_steps, cfg.lr_schedule.total_steps,
                     cfg.lr_schedule.min_lr);
  if (!cfg.checkpoint.resume_from.empty()) {
    load(cfg.checkpoint.resume_from);
  } else if (cfg.checkpoint.resume) {
    // Resumed when the directory holds a checkpoint (rank 0 looks; every rank follows).
    int found = 0;
    if (mesh.rank() == 0)
      found = std::filesystem::exists(std::filesystem::path(cfg.checkpoint.dir) / "latest");
    control->bcast(&found, 1, MPI_INT, 0, "resume (MPI_Ibcast)");
    if (found) load({});
  }
}

double SessionCore::lr() const {
  return schedule ? schedule->lr(int(step)) : cfg.optimizer.lr;
}

std::string SessionCore::check_step(double local_loss, double local_rows,
                                    const std::string& input_problem, StepTotals& totals,
                                    double* extra, int n_extra) {
  // Non-finite values never reach the parameters: this rank's input, loss and gradients
  // (inside backward, already applied: the parameters) are checked with one all-reduce per
  // step, which also sums the losses, the rows and, when clipping, the gradients' squares.
  // Only a bad step pays a second, to name the rank.
  const bool input_ok = input_problem.empty();
  const bool loss_ok = std::isfinite(local_loss);
  bool grads_ok = true;
  double squares = 0;
  const bool clipping = cfg.grad_clip > 0;
  if (clipping) {
    squares = optim::local_sum_squares(graph_params, mesh);
    grads_ok = std::isfinite(squares);
  } else {
    grads_ok = optim::local_all_finite(
        graph_params, mesh,
        cfg.optimizer.in_backward ? optim::Values::parameters : optim::Values::gradients);
  }
  // The sums of squares of the shard dim's first replica (under HSDP the others hold copies).
  const bool first_replica = mesh.rank() < mesh.size(mesh.names().back());
  double sums[8] = {clipping && first_replica ? squares : 0.0,
                    input_ok && loss_ok && grads_ok ? 0.0 : 1.0, loss_ok ? local_loss : 0.0,
                    local_rows};
  for (int i = 0; i < std::min(n_extra, 4); ++i)
    sums[4 + i] = extra[i];
  control->allreduce(sums, 4 + std::min(n_extra, 4), MPI_DOUBLE, MPI_SUM,
                     clipping ? "loss, gradient norm and non-finite check (MPI_Iallreduce)"
                              : "loss and non-finite check (MPI_Iallreduce)");
  for (int i = 0; i < std::min(n_extra, 4); ++i)
    extra[i] = sums[4 + i];
  totals.norm = std::sqrt(sums[0]);
  totals.loss = sums[2];
  totals.rows = sums[3];
  const bool norm_bad = clipping && !std::isfinite(totals.norm);
  if (sums[1] == 0 && !norm_bad) return {};
  // What went bad first: an input on any rank, then a loss, then the gradients (a bad value
  // spreads to every rank's gradients through the reduce-scatter); the lowest such rank.
  const int W = mesh.size(), none = 3 * W;
  int worst = !input_ok   ? mesh.rank()
              : !loss_ok  ? W + mesh.rank()
              : !grads_ok ? 2 * W + mesh.rank()
                          : none;
  control->allreduce(&worst, 1, MPI_INT, MPI_MIN, "non-finite check (MPI_Iallreduce)");
  if (worst == none) return "the gradients' norm is not finite";
  const int rank = worst % W, kind = worst / W;
  std::string problem = input_problem;
  if (kind == 0) control->bcast(problem, rank, "non-finite input (MPI_Ibcast)");
  return "rank " + std::to_string(rank) + ": " +
         (kind == 0   ? problem
          : kind == 1 ? std::string("the loss is not finite")
          : cfg.optimizer.in_backward
              ? std::string("the parameters hold a non-finite value after the update inside "
                            "backward")
          : clipping ? std::string("the gradients hold a non-finite value (or their sum of "
                                   "squares overflows)")
                     : std::string("the gradients hold a non-finite value"));
}

void SessionCore::apply_step(const StepTotals& totals) {
  if (cfg.grad_clip > 0) optim::scale_to_max_norm(graph_params, totals.norm, cfg.grad_clip, mesh);
  opt->step();
  ++step;
}

double SessionCore::non_finite_step(const std::string& what, bool applied) {
  // Named as the train_step call it is since creation or the last load (skipped ones count).
  return non_finite->bad_step(step + (non_finite->skipped() - skipped_at_load) + 1, what, applied,
                              mesh.rank());
}

void SessionCore::report_step(double loss, double rate, std::chrono::steady_clock::time_point start,
                              std::chrono::steady_clock::time_point backward_end) const {
  if (!progress.on_step) return;
  using seconds = std::chrono::duration<double>;
  StepMetrics m{step, loss, rate, seconds(std::chrono::steady_clock::now() - start).count()};
  m.forward_backward_seconds = seconds(backward_end - start).count();
  progress.on_step(m);
}

void SessionCore::check_parameters_finite(const std::string& when) {
  std::string first;
  for (graph::Parameter* p : graph_params)
    if (!optim::local_all_finite({p}, mesh, optim::Values::parameters)) {
      first = p->fqn();
      break;
    }
  int worst = first.empty() ? mesh.size() : mesh.rank();
  control->allreduce(&worst, 1, MPI_INT, MPI_MIN, "non-finite parameters (MPI_Iallreduce)");
  if (worst == mesh.size()) return;
  control->bcast(first, worst, "non-finite parameters (MPI_Ibcast)");
  throw InvalidArgument("the " + when + " parameters hold a non-finite value: '" + first +
                        "' (in rank " + std::to_string(worst) +
                        "'s shard); refused before any step uses them");
}

void SessionCore::check_usable(const char* call) const {
  if (!refused_values.empty())
    throw InvalidArgument(std::string(call) + ": the parameters hold the values of " +
                          refused_values +
                          ", which were refused; load a checkpoint or import weights that "
                          "hold finite values first (or create the session again)");
}

std::string SessionCore::dir_or_configured(const std::string& dir, const char* call) const {
  if (!dir.empty()) return dir;
  if (cfg.checkpoint.dir.empty())
    throw InvalidArgument(std::string(call) +
                          ": no directory given and the configuration has no "
                          "\"checkpoint\": {\"dir\"}");
  return cfg.checkpoint.dir;
}

checkpoint::SaveOptions SessionCore::save_options(const std::string& dir) const {
  checkpoint::SaveOptions o;
  o.kind = cfg.checkpoint.kind == "full" ? checkpoint::Kind::full : checkpoint::Kind::sharded;
  o.keep_last = cfg.checkpoint.keep_last;
  if (!resumed_step_dir.empty()) o.keep = {resumed_step_dir};
  // The configured directory is this run's: its saves carry the run and its retention spares
  // other runs' checkpoints.
  if (claim && dir == cfg.checkpoint.dir) claim->apply(o);
  return o;
}

nlohmann::json SessionCore::metadata() const {
  nlohmann::json m = metadata_extra.is_object() ? metadata_extra : nlohmann::json::object();
  m["session"] = identity;
  return m;
}

void SessionCore::committed(const std::string& step_dir, std::int64_t at, bool async) const {
  if (!progress.on_save) return;
  SaveMetrics m{at, step_dir, async};
  if (async) {
    m.write_seconds = pending.write_seconds();
    m.staging_bytes = pending.staging_bytes();
  }
  progress.on_save(m);
}

std::string SessionCore::save(const std::string& dir) {
  check_usable("save");
  const std::string d = dir_or_configured(dir, "save");
  if (in_flight) wait_save();
  const std::string step_dir = opt->save(d, step, save_options(d), metadata());
  committed(step_dir, step, false);
  return step_dir;
}

void SessionCore::save_async(const std::string& dir) {
  check_usable("save_async");
  const std::string d = dir_or_configured(dir, "save_async");
  if (in_flight)
    throw InvalidArgument("save_async: the save of step " + std::to_string(pending.step()) +
                          " into '" + pending_dir +
                          "' is still in flight; wait for it (wait_save) or poll it (poll_save) "
                          "before starting another");
  pending = opt->save_async(d, step, save_options(d), metadata());
  in_flight = true;
  pending_dir = d;
}

bool SessionCore::poll_save() {
  if (!in_flight) return true;
  bool done = false;
  try {
    done = pending.test();
  } catch (...) {
    in_flight = false;
    throw;
  }
  if (!done) return false;
  in_flight = false;
  // test() committed it: its step directory is the one wait() names (no communication now).
  committed(pending.wait(), pending.step(), true);
  return true;
}

std::string SessionCore::wait_save() {
  if (!in_flight)
    throw InvalidArgument(
        "wait_save: no checkpoint save is in flight (it was committed by an earlier "
        "poll_save or wait_save, or none was started)");
  std::string step_dir;
  try {
    step_dir = pending.wait();
  } catch (...) {
    in_flight = false;
    throw;
  }
  in_flight = false;
  committed(step_dir, pending.step(), true);
  return step_dir;
}

void SessionCore::check_identity(const std::string& dir) {
  // Rank 0 reads the index's metadata; every rank compares it with its own identity.
  std::string text;
  if (mesh.rank() == 0) {
    try {
      const std::string step_dir = checkpoint::resolve_step_dir(dir);
      const checkpoint::Index index =
          checkpoint::parse_index(checkpoint::read_index_text(step_dir), step_dir);
      const nlohmann::json metadata = nlohmann::json::parse(index.metadata);
      if (metadata.contains("session")) text = step_dir + "\n" + metadata["session"].dump();
    } catch (const std::exception&) {
      // No readable checkpoint: the load reports it.
    }
  }
  control->bcast(text, 0, "checkpoint identity (MPI_Ibcast)");
  if (text.empty()) return;  // saved by other code: the load checks the tensors
  const std::string step_dir = text.substr(0, text.find('\n'));
  const nlohmann::json saved = nlohmann::json::parse(text.substr(text.find('\n') + 1));
  std::vector<std::string> theirs;
  if (saved.is_array())
    for (const auto& l : saved)
      if (l.is_string()) theirs.push_back(l.get<std::string>());
  const std::vector<std::string> ours = identity.get<std::vector<std::string>>();
  auto key_of = [](const std::string& l) { return l.substr(0, l.find(" = ")); };
  for (std::size_t i = 0; i < std::max(ours.size(), theirs.size()); ++i) {
    const std::string a = i < theirs.size() ? theirs[i] : "(none)";
    const std::string b = i < ours.size() ? ours[i] : "(none)";
    if (a == b) continue;
    const std::string key = key_of(b == "(none)" ? a : b);
    const bool optimizer = key.rfind("optimizer.", 0) == 0;
    throw InvalidArgument("checkpoint '" + step_dir + "' was saved by another " +
                          (optimizer ? "optimizer" : "model") + ": " + a +
                          " there, but this session's configuration has " + b +
                          (optimizer ? " (its state would not fit; resume with the optimizer "
                                       "it was saved with)"
                                     : ""));
  }
}

std::int64_t SessionCore::load(const std::string& dir) {
  const std::string d = dir_or_configured(dir, "load");
  if (in_flight) wait_save();
  const auto start = std::chrono::steady_clock::now();
  check_identity(d);
  const checkpoint::Loaded loaded = opt->load(d);
  last_load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string what = "checkpoint's (" + loaded.step_dir + ")";
  try {
    check_parameters_finite(what);
  } catch (const InvalidArgument&) {
    refused_values = "the checkpoint '" + loaded.step_dir + "'";
    throw;
  }
  refused_values.clear();
  step = loaded.step;
  skipped_at_load = non_finite->skipped();
  last_loaded = loaded;
  // Resumed in the run's own directory: the chain it continues is its lineage, and the step
  // resumed from is kept.
  if (claim && in_checkpoint_dir(d)) {
    claim->resumed_from(loaded.step_dir);
    resumed_step_dir = loaded.step_dir;
  }
  return step;
}

checkpoint::Loaded SessionCore::load_parameters(const std::string& dir) {
  if (in_flight) wait_save();  // the save in flight reads the parameters
  const checkpoint::Loaded loaded = checkpoint::load(dir, *root, nullptr);
  try {
    check_parameters_finite("checkpoint's (" + loaded.step_dir + ")");
  } catch (const InvalidArgument&) {
    refused_values = "the checkpoint '" + loaded.step_dir + "'";
    throw;
  }
  refused_values.clear();
  return loaded;
}

std::uint64_t SessionCore::reserve_async_staging() {
  return opt->reserve_async_staging();
}

void SessionCore::export_safetensors(const std::string& path) {
  check_usable("export_safetensors");
  // A full (unsharded) checkpoint beside the file, converted by rank 0, then removed.
  const std::string tmp = path + ".fullshard-export";
  checkpoint::SaveOptions so;
  so.kind = checkpoint::Kind::full;
  const std::string step_dir = checkpoint::save(tmp, *root, nullptr, step, {}, {}, so);
  std::string error;
  if (mesh.rank() == 0) {
    try {
      checkpoint::checkpoint_to_safetensors(step_dir, path);
    } catch (const std::exception& e) {
      error = fullshard::detail::message_of(e);
      if (error.empty()) error = "rank 0 could not write the safetensors file '" + path + "'";
    }
    std::error_code ec;
    std::filesystem::remove_all(tmp, ec);
  }
  // Every rank returns when the file is there (or with rank 0's error).
  control->bcast(error, 0, "safetensors export (MPI_Ibcast)");
  if (!error.empty()) throw Error(error);
}

checkpoint::SafetensorsLoaded SessionCore::import_safetensors(const std::string& path, bool cast) {
  if (in_flight) wait_save();  // the save in flight reads the parameters
  std::string error;
  int io = 0;  // the failure is an IoError (a file that cannot be read), not a mismatch
  checkpoint::SafetensorsLoaded read;
  try {
    checkpoint::SafetensorsLoadOptions lo;
    lo.cast = cast;
    read = checkpoint::load_safetensors(path, *root, lo);
  } catch (const std::exception& e) {
    error = fullshard::detail::message_of(e);
    io = dynamic_cast<const IoError*>(&e) != nullptr;
  }
  // A read error of one rank's rows is thrown on every rank (the first failing rank's); -1 in
  // the second word: some rank replaced its rows.
  int failed[2] = {error.empty() ? mesh.size() : mesh.rank(), error.empty() ? -1 : 0};
  control->allreduce(failed, 2, MPI_INT, MPI_MIN, "safetensors import (MPI_Iallreduce)");
  if (failed[0] == mesh.size()) {
    try {
      check_parameters_finite("imported (" + path + ")");
    } catch (const InvalidArgument&) {
      refused_values = "the safetensors file '" + path + "'";
      throw;
    }
    refused_values.clear();
    return read;
  }
  control->bcast(error, failed[0], "safetensors import (MPI_Ibcast)");
  control->bcast(&io, 1, MPI_INT, failed[0], "safetensors import (MPI_Ibcast)");
  // The ranks that read their rows replaced them: the model would be part old, part new.
  if (failed[1] < 0) refused_values = "a safetensors file read in part ('" + path + "')";
  if (io) throw IoError(error);
  throw InvalidArgument(error);
}

}  // namespace fullshard::session
