// The checkpoint format (docs/checkpoint-format.md) and what works on it without MPI or a
// model: reading and checking an index, reading any box of a saved tensor (verified block by
// block), verifying a whole checkpoint, converting between sharded and full. fullshard-ckpt is
// a thin command line over these functions.
//
// A checkpoint root directory holds step directories (step-00000010/, ...) and a `latest`
// file naming the newest complete one. A step directory holds the data files and index.json,
// which describes every tensor: FQN, dtype, global shape, placement, and its shards (file,
// byte offset, length, global offset, shape, and one CRC32C per block of `block_bytes`).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/tensor/placement.hpp"
#include "fullshard/tensor/shape.hpp"

namespace fullshard::checkpoint {

// Opaque: an open file of a checkpoint (lib/checkpoint/io.hpp).
class File;

/// The version this build writes and the only one it reads.
constexpr int kFormatVersion = 1;
/// Default checksum block: a reader that needs part of a shard reads (and verifies) the blocks
/// covering it.
constexpr std::uint64_t kDefaultBlockBytes = std::uint64_t{1} << 20;
/// The largest block a checkpoint may use (a reader holds a block's bytes at once).
constexpr std::uint64_t kMaxBlockBytes = std::uint64_t{1} << 30;
/// The deepest nesting of arrays and objects in the caller's metadata: save refuses deeper
/// metadata, and a reader refuses an index text nested deeper than kMaxIndexDepth (checked
/// on the text before it is parsed, in linear time and constant stack).
constexpr std::size_t kMaxMetadataDepth = 256;
constexpr std::size_t kMaxIndexDepth = kMaxMetadataDepth + 1;
/// The most non-empty shards of one tensor whose boxes are not slabs along one dim (what
/// fullshard writes are slabs, checked in n log n); other layouts are checked pairwise.
constexpr std::size_t kMaxNonSlabShards = 16384;

/// The index of a step directory, and the file holding the CRC32C of its text (written before
/// it; a reader refuses an index that does not match it).
constexpr const char* kIndexFile = "index.json";
constexpr const char* kIndexChecksumFile = "index.json.crc32c";

/// Sharded: one data file per writing rank (rank-00000.bin, ...). Full: one file (model.bin),
/// one shard per tensor, written by rank 0.
enum class Kind { sharded, full };
const char* kind_name(Kind k) noexcept;

/// One saved piece of a tensor: a box of the global tensor stored row-major at
/// [offset, offset + length) of a data file.
struct ShardInfo {
  std::size_t file = 0;  ///< index into Index::files
  std::uint64_t offset = 0;
  std::uint64_t length = 0;  ///< numel(shape) * dtype size
  std::vector<std::int64_t> global_offset;
  Shape shape;
  /// CRC32C of each block_bytes-long block of the shard's bytes (the last may be shorter).
  std::vector<std::uint32_t> crc32c;
};

struct TensorInfo {
  /// "l0.w" for a parameter, "l0.w.exp_avg" for an optimizer state of l0.w.
  std::string name;
  /// The parameter's FQN (== name for a parameter).
  std::string param;
  /// The optimizer state's name ("exp_avg"); empty for a parameter.
  std::string state;
  DType dtype = DType::f32;
  Shape global_shape;
  /// How the saving model held it (Shard(d) or Replicate()); convert --to sharded uses it.
  Placement placement = Placement::Shard(0);
  std::vector<ShardInfo> shards;

  bool is_param() const noexcept { return state.empty(); }
  std::uint64_t bytes() const noexcept {
    return static_cast<std::uint64_t>(numel(global_shape)) * dtype_size(dtype);
  }
};

struct FileInfo {
  std::string name;  ///< plain file name inside the step directory
  std::uint64_t bytes = 0;
};

struct Index {
  int format_version = kFormatVersion;
  Kind kind = Kind::sharded;
  /// The training step the checkpoint was saved at (the caller's number).
  std::int64_t step = 0;
  /// model_fingerprint() of the saving model's parameters.
  std::string model_fingerprint;
  std::uint64_t block_bytes = kDefaultBlockBytes;
  /// The caller's metadata: the text of any JSON document, compact.
  std::string metadata = "{}";
  /// The caller's RNG state bytes (stored as hex).
  std::string rng_state;
  /// Optimizer: saved or not, its step count and its state names.
  bool has_optimizer = false;
  std::int64_t optimizer_step = 0;
  std::vector<std::string> optimizer_state_names;
  /// Where it was saved, as JSON text: {"world_size": W, "mesh_shape": [...], "mesh_names":
  /// [...]}, the saving run and its lineage when claimed (informational).
  std::string saved_by = "{}";
  std::vector<FileInfo> files;
  std::vector<TensorInfo> tensors;

