// POSIX file plumbing of the checkpoint layer (private to lib/checkpoint): RAII descriptors
// with full writes and reads, fsync of files and directories, the atomic step-directory
// protocol, the data-file writer with per-block CRC32C, and fault injection for tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fullshard/checkpoint/format.hpp"

namespace fullshard::checkpoint::detail {

/// An open file descriptor, closed on destruction. Errors are Error naming the path and errno.
class File {
 public:
  File() = default;
  /// Opens for reading; returns an invalid File when the path does not exist (ENOENT).
  static File open_read(const std::string& path);
  /// Creates (truncating) for writing, mode 0644.
  static File create(const std::string& path);
  ~File();
  File(File&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
  File& operator=(File&& o) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  bool valid() const noexcept { return fd_ >= 0; }
  const std::string& path() const noexcept { return path_; }
  std::uint64_t size() const;
  void write_all(const void* data, std::uint64_t n);
  /// Reads n bytes at `offset`; returns the bytes actually read (less only at end of file).
  std::uint64_t pread_all(void* data, std::uint64_t n, std::uint64_t offset) const;
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

std::string join(const std::string& dir, const std::string& name);
/// fsync of a directory, so that renames and creations inside it are durable.
void fsync_dir(const std::string& dir);
void rename_path(const std::string& from, const std::string& to);
/// Whole file as a string; Error naming the path when it cannot be read.
std::string read_text(const std::string& path);
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
};

/// Writes a data file sequentially, computing each shard's per-block CRC32C on the bytes it
/// writes (no second pass). `mid_shard` faults exit halfway through the first shard.
class DataFileWriter {
 public:
  DataFileWriter(std::string path, std::uint64_t block_bytes, const Fault& fault);
  /// Appends one shard's bytes; fills offset, length and crc32c of `shard`.
  void append(const void* data, std::uint64_t n, ShardInfo& shard);
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

/// The temporary directory of a save in progress: root/.tmp-step-XXXXXXXX.
struct PendingStep {
  std::string root;
  std::string tmp;
  std::int64_t step = 0;
};

/// Creates `root` if needed, removes what an interrupted save left (.tmp-* directories,
/// latest.tmp) and creates the step's temporary directory. One saver per root at a time.
PendingStep begin_step(const std::string& root, std::int64_t step);
/// Commits a step whose data files are written and fsync'd in p.tmp: fsync p.tmp; index.json
/// (temporary name, fsync, rename, fsync p.tmp); rename p.tmp to root/step-XXXXXXXX (or
/// step-XXXXXXXX.N when that name exists); fsync root; `latest` (temporary name, fsync, rename,
/// fsync root). Returns the step directory.
std::string commit_step(const PendingStep& p, const std::string& index_text, const Fault& fault);
/// Removes the temporary directory of a failed save (best effort).
void abandon_step(const PendingStep& p) noexcept;

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
/// (global coordinates) from one to the other, in increasing src (and dst) order; empty when
/// they do not intersect. Trailing dims both boxes span fully are merged into one run.
std::vector<Run> box_runs(const std::vector<std::int64_t>& src_off, const Shape& src_shape,
                          const std::vector<std::int64_t>& dst_off, const Shape& dst_shape,
                          std::size_t elem_bytes);

}  // namespace fullshard::checkpoint::detail
