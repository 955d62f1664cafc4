// The process runtime: MPI and Kokkos start/stop, rank placement,
// device binding and settings. Create exactly one in main(), before anything else of
// fullshard, and let it go out of scope last.
#pragma once

#include <mpi.h>

#include <string>

#include "fullshard/runtime/core_share.hpp"
#include "fullshard/runtime/settings.hpp"

namespace fullshard {

class Runtime {
 public:
  /// Starts MPI (asking for MPI_THREAD_MULTIPLE), then Kokkos (passing argc/argv to both). If
  /// the host application already initialised MPI (at any thread level: plain MPI_Init too)
  /// or Kokkos, that library is used as it is and not finalised by this Runtime. Below
  /// MPI_THREAD_MULTIPLE fullshard makes every MPI call from the thread that calls it (the
  /// default FULLSHARD_HOST_PROGRESS=inline; rank 0 says so in one line) and must be called
  /// from one thread at a time. Throws ConfigError on a bad FULLSHARD_* variable, and for
  /// FULLSHARD_HOST_PROGRESS=thread below MPI_THREAD_MULTIPLE.
  Runtime(int& argc, char**& argv);
  /// Same, without command-line arguments.
  Runtime();
  /// The runtime of the ranks of `comm`, an application's communicator (a coupled
  /// simulation's training ranks): MPI must be initialised (any thread level); rank,
  /// world_size, placement and device binding are among comm's ranks, and world() is comm.
  /// Collective over comm only. Not MPI_COMM_NULL (InvalidArgument).
  explicit Runtime(MPI_Comm comm);
  /// Finalises Kokkos, then MPI, each only if this Runtime started it.
  ~Runtime();

  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
  Runtime(Runtime&&) = delete;
  Runtime& operator=(Runtime&&) = delete;

  /// MPI_COMM_WORLD, or the communicator the runtime was made over.
  MPI_Comm world() const noexcept { return comm_; }
  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_size_; }
  /// Rank among the ranks of this node (MPI_Comm_split_type SHARED, or the
  /// FULLSHARD_RANKS_PER_NODE override).
  int local_rank() const noexcept { return local_rank_; }
  int local_size() const noexcept { return local_size_; }
  /// CUDA device bound to this rank, or -1 (CUDA disabled, no GPU, or binding turned off).
  int device() const noexcept { return device_; }
  bool owns_mpi() const noexcept { return owns_mpi_; }
  bool owns_kokkos() const noexcept { return owns_kokkos_; }
  /// The MPI thread level (MPI_THREAD_SINGLE .. MPI_THREAD_MULTIPLE).
  int thread_level() const noexcept { return thread_level_; }
  const Settings& settings() const noexcept { return settings_; }

  /// The threads this rank runs and why: its affinity mask's CPUs divided among the ranks of
  /// the node bound to the same mask, at most srun -c. At start the runtime gives them to
  /// Kokkos's host threads (OpenMP, Threads) unless --kokkos-num-threads, KOKKOS_NUM_THREADS
  /// or OMP_NUM_THREADS chose, and to the loaded BLAS unless its variables
  /// (OPENBLAS_NUM_THREADS, ...) chose; rank 0 says so in one line. A Kokkos the application
  /// started keeps its threads (the line says when they are more than the rank's cores).
  const CoreShare& cores() const noexcept { return cores_; }

  /// One line: ranks, placement, MPI library, Kokkos version and backend, CUDA/NCCL state,
  /// threads per rank, the BLAS and its kernel, the CPU's vector extensions.
  std::string describe() const;

 private:
  void start(int* argc, char*** argv, bool require_mpi);
  void place_ranks();
  void bind_device();
  void share_threads(const std::string& kokkos_note);

  Settings settings_;
  CoreShare cores_;
  MPI_Comm comm_ = MPI_COMM_WORLD;
  bool owns_mpi_ = false;
  bool owns_kokkos_ = false;
  int rank_ = 0;
  int world_size_ = 1;
  int local_rank_ = 0;
  int local_size_ = 1;
  int device_ = -1;
  int thread_level_ = MPI_THREAD_MULTIPLE;
};

/// "MPI_THREAD_SINGLE", ..., "MPI_THREAD_MULTIPLE".
const char* thread_level_name(int level) noexcept;

}  // namespace fullshard
