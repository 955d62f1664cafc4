// A small program that CTest runs to check behaviour that ends a process: bad settings and
// collective timeouts, a host that owns MPI and Kokkos.
// Usage: fullshard-test-probe start | timeout | timeout-inline | preinit
#include <cstdio>
#include <string>
#include <vector>

#include <Kokkos_Core.hpp>

#include "fullshard/fullshard.hpp"

// "preinit": the host application owns MPI and Kokkos; the Runtime must use them as they are
// and leave them running.
int host_owned(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  Kokkos::initialize(argc, argv);
  bool ok = true;
  {
    fullshard::Runtime rt(argc, argv);
    ok = !rt.owns_mpi() && !rt.owns_kokkos();
    fullshard::DeviceMesh mesh(rt, {rt.world_size()}, {"dp"});
    double x = 1.0;
    auto s = fullshard::comm::Stream::caller();
    mesh.comm("dp")
        .all_reduce(&x, &x, 1, fullshard::DType::f64, fullshard::comm::ReduceOp::sum, s)
        .wait();
    ok = ok && x == rt.world_size();
  }
  // Both libraries are still usable after the Runtime is gone.
  int initialized = 0;
  MPI_Initialized(&initialized);
  ok = ok && initialized && Kokkos::is_initialized();
  int all = 0, mine = ok ? 1 : 0, rank = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) std::printf("host-owned MPI and Kokkos: %s\n", all ? "kept" : "BROKEN");
  Kokkos::finalize();
  MPI_Finalize();
  return all ? 0 : 1;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "start";
  if (mode == "preinit") return host_owned(argc, argv);
  try {
    fullshard::Runtime rt(argc, argv);
    if (mode == "timeout" || mode == "timeout-inline") {
      // Rank 0 enters an all-gather that no other rank joins: Work::wait must report it and
      // abort the job after FULLSHARD_TIMEOUT instead of hanging.
      fullshard::DeviceMesh mesh(rt, {rt.world_size()}, {"dp"});
      std::vector<float> buf(4 * rt.world_size());
      if (rt.rank() == 0) {
        auto s = mode == "timeout" ? fullshard::comm::Stream::worker("probe")
                                   : fullshard::comm::Stream::caller("probe");
        mesh.comm("dp").all_gather(buf.data(), buf.data(), 4, fullshard::DType::f32, s).wait();
        std::printf("unexpected: the all-gather finished\n");
      } else {
        MPI_Barrier(MPI_COMM_WORLD);  // waits for rank 0, which never comes
      }
      return 0;
    }
    if (rt.rank() == 0) std::printf("started: %s\n", rt.describe().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
