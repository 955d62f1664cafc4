#include "fullshard/runtime/runtime.hpp"

#include <sched.h>
#include <unistd.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/config.hpp"
#include "fullshard/runtime/blas.hpp"
#include "fullshard/runtime/core_share.hpp"
#include "fullshard/runtime/nccl_info.hpp"
#include "lib/runtime/device_binding.hpp"

namespace fullshard {
namespace {

// Reads an integer environment variable set by a launcher; -1 when unset or not a number.
int launcher_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return (*end == '\0' && n >= 0) ? static_cast<int>(n) : -1;
}

// The error for a Kokkos that did not start: a device build (CUDA, HIP, SYCL) on a machine
// without a usable GPU ends here.
ConfigError kokkos_start_error(int rank, const std::exception& e) {
  std::string msg = "Kokkos::initialize failed on rank " + std::to_string(rank) + " (Kokkos " +
                    std::to_string(KOKKOS_VERSION) + ", default execution space " +
                    Kokkos::DefaultExecutionSpace::name() + "): " + e.what();
#if defined(KOKKOS_ENABLE_CUDA) || defined(KOKKOS_ENABLE_HIP) || defined(KOKKOS_ENABLE_SYCL)
  msg +=
      "; this Kokkos runs on a GPU and needs a visible device with a working driver (on a "
      "machine without a GPU, use a host-only Kokkos build)";
#endif
  return ConfigError(msg);
}

// The cores of this rank: its affinity mask, the ranks of its node bound to the same mask
// (collective over the node's ranks of comm), and srun -c.
LauncherCores read_launcher_cores(MPI_Comm comm, int rank) {
  LauncherCores c;
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  c.node_cpus = online > 0 ? static_cast<int>(online) : 1;
  cpu_set_t mask;
  CPU_ZERO(&mask);
  c.affinity_cpus = sched_getaffinity(0, sizeof mask, &mask) == 0 ? CPU_COUNT(&mask) : c.node_cpus;
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int n = 1;
  MPI_Comm_size(node, &n);
  std::vector<cpu_set_t> masks(static_cast<std::size_t>(n));
  MPI_Allgather(&mask, sizeof mask, MPI_BYTE, masks.data(), sizeof mask, MPI_BYTE, node);
  MPI_Comm_free(&node);
  c.ranks_sharing_mask = static_cast<int>(std::count_if(
      masks.begin(), masks.end(), [&](const cpu_set_t& m) { return CPU_EQUAL(&m, &mask); }));
  if (const char* v = std::getenv("SLURM_CPUS_PER_TASK"); v && *v)
    c.slurm_cpus_per_task = std::atoi(v);
  return c;
}

#if defined(KOKKOS_ENABLE_OPENMP) || defined(KOKKOS_ENABLE_THREADS)
constexpr bool kKokkosHostThreads = true;
#else
constexpr bool kKokkosHostThreads = false;
#endif
// Kokkos 3.7 renamed --kokkos-threads (still read, with a deprecation warning).
constexpr const char* kKokkosThreadsFlag =
    KOKKOS_VERSION >= 30700 ? "--kokkos-num-threads=" : "--kokkos-threads=";

// A thread count for Kokkos that the user chose: its command-line argument or variable, or
// (OpenMP) OMP_NUM_THREADS; empty when none.
std::string kokkos_user_threads(int argc, char** argv) {
  for (int i = 0; argv && i < argc; ++i)
    if (argv[i] && (std::strncmp(argv[i], "--kokkos-num-threads", 20) == 0 ||
                    std::strncmp(argv[i], "--kokkos-threads", 16) == 0))
      return argv[i];
#if defined(KOKKOS_ENABLE_OPENMP)
  static const char* const vars[] = {"KOKKOS_NUM_THREADS", "OMP_NUM_THREADS", nullptr};
#else
  static const char* const vars[] = {"KOKKOS_NUM_THREADS", nullptr};
#endif
  return user_thread_setting(vars);
}

// Kokkos::initialize with the caller's arguments (Kokkos takes its own out of them) and,
// when `threads_arg` is not empty, that thread count after them.
void initialize_kokkos(int* argc, char*** argv, std::string threads_arg) {
  std::vector<char*> args;
  static char name[] = "fullshard";
  if (argc && argv)
    args.assign(*argv, *argv + *argc);
  else
    args.push_back(name);
  if (!threads_arg.empty()) args.push_back(threads_arg.data());
  int n = static_cast<int>(args.size());
  args.push_back(nullptr);
  Kokkos::initialize(n, args.data());
  if (!argc || !argv) return;
  // What Kokkos left, less the thread count it was given, goes back to the caller.
  int kept = 0;
  for (int i = 0; i < n; ++i)
    if (args[static_cast<std::size_t>(i)] != threads_arg.data())
      (*argv)[kept++] = args[static_cast<std::size_t>(i)];
  (*argv)[kept] = nullptr;
  *argc = kept;
}

}  // namespace

