#include "fullshard/checkpoint/directory_claim.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/format.hpp"
#include "lib/checkpoint/collective.hpp"
#include "lib/checkpoint/owner_lock.hpp"

namespace fullshard::checkpoint {

namespace stdfs = std::filesystem;
using detail::LockRecord;

namespace {

std::string new_run_id() {
  std::random_device rd;
  const unsigned long long v = (static_cast<unsigned long long>(rd()) << 32) ^ rd();
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", v);
  return buf;
}

// Creates the lock file with O_EXCL: false when it exists (EEXIST), an Error otherwise.
bool create_lock(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
  if (fd < 0) {
    if (errno == EEXIST) return false;
    throw ConfigError("checkpoint directory '" + stdfs::path(path).parent_path().string() +
                      "': cannot create its lock '" + path + "': " + std::strerror(errno));
  }
  const bool ok = ::write(fd, text.data(), text.size()) == ssize_t(text.size()) && ::fsync(fd) == 0;
  ::close(fd);
  if (!ok) {
    ::unlink(path.c_str());
    throw ConfigError("checkpoint directory: cannot write its lock '" + path +
                      "': " + std::strerror(errno));
  }
  return true;
}

}  // namespace

struct DirectoryClaim::Impl {
  std::string dir, lock_path, run, text;
  std::vector<std::string> lineage;
  bool had_checkpoints = false;
  std::unique_ptr<detail::Comm> comm;
  bool holds_lock = false;  // rank 0
  std::thread heartbeat;
  std::mutex mutex;
  std::condition_variable wake;
  bool stopping = false;

  ~Impl() { release(); }

  // Rank 0: takes the lock (a stale one over), or throws ConfigError naming the owner.
  void take_lock() {
    for (int attempt = 0; attempt < 8; ++attempt) {
      if (create_lock(lock_path, text)) {
        holds_lock = true;
        return;
      }
      const std::optional<LockRecord> lock = detail::read_lock(dir);
      if (!lock) continue;  // released meanwhile
      std::string stale = detail::stale_reason(*lock);
      // An owner process of this host that is exiting (an aborted job's rank 0 outlives its
      // launcher for a moment): waited for, up to 3 s.
      for (int i = 0; stale.empty() && i < 30 && lock->parsed &&
                      lock->host == detail::this_host() && lock->pid != ::getpid();
           ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        stale = detail::stale_reason(*lock);
      }
      if (stale.empty()) {
        if (!lock->parsed && lock->age_s < 1) {  // being written: look again
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          continue;
        }
        throw ConfigError(
            "checkpoint directory '" + dir + "' is in use by another run, " +
            detail::describe(*lock) +
            ": two runs saving into one directory destroy each other's checkpoints; give this "
            "run its own directory, or start it when that run has ended (its lock '" +
            lock_path + "' is taken over once its heartbeat is older than three intervals)");
      }
      // Take over: move the stale lock aside (one run wins the rename), check that it is the
      // lock judged stale (not a fresh one another run just made), remove it, try again.
      const std::string aside = lock_path + ".stale-" + run;
      if (::rename(lock_path.c_str(), aside.c_str()) != 0) continue;
      const std::optional<LockRecord> moved = [&]() -> std::optional<LockRecord> {
        std::ifstream in(aside);
        LockRecord r;
        r.text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
        return in ? std::optional<LockRecord>(r) : std::nullopt;
      }();
      if (moved && moved->text != lock->text) {  // another run's fresh lock: put it back
        ::rename(aside.c_str(), lock_path.c_str());
        continue;
      }
      ::unlink(aside.c_str());
      std::fprintf(stderr,
                   "fullshard[rank 0]: checkpoint directory '%s': took over the lock of %s: %s\n",
                   dir.c_str(), detail::describe(*lock).c_str(), stale.c_str());
    }
    throw ConfigError("checkpoint directory '" + dir + "': could not take its lock '" + lock_path +
                      "' (other runs keep creating and removing it)");
  }

  void start_heartbeat() {
    const double interval = detail::heartbeat_interval();
    heartbeat = std::thread([this, interval] {
      std::unique_lock<std::mutex> lk(mutex);
      while (!wake.wait_for(lk, std::chrono::duration<double>(interval), [&] { return stopping; }))
        ::utimensat(AT_FDCWD, lock_path.c_str(), nullptr, 0);  // now: the heartbeat
    });
  }

