// The C API's configuration file (fullshard/session/config.hpp): every key read with its value,
// every bad value refused with a message naming the file and the key.
#include <doctest/doctest.h>

#include <string>
#include <utility>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/session/config.hpp"

namespace fs = fullshard;
using fs::session::Config;
using fs::session::parse_config;

namespace {

const std::string kMlp = R"("model": {"type": "mlp", "inputs": 3, "hidden": [4, 5], "outputs": 2})";

Config parse(const std::string& rest, const std::string& model = kMlp) {
  return parse_config("{" + model + (rest.empty() ? "" : ", " + rest) + "}", "cfg.json");
}

// The message of parse(...)'s ConfigError ("" when it parses).
std::string error_of(const std::string& rest, const std::string& model = kMlp) {
  try {
    parse(rest, model);
  } catch (const fs::ConfigError& e) {
    return e.message();
  }
  return "";
}

bool has(const Config& c, const std::string& line) {
  for (const auto& l : c.canonical)
    if (l == line) return true;
  return false;
}

}  // namespace

TEST_CASE("config: defaults") {
  const Config c = parse("");
  CHECK(c.model.type == "mlp");
  CHECK(c.model.inputs == 3);
  CHECK(c.model.hidden == std::vector<std::int64_t>{4, 5});
  CHECK(c.model.activation == "relu");
  CHECK(c.loss == "mse");
  CHECK(c.optimizer.type == "adamw");
  CHECK(c.optimizer.lr == 1e-3);
  CHECK(c.optimizer.weight_decay == 0.0);
  CHECK(c.lr_schedule.type == "constant");
  CHECK(c.grad_clip == 0.0);
  CHECK(c.dtype == fs::DType::f32);
  CHECK_FALSE(c.param_dtype.has_value());
  CHECK(c.sharding.policy == "blocks");
  CHECK(c.sharding.reshard_after_forward.is_automatic());
  CHECK(c.memory.budget_mb == 0.0);
  CHECK(c.memory.check == "refuse");
  CHECK(c.seed == 0);
  CHECK(c.threads == 0);
  CHECK(has(c, "optimizer.lr = 0.001"));
  CHECK(has(c, "memory.check = refuse"));
}

TEST_CASE("config: every key is read") {
  const Config c = parse(
      R"("loss": "smooth_l1",
         "optimizer": {"type": "adamw", "lr": 0.02, "weight_decay": 0.1, "beta1": 0.8,
                       "beta2": 0.95, "eps": 1e-6},
         "lr_schedule": {"type": "warmup_cosine", "warmup_steps": 5, "total_steps": 50,
                         "min_lr": 0.001},
         "grad_clip": 2.5, "dtype": "float64",
         "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "float32"},
         "sharding": {"policy": "auto", "reshard_after_forward": false,
                      "forward_prefetch": 2, "memory_budget_mb": 128},
         "memory": {"budget_mb": 2048.5, "check": "warn"},
         "seed": 42, "threads": 3)",
      R"("model": {"type": "mlp", "inputs": 3, "hidden": [4], "outputs": 2,
                   "activation": "gelu"})");
  CHECK(c.model.activation == "gelu");
  CHECK(c.loss == "smooth_l1");
  CHECK(c.optimizer.lr == 0.02);
  CHECK(c.optimizer.weight_decay == 0.1);
  CHECK(c.optimizer.beta1 == 0.8);
  CHECK(c.optimizer.beta2 == 0.95);
  CHECK(c.optimizer.eps == 1e-6);
  CHECK(c.lr_schedule.type == "warmup_cosine");
  CHECK(c.lr_schedule.warmup_steps == 5);
  CHECK(c.lr_schedule.total_steps == 50);
  CHECK(c.lr_schedule.min_lr == 0.001);
  CHECK(c.grad_clip == 2.5);
  CHECK(c.dtype == fs::DType::f64);
  CHECK(c.param_dtype == fs::DType::bf16);
  CHECK(c.reduce_dtype == fs::DType::f32);
  CHECK(c.sharding.policy == "auto");
  CHECK(c.sharding.reshard_after_forward.keeps_unsharded());
  CHECK(c.sharding.forward_prefetch == 2);
  CHECK(c.sharding.memory_budget_mb == 128);
  CHECK(c.memory.budget_mb == 2048.5);
  CHECK(c.memory.check == "warn");
  CHECK(c.seed == 42);
  CHECK(c.threads == 3);

  const Config s = parse(R"("optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9})");
  CHECK(s.optimizer.type == "sgd");
  CHECK(s.optimizer.momentum == 0.9);

  const Config r = parse("", R"("model": {"type": "residual_mlp", "inputs": 3, "hidden": 8,
                                          "outputs": 1, "blocks": 2})");
  CHECK(r.model.hidden == std::vector<std::int64_t>{8});
  CHECK(r.model.blocks == 2);
  CHECK(r.model.deferred_init);  // every built-in family: sharded creation by default
  const Config w = parse("", R"("model": {"type": "mlp", "inputs": 3, "hidden": [8],
                                          "outputs": 1, "deferred_init": false})");
  CHECK(!w.model.deferred_init);

  const Config g = parse("", R"("model": {"type": "gpt", "vocab": 64, "context": 16,
                                          "d_model": 32, "heads": 4, "layers": 3,
                                          "mlp_ratio": 2, "checkpoint_blocks": true,
                                          "deferred_init": true})");
  CHECK(g.loss == "next_token");
  CHECK(g.model.vocab == 64);
  CHECK(g.model.context == 16);
  CHECK(g.model.d_model == 32);
  CHECK(g.model.heads == 4);
  CHECK(g.model.layers == 3);
  CHECK(g.model.mlp_ratio == 2);
  CHECK(g.model.checkpoint_blocks);
  CHECK(g.model.deferred_init);

  const Config v = parse("", R"("model": {"type": "conv_autoencoder", "channels": 2,
                                          "out_channels": 3, "width": 8, "levels": 3,
                                          "activation": "silu"})");
  CHECK(v.model.channels == 2);
  CHECK(v.model.out_channels == 3);
  CHECK(v.model.width == 8);
  CHECK(v.model.levels == 3);
  CHECK(v.model.activation == "silu");

  const Config t = parse("", R"("model": {"type": "torchscript", "file": "m.pt"})");
  CHECK(t.model.file == "m.pt");
}

