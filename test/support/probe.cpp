// A small program that CTest runs to check behaviour that ends a process: bad settings and
// collective timeouts. Usage: fullshard-test-probe start | timeout
#include <cstdio>
#include <string>
#include <vector>

#include "fullshard/fullshard.hpp"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "start";
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
