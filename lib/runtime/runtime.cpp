#include "fullshard/runtime/runtime.hpp"

#include <Kokkos_Core.hpp>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/config.hpp"
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

  if (!Kokkos::is_initialized()) {
    int no_argc = 0;
    char* no_argv[] = {nullptr};
    try {
      if (argc && argv)
        Kokkos::initialize(*argc, *argv);
      else
        Kokkos::initialize(no_argc, no_argv);
    } catch (const std::exception& e) {
      // The destructor of a half-made Runtime does not run: end MPI here.
      if (owns_mpi_) MPI_Finalize();
      throw kokkos_start_error(rank_, e);
    }
    owns_kokkos_ = true;
  }
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
  return s;
}

}  // namespace fullshard
