// safetensors files (https://github.com/huggingface/safetensors): the weight exchange format
// every framework reads. Layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON
// mapping each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative
// to the byte after the header) plus an optional "__metadata__" map of strings, then the raw
// little-endian bytes, every byte of that region belonging to exactly one tensor.
//
//   SafetensorsReader r("model.safetensors");          // parses and checks the header only
//   const auto& t = r.tensor("layers.0.w");
//   r.read_rows(t, first_row, rows, dst);              // pread of exactly those bytes
//
//   SafetensorsWriter w("out.safetensors", {{"w", DType::f32, {4, 3}}}, {{"format", "pt"}});
//   w.write("w", data, 48);                            // any order, in pieces
//   w.commit();                                        // fsync + rename: visible only now
//
// Plus conversion to and from fullshard checkpoints (streamed: a model larger than memory
// converts) and loading into a fully_shard'ed model, each rank reading only its shards' bytes.
// Format details and the checks: docs/checkpoint-format.md, "safetensors".
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/base/dtype.hpp"
#include "fullshard/checkpoint/format.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/tensor/shape.hpp"

namespace fullshard::checkpoint {

// Opaque: an open file of a checkpoint (lib/checkpoint/io.hpp).
class File;

/// The safetensors dtype name of a fullshard dtype: "F32", "F64", "F16", "BF16".
const char* safetensors_dtype_name(DType t) noexcept;

/// Limits a reader enforces before it allocates anything for the header.
struct SafetensorsLimits {
  /// Largest header accepted (the reference implementation's limit: 100 MB).
  std::uint64_t max_header_bytes = 100'000'000;
  /// Deepest JSON nesting accepted (a valid header needs 3: root, tensor, shape).
  int max_depth = 16;
};

/// One tensor of a safetensors file.
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;  ///< may be empty (a 0-d scalar)
  /// [begin, end) relative to the start of the data region (SafetensorsReader::data_offset()).
  std::uint64_t begin = 0;
  std::uint64_t end = 0;

  std::uint64_t bytes() const noexcept { return end - begin; }
};

/// Reads a safetensors file. The constructor reads the 8-byte length and the header (nothing
/// else) and checks it completely; every refusal is an InvalidArgument naming the file and,
/// where there is one, the tensor: a file shorter than its header length says, a header larger
/// than the limit, not UTF-8, invalid JSON, nested deeper than the limit, a duplicate name, an
/// entry without dtype/shape/data_offsets or with the wrong types, an unknown or unsupported
/// dtype (fullshard holds F32, F64, F16, BF16), a shape whose element count overflows or whose
/// bytes differ from its offsets, offsets beyond the data region, two tensors overlapping, a
/// hole between tensors, data not reaching the end of the file. Tensor data are then read with
/// pread, only the bytes asked for. Not thread-safe; no MPI.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path, const SafetensorsLimits& limits = {});
  ~SafetensorsReader();
  SafetensorsReader(SafetensorsReader&&) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&&) noexcept;

  const std::string& path() const noexcept { return path_; }
  /// Tensors in file order (increasing offsets; equal offsets: in name order).
  const std::vector<SafetensorsTensor>& tensors() const noexcept { return tensors_; }
  /// The tensor called `name`, or nullptr.
  const SafetensorsTensor* find(const std::string& name) const noexcept;
  /// The tensor called `name`; InvalidArgument naming the file when there is none.
  const SafetensorsTensor& tensor(const std::string& name) const;
  /// The header's "__metadata__" (empty when absent).
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  /// File offset of the data region (8 + header length): tensor t's bytes are at
  /// [data_offset() + t.begin, data_offset() + t.end) of the file, e.g. for mmap.
  std::uint64_t data_offset() const noexcept { return data_offset_; }
  /// Size of the file in bytes.
  std::uint64_t file_bytes() const noexcept { return file_bytes_; }

  /// Reads bytes [offset, offset + n) of tensor t's data into dst.
  void read_bytes(const SafetensorsTensor& t, std::uint64_t offset, std::uint64_t n, void* dst);
  /// Reads the whole tensor.
  void read(const SafetensorsTensor& t, void* dst);
  /// Reads rows [first, first + rows) along dim 0 (one contiguous byte range).
  void read_rows(const SafetensorsTensor& t, std::int64_t first, std::int64_t rows, void* dst);
  /// Reads the box [offset, offset + shape) (row-major into dst): one pread per contiguous run
  /// of the box, runs close together read as one window.
  void read_box(const SafetensorsTensor& t, const std::vector<std::int64_t>& offset,
                const Shape& shape, void* dst);
  /// Bytes read from the file so far (the header included).
  std::uint64_t bytes_read() const noexcept { return bytes_read_; }

 private:
  std::string path_;
  std::unique_ptr<File> file_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::size_t> by_name_;
  std::map<std::string, std::string> metadata_;
  std::uint64_t data_offset_ = 0;
  std::uint64_t file_bytes_ = 0;
  std::uint64_t bytes_read_ = 0;
};

