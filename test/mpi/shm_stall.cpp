// A peer that stalls in the middle of training with shared-memory collectives: every rank
// must end its wait with the FULLSHARD_TIMEOUT message naming the operation (CTest runs it on
// 3 ranks with FULLSHARD_TIMEOUT=2 through shm_stall.cmake, which checks each rank's
// message). The last rank sleeps before the second step; the others time out in the
// all-gather; the sleeper, once awake, times out waiting for them to read its shard.
#include <chrono>
#include <cstdio>
#include <thread>

#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/fullshard.hpp"

int main(int argc, char** argv) {
  namespace fs = fullshard;
  int caught = 0;
  {
    fs::Runtime rt(argc, argv);
    MPI_Barrier(MPI_COMM_WORLD);  // ranks start apart; the bounded steps below start together
    {
      fs::DeviceMesh mesh(rt, {rt.world_size()}, {"dp"});
      auto root = fs::graph::Module::make_root("model");
      for (int i = 0; i < 2; ++i) {
        auto& m = root->add_module("l" + std::to_string(i));
        m.add_param("w", {6, 4}).init([](std::int64_t e) { return 0.5 * e; });
        m.on_backward([](fs::graph::Module& mod) {
          fs::Tensor g = mod.param("w").grad();
          g.fill(1.0);
        });
        fs::fsdp::fully_shard(m, mesh);
      }
      fs::fsdp::fully_shard(*root, mesh);
      fs::fsdp::forward(*root);
      fs::fsdp::backward(*root);
      if (mesh.shm("dp") == nullptr) std::printf("shm_stall: no shared memory on this mesh\n");
      if (rt.rank() == rt.world_size() - 1)
        std::this_thread::sleep_for(std::chrono::duration<double>(2.5 * rt.settings().timeout_s));
      try {
        fs::fsdp::forward(*root);
        fs::fsdp::backward(*root);
        std::printf("shm_stall: rank %d finished the step\n", rt.rank());
      } catch (const fs::CommError& e) {
        caught = 1;
        std::printf("shm_stall: rank %d caught CommError\n", rt.rank());
      }
      std::fflush(stdout);
      int all = 0;
      MPI_Allreduce(&caught, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
      if (rt.rank() == 0 && all) std::printf("shm_stall: every rank reported the timeout\n");
      caught = all;
    }
  }
  return caught ? 0 : 1;
}
