// fullshard-bench-fsdp: what a communication group costs on top of the raw MPI collective,
// and whether a host collective overlaps with computation here.
//
//   fsdp/all_gather/<MiB>        FSDPModule::unshard() + reshard(): collective (no copy-in:
//                                the shards are the send buffer) + copy-out into the
//                                unsharded parameters, one group of 64 parameters
//   fsdp/all_gather_bf16/<MiB>   the same with param_dtype bf16 (cast copy-in, half the bytes)
//   raw/MPI_Allgather/<MiB>      MPI_Allgather in place of the same bytes (f32)
//   fsdp/reduce_scatter/<MiB>    post-backward of the group: copy-in (chunk-cat) + reduce-
//                                scatter + copy-out (divide, accumulate), waited for
//   raw/MPI_Reduce_scatter_block/<MiB>
//   overlap/<mode>/<MiB>         an all-gather and a computation of about the same duration:
//                                comm, compute, sequential, worker (all-gather on a worker
//                                stream while the caller computes), iallgather (MPI_Iallgather
//                                + MPI_Test between compute chunks)
// <MiB> is the group shard per rank (the bytes each rank contributes).
//
// Launch: scripts/mpirun-local -n 4 build/bench/fullshard-bench-fsdp [--benchmark_* flags]
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/fullshard.hpp"
#include "group_bench.hpp"
#include "mpi_bench.hpp"

namespace {

namespace fs = fullshard;
using fs::bench::die;
using fs::bench::timed_loop;

using fs::bench::bench_group_all_gather;
using fs::bench::bench_group_reduce_scatter;
using fs::bench::bench_raw_collective;

// ---- overlap ------------------------------------------------------------------------------

// A memory- and FMA-bound pass over a 1 MiB buffer, repeated `reps` times.
double compute(std::vector<float>& x, int reps) {
  float acc = 0;
  for (int k = 0; k < reps; ++k)
    for (auto& v : x) {
      v = v * 0.999f + 0.001f;
      acc += v;
    }
  return acc;
}

enum class Mode { comm, compute, sequential, worker, iallgather };

void bench_overlap(benchmark::State& state, const fs::DeviceMesh* mesh, MPI_Comm raw, double mib,
                   Mode mode, int reps) {
  try {
    auto& c = mesh->comm(mesh->names()[0], fs::comm::StreamKind::all_gather);
    const int W = c.size(), r = c.rank();
    const std::int64_t per_rank = static_cast<std::int64_t>(mib * (1 << 20)) / 4;
    std::vector<float> buf(static_cast<std::size_t>(per_rank * W), 1.0f);
    std::vector<float> work((1 << 20) / 4, 1.0f);
    auto caller = fs::comm::Stream::caller();
    auto worker = fs::comm::Stream::worker("overlap");
    float* slot = buf.data() + r * per_rank;
    volatile double sink = 0;
    auto op = [&] {
      switch (mode) {
        case Mode::comm:
          c.all_gather(slot, buf.data(), per_rank, fs::DType::f32, caller).wait();
          break;
        case Mode::compute:
          sink = compute(work, reps);
          break;
        case Mode::sequential:
          c.all_gather(slot, buf.data(), per_rank, fs::DType::f32, caller).wait();
          sink = compute(work, reps);
          break;
        case Mode::worker: {
          auto w = c.all_gather(slot, buf.data(), per_rank, fs::DType::f32, worker);
          sink = compute(work, reps);
          w.wait();
          break;
        }
        case Mode::iallgather: {
          MPI_Request req = MPI_REQUEST_NULL;
          MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf.data(), static_cast<int>(per_rank),
                         MPI_FLOAT, raw, &req);
          int done = 0;
          for (int k = 0; k < reps; ++k) {
            sink = compute(work, 1);
            if (!done) MPI_Test(&req, &done, MPI_STATUS_IGNORE);
          }
          MPI_Wait(&req, MPI_STATUS_IGNORE);
          break;
        }
      }
    };
    op();
    timed_loop(state, op);
    (void)sink;
  } catch (const std::exception& e) {
    die("overlap", e);
  }
}

