#include "lib/checkpoint/io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/checksum.hpp"
#include "fullshard/runtime/settings.hpp"
#include "lib/base/abort.hpp"

namespace fullshard::checkpoint::detail {

namespace fs = std::filesystem;

namespace {

[[noreturn]] void io_error(const std::string& what, const std::string& path, int err,
                           const std::string& tensor = {}) {
  throw Error("checkpoint: " + what + " '" + path + "' failed: " + std::strerror(err) +
              (tensor.empty() ? "" : " (tensor '" + tensor + "')"));
}

// Largest single read/write request (Linux transfers at most ~2 GiB per call anyway).
constexpr std::uint64_t kMaxIo = std::uint64_t{1} << 30;
// Bytes checksummed and written per write() call (rounded to whole checksum blocks).
constexpr std::uint64_t kWriteChunk = std::uint64_t{2} << 20;

}  // namespace

}  // namespace fullshard::checkpoint::detail

namespace fullshard::checkpoint {

using namespace detail;  // the I/O errors and helpers File uses

// ---- File -----------------------------------------------------------------------------------

namespace {

const char* file_kind(mode_t m) noexcept {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m) || S_ISBLK(m)) return "a device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

[[noreturn]] void not_regular(const std::string& path, mode_t m, const std::string& tensor) {
  throw InvalidArgument("checkpoint: '" + path + "' is " + file_kind(m) +
                        ", not a regular file: refused (a checkpoint holds only regular files)" +
                        (tensor.empty() ? "" : " (needed for tensor '" + tensor + "')"));
}

}  // namespace

File File::open_read(const std::string& path, const std::string& tensor) {
  File f;
  f.path_ = path;
  // Regular files only: opening a FIFO would block until a writer comes (forever), reading a
  // device or a directory makes no sense. stat first, so that no device is even opened; then
  // open without blocking and check the descriptor itself (the path may have changed since).
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return f;
    io_error("stat of", path, errno, tensor);
  }
  if (!S_ISREG(st.st_mode)) not_regular(path, st.st_mode, tensor);
  f.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (f.fd_ < 0) {
    if (errno == ENOENT) return f;
    io_error("open", path, errno, tensor);
  }
  if (::fstat(f.fd_, &st) != 0) io_error("stat of", path, errno, tensor);
  if (!S_ISREG(st.st_mode)) not_regular(path, st.st_mode, tensor);  // f closes the descriptor
  const int flags = ::fcntl(f.fd_, F_GETFL);
  if (flags < 0 || ::fcntl(f.fd_, F_SETFL, flags & ~O_NONBLOCK) != 0)
    io_error("fcntl of", path, errno, tensor);
  return f;
}

File File::create(const std::string& path) {
  File f;
  f.path_ = path;
  f.fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f.fd_ < 0) io_error("create", path, errno);
  return f;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

File& File::operator=(File&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    o.fd_ = -1;
  }
  return *this;
}

std::uint64_t File::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) io_error("stat", path_, errno);
  return static_cast<std::uint64_t>(st.st_size);
}

void File::write_all(const void* data, std::uint64_t n, const std::string& tensor) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, static_cast<std::size_t>(std::min(n, kMaxIo)));
    if (w < 0) {
      if (errno == EINTR) continue;
      io_error("write to", path_, errno, tensor);
    }
    p += w;
    n -= static_cast<std::uint64_t>(w);
  }
}

void File::pwrite_all(const void* data, std::uint64_t n, std::uint64_t offset,
                      const std::string& tensor) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w =
        ::pwrite(fd_, p, static_cast<std::size_t>(std::min(n, kMaxIo)), static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      io_error("write to", path_, errno, tensor);
    }
    p += w;
    n -= static_cast<std::uint64_t>(w);
    offset += static_cast<std::uint64_t>(w);
  }
}

std::uint64_t File::pread_all(void* data, std::uint64_t n, std::uint64_t offset,
                              const std::string& tensor) const {
  auto* p = static_cast<char*>(data);
  std::uint64_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd_, p + done, static_cast<std::size_t>(std::min(n - done, kMaxIo)),
                              static_cast<off_t>(offset + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      io_error("read from", path_, errno, tensor);
    }
    if (r == 0) break;  // end of file
    done += static_cast<std::uint64_t>(r);
  }
  return done;
}