/// A tensor to write: its name, dtype and shape.
struct SafetensorsSpec {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
};

/// Writes a safetensors file atomically: the constructor lays the tensors out as the reference
/// writer (the Python package) does — sorted by dtype alignment, largest first (F64, F32, BF16,
/// F16), then by name, back to back, the header padded with spaces to a multiple of 8 bytes, so
/// every tensor starts at a multiple of its element size — and writes the header to PATH.tmp.
/// write() then streams each tensor's bytes, in any tensor order and in pieces; commit() checks
/// that every tensor is complete, fsyncs, renames to PATH and fsyncs the directory. Destroyed
/// without commit() (an error), the temporary file is removed and PATH is untouched.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<SafetensorsSpec> tensors,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  /// The layout, in file order.
  const std::vector<SafetensorsTensor>& tensors() const noexcept { return layout_; }
  /// Appends the next n bytes of tensor `name` (its bytes arrive in order; tensors in any order).
  void write(const std::string& name, const void* data, std::uint64_t n);
  /// Completes the file (see above); InvalidArgument naming a tensor not completely written.
  void commit();
  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_, tmp_;
  std::unique_ptr<File> file_;
  std::vector<SafetensorsTensor> layout_;
  std::map<std::string, std::size_t> by_name_;
  std::vector<std::uint64_t> written_;
  std::uint64_t data_offset_ = 0;
  bool committed_ = false;
};

struct ToSafetensorsOptions {
  /// Also write the optimizer state (tensors "<fqn>.<state>", f32) to this second file; empty:
  /// model only.
  std::string optimizer_path;
  /// Most bytes of a tensor held in memory at once (a larger tensor is streamed in pieces).
  std::uint64_t chunk_bytes = std::uint64_t{64} << 20;
};

/// Writes the parameters of the fullshard checkpoint at `src` (a root or step directory, any
/// kind) as one safetensors file at `dst`, FQNs as names, metadata {"format": "pt",
/// "fullshard.step", "fullshard.model_fingerprint", "fullshard.source"}. Streams tensor by
/// tensor, shard by shard, at most chunk_bytes at a time; verifies every checksum it reads.
void checkpoint_to_safetensors(const std::string& src, const std::string& dst,
                               const ToSafetensorsOptions& options = {});

struct FromSafetensorsOptions {
  /// Kind::full: one model.bin; Kind::sharded: `shards` files, every tensor split along dim 0
  /// (torch.chunk).
  Kind kind = Kind::full;
  int shards = 1;
  std::uint64_t block_bytes = kDefaultBlockBytes;
  std::int64_t step = 0;
  /// When not null: the model the file must match, every parameter (name, shape, dtype) present
  /// and nothing else (InvalidArgument naming the file and the tensor).
  graph::Module* expect = nullptr;
  std::uint64_t chunk_bytes = std::uint64_t{64} << 20;
};

/// Makes a fullshard checkpoint (parameters only, no optimizer state) in the root `dst` from the
/// safetensors file `src`, committed atomically like a save. Returns the step directory. The
/// file's metadata goes into the index's metadata ("safetensors_metadata"). Streams.
std::string safetensors_to_checkpoint(const std::string& src, const std::string& dst,
                                      const FromSafetensorsOptions& options = {});

struct SafetensorsLoadOptions {
  SafetensorsLimits limits;
  /// A tensor whose dtype differs from its parameter's: converted (through double, rounding to
  /// nearest even when narrowing, e.g. F32 into a bf16 parameter) when true, refused when false.
  bool cast = false;
};

/// What load_safetensors read.
struct SafetensorsLoaded {
  std::size_t tensors = 0;
  /// Tensors converted to their parameter's dtype (SafetensorsLoadOptions::cast).
  std::size_t cast = 0;
  /// Bytes this rank read from the file (its shards' bytes plus the header).
  std::uint64_t bytes_read = 0;
  std::map<std::string, std::string> metadata;
};

/// Loads the parameters of `model` (FQNs relative to it; fully_shard'ed or not) from the
/// safetensors file at `path`: every rank reads the header, checks it against the model (every
/// parameter present with its shape and dtype, unless options.cast, no other tensor) and then
/// reads only the byte ranges of its own shards (its dim-0 rows of a Shard(0) parameter: one
/// pread), into staging tensors that load_sharded_state_dict copies in once everything was
/// read. Nothing in the model changes on error. Not collective: every rank checks the same
/// header, so a bad file or a mismatch is refused on every rank alike (InvalidArgument naming
/// the file and the tensor); an I/O error while reading a rank's own bytes is thrown on that
/// rank only. Call with every group sharded (outside forward/backward).
SafetensorsLoaded load_safetensors(const std::string& path, graph::Module& model,
                                   const SafetensorsLoadOptions& options = {});

}  // namespace fullshard::checkpoint
