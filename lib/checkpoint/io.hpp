// POSIX file plumbing of the checkpoint layer (private to lib/checkpoint): RAII descriptors
// with full writes and reads, fsync of files and directories, the atomic step-directory
// protocol, the data-file writer with per-block CRC32C, and fault injection for tests.
#pragma once

#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "fullshard/checkpoint/format.hpp"

namespace fullshard::checkpoint::detail {

/// Allocator whose value-less construct() default-initialises: resize() of a vector of bytes
/// leaves them uninitialised instead of zero-filling memory about to be overwritten.
template <class T>
struct UninitAllocator : std::allocator<T> {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() noexcept = default;
  template <class U>
  UninitAllocator(const UninitAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible<U>::value) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
/// A byte buffer that grows without zero-filling.
using ByteBuffer = std::vector<char, UninitAllocator<char>>;

}  // namespace fullshard::checkpoint::detail

namespace fullshard::checkpoint {

// Opaque in the public headers (format.hpp, safetensors.hpp): an open file of a checkpoint.
/// An open file descriptor, closed on destruction. Errors are Error naming the path and errno,
/// and the tensor when the caller passes one.
class File {
 public:
  File() = default;
  /// Opens a regular file for reading; returns an invalid File when the path does not exist
  /// (ENOENT). Anything else in its place (a FIFO, a directory, a device) is an
  /// InvalidArgument naming the path and `tensor` (if not empty), and is never opened
  /// blocking (a FIFO would block forever).
  static File open_read(const std::string& path, const std::string& tensor = {});
  /// Creates (truncating) for writing, mode 0644.
  static File create(const std::string& path);
  ~File();
  File(File&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
  File& operator=(File&& o) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  bool valid() const noexcept { return fd_ >= 0; }
  int descriptor() const noexcept { return fd_; }
  const std::string& path() const noexcept { return path_; }
  std::uint64_t size() const;
  /// Writes n bytes; `tensor` (if not empty) is named in the error message.
  void write_all(const void* data, std::uint64_t n, const std::string& tensor = {});
  /// Writes n bytes at `offset` (pwrite; the file position is unchanged).
  void pwrite_all(const void* data, std::uint64_t n, std::uint64_t offset,
                  const std::string& tensor = {});
  /// Reads n bytes at `offset`; returns the bytes actually read (less only at end of file).
  std::uint64_t pread_all(void* data, std::uint64_t n, std::uint64_t offset,
                          const std::string& tensor = {}) const;
  /// Starts writeback of [offset, offset + n) without waiting (Linux sync_file_range; nothing
  /// elsewhere), so that the disk writes while the next chunk is checksummed and copied, and
  /// the final fsync has less left to do.
  void start_writeback(std::uint64_t offset, std::uint64_t n) const noexcept;
  void sync();
  /// Closes, reporting a close error (a deferred write error on some file systems).
  void close();

 private:
  int fd_ = -1;
  std::string path_;
};

}  // namespace fullshard::checkpoint

namespace fullshard::checkpoint::detail {

std::string join(const std::string& dir, const std::string& name);
/// fsync of a directory, so that renames and creations inside it are durable.
void fsync_dir(const std::string& dir);
void rename_path(const std::string& from, const std::string& to);
/// Whole file as a string; Error naming the path when it cannot be read.
std::string read_text(const std::string& path);
/// The step directory `path` designates (itself, or the one `latest` names) without reading
/// its index: resolve_step_dir minus the checksum check, for callers that read the index next.
std::string find_step_dir(const std::string& path);
bool exists(const std::string& path) noexcept;
/// Removes a file or a directory tree; errors ignored (clean-up paths).
void remove_quietly(const std::string& path) noexcept;

/// FULLSHARD_CKPT_FAULT: a named point of the save protocol at which the process exits with
/// std::_Exit(kFaultExitCode) (simulating a kill), on every rank or on one world rank.
constexpr int kFaultExitCode = 41;
struct Fault {
  std::string point;  // empty: none
  int rank = -1;      // world rank, -1: every rank
  /// From the environment; ConfigError for a bad value.
  static Fault from_environment();
  /// Exits the process if this is the configured point (and rank).
  void maybe_exit(const char* here) const;
  bool armed(const char* here) const;
  /// Throws Error (an injected failure) if this is the configured point (and rank).
  void maybe_throw(const char* here) const;
};

/// Writes a data file sequentially, computing each shard's per-block CRC32C on the bytes it
/// writes (no second pass). `mid_shard` faults exit halfway through the first shard.
class DataFileWriter {
 public:
  DataFileWriter(std::string path, std::uint64_t block_bytes, const Fault& fault);
  /// Appends one shard of `tensor` (named in errors); fills offset, length and crc32c of
  /// `shard`.
  void append(const void* data, std::uint64_t n, ShardInfo& shard, const std::string& tensor);
  /// fsync and close.
  void finish();
  std::uint64_t bytes() const noexcept { return bytes_; }
  const std::string& path() const noexcept { return file_.path(); }

