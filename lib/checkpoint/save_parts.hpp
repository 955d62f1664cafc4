// The steps of a save (private to lib/checkpoint), shared by the synchronous save() and the
// asynchronous save_async(): prepare (checks, the tensors, the index), start (the temporary
// step directory), write (each writer's data file), commit (rank 0's index, renames and
// `latest`) and retention. prepare, start and commit are collective over the save's Comm;
// write_shards touches no MPI and no model memory beyond what host_of returns, so a
// background thread may run it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/tensor/sharding.hpp"
#include "fullshard/tensor/tensor.hpp"
#include "lib/checkpoint/collective.hpp"
#include "lib/checkpoint/io.hpp"

namespace fullshard::checkpoint::detail {

/// The mesh the model is sharded over: every fully_shard'ed module of it must use the same
/// (InvalidArgument naming two modules that differ, or saying that none is sharded).
const DeviceMesh& model_mesh(graph::Module& model, const char* what);

/// One tensor to save: a parameter or an optimizer state, with this rank's shard.
struct SaveEntry {
  TensorInfo info;  // name, param, state, dtype, global shape, placement (no shards)
  Tensor local;
  ShardLayout layout;
};

/// What prepare_save agreed on.
struct SaveSetup {
  std::vector<SaveEntry> entries;
  Index index;  // every field but the files and shards
  Fault fault;
};

/// Checks the arguments, collects the tensors and builds the index; a failure on any rank is
/// thrown on every rank.
SaveSetup prepare_save(Comm& c, const DeviceMesh& mesh, graph::Module& model,
                       const optim::Optimizer* optimizer, std::int64_t step,
                       const std::string& metadata, const std::string& rng_state,
                       const SaveOptions& options);

/// The tensors a save of `model` (and `optimizer`'s state, where it exists) writes, in file
/// order, each with its shard on this rank. With `future_state`, also the optimizer state its
/// first step will make (f32, the parameter's layout), each without a tensor.
std::vector<SaveEntry> collect_entries(graph::Module& model, const optim::Optimizer* optimizer,
                                       bool future_state);

/// Rank 0 creates the temporary step directory (cleaning what interrupted saves left); every
/// rank learns it.
PendingStep start_save(Comm& c, const std::string& dir, std::int64_t step,
                       const SaveOptions& options);

/// agree(), and on failure rank 0 removes the temporary directory first.
void agree_or_abandon(Comm& c, const std::exception_ptr& err, const PendingStep& p);

/// Whether this rank writes a data file in a sharded save (replicate coordinate 0 under HSDP:
/// the other replicas hold copies).
bool is_writer(const DeviceMesh& mesh);
/// The entries a writer writes, in order: its nonempty shards (replicated tensors: rank 0's).
std::vector<const SaveEntry*> entries_to_write(const DeviceMesh& mesh,
                                               const std::vector<SaveEntry>& entries);
/// The data file of the writer with this shard coordinate: rank-XXXXX.bin.
std::string rank_file(int shard_rank);

/// Writes `entries` (host_of gives each one's host bytes) to tmp/file with per-block
/// checksums and fsyncs it; returns the writer's record for commit_sharded.
std::string write_shards(const std::vector<const SaveEntry*>& entries, const std::string& file,
                         std::uint64_t block_bytes, const std::string& tmp, const Fault& fault,
                         const std::function<const void*(const SaveEntry&)>& host_of);

/// write_shards for shards that lie back to back in one buffer, the data file's image (`image`,
/// n bytes, aligned to kDirectAlign; each entry's `local` a view of it, in file order):
/// checksums every block, then writes the image at once (write_file_image: O_DIRECT where it
/// can). The same file and record as write_shards.
/// `block_crcs[i]`, when not empty, holds entry i's block checksums (computed as it was
/// copied into the image): not computed again.
std::string write_image(const std::vector<SaveEntry>& entries,
                        const std::vector<std::vector<std::uint32_t>>& block_crcs,
                        const char* image, std::uint64_t n, const std::string& file,
                        std::uint64_t block_bytes, const std::string& tmp, const Fault& fault);

/// Gathers every writer's record (empty for non-writers) on rank 0, which completes the index,
/// checks it as a loader would and commits the step; every rank learns the step directory.
std::string commit_sharded(Comm& c, const std::string& record, Index& index,
                           const PendingStep& pending, const Fault& fault);

/// Retention once `latest` names the new checkpoint (SaveOptions::keep_last): rank 0 deletes
/// the older step directories, warning about those it cannot.
void apply_retention(Comm& c, const std::string& dir, const SaveOptions& options);

/// Completes the asynchronous save in flight, if any (collective over the mesh it was started
/// on; throws its error on every rank): every save waits for the one before it.
void complete_async_save();

/// Asks Linux for transparent huge pages for fresh host memory about to be filled (fewer page
/// faults on first touch). Advisory.
void advise_huge_pages(const Tensor& t) noexcept;

}  // namespace fullshard::checkpoint::detail
