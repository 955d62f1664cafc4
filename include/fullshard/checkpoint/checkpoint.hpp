// Checkpoints of fully_shard'ed models: save on one mesh, load on any other (world size, FSDP
// or HSDP), atomically committed and verified. Format and protocol: docs/checkpoint-format.md.
//
//   // every rank, every N steps:
//   checkpoint::save(dir, *model, &opt, step, {{"loss", loss}}, rng_bytes);
//   // on restart (any number of ranks):
//   checkpoint::Loaded ck = checkpoint::load(dir, *model, &opt);
//   for (std::int64_t s = ck.step; s < total; ++s) ...
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fullshard/checkpoint/format.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/optim/optimizer.hpp"

namespace fullshard::checkpoint {

struct SaveOptions {
  /// sharded: every shard-group rank (replicate coordinate 0 under HSDP) writes its own shards
  /// to its own file, in parallel. full: rank 0 gathers one tensor at a time and writes one
  /// consolidated file (memory on rank 0: the largest tensor, not the model).
  Kind kind = Kind::sharded;
  /// Checksum block size (bytes > 0): the granularity at which a resharding load reads and
  /// verifies.
  std::uint64_t block_bytes = kDefaultBlockBytes;
  /// Retention: after the new checkpoint is complete and `latest` names it, rank 0 deletes
  /// the committed step directories of `dir` beyond the `keep_last` most recently committed
  /// (0, the default: keep all). Never deleted: the one `latest` names and those in `keep`.
  /// A directory that cannot be deleted is a warning, not a failed save.
  int keep_last = 0;
  /// Step directories retention never deletes (the one this job resumed from).
  std::vector<std::string> keep = {};
  /// The saving run (DirectoryClaim::apply sets it, with `lineage`): recorded in the index's
  /// `saved_by`; a directory another run's lock holds is refused. Empty: no claim.
  std::string run = {};
  /// With `run`: retention deletes only checkpoints saved by these runs (and, once recorded,
  /// passes the lineage on to the checkpoint). Empty: any checkpoint.
  std::vector<std::string> lineage = {};
};

/// Saves the model's parameters (and, with an optimizer, its state and step count), `step`,
/// `metadata` (the text of any JSON document, nested at most kMaxMetadataDepth deep; empty:
/// none, as "{}") and `rng_state` (opaque bytes; rank 0's are kept) as a new step
/// directory under `dir` (created if needed) and points dir/latest at it. Nothing is visible
/// until every file is written and fsync'd: a save interrupted at any point leaves the
/// previous checkpoint in `dir` loadable (see docs/checkpoint-format.md).
///
/// Collective over the model's mesh (the mesh of its fully_shard'ed modules, which must all
/// share one). An error on any rank (I/O, bad argument) is thrown on every rank, with the
/// failing rank's message, after the partial step directory was removed. Returns the new step
/// directory (the same on every rank). One saver per `dir` at a time.
std::string save(const std::string& dir, graph::Module& model, const optim::Optimizer* optimizer,
                 std::int64_t step, const std::string& metadata = std::string(),
                 const std::string& rng_state = std::string(), const SaveOptions& options = {});

/// What check_directory found.
struct DirectoryCheck {
  /// Bytes an unprivileged writer may still use on the directory's file system (statvfs);
  /// unset when the file system cannot tell.
  std::optional<std::uint64_t> free_bytes;
};

/// For a run given a checkpoint directory, before its first step (a bad path must not cost a
/// whole job): creates `dir` if it is missing (its parent must exist: a mistyped path is
/// refused, not created) and proves it writable on every rank of `mesh`: a probe file
/// written, fsync'd and removed. Any rank's failure is a ConfigError on every rank naming the
/// path and the reason. Collective over the mesh.
DirectoryCheck check_directory(const std::string& dir, const DeviceMesh& mesh);

/// For a run that writes the file `path` when it ends (an exported model, a trace), before its
/// first step: rank `writer` (the one that will write it) proves that it can: `path` is not a
/// directory or a special file, its directory exists and takes a new file (a probe written and
/// removed), and an existing file is writable (it stays as it is). A failure is a ConfigError
/// on every rank naming `what` (the option: "--save-to") and the path. Collective over the
/// mesh.
void check_output_file(const std::string& path, const std::string& what, const DeviceMesh& mesh,
                       int writer = 0);

/// What load() restored besides the tensors.
struct Loaded {
  std::int64_t step = 0;
  /// The saved metadata, as JSON text ("{}" when none was given, and before a load).
  std::string metadata = "{}";
  std::string rng_state;
  /// The step directory loaded from.
  std::string step_dir;
  Kind kind = Kind::sharded;
  /// Bytes this rank read from data files.
  std::uint64_t bytes_read = 0;
};

/// Loads the checkpoint at `dir` (a root written by save(), which follows dir/latest, or one
/// step directory) into the model and, when `optimizer` is not null, the optimizer, whatever
/// mesh and world size saved it: each rank reads only the checksum blocks that intersect its
/// own shards, verifies them, and assembles its shards.
///
/// Checked before anything is written: format version, the index against the model (missing
/// or unexpected parameter, wrong shape or dtype, a checkpoint of another model), files present
/// and of the right size, every checksum. Any problem on any rank is thrown on every rank
/// (InvalidArgument naming the file and the tensor) and nothing is loaded on any rank.
/// Parameters are read straight into fresh sharded storage that each group adopts once every
/// rank succeeded (no staging copy; views from an earlier sharded_state_dict keep the old
/// values); optimizer state is read into the tensors the optimizer then keeps. Collective over
/// the model's mesh. Call with every group sharded (outside forward/backward).
Loaded load(const std::string& dir, graph::Module& model, optim::Optimizer* optimizer = nullptr);

}  // namespace fullshard::checkpoint
