// fullshard-bench-checkpoint: checkpoint save and load against plain POSIX I/O of the same
// bytes, and one file per rank against one MPI-IO shared file.
//
//   posix/write_fsync/<MiB>   each rank write()s its bytes to its own new file, fsync, close
//   mpiio/write_sync/<MiB>    one shared file: MPI_File_write_at_all at rank * bytes,
//                             MPI_File_sync, close
//   ckpt/save/<MiB>           checkpoint::save (sharded, no optimizer) of a model whose shards
//                             total <MiB> per rank: data files with CRC32C, index, renames,
//                             latest, and every fsync of the protocol
//   posix/read_cold/<MiB>     each rank pread()s its file after dropping it from the page cache
//                             (posix_fadvise DONTNEED of the clean, fsync'd pages)
//   mpiio/read_cold/<MiB>     MPI_File_read_at_all of each rank's part of the shared file
//   ckpt/load_cold/<MiB>      checkpoint::load of that checkpoint into the same model, same mesh,
//                             files dropped from the page cache first (the restart case):
//                             read + verify into fresh group storage, agree, adopt it
//   posix/read_warm/<MiB>, ckpt/load_warm/<MiB>: the same from
//                             the page cache
// <MiB> is the data per rank. Setup (removing the previous iteration's files, dropping caches)
// is not timed. Counters: med_us, min_us (max over ranks), GBps = bytes per rank / median.
// Iterations are fixed per size (21, 11, 7): the median is what the README tables use.
//
// Launch: scripts/mpirun-local -n 2 build/bench/fullshard-bench-checkpoint [--dir=PATH]
//         [--benchmark_* flags]; PATH (default $TMPDIR or /tmp) must be on the file system
//         to measure.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/checkpoint/checksum.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fullshard.hpp"
#include "mpi_bench.hpp"

namespace {

namespace fs = fullshard;
namespace ck = fullshard::checkpoint;
using fs::bench::die;

constexpr int kParams = 8;
constexpr std::int64_t kCols = 1024;

struct Bench {
  std::string dir;  // shared scratch directory
  const fs::DeviceMesh* mesh = nullptr;
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
};

// Like bench::timed_loop, with an untimed setup before each iteration.
void timed(benchmark::State& state, const Bench& b, std::uint64_t bytes,
           const std::function<void()>& setup, const std::function<void()>& op) {
  std::vector<double> times;
  for (auto _ : state) {
    setup();
    MPI_Barrier(b.comm);
    const double t0 = MPI_Wtime();
    op();
    const double local = MPI_Wtime() - t0;
    double slowest = 0.0;
    MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, b.comm);
    state.SetIterationTime(slowest);
    times.push_back(slowest);
  }
  if (times.empty()) return;
  std::sort(times.begin(), times.end());
  const std::size_t n = times.size();
  const double med = n % 2 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]);
  state.counters["med_us"] = med * 1e6;
  state.counters["min_us"] = times.front() * 1e6;
  state.counters["GBps"] = static_cast<double>(bytes) / med / 1e9;
}

void drop_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void drop_tree(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir, ec))
    if (e.is_regular_file()) drop_cache(e.path().string());
}

void remove_tree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

// A model of kParams (rows, kCols) f32 parameters, one group, `mib` MiB of shards per rank.
std::unique_ptr<fs::graph::Module> make_model(const fs::DeviceMesh& mesh, double mib) {
  const std::int64_t per_rank = static_cast<std::int64_t>(mib * (1 << 20)) / 4;
  const std::int64_t rows = std::max<std::int64_t>(1, per_rank * mesh.size() / (kParams * kCols));
  auto root = fs::graph::Module::make_root("bench");
  for (int i = 0; i < kParams; ++i)
    root->add_param("p" + std::to_string(i), {rows, kCols}).init([i](std::int64_t e) {
      return static_cast<double>((e + i) % 97);
    });
  fs::fsdp::fully_shard(*root, mesh);
  return root;
}

std::vector<char> payload(std::uint64_t bytes, int rank) {
  std::vector<char> v(static_cast<std::size_t>(bytes));
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<char>((i * 31 + static_cast<std::size_t>(rank)) & 0xff);
  return v;
}

void check(bool ok, const char* what) {
  if (!ok) throw fs::Error(std::string("bench: ") + what);
}

void posix_write(const std::string& path, const std::vector<char>& buf) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  check(fd >= 0, "open for writing");
  std::size_t done = 0;
  while (done < buf.size()) {
    const ssize_t w = ::write(fd, buf.data() + done, buf.size() - done);
    check(w > 0, "write");
    done += static_cast<std::size_t>(w);
  }
  check(::fsync(fd) == 0, "fsync");
  check(::close(fd) == 0, "close");
}