TEST_CASE("config: every bad value names the file and the key") {
  const std::vector<std::pair<std::string, std::string>> top = {
      {R"("optimiser": {})", "cfg.json: unknown key 'optimiser'; this object takes model, loss"},
      {R"("loss": "hinge")", "cfg.json: loss: unknown value \"hinge\"; expected one of mse"},
      {R"("loss": 1)", "cfg.json: loss: expected one of mse"},
      {R"("optimizer": {"type": "lamb"})", "cfg.json: optimizer.type: unknown value \"lamb\""},
      {R"("optimizer": {"lr": "fast"})", "cfg.json: optimizer.lr: expected a number, got a string"},
      {R"("optimizer": {"lr": -1})", "cfg.json: optimizer.lr: -1 is out of range"},
      {R"("optimizer": {"beta1": 1.5})", "cfg.json: optimizer.beta1: 1.5 is out of range"},
      {R"("optimizer": {"eps": 0})", "cfg.json: optimizer.eps: 0 is out of range"},
      {R"("optimizer": {"momentum": 0.9})",
       "cfg.json: unknown key 'optimizer.momentum' in 'optimizer'"},
      {R"("optimizer": {"type": "sgd", "beta1": 0.9})",
       "cfg.json: unknown key 'optimizer.beta1' in 'optimizer'"},
      {R"("optimizer": 3)", "cfg.json: optimizer: expected an object, got a number"},
      {R"("lr_schedule": {"type": "warmup_cosine"})", "cfg.json: lr_schedule.total_steps: missing"},
      {R"("lr_schedule": {"type": "warmup_cosine", "warmup_steps": 9, "total_steps": 9})",
       "cfg.json: lr_schedule.warmup_steps: 9 must be below total_steps 9"},
      {R"("lr_schedule": {"type": "warmup_cosine", "total_steps": 10, "min_lr": 1})",
       "cfg.json: lr_schedule.min_lr: 1 is out of range"},
      {R"("lr_schedule": {"type": "step"})", "cfg.json: lr_schedule.type: unknown value \"step\""},
      {R"("lr_schedule": {"warmup_steps": 3})",
       "cfg.json: unknown key 'lr_schedule.warmup_steps' in 'lr_schedule'"},
      {R"("grad_clip": -1)", "cfg.json: grad_clip: -1 is out of range"},
      {R"("grad_clip": true)", "cfg.json: grad_clip: expected a number, got a boolean"},
      {R"("dtype": "f16")", "cfg.json: dtype: unknown dtype \"f16\""},
      {R"("mixed_precision": {"param_dtype": "int8"})",
       "cfg.json: mixed_precision.param_dtype: unknown dtype \"int8\""},
      {R"("mixed_precision": {"output_dtype": "bf16"})",
       "cfg.json: unknown key 'mixed_precision.output_dtype'"},
      {R"("sharding": {"policy": "every"})", "cfg.json: sharding.policy: unknown value \"every\""},
      {R"("sharding": {"policy": "auto"})", "cfg.json: sharding.memory_budget_mb: missing"},
      {R"("sharding": {"memory_budget_mb": 10})",
       "cfg.json: unknown key 'sharding.memory_budget_mb' in 'sharding'"},
      {R"("sharding": {"reshard_after_forward": 0})",
       "cfg.json: sharding.reshard_after_forward: expected true, false or a number of ranks k >= "
       "1, got a number (0)"},
      {R"("sharding": {"calibrate_steps": -1})",
       "cfg.json: sharding.calibrate_steps: -1 is out of range"},
      {R"("sharding": {"forward_prefetch": 17})",
       "cfg.json: sharding.forward_prefetch: 17 is out of range"},
      {R"("memory": {"budget_mb": -1})", "cfg.json: memory.budget_mb: -1 is out of range"},
      {R"("memory": {"check": "ignore"})", "cfg.json: memory.check: unknown value \"ignore\""},
      {R"("memory": {"budget": 1})", "cfg.json: unknown key 'memory.budget' in 'memory'"},
      {R"("seed": -1)", "cfg.json: seed: -1 is out of range"},
      {R"("seed": 1.5)", "cfg.json: seed: expected an integer, got a number"},
      {R"("threads": 5000)", "cfg.json: threads: 5000 is out of range"},
      {R"("accumulation": 0)", "cfg.json: accumulation: 0 is out of range"},
      {R"("sharding": {"compression": {"all_gather": "int4"}})",
       "cfg.json: sharding.compression.all_gather: unknown value \"int4\""},
      {R"("sharding": {"compression": {"reduce_scatter": "fp8_e4m3"}})",
       "cfg.json: sharding.compression.reduce_scatter: unknown value \"fp8_e4m3\"; expected "
       "one of none, int8"},
      {R"("sharding": {"compression": {"block": 100}})",
       "cfg.json: sharding.compression.block: 100 is not a power of two"},
      {R"("sharding": {"groups": ["a"]})",
       "cfg.json: sharding.groups: expected an array of arrays of module names, got a string"},
      {R"("sharding": {"groups": [["a"], []]})",
       "cfg.json: sharding.groups: expected an array of arrays of module names, got an array"},
      {R"("sharding": {"groups": [["a", "b"], ["b"]]})",
       "cfg.json: sharding.groups: module \"b\" is in more than one group"},
      {R"("sharding": {"policy": "auto", "memory_budget_mb": 9, "groups": [["a"]]})",
       "cfg.json: sharding.groups: the auto policy chooses the groups itself"},
      {R"("optimizer": {"in_backward": 1})",
       "cfg.json: optimizer.in_backward: expected true or false"},
      {R"("optimizer": {"in_backward": true}, "grad_clip": 1)",
       "cfg.json: optimizer.in_backward: true cannot clip (grad_clip 1.0): a global "
       "gradient norm needs every gradient before any update"},
      {R"("optimizer": {"in_backward": true}, "dtype": "f64")",
       "cfg.json: optimizer.in_backward: true needs f32 parameters, not dtype f64"},
      {R"("checkpoint": {"keep_last": -1})", "cfg.json: checkpoint.keep_last: -1 is out of range"},
      {R"("checkpoint": {"resume": true})",
       "cfg.json: checkpoint.resume: true needs checkpoint.dir"},
      {R"("checkpoint": {"path": "x"})",
       "cfg.json: unknown key 'checkpoint.path' in 'checkpoint'; this object takes dir, "
       "keep_last, kind, resume"},
  };
  for (const auto& entry : top) {  // (no structured bindings: CAPTURE captures)
    const auto& text = entry.first;
    const auto& want = entry.second;
    CAPTURE(text);
    const std::string got = error_of(text);
    CAPTURE(got);
    CHECK(got.find(want) != std::string::npos);
  }
  const std::vector<std::pair<std::string, std::string>> models = {
      {R"("mode": {})", "cfg.json: model: missing"},
      {R"("model": {"type": "rnn"})", "cfg.json: model.type: unknown value \"rnn\""},
      {R"("model": {})", "cfg.json: model.type: missing"},
      {R"("model": {"type": "mlp", "inputs": 3, "outputs": 2})", "cfg.json: model.hidden: missing"},
      {R"("model": {"type": "mlp", "hidden": [2], "outputs": 2})",
       "a mlp needs \"inputs\" and \"outputs\""},
      {R"("model": {"type": "mlp", "inputs": 0, "hidden": [2], "outputs": 2})",
       "cfg.json: model.inputs: 0 is out of range"},
      {R"("model": {"type": "mlp", "inputs": 3, "hidden": [2, 0], "outputs": 2})",
       "cfg.json: model.hidden: expected integers from 1"},
      {R"("model": {"type": "mlp", "inputs": 3, "hidden": 4, "outputs": 2})",
       "cfg.json: model.hidden: expected a non-empty array of integers, got a number"},
      {R"("model": {"type": "mlp", "inputs": 3, "hidden": [4], "outputs": 2, "blocks": 2})",
       "cfg.json: unknown key 'model.blocks' in 'model'"},
      {R"("model": {"type": "mlp", "inputs": 3, "hidden": [4], "outputs": 2,
                    "activation": "sigmoid"})",
       "cfg.json: model.activation: unknown value \"sigmoid\""},
      {R"("model": {"type": "gpt", "d_model": 30, "heads": 4})",
       "cfg.json: model.heads: 4 does not divide model.d_model 30"},
      {R"("model": {"type": "gpt", "vocab": 1})", "cfg.json: model.vocab: 1 is out of range"},
      {R"("model": {"type": "conv_autoencoder", "levels": 9})",
       "cfg.json: model.levels: 9 is out of range"},
      {R"("model": {"type": "torchscript"})", "cfg.json: model.file: missing"},
      {R"("model": {"type": "torchscript", "file": 7})",
       "cfg.json: model.file: expected a string, got a number"},
  };
  for (const auto& entry : models) {
    const auto& model = entry.first;
    const auto& want = entry.second;
    CAPTURE(model);
    std::string got;
    try {
      parse_config("{" + model + "}", "cfg.json");
    } catch (const fs::ConfigError& e) {
      got = e.message();
    }
    CAPTURE(got);
    CHECK(got.find(want) != std::string::npos);
  }
  // The GPT's loss is its own.
  CHECK(error_of(R"("loss": "mse")", R"("model": {"type": "gpt"})")
            .find("cfg.json: loss: unknown value \"mse\"; expected one of next_token") !=
        std::string::npos);
  // JSON itself: a syntax error and a duplicate key name the file.
  CHECK(error_of(R"("seed": )").find("cfg.json") != std::string::npos);
  CHECK(error_of(R"("seed": 1, "seed": 2)").find("duplicate key 'seed'") != std::string::npos);
}