void File::start_writeback(std::uint64_t offset, std::uint64_t n) const noexcept {
#if defined(__linux__) && defined(SYNC_FILE_RANGE_WRITE)
  ::sync_file_range(fd_, static_cast<off64_t>(offset), static_cast<off64_t>(n),
                    SYNC_FILE_RANGE_WRITE);
#else
  (void)offset, (void)n;
#endif
}

void File::sync() {
  if (::fsync(fd_) != 0) io_error("fsync of", path_, errno);
}

void File::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) io_error("close of", path_, errno);
}

}  // namespace fullshard::checkpoint

namespace fullshard::checkpoint::detail {

// ---- Paths ----------------------------------------------------------------------------------

std::string join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) io_error("open of directory", dir, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some file systems refuse fsync on directories (EINVAL); their renames are durable anyway.
  if (rc != 0 && err != EINVAL && err != EBADF) io_error("fsync of directory", dir, err);
}

void rename_path(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0)
    throw Error("checkpoint: rename of '" + from + "' to '" + to +
                "' failed: " + std::strerror(errno));
}

std::string read_text(const std::string& path) {
  File f = File::open_read(path);
  if (!f.valid()) throw Error("checkpoint: '" + path + "' does not exist");
  std::string s(static_cast<std::size_t>(f.size()), '\0');
  s.resize(static_cast<std::size_t>(f.pread_all(s.data(), s.size(), 0)));
  return s;
}

bool exists(const std::string& path) noexcept {
  std::error_code ec;
  return fs::exists(path, ec);
}

void remove_quietly(const std::string& path) noexcept {
  std::error_code ec;
  fs::remove_all(path, ec);
}

// ---- Fault injection --------------------------------------------------------------------------

Fault Fault::from_environment() {
  Fault f;
  const char* v = std::getenv("FULLSHARD_CKPT_FAULT");
  if (!v || !*v) return f;
  const CheckpointFault parsed = parse_checkpoint_fault(v);
  f.point = parsed.point;
  f.rank = parsed.rank;
  return f;
}

bool Fault::armed(const char* here) const {
  if (point.empty() || point != here) return false;
  return rank < 0 || rank == fullshard::detail::world_rank_or_minus_one() ||
         (rank == 0 && fullshard::detail::world_rank_or_minus_one() < 0);
}

void Fault::maybe_throw(const char* here) const {
  if (armed(here))
    throw Error(std::string("FULLSHARD_CKPT_FAULT=") + here +
                ": injected failure (as if out of memory) in a checkpoint save");
}

void Fault::maybe_exit(const char* here) const {
  if (!armed(here)) return;
  std::fprintf(stderr,
               "fullshard[rank %d]: FULLSHARD_CKPT_FAULT=%s: exiting in the middle of a "
               "checkpoint save\n",
               fullshard::detail::world_rank_or_minus_one(), here);
  std::fflush(stderr);
  std::fflush(stdout);
  std::_Exit(kFaultExitCode);
}

// ---- DataFileWriter ---------------------------------------------------------------------------

DataFileWriter::DataFileWriter(std::string path, std::uint64_t block_bytes, const Fault& fault)
    : file_(File::create(path)),
      block_(block_bytes),
      chunk_(std::max<std::uint64_t>(block_bytes, kWriteChunk / block_bytes * block_bytes)),
      fault_(fault) {}

void DataFileWriter::append(const void* data, std::uint64_t n, ShardInfo& shard,
                            const std::string& tensor) {
  shard.offset = bytes_;
  shard.length = n;
  shard.crc32c.clear();
  shard.crc32c.reserve(static_cast<std::size_t>((n + block_ - 1) / block_));
  const auto* p = static_cast<const char*>(data);
  const bool fault_here = bytes_ == 0 && n > 0 && fault_.armed("mid_shard");
  // Per chunk: checksum its blocks, write it while it is still in cache, start its writeback.
  for (std::uint64_t done = 0; done < n;) {
    const std::uint64_t len = std::min(chunk_, n - done);
    for (std::uint64_t b = 0; b < len; b += block_)
      shard.crc32c.push_back(
          crc32c(p + done + b, static_cast<std::size_t>(std::min(block_, len - b))));
    if (fault_here) {
      file_.write_all(p + done, std::max<std::uint64_t>(1, len / 2), tensor);
      fault_.maybe_exit("mid_shard");
    }
    file_.write_all(p + done, len, tensor);
    file_.start_writeback(bytes_ + done, len);
    done += len;
  }
  bytes_ += n;
}

void DataFileWriter::finish() {
  file_.sync();
  file_.close();
}

