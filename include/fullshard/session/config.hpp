// The typed configuration of a training session (fullshard::session::Session): the model, the
// loss, the optimizer and its schedule, clipping, precision, sharding, the memory check and
// checkpoints. The JSON configuration file (docs/guide/c-fortran.md, "The configuration file"; the
// C API and the Fortran module read it) is one serialisation of it: parse_config reads it, to_json
// writes it, and every key is checked (name, type, range); an unknown key or a bad value is
// a ConfigError naming the source, the key and what was expected.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/graph/shard_request.hpp"

namespace fullshard {
class DeviceMesh;
}

namespace fullshard::session {

/// "model": which network. Only the keys of the chosen type are accepted.
struct ModelSpec {
  /// mlp | residual_mlp | gpt | conv_autoencoder | torchscript: LibTorch models the session
  /// builds (Session); native: a model the program gives (NativeSession, no other key).
  std::string type;
  // mlp: inputs -> hidden[0] -> ... -> outputs, one block per hidden layer;
  // residual_mlp: inputs -> hidden (blocks residual blocks) -> outputs.
  std::int64_t inputs = 0, outputs = 0;
  std::vector<std::int64_t> hidden;
  std::int64_t blocks = 0;
  std::string activation = "relu";  // mlp, conv_autoencoder: relu | gelu | tanh | silu
  // gpt
  std::int64_t vocab = 256, context = 128, d_model = 128, heads = 4, layers = 2, mlp_ratio = 4;
  bool checkpoint_blocks = false;
  double dropout = 0.0;  // after attention and MLP, in training steps only
  // Built-in families: each piece released to the meta device as it is built and each rank
  // initialises its own rows (counter-based, the same model at any rank count); false: built
  // whole with LibTorch's generator, then sharded.
  bool deferred_init = true;
  // conv_autoencoder: (N, channels, H, W) -> (N, out_channels, H, W); H and W divisible by
  // 2^levels.
  std::int64_t channels = 1, out_channels = 1, width = 16, levels = 2;
  // torchscript
  std::string file;
};

struct OptimizerSpec {
  std::string type = "adamw";  // adamw | sgd
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;  // sgd
  /// Parameters updated without weight decay, by fully qualified name: shell patterns
  /// (fnmatch; "*" also matches "."), e.g. GPT-2's {"*.bias", "*.ln*", "tok.*", "pos.*"}. A
  /// pattern that matches no parameter is refused (a misspelt name decays silently otherwise).
  /// A tied weight is matched by the name it has in checkpoints (its first). Inside backward,
  /// a group's parameters must all decay or none.
  std::vector<std::string> no_weight_decay;
  /// The optimizer inside backward (optim::Optimizer::run_in_backward): each group's shards are
  /// updated as soon as its reduced gradient lands, so no sharded gradient is held between
  /// backward and the step. The same numbers as the step after backward. f32 parameters only;
  /// not with grad_clip (a global norm needs every gradient before any update).
  bool in_backward = false;
};

struct ScheduleSpec {
  std::string type = "constant";  // constant | warmup_cosine
  int warmup_steps = 0, total_steps = 0;
  double min_lr = 0.0;
};

struct ShardingSpec {
  std::string policy = "blocks";  // blocks | root | auto
  /// FSDP2's reshard_after_forward: true (JSON true: every group but the root's reshards
  /// after its forward), false, or k ranks (JSON integer: each rank keeps a 1/k slice; k
  /// divides the shard dim).
  graph::ReshardAfterForward reshard_after_forward = graph::ReshardAfterForward::automatic();
  double memory_budget_mb = 0.0;  // auto
  /// auto: the planner may also choose int8 all-gathers and reduce-scatters (they change the
  /// numbers: only where allowed).
  bool allow_compression = false;
  /// The plan's cost model (fullshard-calibrate --out); empty: the mesh's defaults.
  std::string cost_file;
  int forward_prefetch = 0;
  /// Training steps whose module compute times calibrate the plan's prediction
  /// (Session::plan()), after the first step (which faults the buffers in); 0: none. The
  /// sharding the plan chose stays. CPU meshes (a GPU mesh keeps the default costs) and
  /// accumulation 1 (the plan is one forward and backward, a step of micro-batches is not).
  int calibrate_steps = 10;
  /// Compressed collectives of every group (int8 or fp8 e4m3 all-gathers, int8
  /// reduce-scatters, one f32 scale per `block` elements); none by default.
  graph::CompressionPolicy compression;
  /// List groups (FSDP2's fully_shard([m1, m2, ...])): each entry's modules, by fully
  /// qualified name, in one communication group; a module of a list is not a group of its own
  /// under the blocks policy. Not with the auto policy (it chooses the groups).
  std::vector<std::vector<std::string>> groups;
};

/// "memory": the rank's planned process peak (docs/memory.md) against what it can have, checked
/// on every rank before the model's shards are allocated.
struct MemorySpec {
  double budget_mb = 0.0;        // 0: the cgroup limit or MemAvailable, shared by the node's ranks
  std::string check = "refuse";  // refuse | warn | off
};

/// "checkpoint": where and how the session saves (Session::save, save_async, resume).
struct CheckpointSpec {
  /// The checkpoint root; empty: none configured (save and load then take a directory).
  /// Checked before the first step (created if its parent exists; written and read back by
  /// every rank: a directory one rank cannot write or does not share is refused there).
  std::string dir;
  /// Committed step directories kept (the oldest beyond it are removed after each commit);
  /// 0: keep all.
  int keep_last = 0;
  /// sharded: every rank writes its shards (the default; asynchronous saves need it); full:
  /// rank 0 gathers and writes one consolidated file.
  std::string kind = "sharded";
  /// Load the latest checkpoint in `dir` at creation when there is one (saved on any number
  /// of ranks).
  bool resume = false;
  /// With `resume`: load this checkpoint instead (a checkpoint root or one step directory,
  /// refused when missing); `dir` is then optional. One of `dir`'s own continues the run's
  /// lineage there; the step directory resumed from is never removed by keep_last.
  std::string resume_from;
  /// A fresh run on a `dir` that holds checkpoints (refused otherwise): they are kept, and
  /// retention deletes only this run's. The session owns `dir` while it lives
  /// (checkpoint::DirectoryClaim: a second run on it is refused, naming the owner).
  bool start_over = false;
};

/// "non_finite": what a step does with a NaN or an infinity. A float input or target holding
/// one (checked before the forward), a non-finite loss or gradient (after the backward: one
/// all-reduce of two numbers over the ranks) makes the step skipped on every rank: nothing is
/// applied, the step count and the schedule do not advance, and it is counted
/// (Session::skipped_steps). Initial weights, imported weights and checkpoints holding one are
/// refused. With the optimizer inside backward a bad gradient is already applied when found:
/// the run stops (an InvalidArgument naming the step and rank; resume from a checkpoint).
struct NonFiniteSpec {
  /// skip: a bad step is skipped (rank 0 prints a line) and training goes on, until more than
  /// max_skipped steps were skipped; stop: the first bad step is an InvalidArgument on every
  /// rank naming the step, the rank and what held the value (input or target i, the loss,
  /// the gradients).
  std::string policy = "skip";
  int max_skipped = 10;
};

struct Config {
  std::string source;  // the file name (or "<string>") errors name
  ModelSpec model;
  std::string loss = "mse";  // mse | l1 | smooth_l1 | cross_entropy | next_token (gpt)
  OptimizerSpec optimizer;
  ScheduleSpec lr_schedule;
  double grad_clip = 0.0;  // max global gradient norm; 0: off
  /// Micro-batches per step (gradient accumulation): each rank's batch is split along its
  /// first dim into this many and their gradients summed before one reduce-scatter; the loss
  /// is their mean (the same step as the whole batch when they divide it evenly).
  int accumulation = 1;
  NonFiniteSpec non_finite;
  DType dtype = DType::f32;                        // the parameters' (f32 | f64)
  std::optional<DType> param_dtype, reduce_dtype;  // mixed precision (FSDP2's policy)
  ShardingSpec sharding;
  MemorySpec memory;
  CheckpointSpec checkpoint;
  std::uint64_t seed = 0;
  int threads = 0;  // LibTorch intra-op threads; 0: the launcher's cores
  /// How a program's user sets a key, where it is not the configuration file: "--resume" for
  /// "checkpoint.resume" (fullshard-train's options); messages that name or advise a setting
  /// name it so (name_of(), setting()). Not part of the JSON form nor of what the ranks
  /// compare.
  std::map<std::string, std::string> option_names;
  /// option_names' entry for `key`, or `key`.
  std::string name_of(const std::string& key) const;
  /// `key` set as the user would write it: option_names' entry followed by `option_value`
  /// ("--non-finite stop"), or the JSON form with `json_value` ("\"non_finite\":
  /// {\"policy\": \"stop\"}").
  std::string setting(const std::string& key, const std::string& json_value,
                      const std::string& option_value = {}) const;
  /// Every value read, as "key = value" in a fixed order (defaults included): what the ranks
  /// compare before they build the model (parse_config fills it; canonical_lines computes it).
  std::vector<std::string> canonical;
};

/// Parses `text` (JSON) from `source`. ConfigError "<source>: <key>: <problem>".
Config parse_config(const std::string& text, const std::string& source);

/// Reads and parses the file at `path` (ConfigError naming it when it cannot be read).
Config read_config(const std::string& path);

/// Reads the configuration file at `path` on every rank of `mesh` and agrees on it: a file one
/// rank cannot read, or reads differently, is a ConfigError (RankMismatch naming the rank and
/// the first differing key) on every rank instead of a hang. Collective.
Config read_config(const DeviceMesh& mesh, const std::string& path);
/// The same for configuration text (`source` names it in messages); `read_error`: this rank
/// could not read it (the rank still joins the agreement, so that every rank reports it).
Config parse_config(const DeviceMesh& mesh, const std::string& text, const std::string& source,
                    std::string read_error = {});

/// The configuration as the JSON file would state it (every key, defaults included), as text
/// (`indent` < 0: on one line): parse_config(to_json(c), ...) gives `c` back.
std::string to_json(const Config& c, int indent = -1);

/// Checks `c` as parse_config checks a file (ranges, combinations; ConfigError naming the
/// key, with c.source as the source) and returns its "key = value" lines.
std::vector<std::string> canonical_lines(const Config& c);

}  // namespace fullshard::session