  /// The tensor called `name`, or nullptr.
  const TensorInfo* find(const std::string& name) const noexcept;
};

/// Fingerprint of a model's parameters: FNV-1a 64 of "fqn dtype shape" lines sorted by FQN, as
/// 16 hex digits. `params` maps FQN to (dtype, global shape).
std::string model_fingerprint(const std::map<std::string, std::pair<DType, Shape>>& params);
/// The same for the parameter tensors of an index.
std::string model_fingerprint(const Index& index);

/// Checks every field of an index against the others, with overflow-checked arithmetic,
/// before anything uses them: format version; block_bytes in [1, kMaxBlockBytes]; file names
/// plain and distinct; per tensor a known dtype, a non-empty shape whose byte size fits in
/// int64, a placement dim it has; per shard a file that exists, global_offset and shape with
/// the tensor's dims and the box inside the tensor, length = elements x dtype size, [offset,
/// offset + length) inside its file, one CRC per block (ceil(length / block_bytes)); the
/// shards of each tensor tiling it exactly (no overlap, no gap); optimizer states of
/// parameters that are present. InvalidArgument naming `where` (the index file) and the
/// tensor.
void validate_index(const Index& index, const std::string& where);
/// Parses an index text (types field by field) and validates it (validate_index); a syntax error
/// names `where` and the byte, and so does a text nested deeper than kMaxIndexDepth (refused before
/// it is parsed).
Index parse_index(const std::string& text, const std::string& where);

/// The step directory a path designates: `path` itself when it holds index.json, else the
/// directory named by path/latest. InvalidArgument when neither exists (naming the path), or
/// when its index does not match its checksum (read_index_text).
std::string resolve_step_dir(const std::string& path);
/// The text of step_dir/index.json, checked against the CRC32C in step_dir/index.json.crc32c
/// (absent in checkpoints written before it existed: then unchecked). InvalidArgument naming
/// the index file when they differ (a flipped byte anywhere in the index, metadata and step
/// included); Error when it cannot be read.
std::string read_index_text(const std::string& step_dir);

/// Reads tensors out of one step directory. Data files are opened on first use (at most 64 at
/// a time: the least recently used is closed first) and every block read is checked against
/// its CRC32C. Not thread-safe; no MPI.
class Reader {
 public:
  /// Resolves `path` (resolve_step_dir) and reads its index (read_index_text, parse_index).
  explicit Reader(const std::string& path);
  /// Uses an index already read (e.g. broadcast by rank 0) for the step directory `step_dir`;
  /// validates it again (validate_index: linear in the shards, negligible next to the reads).
  Reader(std::string step_dir, Index index);
  ~Reader();
  Reader(Reader&&) noexcept;
  Reader& operator=(Reader&&) noexcept;

  const Index& index() const noexcept { return index_; }
  const std::string& step_dir() const noexcept { return dir_; }
  /// step_dir()/index.json, as error messages name it.
  std::string index_path() const;
  /// The tensor called `name`; InvalidArgument naming the index file when there is none.
  const TensorInfo& tensor(const std::string& name) const;

  /// Reads the box [offset, offset + shape) of `t` into `dst` (row-major, numel(shape) elements
  /// of t.dtype). Reads only the checksum blocks of the saved shards that hold bytes of the box
  /// (a column slab skips the blocks between its rows), verifies each, and copies the
  /// intersections. Errors (InvalidArgument) name the file and the tensor: missing file, file
  /// shorter than the index says, checksum mismatch; an I/O error is an Error naming both.
  void read_box(const TensorInfo& t, const std::vector<std::int64_t>& offset, const Shape& shape,
                void* dst);
  /// read_box of the whole tensor.
  void read_full(const TensorInfo& t, void* dst);
  /// Re-reads shard `s` of `t` and checks every block (fullshard-ckpt verify).
  void verify_shard(const TensorInfo& t, std::size_t s);

  /// Bytes read from data files so far.
  std::uint64_t bytes_read() const noexcept { return bytes_read_; }

 private:
  const File& open_file(std::size_t i, const TensorInfo& t);
  struct Files;
  std::string dir_;
  Index index_;
  std::unique_ptr<Files> files_;
  std::uint64_t bytes_read_ = 0;
};

/// One problem found by verify().
struct VerifyIssue {
  std::string file;
  std::string tensor;
  std::string message;
};

/// Checks a checkpoint completely: the index (and its checksum), every data file's presence
/// and size, every block's checksum. Collects every problem instead of stopping at the first
/// (an index that cannot be read or parsed is one issue). Reads every byte once, file by file.
/// InvalidArgument when `path` is not a checkpoint at all (resolve_step_dir's errors).
std::vector<VerifyIssue> verify(const std::string& path);

struct ConvertOptions {
  Kind to = Kind::full;
  /// Sharded output: shards per tensor (a tensor's saved placement is kept; Replicate tensors
  /// go into rank-00000.bin). 0: the source's number of data files.
  int shards = 0;
  std::uint64_t block_bytes = kDefaultBlockBytes;
};

/// Rewrites the checkpoint at `src` (a root or step directory) as a new checkpoint in the root
/// directory `dst` (created when missing; committed atomically like a save, with `latest`).
/// Streams one tensor shard at a time; verifies everything it reads. Returns the new step
/// directory. No MPI.
std::string convert(const std::string& src, const std::string& dst, const ConvertOptions& options);

}  // namespace fullshard::checkpoint
