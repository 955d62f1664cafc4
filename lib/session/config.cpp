#include "fullshard/session/config.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "fullshard/base/error.hpp"
#include "fullshard/kernels/quantize.hpp"
#include "lib/base/json_reader.hpp"

namespace fullshard::session {

namespace {

using ojson = nlohmann::ordered_json;

std::string type_of(const ojson& v) {
  if (v.is_boolean()) return "a boolean";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i)
    s += (i ? ", " : "") + v[i];
  return s;
}

// One JSON object of the configuration: each get() names the key it reads; finish() refuses
// every key that was not read (naming it and the keys the object takes).
class Section {
 public:
  Section(const ojson& j, std::string path, Config& c) : j_(j), path_(std::move(path)), c_(c) {
    if (!j_.is_object()) fail(path_.empty() ? "the configuration" : path_, "an object");
  }

  double number(const std::string& key, double def, double lo, double hi) {
    const ojson* v = find(key);
    double x = def;
    if (v) {
      if (!v->is_number()) fail(key, "a number", *v);
      x = v->get<double>();
      if (!std::isfinite(x) || x < lo || x > hi) range(key, *v, lo, hi);
    }
    record(key, ojson(x).dump());
    return x;
  }
  std::int64_t integer(const std::string& key, std::int64_t def, std::int64_t lo, std::int64_t hi) {
    const ojson* v = find(key);
    std::int64_t x = def;
    if (v) {
      if (!v->is_number_integer()) fail(key, "an integer", *v);
      if (v->is_number_unsigned() &&
          v->get<std::uint64_t>() > std::uint64_t(std::numeric_limits<std::int64_t>::max()))
        range(key, *v, double(lo), double(hi));
      x = v->get<std::int64_t>();
      if (x < lo || x > hi) range(key, *v, double(lo), double(hi));
    }
    record(key, std::to_string(x));
    return x;
  }
  bool boolean(const std::string& key, bool def) {
    const ojson* v = find(key);
    bool x = def;
    if (v) {
      if (!v->is_boolean()) fail(key, "true or false", *v);
      x = v->get<bool>();
    }
    record(key, x ? "true" : "false");
    return x;
  }
  /// One of `choices` (the first is the default unless `required`).
  std::string choice(const std::string& key, const std::vector<std::string>& choices,
                     bool required = false) {
    const ojson* v = find(key);
    std::string x = choices.front();
    if (!v && required) missing(key, "one of " + join(choices));
    if (v) {
      if (!v->is_string()) fail(key, "one of " + join(choices), *v);
      x = v->get<std::string>();
      bool ok = false;
      for (const auto& c : choices)
        ok = ok || c == x;
      if (!ok)
        throw ConfigError(c_.source + ": " + full(key) + ": unknown value \"" + x +
                          "\"; expected one of " + join(choices));
    }
    record(key, x);
    return x;
  }
  std::string text(const std::string& key, bool required) {
    const ojson* v = find(key);
    if (!v && required) missing(key, "a string");
    std::string x;
    if (v) {
      if (!v->is_string()) fail(key, "a string", *v);
      x = v->get<std::string>();
    }
    record(key, x);
    return x;
  }
  std::vector<std::int64_t> integers(const std::string& key, std::int64_t lo, std::int64_t hi,
                                     bool required) {
    const ojson* v = find(key);
    if (!v && required) missing(key, "an array of integers");
    std::vector<std::int64_t> x;
    std::string shown = "[";
    if (v) {
      if (!v->is_array() || v->empty()) fail(key, "a non-empty array of integers", *v);
      for (const auto& e : *v) {
        if (!e.is_number_integer() || e.get<std::int64_t>() < lo || e.get<std::int64_t>() > hi)
          throw ConfigError(c_.source + ": " + full(key) + ": expected integers from " +
                            std::to_string(lo) + " to " + std::to_string(hi) + ", got " + e.dump());
        x.push_back(e.get<std::int64_t>());
        shown += (x.size() > 1 ? "," : "") + std::to_string(x.back());
      }
    }
    record(key, shown + "]");
    return x;
  }
  /// FSDP2's reshard_after_forward: true, false or an integer k >= 1.
  graph::ReshardAfterForward reshard(const std::string& key, graph::ReshardAfterForward def) {
    const ojson* v = find(key);
    graph::ReshardAfterForward x = def;
    if (v) {
      if (v->is_boolean())
        x = v->get<bool>() ? graph::ReshardAfterForward::automatic()
                           : graph::ReshardAfterForward::never();
      else if (v->is_number_integer() && v->get<std::int64_t>() >= 1 &&
               v->get<std::int64_t>() <= (1 << 20))
        x = graph::ReshardAfterForward::group_size(int(v->get<std::int64_t>()));
      else
        fail(key, "true, false or a number of ranks k >= 1", *v);
    }
    record(key, x.is_automatic() ? "true" : x.keeps_unsharded() ? "false" : x.to_string());
    return x;
  }
  /// An array of distinct non-empty strings, or absent (none).
  std::vector<std::string> strings(const std::string& key, const std::string& what) {
    const ojson* v = find(key);
    std::vector<std::string> x;
    if (v) {
      const std::string expected = "an array of " + what;
      if (!v->is_array()) fail(key, expected, *v);
      for (const auto& e : *v) {
        if (!e.is_string() || e.get<std::string>().empty()) fail(key, expected, e);
        if (std::find(x.begin(), x.end(), e.get<std::string>()) != x.end())
          throw ConfigError(c_.source + ": " + full(key) + ": \"" + e.get<std::string>() +
                            "\" is listed twice");
        x.push_back(e.get<std::string>());
      }
    }
    record(key, v ? v->dump() : "[]");
    return x;
  }
  /// An array of non-empty arrays of distinct non-empty strings (list groups), or absent.
  std::vector<std::vector<std::string>> name_lists(const std::string& key) {
    const ojson* v = find(key);
    std::vector<std::vector<std::string>> x;
    if (v) {
      const std::string expected = "an array of arrays of module names";
      if (!v->is_array()) fail(key, expected, *v);
      std::set<std::string> seen;
      for (const auto& list : *v) {
        if (!list.is_array() || list.empty()) fail(key, expected, list);
        x.emplace_back();
        for (const auto& name : list) {
          if (!name.is_string() || name.get<std::string>().empty()) fail(key, expected, name);
          if (!seen.insert(name.get<std::string>()).second)
            throw ConfigError(c_.source + ": " + full(key) + ": module \"" +
                              name.get<std::string>() + "\" is in more than one group");
          x.back().push_back(name.get<std::string>());
        }
      }
    }
    record(key, v ? v->dump() : "[]");
    return x;
  }
  /// A DType name (f32, bf16, ...) or absent.
  std::optional<DType> dtype(const std::string& key, const std::vector<std::string>& allowed,
                             std::optional<DType> def = {}) {
    const ojson* v = find(key);
    std::optional<DType> x = def;
    if (v) {
      if (!v->is_string()) fail(key, "one of " + join(allowed), *v);
      const std::string s = v->get<std::string>();
      bool ok = false;
      for (const auto& a : allowed)
        ok = ok || a == s;
      if (!ok)
        throw ConfigError(c_.source + ": " + full(key) + ": unknown dtype \"" + s +
                          "\"; expected one of " + join(allowed));
      x = parse_dtype(s, c_.source + ": " + full(key));
    }
    record(key, x ? dtype_name(*x) : "none");
    return x;
  }
  /// A nested object (an empty one when absent and not required).
  Section object(const std::string& key, bool required) {
    const ojson* v = find(key);
    if (!v && required) missing(key, "an object");
    if (v && !v->is_object()) fail(key, "an object", *v);
    return Section(v ? *v : empty_, full(key), c_);
  }
  bool has(const std::string& key) const { return j_.contains(key); }

