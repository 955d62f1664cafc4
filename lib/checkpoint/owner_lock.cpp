#include "lib/checkpoint/owner_lock.hpp"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include <nlohmann/json.hpp>

#include "fullshard/base/error.hpp"

namespace fullshard::checkpoint::detail {

double heartbeat_interval() {
  const char* v = std::getenv("FULLSHARD_LOCK_HEARTBEAT");
  if (v == nullptr || *v == '\0') return 30.0;
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  if (end == v || *end != '\0' || !std::isfinite(s) || s <= 0 || s > 86400)
    throw ConfigError("FULLSHARD_LOCK_HEARTBEAT=" + std::string(v) +
                      ": expected seconds between 0 and 86400 (the checkpoint directory lock's "
                      "heartbeat interval)");
  return s;
}

std::string this_job() {
  const char* v = std::getenv("SLURM_JOB_ID");
  return v ? std::string(v) : std::string();
}

std::string this_host() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

std::optional<LockRecord> read_lock(const std::string& dir) {
  const std::string path = dir + "/" + kLockFile;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  LockRecord r;
  r.text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  const auto mtime =
      std::chrono::seconds(st.st_mtim.tv_sec) + std::chrono::nanoseconds(st.st_mtim.tv_nsec);
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  r.age_s = std::chrono::duration<double>(now - mtime).count();
  try {
    const nlohmann::json j = nlohmann::json::parse(r.text);
    r.run = j.at("run").get<std::string>();
    r.job = j.at("job").get<std::string>();
    r.host = j.at("host").get<std::string>();
    r.pid = j.at("pid").get<long long>();
    r.heartbeat_s = j.at("heartbeat_s").get<double>();
    r.parsed = r.heartbeat_s > 0;
  } catch (const std::exception&) {
    r.parsed = false;
  }
  return r;
}

std::string stale_reason(const LockRecord& lock) {
  char buf[160];
  // An unreadable lock (a crash while it was written) is stale after the default interval's
  // three heartbeats.
  const double interval = lock.parsed ? lock.heartbeat_s : 30.0;
  if (lock.age_s > 3 * interval) {
    std::snprintf(buf, sizeof buf, "its last heartbeat was %.0f s ago (more than 3 x %.0f s)",
                  lock.age_s, interval);
    return buf;
  }
  if (!lock.parsed) return {};
  if (!lock.job.empty() && lock.job == this_job())
    return "it names this Slurm job (" + lock.job + "): the job was requeued";
  if (lock.host == this_host() && lock.pid > 0 && ::kill(pid_t(lock.pid), 0) != 0 && errno == ESRCH)
    return "its process " + std::to_string(lock.pid) + " on this host is gone";
  return {};
}

std::string describe(const LockRecord& lock) {
  if (!lock.parsed) return "an unreadable lock";
  char age[64];
  std::snprintf(age, sizeof age, "heartbeat %.0f s ago", lock.age_s);
  return "run " + lock.run + " (" + (lock.job.empty() ? "" : "Slurm job " + lock.job + ", ") +
         "host " + lock.host + ", process " + std::to_string(lock.pid) + ", " + age + ")";
}

std::string lock_text(const std::string& run) {
  nlohmann::json j = {{"run", run},
                      {"job", this_job()},
                      {"host", this_host()},
                      {"pid", static_cast<long long>(::getpid())},
                      {"heartbeat_s", heartbeat_interval()}};
  return j.dump() + "\n";
}

void check_not_held_by_another(const std::string& dir, const std::string& run) {
  const std::optional<LockRecord> lock = read_lock(dir);
  if (!lock || (lock->parsed && lock->run == run) || !stale_reason(*lock).empty()) return;
  throw Error("checkpoint: '" + dir + "' is the checkpoint directory of another run, " +
              describe(*lock) +
              ": saving into it could destroy that run's checkpoints; give this run its own "
              "directory");
}

}  // namespace fullshard::checkpoint::detail