TEST_CASE("config: the typed configuration and its JSON form are one") {
  // to_json writes every key; parsing it gives the same configuration (its canonical lines).
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", kMlp},
      {R"("optimizer": {"type": "sgd", "lr": 0.5, "momentum": 0.9}, "accumulation": 4,
          "sharding": {"reshard_after_forward": 2, "groups": [["layers.0", "layers.1"]],
                       "compression": {"all_gather": "fp8_e4m3", "reduce_scatter": "int8",
                                       "block": 64}},
          "checkpoint": {"dir": "ck", "keep_last": 2, "resume": true},
          "mixed_precision": {"param_dtype": "bf16"}, "seed": 7)",
       kMlp},
      {R"("lr_schedule": {"type": "warmup_cosine", "warmup_steps": 2, "total_steps": 9},
          "sharding": {"policy": "auto", "memory_budget_mb": 12, "reshard_after_forward": false})",
       R"("model": {"type": "gpt", "layers": 3})"},
      {"", R"("model": {"type": "residual_mlp", "inputs": 2, "outputs": 3, "blocks": 2})"},
      {"", R"("model": {"type": "conv_autoencoder", "channels": 2, "deferred_init": false})"},
      {"", R"("model": {"type": "torchscript", "file": "m.pt"})"},
  };
  for (const auto& entry : cases) {
    CAPTURE(entry.first);
    CAPTURE(entry.second);
    const Config c = parse(entry.first, entry.second);
    const std::string text = fs::session::to_json(c);
    CAPTURE(text);
    const Config back = parse_config(text, "cfg.json");
    CHECK(back.canonical == c.canonical);
    CHECK(fs::session::canonical_lines(c) == c.canonical);
  }
  // A configuration built in C++ is checked as a file is.
  Config c = parse("");
  c.accumulation = 0;
  c.source = "my session";
  CHECK_THROWS_WITH_AS(fs::session::canonical_lines(c),
                       doctest::Contains("my session: accumulation: 0 is out of range"),
                       fs::ConfigError);
  c = parse(R"("sharding": {"reshard_after_forward": 2})");
  CHECK(c.sharding.reshard_after_forward.value() == 2);
  CHECK(has(c, "sharding.reshard_after_forward = 2"));
}