void posix_read(const std::string& path, std::vector<char>& buf) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  check(fd >= 0, "open for reading");
  std::size_t done = 0;
  while (done < buf.size()) {
    const ssize_t r = ::pread(fd, buf.data() + done, buf.size() - done, static_cast<off_t>(done));
    check(r > 0, "pread");
    done += static_cast<std::size_t>(r);
  }
  ::close(fd);
}

std::string rank_path(const Bench& b, const char* what) {
  return b.dir + "/" + what + "-" + std::to_string(b.rank);
}

void bench_posix_write(benchmark::State& state, const Bench* b, double mib) {
  try {
    const auto bytes = static_cast<std::uint64_t>(mib * (1 << 20));
    const auto buf = payload(bytes, b->rank);
    const std::string path = rank_path(*b, "posix");
    timed(
        state, *b, bytes, [&] { remove_tree(path); }, [&] { posix_write(path, buf); });
  } catch (const std::exception& e) {
    die("posix/write_fsync", e);
  }
}

void bench_posix_read(benchmark::State& state, const Bench* b, double mib, bool cold) {
  try {
    const auto bytes = static_cast<std::uint64_t>(mib * (1 << 20));
    const std::string path = rank_path(*b, "posix-read");
    posix_write(path, payload(bytes, b->rank));
    std::vector<char> buf(static_cast<std::size_t>(bytes), 1);
    timed(
        state, *b, bytes,
        [&] {
          if (cold) drop_cache(path);
        },
        [&] { posix_read(path, buf); });
    check(buf[1] == static_cast<char>((31 + b->rank) & 0xff), "read back wrong data");
    remove_tree(path);
  } catch (const std::exception& e) {
    die("posix/read", e);
  }
}

void mpiio_write(const Bench& b, const std::string& path, const std::vector<char>& buf) {
  MPI_File f;
  check(MPI_File_open(b.comm, path.c_str(), MPI_MODE_CREATE | MPI_MODE_WRONLY, MPI_INFO_NULL, &f) ==
            MPI_SUCCESS,
        "MPI_File_open");
  const MPI_Offset off = static_cast<MPI_Offset>(buf.size()) * b.rank;
  check(MPI_File_write_at_all(f, off, buf.data(), static_cast<int>(buf.size()), MPI_BYTE,
                              MPI_STATUS_IGNORE) == MPI_SUCCESS,
        "MPI_File_write_at_all");
  check(MPI_File_sync(f) == MPI_SUCCESS, "MPI_File_sync");
  check(MPI_File_close(&f) == MPI_SUCCESS, "MPI_File_close");
}

void bench_mpiio_write(benchmark::State& state, const Bench* b, double mib) {
  try {
    const auto bytes = static_cast<std::uint64_t>(mib * (1 << 20));
    const auto buf = payload(bytes, b->rank);
    const std::string path = b->dir + "/mpiio";
    timed(
        state, *b, bytes,
        [&] {
          if (b->rank == 0) remove_tree(path);
          MPI_Barrier(b->comm);
        },
        [&] { mpiio_write(*b, path, buf); });
  } catch (const std::exception& e) {
    die("mpiio/write_sync", e);
  }
}

void bench_mpiio_read(benchmark::State& state, const Bench* b, double mib) {
  try {
    const auto bytes = static_cast<std::uint64_t>(mib * (1 << 20));
    const std::string path = b->dir + "/mpiio-read";
    mpiio_write(*b, path, payload(bytes, b->rank));
    std::vector<char> buf(static_cast<std::size_t>(bytes), 1);
    auto op = [&] {
      MPI_File f;
      check(MPI_File_open(b->comm, path.c_str(), MPI_MODE_RDONLY, MPI_INFO_NULL, &f) == MPI_SUCCESS,
            "MPI_File_open");
      check(
          MPI_File_read_at_all(f, static_cast<MPI_Offset>(bytes) * b->rank, buf.data(),
                               static_cast<int>(bytes), MPI_BYTE, MPI_STATUS_IGNORE) == MPI_SUCCESS,
          "MPI_File_read_at_all");
      check(MPI_File_close(&f) == MPI_SUCCESS, "MPI_File_close");
    };
    timed(
        state, *b, bytes,
        [&] {
          if (b->rank == 0) drop_cache(path);
          MPI_Barrier(b->comm);
        },
        op);
    check(buf[1] == static_cast<char>((31 + b->rank) & 0xff), "read back wrong data");
    MPI_Barrier(b->comm);
    if (b->rank == 0) remove_tree(path);
  } catch (const std::exception& e) {
    die("mpiio/read", e);
  }
}