  /// Refuses the keys that were not read.
  void finish() const {
    for (auto it = j_.begin(); it != j_.end(); ++it)
      if (!read_.count(it.key())) {
        std::vector<std::string> keys(order_.begin(), order_.end());
        throw ConfigError(c_.source + ": unknown key " + detail::json_key_shown(full(it.key())) +
                          (path_.empty() ? "" : " in '" + path_ + "'") + "; this object takes " +
                          (keys.empty() ? std::string("no keys") : join(keys)));
      }
  }

 private:
  const ojson* find(const std::string& key) {
    read_.insert(key);
    order_.push_back(key);
    auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }
  std::string full(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  void record(const std::string& key, const std::string& value) {
    c_.canonical.push_back(full(key) + " = " + value);
  }
  [[noreturn]] void fail(const std::string& key, const std::string& expected,
                         const ojson& got) const {
    throw ConfigError(c_.source + ": " + full(key) + ": expected " + expected + ", got " +
                      type_of(got) + " (" + got.dump().substr(0, 80) + ")");
  }
  [[noreturn]] void fail(const std::string& what, const std::string& expected) const {
    throw ConfigError(c_.source + ": " + what + ": expected " + expected + ", got " + type_of(j_));
  }
  [[noreturn]] void missing(const std::string& key, const std::string& expected) const {
    throw ConfigError(c_.source + ": " + full(key) + ": missing (expected " + expected + ")");
  }
  [[noreturn]] void range(const std::string& key, const ojson& v, double lo, double hi) const {
    std::ostringstream m;
    m << c_.source << ": " << full(key) << ": " << v.dump() << " is out of range [" << lo << ", "
      << hi << "]";
    throw ConfigError(m.str());
  }

  static inline const ojson empty_ = ojson::object();
  const ojson& j_;
  std::string path_;
  Config& c_;
  std::set<std::string> read_;
  std::vector<std::string> order_;
};

constexpr std::int64_t kMaxSize = std::int64_t{1} << 31;
const std::vector<std::string> kActivations = {"relu", "gelu", "tanh", "silu"};

void read_model(Section m, Config& c) {
  ModelSpec& s = c.model;
  s.type = m.choice(
      "type", {"mlp", "residual_mlp", "gpt", "conv_autoencoder", "torchscript", "native"}, true);
  if (s.type == "mlp" || s.type == "residual_mlp") {
    s.inputs = m.integer("inputs", 0, 1, kMaxSize);
    s.outputs = m.integer("outputs", 0, 1, kMaxSize);
    if (!m.has("inputs") || !m.has("outputs"))
      throw ConfigError(c.source + ": model: a " + s.type + " needs \"inputs\" and \"outputs\"");
    if (s.type == "mlp") {
      s.hidden = m.integers("hidden", 1, kMaxSize, true);
      s.activation = m.choice("activation", kActivations);
    } else {
      s.hidden = {m.integer("hidden", 256, 1, kMaxSize)};
      s.blocks = m.integer("blocks", 4, 1, 1 << 16);
    }
  } else if (s.type == "gpt") {
    s.vocab = m.integer("vocab", s.vocab, 2, kMaxSize);
    s.context = m.integer("context", s.context, 2, kMaxSize);
    s.d_model = m.integer("d_model", s.d_model, 1, kMaxSize);
    s.heads = m.integer("heads", s.heads, 1, 1 << 16);
    s.layers = m.integer("layers", s.layers, 1, 1 << 16);
    s.mlp_ratio = m.integer("mlp_ratio", s.mlp_ratio, 1, 64);
    s.checkpoint_blocks = m.boolean("checkpoint_blocks", false);
    s.dropout = m.number("dropout", 0.0, 0.0, 0.99);
    if (s.d_model % s.heads != 0)
      throw ConfigError(c.source + ": model.heads: " + std::to_string(s.heads) +
                        " does not divide model.d_model " + std::to_string(s.d_model));
  } else if (s.type == "conv_autoencoder") {
    s.channels = m.integer("channels", 1, 1, 1 << 16);
    s.out_channels = m.integer("out_channels", s.channels, 1, 1 << 16);
    s.width = m.integer("width", 16, 1, 1 << 16);
    s.levels = m.integer("levels", 2, 1, 8);
    s.activation = m.choice("activation", kActivations);
  } else if (s.type == "torchscript") {
    s.file = m.text("file", true);
  }
  // Built-in families: no rank ever holds the whole model unless asked (a native model is
  // created sharded by the program's model).
  if (s.type != "torchscript" && s.type != "native")
    s.deferred_init = m.boolean("deferred_init", true);
  m.finish();
}

}  // namespace

Config parse_config(const std::string& text, const std::string& source) {
  Config c;
  c.source = source;
  const ojson j = detail::parse_json_strict(text, source);
  Section top(j, "", c);
  read_model(top.object("model", true), c);
  const bool gpt = c.model.type == "gpt";
  // A native model computes its own loss: the mean squared error.
  c.loss =
      top.choice("loss", gpt ? std::vector<std::string>{"next_token"}
                         : c.model.type == "native"
                             ? std::vector<std::string>{"mse"}
                             : std::vector<std::string>{"mse", "l1", "smooth_l1", "cross_entropy"});
  {
    Section o = top.object("optimizer", false);
    OptimizerSpec& s = c.optimizer;
    s.type = o.choice("type", {"adamw", "sgd"});
    s.lr = o.number("lr", s.lr, 0.0, 1e6);
    s.weight_decay = o.number("weight_decay", 0.0, 0.0, 1e6);
    s.no_weight_decay = o.strings("no_weight_decay", "parameter name patterns");
    if (s.type == "adamw") {
      const double inf = std::numeric_limits<double>::max();
      s.beta1 = o.number("beta1", s.beta1, 0.0, 0.999999);
      s.beta2 = o.number("beta2", s.beta2, 0.0, 0.999999999);
      s.eps = o.number("eps", s.eps, 1e-30, inf);
    } else {
      s.momentum = o.number("momentum", 0.0, 0.0, 0.999999);
    }
    s.in_backward = o.boolean("in_backward", false);
    o.finish();
  }
  {
    Section o = top.object("lr_schedule", false);
    ScheduleSpec& s = c.lr_schedule;
    s.type = o.choice("type", {"constant", "warmup_cosine"});
    if (s.type == "warmup_cosine") {
      s.warmup_steps = int(o.integer("warmup_steps", 0, 0, 1 << 30));
      s.total_steps = int(o.integer("total_steps", 0, 1, 1 << 30));
      s.min_lr = o.number("min_lr", 0.0, 0.0, c.optimizer.lr);
      if (!o.has("total_steps"))
        throw ConfigError(c.source +
                          ": lr_schedule.total_steps: missing (a warmup_cosine "
                          "schedule needs it)");
      if (s.warmup_steps >= s.total_steps)
        throw ConfigError(c.source +
                          ": lr_schedule.warmup_steps: " + std::to_string(s.warmup_steps) +
                          " must be below total_steps " + std::to_string(s.total_steps));
    }
    o.finish();
  }
  c.grad_clip = top.number("grad_clip", 0.0, 0.0, 1e30);
  c.accumulation = int(top.integer("accumulation", 1, 1, 1 << 16));
  if (c.accumulation > 1 && c.model.type == "native")
    throw ConfigError(c.source + ": accumulation: " + std::to_string(c.accumulation) +
                      ": a native model takes one batch per step (NativeSession::train_step); "
                      "give it the whole batch");
  {
    Section o = top.object("non_finite", false);
    c.non_finite.policy = o.choice("policy", {"skip", "stop"});
    c.non_finite.max_skipped = int(o.integer("max_skipped", 10, 0, 1 << 30));
    o.finish();
  }
  c.dtype = *top.dtype("dtype", {"float32", "f32", "float64", "f64"}, DType::f32);
  if (c.optimizer.in_backward && c.grad_clip > 0)
    throw ConfigError(c.source + ": optimizer.in_backward: true cannot clip (grad_clip " +
                      ojson(c.grad_clip).dump() +
                      "): a global gradient norm needs every gradient before any update");
  if (c.optimizer.in_backward && c.dtype != DType::f32)
    throw ConfigError(c.source + ": optimizer.in_backward: true needs f32 parameters, not dtype " +
                      dtype_name(c.dtype) + " (fullshard's optimizers are f32)");
  {
    Section o = top.object("mixed_precision", false);
    const std::vector<std::string> kinds = {"f32", "float32", "bf16", "bfloat16", "f16", "float16"};
    c.param_dtype = o.dtype("param_dtype", kinds);
    c.reduce_dtype = o.dtype("reduce_dtype", kinds);
    o.finish();
  }
  {
    Section o = top.object("sharding", false);
    ShardingSpec& s = c.sharding;
    s.policy = o.choice("policy", {"blocks", "root", "auto"});
    s.reshard_after_forward =
        o.reshard("reshard_after_forward", graph::ReshardAfterForward::automatic());
    s.forward_prefetch = int(o.integer("forward_prefetch", 0, 0, 16));
    s.calibrate_steps = int(o.integer("calibrate_steps", 10, 0, 1000));
    {
      Section z = o.object("compression", false);
      const std::string ag = z.choice("all_gather", {"none", "int8", "fp8_e4m3"});
      const std::string rs = z.choice("reduce_scatter", {"none", "int8"});
      const std::int64_t block = z.integer("block", 256, 8, 1 << 20);
      if ((block & (block - 1)) != 0)
        throw ConfigError(c.source + ": sharding.compression.block: " + std::to_string(block) +
                          " is not a power of two");
      if (ag != "none") s.compression.all_gather = kernels::parse_quant_code(ag, ag);
      if (rs != "none") s.compression.reduce_scatter = kernels::parse_quant_code(rs, rs);
      s.compression.block = int(block);
      z.finish();
    }
    s.groups = o.name_lists("groups");
    if (!s.groups.empty() && s.policy == "auto")
      throw ConfigError(c.source +
                        ": sharding.groups: the auto policy chooses the groups itself; "
                        "declare list groups with the blocks or root policy");
    s.cost_file = o.text("cost_file", false);
    if (s.policy == "auto") {
      s.allow_compression = o.boolean("allow_compression", false);
      s.memory_budget_mb = o.number("memory_budget_mb", 0.0, 1e-6, 1e12);
      if (!o.has("memory_budget_mb"))
        throw ConfigError(c.source +
                          ": sharding.memory_budget_mb: missing (the auto policy "
                          "plans under a per-rank memory budget)");
    }
    o.finish();
  }
  {
    Section o = top.object("memory", false);
    c.memory.budget_mb = o.number("budget_mb", 0.0, 0.0, 1e12);
    c.memory.check = o.choice("check", {"refuse", "warn", "off"});
    o.finish();
  }
  {
    Section o = top.object("checkpoint", false);
    c.checkpoint.dir = o.text("dir", false);
    c.checkpoint.keep_last = int(o.integer("keep_last", 0, 0, 1 << 20));
    c.checkpoint.kind = o.choice("kind", {"sharded", "full"});
    c.checkpoint.resume = o.boolean("resume", false);
    c.checkpoint.resume_from = o.text("resume_from", false);
    if (!c.checkpoint.resume_from.empty() && !c.checkpoint.resume)
      throw ConfigError(c.source + ": checkpoint.resume_from: set without checkpoint.resume: true");
    if (c.checkpoint.resume && c.checkpoint.dir.empty() && c.checkpoint.resume_from.empty())
      throw ConfigError(
          c.source + ": checkpoint.resume: true needs checkpoint.dir (or checkpoint.resume_from)");
    c.checkpoint.start_over = o.boolean("start_over", false);
    if (c.checkpoint.start_over && c.checkpoint.resume)
      throw ConfigError(c.source +
                        ": checkpoint.start_over: true and checkpoint.resume: true contradict "
                        "each other (resume continues the directory's checkpoints, start_over "
                        "starts a new run beside them)");
    o.finish();
  }
  c.seed = std::uint64_t(top.integer("seed", 0, 0, std::numeric_limits<std::int64_t>::max()));
  c.threads = int(top.integer("threads", 0, 0, 4096));
  top.finish();
  return c;
}

Config read_config(const std::string& path) {
  std::string text;
  try {
    text = fullshard::read_text_file(path, "configuration");
  } catch (const ConfigError&) {
    throw;
  } catch (const Error& e) {
    throw ConfigError(e.message());
  }
  return parse_config(text, path);
}

std::string to_json(const Config& c, int indent) {
  ojson j;
  const ModelSpec& m = c.model;
  ojson& model = j["model"];
  model["type"] = m.type;
  if (m.type == "mlp" || m.type == "residual_mlp") {
    model["inputs"] = m.inputs;
    model["outputs"] = m.outputs;
    if (m.type == "mlp") {
      model["hidden"] = m.hidden;
      model["activation"] = m.activation;
    } else {
      model["hidden"] = m.hidden.empty() ? std::int64_t{256} : m.hidden.front();
      model["blocks"] = m.blocks;
    }
  } else if (m.type == "gpt") {
    model["vocab"] = m.vocab;
    model["context"] = m.context;
    model["d_model"] = m.d_model;
    model["heads"] = m.heads;
    model["layers"] = m.layers;
    model["mlp_ratio"] = m.mlp_ratio;
    model["checkpoint_blocks"] = m.checkpoint_blocks;
    model["dropout"] = m.dropout;
  } else if (m.type == "conv_autoencoder") {
    model["channels"] = m.channels;
    model["out_channels"] = m.out_channels;
    model["width"] = m.width;
    model["levels"] = m.levels;
    model["activation"] = m.activation;
  } else if (m.type == "torchscript") {
    model["file"] = m.file;
  }
  if (m.type != "torchscript" && m.type != "native") model["deferred_init"] = m.deferred_init;
  j["loss"] = c.loss;
  ojson& o = j["optimizer"];
  o["type"] = c.optimizer.type;
  o["lr"] = c.optimizer.lr;
  o["weight_decay"] = c.optimizer.weight_decay;
  if (!c.optimizer.no_weight_decay.empty()) o["no_weight_decay"] = c.optimizer.no_weight_decay;
  if (c.optimizer.type == "adamw") {
    o["beta1"] = c.optimizer.beta1;
    o["beta2"] = c.optimizer.beta2;
    o["eps"] = c.optimizer.eps;
  } else {
    o["momentum"] = c.optimizer.momentum;
  }
  o["in_backward"] = c.optimizer.in_backward;
  ojson& sched = j["lr_schedule"];
  sched["type"] = c.lr_schedule.type;
  if (c.lr_schedule.type == "warmup_cosine") {
    sched["warmup_steps"] = c.lr_schedule.warmup_steps;
    sched["total_steps"] = c.lr_schedule.total_steps;
    sched["min_lr"] = c.lr_schedule.min_lr;
  }
  j["grad_clip"] = c.grad_clip;
  j["accumulation"] = c.accumulation;
  j["non_finite"] = {{"policy", c.non_finite.policy}, {"max_skipped", c.non_finite.max_skipped}};
  j["dtype"] = dtype_name(c.dtype);
  ojson& mp = j["mixed_precision"];
  mp = ojson::object();
  if (c.param_dtype) mp["param_dtype"] = dtype_name(*c.param_dtype);
  if (c.reduce_dtype) mp["reduce_dtype"] = dtype_name(*c.reduce_dtype);
  ojson& sh = j["sharding"];
  sh["policy"] = c.sharding.policy;
  const graph::ReshardAfterForward r = c.sharding.reshard_after_forward;
  if (r.is_automatic())
    sh["reshard_after_forward"] = true;
  else if (r.keeps_unsharded())
    sh["reshard_after_forward"] = false;
  else if (r.reshards())
    sh["reshard_after_forward"] = true;
  else
    sh["reshard_after_forward"] = r.value();
  sh["forward_prefetch"] = c.sharding.forward_prefetch;
  sh["calibrate_steps"] = c.sharding.calibrate_steps;
  const graph::CompressionPolicy& z = c.sharding.compression;
  sh["compression"] = {
      {"all_gather", z.all_gather ? kernels::quant_code_name(*z.all_gather) : "none"},
      {"reduce_scatter", z.reduce_scatter ? kernels::quant_code_name(*z.reduce_scatter) : "none"},
      {"block", z.block}};
  if (!c.sharding.cost_file.empty()) sh["cost_file"] = c.sharding.cost_file;
  if (c.sharding.policy == "auto") {
    sh["memory_budget_mb"] = c.sharding.memory_budget_mb;
    sh["allow_compression"] = c.sharding.allow_compression;
  }
  if (!c.sharding.groups.empty()) sh["groups"] = c.sharding.groups;
  j["memory"] = {{"budget_mb", c.memory.budget_mb}, {"check", c.memory.check}};
  ojson& ck = j["checkpoint"];
  ck = ojson::object();
  if (!c.checkpoint.dir.empty()) ck["dir"] = c.checkpoint.dir;
  ck["keep_last"] = c.checkpoint.keep_last;
  ck["kind"] = c.checkpoint.kind;
  ck["resume"] = c.checkpoint.resume;
  if (!c.checkpoint.resume_from.empty()) ck["resume_from"] = c.checkpoint.resume_from;
  ck["start_over"] = c.checkpoint.start_over;
  j["seed"] = c.seed;
  j["threads"] = c.threads;
  return j.dump(indent);
}

std::string Config::name_of(const std::string& key) const {
  const auto it = option_names.find(key);
  return it != option_names.end() ? it->second : key;
}

std::string Config::setting(const std::string& key, const std::string& value,
                            const std::string& option_value) const {
  const auto it = option_names.find(key);
  if (it != option_names.end())
    return it->second + (option_value.empty() ? "" : " " + option_value);
  // "a.b" -> "a": {"b": value}
  const std::size_t dot = key.find('.');
  if (dot == std::string::npos) return "\"" + key + "\": " + value;
  return "\"" + key.substr(0, dot) + "\": {\"" + key.substr(dot + 1) + "\": " + value + "}";
}

std::vector<std::string> canonical_lines(const Config& c) {
  return parse_config(to_json(c), c.source.empty() ? "<session configuration>" : c.source)
      .canonical;
}

}  // namespace fullshard::session
