#include <fullshard/fullshard.hpp>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  fullshard::Runtime rt(argc, argv);
  fullshard::DeviceMesh mesh(rt, {rt.world_size()}, {"dp"});
  auto& comm = mesh.comm("dp");
  const int r = comm.rank();
  const int W = comm.size();
  std::vector<double> all(3 * W, -1.0);
  for (int i = 0; i < 3; ++i)
    all[3 * r + i] = 100.0 * r + i;
  auto stream = fullshard::comm::Stream::caller();
  comm.all_gather(all.data() + 3 * r, all.data(), 3, fullshard::DType::f64, stream).wait();
  bool ok = true;
  for (int q = 0; q < W; ++q)
    for (int i = 0; i < 3; ++i)
      ok &= all[3 * q + i] == 100.0 * q + i;
  int mine = ok ? 1 : 0, every = 0;
  MPI_Allreduce(&mine, &every, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rt.rank() == 0)
    std::printf("consumer: all_gather over %d ranks %s\n", W, every ? "ok" : "FAILED");
  return every ? 0 : 1;
}