// Compute repetitions that take about as long as an all-gather of `mib` per rank (measured on
// rank 0, broadcast so every rank runs the same work).
int calibrate(const fs::DeviceMesh& mesh, double mib) {
  auto& c = mesh.comm(mesh.names()[0], fs::comm::StreamKind::all_gather);
  const std::int64_t per_rank = static_cast<std::int64_t>(mib * (1 << 20)) / 4;
  std::vector<float> buf(static_cast<std::size_t>(per_rank * c.size()), 1.0f);
  std::vector<float> work((1 << 20) / 4, 1.0f);
  auto s = fs::comm::Stream::caller();
  std::vector<double> t;
  for (int i = 0; i < 7; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    c.all_gather(buf.data() + c.rank() * per_rank, buf.data(), per_rank, fs::DType::f32, s).wait();
    t.push_back(MPI_Wtime() - t0);
  }
  std::sort(t.begin(), t.end());
  const double t1 = MPI_Wtime();
  volatile double sink = compute(work, 10);
  (void)sink;
  const double per_rep = (MPI_Wtime() - t1) / 10;
  int reps = std::max(1, static_cast<int>(std::lround(t[3] / per_rep)));
  MPI_Bcast(&reps, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return reps;
}

}  // namespace

int main(int argc, char** argv) {
  if (!fs::bench::early_flags(argc, argv, "fullshard-bench-fsdp")) return 1;
  fs::Runtime rt(argc, argv);
  int result = 0;
  {
    fs::DeviceMesh mesh(rt, {rt.world_size()}, {"dp"});
    MPI_Comm raw = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);
    for (double mib : {0.25, 1.0, 4.0, 16.0}) {
      const std::string s = mib < 1 ? "0.25" : std::to_string(static_cast<int>(mib));
      const std::optional<fs::DType> f32, bf16 = fs::DType::bf16;
      const fs::fsdp::CompressionPolicy none;
      benchmark::RegisterBenchmark(("fsdp/all_gather/" + s).c_str(), bench_group_all_gather, &mesh,
                                   mib, f32, "fsdp/all_gather", none)
          ->UseManualTime();
      benchmark::RegisterBenchmark(("fsdp/all_gather_bf16/" + s).c_str(), bench_group_all_gather,
                                   &mesh, mib, bf16, "fsdp/all_gather_bf16", none)
          ->UseManualTime();
      benchmark::RegisterBenchmark(("raw/MPI_Allgather/" + s).c_str(), bench_raw_collective, raw,
                                   mib, true)
          ->UseManualTime();
      benchmark::RegisterBenchmark(("fsdp/reduce_scatter/" + s).c_str(), bench_group_reduce_scatter,
                                   &mesh, mib, "fsdp/reduce_scatter", none)
          ->UseManualTime();
      benchmark::RegisterBenchmark(("raw/MPI_Reduce_scatter_block/" + s).c_str(),
                                   bench_raw_collective, raw, mib, false)
          ->UseManualTime();
    }
    for (double mib : {1.0, 8.0}) {
      const int reps = calibrate(mesh, mib);
      const std::string s = std::to_string(static_cast<int>(mib));
      const std::pair<const char*, Mode> modes[] = {{"comm", Mode::comm},
                                                    {"compute", Mode::compute},
                                                    {"sequential", Mode::sequential},
                                                    {"worker", Mode::worker},
                                                    {"iallgather", Mode::iallgather}};
      for (const auto& [name, mode] : modes)
        benchmark::RegisterBenchmark(("overlap/" + std::string(name) + "/" + s).c_str(),
                                     bench_overlap, &mesh, raw, mib, mode, reps)
            ->UseManualTime();
    }
    result = fs::bench::run_benchmarks(argc, argv);
    MPI_Comm_free(&raw);
  }
  return result;
}