const char* thread_level_name(int level) noexcept {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
  }
  return "an unknown MPI thread level";
}

Runtime::Runtime() {
  start(nullptr, nullptr, false);
}

Runtime::Runtime(int& argc, char**& argv) {
  start(&argc, &argv, false);
}

Runtime::Runtime(MPI_Comm comm) : comm_(comm) {
  if (comm == MPI_COMM_NULL) throw InvalidArgument("Runtime: the communicator is MPI_COMM_NULL");
  start(nullptr, nullptr, true);
}

void Runtime::start(int* argc, char*** argv, bool require_mpi) {
  // Settings first: a bad variable must fail before anything is started.
  settings_ = Settings::from_environment();

  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized && require_mpi)
    throw InvalidArgument("Runtime(comm): MPI is not initialised; call MPI_Init first");
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    if (MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
      throw CommError("MPI_Init_thread failed");
    owns_mpi_ = true;
  } else {
    MPI_Query_thread(&provided);
  }
  thread_level_ = provided;
  // Below MPI_THREAD_MULTIPLE (a simulation's plain MPI_Init) fullshard calls MPI only from
  // the thread that calls it: channel streams run inline, never on worker threads.
  if (provided < MPI_THREAD_MULTIPLE && settings_.host_progress == HostProgress::thread) {
    if (owns_mpi_) {
      MPI_Finalize();
      owns_mpi_ = false;
    }
    throw ConfigError(
        "FULLSHARD_HOST_PROGRESS=thread needs MPI_THREAD_MULTIPLE (its channel "
        "streams call MPI from their own threads), but MPI provides " +
        std::string(thread_level_name(provided)) +
        "; unset it (the default, inline, calls MPI from the calling thread only)");
  }
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &world_size_);
  place_ranks();
  bind_device();

  cores_ = share_cores(read_launcher_cores(comm_, rank_));
  // Kokkos's host threads: the rank's cores unless the user chose.
  std::string kokkos_threads;
  if (!Kokkos::is_initialized()) {
    const std::string user = kokkos_user_threads(argc ? *argc : 0, argv ? *argv : nullptr);
    std::string threads_arg;
    if (kKokkosHostThreads && user.empty())
      threads_arg = kKokkosThreadsFlag + std::to_string(cores_.threads);
    try {
      initialize_kokkos(argc, argv, threads_arg);
    } catch (const std::exception& e) {
      // The destructor of a half-made Runtime does not run: end MPI here.
      if (owns_mpi_) MPI_Finalize();
      throw kokkos_start_error(rank_, e);
    }
    owns_kokkos_ = true;
    if (kKokkosHostThreads && !user.empty()) kokkos_threads = " (" + user + ", yours)";
  } else if (kKokkosHostThreads) {
    kokkos_threads = " (Kokkos was started by the application)";
  }
  share_threads(kokkos_threads);
  if (rank_ == 0 && provided < MPI_THREAD_MULTIPLE && settings_.log_level >= 1)
    std::fprintf(stderr,
                 "fullshard: note: MPI thread level %s: fullshard makes every MPI call from the "
                 "thread that calls it (FULLSHARD_HOST_PROGRESS=thread is unavailable; call "
                 "fullshard from one thread at a time)\n",
                 thread_level_name(provided));
  if (rank_ == 0)
    for (const auto& w : settings_.warnings)
      std::fprintf(stderr, "fullshard: warning: %s\n", w.c_str());
}

void Runtime::place_ranks() {
  if (settings_.ranks_per_node > 0) {
    const int rpn = settings_.ranks_per_node;
    if (world_size_ % rpn != 0)
      throw ConfigError("FULLSHARD_RANKS_PER_NODE=" + std::to_string(rpn) +
                        " does not divide the world size " + std::to_string(world_size_));
    local_rank_ = rank_ % rpn;
    local_size_ = rpn;
    return;
  }
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &local_rank_);
  MPI_Comm_size(node, &local_size_);
  MPI_Comm_free(&node);
  // Cross-check with what the launcher says (its local ranks count the whole world); a
  // difference means an unusual binding (or a container hiding the node), which users want
  // to know about.
  if (comm_ != MPI_COMM_WORLD) return;
  for (const char* var : {"SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"}) {
    const int v = launcher_int(var);
    if (v >= 0 && v != local_rank_ && settings_.log_level >= 1)
      std::fprintf(stderr,
                   "fullshard[rank %d]: warning: %s=%d but MPI's shared-memory split gives "
                   "local rank %d; using %d\n",
                   rank_, var, v, local_rank_, local_rank_);
  }
}