void bench_save(benchmark::State& state, const Bench* b, double mib) {
  try {
    auto model = make_model(*b->mesh, mib);
    const std::string dir = b->dir + "/ckpt-save";
    const auto bytes = static_cast<std::uint64_t>(mib * (1 << 20));
    timed(
        state, *b, bytes,
        [&] {
          if (b->rank == 0) remove_tree(dir);
          MPI_Barrier(b->comm);
        },
        [&] { ck::save(dir, *model, nullptr, 1); });
    MPI_Barrier(b->comm);
    if (b->rank == 0) remove_tree(dir);
  } catch (const std::exception& e) {
    die("ckpt/save", e);
  }
}

void bench_load(benchmark::State& state, const Bench* b, double mib, bool cold) {
  try {
    auto model = make_model(*b->mesh, mib);
    const std::string dir = b->dir + "/ckpt-load";
    const std::string step_dir = ck::save(dir, *model, nullptr, 1);
    const auto bytes = static_cast<std::uint64_t>(mib * (1 << 20));
    timed(
        state, *b, bytes,
        [&] {
          if (cold && b->rank == 0) drop_tree(step_dir);
          MPI_Barrier(b->comm);
        },
        [&] { ck::load(dir, *model, nullptr); });
    MPI_Barrier(b->comm);
    if (b->rank == 0) remove_tree(dir);
  } catch (const std::exception& e) {
    die("ckpt/load", e);
  }
}

// Takes --dir=PATH out of argv.
std::string take_dir(int& argc, char** argv) {
  const char* t = std::getenv("TMPDIR");
  std::string dir = t && *t ? t : "/tmp";
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--dir=", 0) == 0)
      dir = a.substr(6);
    else
      argv[kept++] = argv[i];
  }
  argc = kept;
  argv[argc] = nullptr;
  return dir;
}

}  // namespace

int main(int argc, char** argv) {
  if (!fs::bench::early_flags(argc, argv, "fullshard-bench-checkpoint")) return 1;
  const std::string parent = take_dir(argc, argv);
  fs::Runtime rt(argc, argv);
  int result = 0;
  {
    fs::DeviceMesh mesh(rt, {rt.world_size()}, {"dp"});
    Bench b;
    b.mesh = &mesh;
    b.rank = rt.rank();
    b.size = rt.world_size();
    MPI_Comm_dup(MPI_COMM_WORLD, &b.comm);
    // A fresh scratch directory, shared by the ranks, removed at the end.
    std::string dir;
    if (b.rank == 0) {
      std::string tmpl = parent + "/fullshard-bench-ckpt-XXXXXX";
      if (mkdtemp(tmpl.data())) dir = tmpl;
    }
    int len = static_cast<int>(dir.size());
    MPI_Bcast(&len, 1, MPI_INT, 0, MPI_COMM_WORLD);
    dir.resize(static_cast<std::size_t>(len));
    MPI_Bcast(dir.data(), len, MPI_CHAR, 0, MPI_COMM_WORLD);
    if (dir.empty()) {
      if (b.rank == 0) std::fprintf(stderr, "cannot create a directory under %s\n", parent.c_str());
      return 1;
    }
    b.dir = dir;
    benchmark::AddCustomContext("checkpoint_dir", dir);
    benchmark::AddCustomContext("crc32c", ck::crc32c_implementation());
    // Fixed iteration counts (the same on every rank), enough for a stable median.
    for (const auto& size : {std::pair<double, int>{16.0, 21}, {64.0, 11}, {256.0, 7}}) {
      // Plain variables, not structured bindings: the lambda below captures them (C++17).
      const double mib = size.first;
      const int iterations = size.second;
      const std::string s = std::to_string(static_cast<int>(mib));
      auto reg = [&](const std::string& name, auto fn, auto... args) {
        benchmark::RegisterBenchmark((name + "/" + s).c_str(), fn, &b, mib, args...)
            ->UseManualTime()
            ->Iterations(iterations);
      };
      reg("posix/write_fsync", bench_posix_write);
      reg("mpiio/write_sync", bench_mpiio_write);
      reg("ckpt/save", bench_save);
      reg("posix/read_cold", bench_posix_read, true);
      reg("mpiio/read_cold", bench_mpiio_read);
      reg("ckpt/load_cold", bench_load, true);
      reg("posix/read_warm", bench_posix_read, false);
      reg("ckpt/load_warm", bench_load, false);
    }
    result = fs::bench::run_benchmarks(argc, argv);
    MPI_Barrier(MPI_COMM_WORLD);
    if (b.rank == 0) remove_tree(dir);
    MPI_Comm_free(&b.comm);
  }
  return result;
}