void write_file_image(const std::string& path, const char* data, std::uint64_t n,
                      const Fault& fault) {
  File f = File::create(path);
  if (fault.armed("mid_shard")) {
    f.write_all(data, std::max<std::uint64_t>(1, n / 2));
    fault.maybe_exit("mid_shard");
  }
  std::uint64_t done = 0;
#if defined(__linux__) && defined(O_DIRECT)
  const int fd = f.descriptor();
  const int flags = ::fcntl(fd, F_GETFL);
  const std::uint64_t aligned = n / kDirectAlign * kDirectAlign;
  if (aligned > 0 && reinterpret_cast<std::uintptr_t>(data) % kDirectAlign == 0 && flags >= 0 &&
      ::fcntl(fd, F_SETFL, flags | O_DIRECT) == 0) {
    constexpr std::uint64_t kDirectChunk = std::uint64_t{16} << 20;
    while (done < aligned) {
      const std::uint64_t len = std::min(kDirectChunk, aligned - done);
      const ssize_t w =
          ::pwrite(fd, data + done, static_cast<std::size_t>(len), static_cast<off_t>(done));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && errno == EINVAL && done == 0) break;  // refused after all: buffered
      if (w < 0) io_error("write to", path, errno);
      done += static_cast<std::uint64_t>(w);
      if (done % kDirectAlign != 0) break;  // a short write: the rest buffered
    }
    if (::fcntl(fd, F_SETFL, flags) != 0) io_error("fcntl (clearing O_DIRECT) of", path, errno);
  }
#endif
  for (std::uint64_t at = done; at < n;) {
    const std::uint64_t len = std::min(kWriteChunk, n - at);
    f.pwrite_all(data + at, len, at);
    f.start_writeback(at, len);
    at += len;
  }
  f.sync();
  f.close();
}

// ---- Step directories -------------------------------------------------------------------------

namespace {

std::string step_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

// Writes `text` to dir/name through dir/name.tmp: write, fsync, rename, fsync dir.
void write_atomic(const std::string& dir, const std::string& name, const std::string& text,
                  const Fault& fault, const char* mid_point) {
  const std::string tmp = join(dir, name + ".tmp");
  File f = File::create(tmp);
  if (fault.armed(mid_point)) {
    f.write_all(text.data(), text.size() / 2);
    fault.maybe_exit(mid_point);
  }
  f.write_all(text.data(), text.size());
  f.sync();
  f.close();
  rename_path(tmp, join(dir, name));
  fsync_dir(dir);
}

}  // namespace

PendingStep begin_step(const std::string& root, std::int64_t step) {
  if (step < 0) throw InvalidArgument("checkpoint: step must be >= 0, got " + std::to_string(step));
  std::error_code ec;
  // The directories about to be created: the parent of each is fsync'd once it exists, so
  // that a new root survives a crash along with the checkpoints inside it.
  std::vector<fs::path> created;
  fs::path d = fs::absolute(root, ec).lexically_normal();
  if (!d.has_filename()) d = d.parent_path();  // a trailing '/'
  for (; !ec && d.has_relative_path() && !fs::exists(d, ec); d = d.parent_path())
    created.push_back(d);
  fs::create_directories(root, ec);
  if (ec || !fs::is_directory(root))
    throw Error("checkpoint: cannot create the checkpoint directory '" + root +
                "': " + (ec ? ec.message() : std::string("not a directory")));
  for (auto it = created.rbegin(); it != created.rend(); ++it)
    fsync_dir(it->parent_path().string());
  // Leftovers of an interrupted save: never referenced by `latest`, safe to remove.
  std::vector<std::string> stale;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp-", 0) == 0 || name == "latest.tmp") stale.push_back(e.path().string());
  }
  for (const auto& path : stale)
    remove_quietly(path);
  PendingStep p;
  p.root = root;
  p.step = step;
  p.tmp = join(root, ".tmp-" + step_name(step));
  if (!fs::create_directory(p.tmp, ec) || ec)
    throw Error("checkpoint: cannot create '" + p.tmp + "': " + ec.message());
  return p;
}

std::string index_checksum_text(const std::string& index_text) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "crc32c %08x bytes %llu\n",
                crc32c(index_text.data(), index_text.size()),
                static_cast<unsigned long long>(index_text.size()));
  return buf;
}