void Runtime::bind_device() {
  if (!settings_.bind_device) return;
  // Ranks of one node share a color: the FULLSHARD_RANKS_PER_NODE blocks, or the node's
  // lowest world rank (MPI's shared-memory split).
  int node_color = 0;
  if (settings_.ranks_per_node > 0) {
    node_color = rank_ / settings_.ranks_per_node;
  } else {
    MPI_Comm node = MPI_COMM_NULL;
    MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node);
    MPI_Allreduce(&rank_, &node_color, 1, MPI_INT, MPI_MIN, node);
    MPI_Comm_free(&node);
  }
  device_ = detail::bind_local_device(comm_, node_color, local_rank_);
}

Runtime::~Runtime() {
  if (owns_kokkos_ && Kokkos::is_initialized()) Kokkos::finalize();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_mpi_ && !finalized) MPI_Finalize();
}

std::string Runtime::describe() const {
  char mpi_version[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
  int len = 0;
  MPI_Get_library_version(mpi_version, &len);
  std::string mpi(mpi_version, static_cast<std::size_t>(len));
  if (const auto nl = mpi.find_first_of("\n,"); nl != std::string::npos) mpi.resize(nl);
  std::string s = std::to_string(world_size_) + " ranks (" + std::to_string(local_size_) +
                  " per node), MPI: " + mpi + ", Kokkos " + std::to_string(KOKKOS_VERSION) + " (" +
                  Kokkos::DefaultExecutionSpace::name() + ")";
  s += ", CUDA: ";
  s += FULLSHARD_HAS_CUDA ? (device_ >= 0 ? "device " + std::to_string(device_)
                                          : std::string("built, no GPU visible"))
                          : std::string("not built");
  const std::string nccl = nccl_version();
  s += ", NCCL: " + (nccl.empty() ? std::string("not built") : "built (" + nccl + ")");
  s += ", threads per rank " + std::to_string(cores_.threads) + " (" + cores_.why +
       "), BLAS: " + loaded_blas().describe() + ", CPU: " + cpu_features().names();
  return s;
}

void Runtime::share_threads(const std::string& kokkos_note) {
  const int kokkos = Kokkos::DefaultHostExecutionSpace().concurrency();
  std::string line;
  if (kKokkosHostThreads) {
    line = std::string("Kokkos ") + Kokkos::DefaultHostExecutionSpace::name() + " " +
           std::to_string(kokkos) + kokkos_note;
    if (kokkos > cores_.threads)
      line += " [more threads than the rank's " + std::to_string(cores_.threads) +
              (cores_.threads == 1 ? " core" : " cores") + "]";
  }
  BlasInfo blas = loaded_blas();
  if (!blas.library.empty()) {
    const std::string user = user_thread_setting(blas_thread_variables(blas.library));
    if (user.empty()) set_blas_threads(cores_.threads);
    blas = loaded_blas();
    line += (line.empty() ? "" : ", ") + blas.library + " " + std::to_string(blas.threads) +
            (user.empty() ? "" : " (" + user + ", yours)");
  }
  if (rank_ == 0 && !line.empty() && settings_.log_level >= 1)
    std::fprintf(stderr, "fullshard: %d thread%s per rank (%s): %s\n", cores_.threads,
                 cores_.threads == 1 ? "" : "s", cores_.why.c_str(), line.c_str());
  if (rank_ == 0 && !blas.better_kernel.empty() && settings_.log_level >= 1) {
    const char* forced = std::getenv("OPENBLAS_CORETYPE");
    std::fprintf(
        stderr,
        "fullshard: warning: %s runs its %s kernel%s on a CPU with %s: matrix "
        "products run up to 3x slower than they can; set %s in the environment "
        "before the program starts (the fullshard programs set it themselves)\n",
        (blas.library + " " + blas.version).c_str(), blas.kernel.c_str(),
        forced && *forced ? (std::string(" (OPENBLAS_CORETYPE=") + forced + ")").c_str() : "",
        cpu_features().names().c_str(), blas.better_kernel.c_str());
  }
}

}  // namespace fullshard