 private:
  File file_;
  std::uint64_t block_;
  std::uint64_t chunk_;
  const Fault& fault_;
  std::uint64_t bytes_ = 0;
};

/// Alignment of the buffer, file offsets and lengths of direct (O_DIRECT) writes.
constexpr std::uint64_t kDirectAlign = 4096;

/// Writes the n bytes at `data` (aligned to kDirectAlign) as the file `path` and fsyncs it:
/// with O_DIRECT where the file system takes it (the device reads the buffer itself: no copy
/// into the page cache and hardly any CPU, which a background writer sharing cores with
/// training needs), else buffered with early writeback as DataFileWriter. Bytes past the last
/// aligned block are written buffered. A `mid_shard` fault writes half of them and exits.
void write_file_image(const std::string& path, const char* data, std::uint64_t n,
                      const Fault& fault);

/// The temporary directory of a save in progress: root/.tmp-step-XXXXXXXX.
struct PendingStep {
  std::string root;
  std::string tmp;
  std::int64_t step = 0;
};

/// Creates `root` if needed (fsync'ing the parent of every directory it creates), removes what
/// an interrupted save left (.tmp-* directories, latest.tmp) and creates the step's temporary
/// directory. One saver per root at a time.
PendingStep begin_step(const std::string& root, std::int64_t step);
/// Commits a step whose data files are written and fsync'd in p.tmp: index.json.crc32c (the
/// checksum of the index text; temporary name, fsync, rename); index.json (temporary name,
/// fsync, rename, fsync p.tmp); rename p.tmp to root/step-XXXXXXXX (or step-XXXXXXXX.N when
/// that name exists); fsync root; `latest` (temporary name, fsync, rename, fsync root).
/// Returns the step directory.
std::string commit_step(const PendingStep& p, const std::string& index_text, const Fault& fault);
/// The content of index.json.crc32c for an index text: "crc32c XXXXXXXX bytes N\n".
std::string index_checksum_text(const std::string& index_text);
/// Removes the temporary directory of a failed save (best effort).
void abandon_step(const PendingStep& p) noexcept;
/// Retention (SaveOptions::keep_last): deletes the committed step directories of `root` (a
/// step-XXXXXXXX[.N] directory holding an index) beyond the `keep_last` most recently
/// committed (by their index's modification time, newest first), never the one root/latest
/// names nor those in `keep`; with `lineage`, only those whose index names one of these runs
/// (saved_by.run: another run's checkpoints are not counted and never deleted). Returns a
/// message per directory it could not delete.
std::vector<std::string> prune_steps(const std::string& root, int keep_last,
                                     const std::vector<std::string>& keep,
                                     const std::vector<std::string>* lineage = nullptr);

/// The byte offset of the first '[' or '{' of `text` (JSON) nested deeper than `max_depth`,
/// or npos (strings skipped; linear, constant stack; a syntax error is left to the parser).
std::size_t json_depth_exceeded(const std::string& text, std::size_t max_depth) noexcept;

std::string hex_encode(const std::string& bytes);
/// InvalidArgument naming `what` on a bad hex string.
std::string hex_decode(const std::string& hex, const std::string& what);

/// One contiguous piece of a box copy: `len` bytes at byte `src` of the source box's row-major
/// storage go to byte `dst` of the destination's.
struct Run {
  std::uint64_t src;
  std::uint64_t dst;
  std::uint64_t len;
};

/// The runs copying the intersection of boxes (src_off, src_shape) and (dst_off, dst_shape)
/// (global coordinates) from one to the other, generated one at a time in increasing src (and
/// dst) order: a Shard(1) box of a tall tensor has a run per row, never held all at once.
/// Trailing dims both boxes span fully are merged into one run.
class BoxRuns {
 public:
  BoxRuns(const std::vector<std::int64_t>& src_off, const Shape& src_shape,
          const std::vector<std::int64_t>& dst_off, const Shape& dst_shape, std::size_t elem_bytes);
  /// No run left (from the start when the boxes do not intersect).
  bool done() const noexcept { return left_ == 0; }
  /// The current run (not done()).
  const Run& run() const noexcept { return run_; }
  void next() noexcept;
  /// Number of runs in all.
  std::uint64_t count() const noexcept { return count_; }
  /// First source byte not copied yet (within the current run).
  std::uint64_t pending() const noexcept { return run_.src + copied_; }
  /// Copies what the runs hold of source bytes [lo, hi), which `window` holds (source byte lo
  /// at window[0]), to `dst` (the destination box's storage), and moves past everything before
  /// hi. Windows come in increasing order, none starting after pending(). A null `window` only
  /// moves on (the bytes were read straight into place).
  void copy(const char* window, std::uint64_t lo, std::uint64_t hi, char* dst) noexcept;

 private:
  std::vector<std::int64_t> idx_, ext_;       // position in, and extent of, dims [0, k)
  std::vector<std::uint64_t> sstep_, dstep_;  // bytes per step of those dims
  Run run_{0, 0, 0};
  std::uint64_t count_ = 0;
  std::uint64_t left_ = 0;    // runs left, the current one included
  std::uint64_t copied_ = 0;  // bytes of the current run already copied
};

/// Every run of BoxRuns in a vector (for small boxes and tests).
std::vector<Run> box_runs(const std::vector<std::int64_t>& src_off, const Shape& src_shape,
                          const std::vector<std::int64_t>& dst_off, const Shape& dst_shape,
                          std::size_t elem_bytes);

}  // namespace fullshard::checkpoint::detail