std::string commit_step(const PendingStep& p, const std::string& index_text, const Fault& fault) {
  fault.maybe_exit("after_shards");
  // The index's checksum first: p.tmp becomes visible (renamed) only after both are durable.
  write_atomic(p.tmp, kIndexChecksumFile, index_checksum_text(index_text), fault, "");
  // write_atomic's fsync of p.tmp makes the data files' entries durable with the index's.
  write_atomic(p.tmp, kIndexFile, index_text, fault, "mid_index");
  fault.maybe_exit("after_index");
  std::string name = step_name(p.step);
  for (int k = 1; exists(join(p.root, name)); ++k)
    name = step_name(p.step) + "." + std::to_string(k);
  const std::string final_dir = join(p.root, name);
  rename_path(p.tmp, final_dir);
  fsync_dir(p.root);
  fault.maybe_exit("before_latest");
  write_atomic(p.root, "latest", name + "\n", fault, "mid_latest");
  return final_dir;
}

void abandon_step(const PendingStep& p) noexcept {
  if (!p.tmp.empty()) remove_quietly(p.tmp);
}

namespace {

// Whether the index at `path` names one of `runs` as its saver (saved_by.run).
bool saved_by_one_of(const fs::path& path, const std::vector<std::string>& runs) {
  try {
    const nlohmann::json j = nlohmann::json::parse(read_text(path.string()));
    const auto& by = j.at("saved_by");
    if (!by.contains("run") || !by["run"].is_string()) return false;
    return std::find(runs.begin(), runs.end(), by["run"].get<std::string>()) != runs.end();
  } catch (const std::exception&) {
    return false;  // unreadable: not ours to delete
  }
}

}  // namespace

std::vector<std::string> prune_steps(const std::string& root, int keep_last,
                                     const std::vector<std::string>& keep,
                                     const std::vector<std::string>* lineage) {
  std::vector<std::string> problems;
  std::error_code ec;
  auto is_step_name = [](const std::string& n) {
    // step-XXXXXXXX, optionally .N (a later commit of the same step number)
    if (n.size() < 13 || n.compare(0, 5, "step-") != 0) return false;
    for (std::size_t i = 5; i < 13; ++i)
      if (n[i] < '0' || n[i] > '9') return false;
    if (n.size() == 13) return true;
    if (n[13] != '.' || n.size() == 14) return false;
    for (std::size_t i = 14; i < n.size(); ++i)
      if (n[i] < '0' || n[i] > '9') return false;
    return true;
  };
  struct Step {
    fs::path path;
    fs::file_time_type committed;
  };
  std::vector<Step> steps;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (!is_step_name(e.path().filename().string())) continue;
    std::error_code te;
    const fs::file_time_type t = fs::last_write_time(e.path() / kIndexFile, te);
    if (te) continue;  // no index: not a committed step, left alone
    if (lineage && !saved_by_one_of(e.path() / kIndexFile, *lineage)) continue;  // another run's
    steps.push_back({e.path(), t});
  }
  std::sort(steps.begin(), steps.end(), [](const Step& a, const Step& b) {
    return a.committed != b.committed ? a.committed > b.committed
                                      : a.path.filename() > b.path.filename();
  });
  std::vector<fs::path> protect;
  auto canonical = [](const fs::path& p) {
    std::error_code ce;
    const fs::path c = fs::weakly_canonical(p, ce);
    return ce ? p.lexically_normal() : c;
  };
  std::string latest;
  try {
    latest = read_text(join(root, "latest"));
  } catch (const std::exception&) {
  }
  while (!latest.empty() &&
         (latest.back() == '\n' || latest.back() == '\r' || latest.back() == ' '))
    latest.pop_back();
  if (!latest.empty()) protect.push_back(canonical(fs::path(root) / latest));
  for (const std::string& k : keep)
    protect.push_back(canonical(k));
  bool removed = false;
  for (std::size_t i = std::size_t(std::max(keep_last, 0)); i < steps.size(); ++i) {
    const fs::path c = canonical(steps[i].path);
    if (std::find(protect.begin(), protect.end(), c) != protect.end()) continue;
    std::error_code re;
    fs::remove_all(steps[i].path, re);
    if (re)
      problems.push_back("cannot delete the old checkpoint '" + steps[i].path.string() +
                         "': " + re.message());
    else
      removed = true;
  }
  if (removed) fsync_dir(root);
  return problems;
}

// ---- Hex --------------------------------------------------------------------------------------

std::string hex_encode(const std::string& bytes) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

std::string hex_decode(const std::string& hex, const std::string& what) {
  auto nibble = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    throw InvalidArgument(what + ": not a hex string");
  };
  if (hex.size() % 2) throw InvalidArgument(what + ": odd number of hex digits");
  std::string out(hex.size() / 2, '\0');
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<char>(nibble(hex[2 * i]) * 16 + nibble(hex[2 * i + 1]));
  return out;
}