  void release() noexcept {
    if (heartbeat.joinable()) {
      {
        std::lock_guard<std::mutex> lk(mutex);
        stopping = true;
      }
      wake.notify_all();
      heartbeat.join();
    }
    if (!holds_lock) return;
    holds_lock = false;
    // Removed only while it is still ours (a run that took it over keeps its own).
    const std::optional<LockRecord> lock = detail::read_lock(dir);
    if (lock && lock->text == text) ::unlink(lock_path.c_str());
  }
};

DirectoryClaim::DirectoryClaim(const std::string& dir, const DeviceMesh& mesh, ClaimOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.dir = dir;
  s.lock_path = (stdfs::path(dir) / detail::kLockFile).string();
  s.comm = detail::checkpoint_comm(mesh.control_world(), mesh.timeout_s(),
                                   "checkpoint directory claim of '" + dir + "'");
  detail::Comm& c = *s.comm;
  std::exception_ptr err;
  if (c.rank() == 0)
    err = detail::attempt([&] {
      s.run = new_run_id();
      s.text = detail::lock_text(s.run);
      s.take_lock();
      std::error_code ec;
      s.had_checkpoints = stdfs::exists(stdfs::path(dir) / "latest", ec);
      if (s.had_checkpoints && !options.resume && !options.start_over) {
        std::string latest;
        std::ifstream in(stdfs::path(dir) / "latest");
        std::getline(in, latest);
        s.release();
        throw ConfigError("checkpoint directory '" + dir +
                          "' holds the checkpoints of an earlier run (latest: " + latest +
                          "); a fresh run there would mix with them and its retention would "
                          "delete them: " +
                          options.resume_hint + " continues them, " + options.start_over_hint +
                          " starts a new run beside them (they are kept), or give this run "
                          "its own directory");
      }
      s.start_heartbeat();
    });
  detail::agree(c, err, "checkpoint directory claim");
  std::string shared = s.run + (s.had_checkpoints ? "1" : "0");
  detail::bcast_string(c, shared, 0);
  s.run = shared.substr(0, shared.size() - 1);
  s.had_checkpoints = shared.back() == '1';
  s.lineage = {s.run};
}

DirectoryClaim::~DirectoryClaim() {
  impl_->release();
}

const std::string& DirectoryClaim::dir() const noexcept {
  return impl_->dir;
}
const std::string& DirectoryClaim::run() const noexcept {
  return impl_->run;
}
const std::vector<std::string>& DirectoryClaim::lineage() const noexcept {
  return impl_->lineage;
}
bool DirectoryClaim::had_checkpoints() const noexcept {
  return impl_->had_checkpoints;
}

void DirectoryClaim::resumed_from(const std::string& step_dir) {
  Impl& s = *impl_;
  detail::Comm& c = *s.comm;
  std::string joined;
  if (c.rank() == 0) {
    try {
      const Index index = parse_index(read_index_text(step_dir), step_dir);
      const nlohmann::json by = nlohmann::json::parse(index.saved_by);
      if (by.contains("lineage") && by["lineage"].is_array())
        for (const auto& r : by["lineage"])
          if (r.is_string()) joined += r.get<std::string>() + "\n";
      if (by.contains("run") && by["run"].is_string())
        joined += by["run"].get<std::string>() + "\n";
    } catch (const std::exception&) {
      // Saved without a lineage (another tool, an older fullshard): kept by retention.
    }
  }
  detail::bcast_string(c, joined, 0);
  std::size_t at = 0;
  for (std::size_t nl; (nl = joined.find('\n', at)) != std::string::npos; at = nl + 1) {
    const std::string r = joined.substr(at, nl - at);
    if (std::find(s.lineage.begin(), s.lineage.end(), r) == s.lineage.end())
      s.lineage.insert(s.lineage.end() - 1, r);  // this run stays last
  }
}

void DirectoryClaim::apply(SaveOptions& options) const {
  options.run = impl_->run;
  options.lineage = impl_->lineage;
}

}  // namespace fullshard::checkpoint