// ---- Box runs ---------------------------------------------------------------------------------

BoxRuns::BoxRuns(const std::vector<std::int64_t>& src_off, const Shape& src_shape,
                 const std::vector<std::int64_t>& dst_off, const Shape& dst_shape,
                 std::size_t elem_bytes) {
  const auto es = static_cast<std::uint64_t>(elem_bytes);
  const std::size_t n = src_shape.size();
  if (n == 0) {  // a scalar: one element
    count_ = left_ = 1;
    run_ = {0, 0, es};
    return;
  }
  std::vector<std::int64_t> lo(n), ext(n);
  for (std::size_t d = 0; d < n; ++d) {
    lo[d] = std::max(src_off[d], dst_off[d]);
    const std::int64_t hi = std::min(src_off[d] + src_shape[d], dst_off[d] + dst_shape[d]);
    if (hi <= lo[d]) return;  // no intersection: done()
    ext[d] = hi - lo[d];
  }
  std::vector<std::int64_t> sstride(n, 1), dstride(n, 1);
  for (std::size_t d = n - 1; d > 0; --d) {
    sstride[d - 1] = sstride[d] * src_shape[d];
    dstride[d - 1] = dstride[d] * dst_shape[d];
  }
  // Merge trailing dims spanned fully by both boxes into the run.
  std::size_t k = n - 1;  // dims [k, n) form one run
  std::int64_t run = ext[k];
  while (k > 0 && ext[k] == src_shape[k] && ext[k] == dst_shape[k]) {
    --k;
    run *= ext[k];
  }
  std::int64_t sbase = 0, dbase = 0;
  for (std::size_t d = 0; d < n; ++d) {
    sbase += (lo[d] - src_off[d]) * sstride[d];
    dbase += (lo[d] - dst_off[d]) * dstride[d];
  }
  count_ = 1;
  idx_.assign(k, 0);
  ext_.assign(ext.begin(), ext.begin() + static_cast<std::ptrdiff_t>(k));
  sstep_.resize(k);
  dstep_.resize(k);
  for (std::size_t d = 0; d < k; ++d) {
    count_ *= static_cast<std::uint64_t>(ext[d]);
    sstep_[d] = static_cast<std::uint64_t>(sstride[d]) * es;
    dstep_[d] = static_cast<std::uint64_t>(dstride[d]) * es;
  }
  left_ = count_;
  run_ = {static_cast<std::uint64_t>(sbase) * es, static_cast<std::uint64_t>(dbase) * es,
          static_cast<std::uint64_t>(run) * es};
}

void BoxRuns::next() noexcept {
  if (left_ == 0) return;
  copied_ = 0;
  if (--left_ == 0) return;
  // Row-major increment of the position over dims [0, k), moving src and dst along (unsigned
  // wrap-around in between is harmless: the result is in range).
  for (std::size_t d = idx_.size(); d-- > 0;) {
    if (++idx_[d] < ext_[d]) {
      run_.src += sstep_[d];
      run_.dst += dstep_[d];
      return;
    }
    idx_[d] = 0;
    run_.src -= static_cast<std::uint64_t>(ext_[d] - 1) * sstep_[d];
    run_.dst -= static_cast<std::uint64_t>(ext_[d] - 1) * dstep_[d];
  }
}

void BoxRuns::copy(const char* window, std::uint64_t lo, std::uint64_t hi, char* dst) noexcept {
  while (left_ > 0) {
    const std::uint64_t a = std::max(run_.src + copied_, lo);
    if (a >= hi) return;
    const std::uint64_t end = run_.src + run_.len;
    const std::uint64_t b = std::min(end, hi);
    if (window) std::memcpy(dst + run_.dst + (a - run_.src), window + (a - lo), b - a);
    if (end > hi) {
      copied_ = hi - run_.src;
      return;
    }
    next();
  }
}

std::vector<Run> box_runs(const std::vector<std::int64_t>& src_off, const Shape& src_shape,
                          const std::vector<std::int64_t>& dst_off, const Shape& dst_shape,
                          std::size_t elem_bytes) {
  std::vector<Run> out;
  for (BoxRuns r(src_off, src_shape, dst_off, dst_shape, elem_bytes); !r.done(); r.next())
    out.push_back(r.run());
  return out;
}

}  // namespace fullshard::checkpoint::detail
