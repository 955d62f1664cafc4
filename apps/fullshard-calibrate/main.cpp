// fullshard-calibrate: measures the alpha-beta cost model of this machine's collectives and
// writes it as JSON for `fullshard-plan --cost`. Where the shard dim runs on node-local shared
// memory (FULLSHARD_HOST_COLLECTIVES=auto on one node, or shm) it measures that path too and
// writes "transport": {"shard": "shm"} with the "shm" coefficients; where it spans nodes that
// each hold the same number (two or more) of its ranks, the two-level path ("shm+mpi": MPI
// across the nodes, the "shm" coefficients over the node's ranks).
//   mpirun -n 8 fullshard-calibrate --mesh 8 --out cost.json        (FSDP)
//   mpirun -n 8 fullshard-calibrate --mesh 2x4 --out cost.json      (HSDP: replicate x shard)
// With --compute-out it also measures the compute rates (schedule::ComputeRates: SGEMM at the
// --mlp / --gemm shapes, elementwise passes, optimizer steps) and, for every --mlp shape, the
// residual MLP's modules themselves (input, block, output: their forward and backward code on
// their own parameters and activations); on every rank at once, or one rank at a time when
// the job has more ranks than cores:
//   mpirun -n 4 fullshard-calibrate --mesh 4 --out cost.json --compute-out compute.json
//       --mlp 64x512,64x1024
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "fullshard/fullshard.hpp"
#include "fullshard/schedule/cost_model.hpp"
#ifdef FULLSHARD_CALIBRATE_COMPUTE
#include "blas_kernel.hpp"
#include "mlp_cost.hpp"
#endif

namespace {

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr,
               "fullshard-calibrate: error: %s\n"
               "usage: mpirun -n N fullshard-calibrate --mesh N|RxS --out FILE "
               "[--sizes BYTES,BYTES,...] [--reps K] [--median]\n"
               "       [--compute-out FILE [--mlp ROWSxHIDDEN,...] [--gemm MxNxK:TT,...] "
               "[--compute-ms MS]\n"
               "        [--mlp-blocks L] [--mlp-inputs I] [--mlp-outputs O]]\n",
               msg.c_str());
  std::exit(2);
}

std::vector<std::size_t> parse_sizes(const std::string& s) {
  std::vector<std::size_t> out;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    const std::size_t comma = s.find(',', pos);
    const std::string item =
        s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    char* end = nullptr;
    const unsigned long long v = std::strtoull(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v == 0 || v % 4 != 0)
      usage_error("--sizes: '" + item + "' is not a positive byte count divisible by 4");
    out.push_back(static_cast<std::size_t>(v));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
#ifdef FULLSHARD_CALIBRATE_COMPUTE
  fullshard::apps::run_on_best_blas_kernel(argv);  // the rates of the kernel that will train
#endif
  try {
    fullshard::Runtime rt(argc, argv);
    std::string mesh_arg, out;
    std::vector<std::size_t> sizes = {1 << 16, 1 << 20, 1 << 22};
    int reps = 5;
    bool median = false;
    std::string compute_out;
    std::vector<fullshard::schedule::Gemm> gemms;
    std::int64_t elementwise_floats = 0;
    double compute_ms = 100.0;
    // --mlp: the residual MLPs whose modules are timed (rows per rank x hidden).
    std::vector<std::pair<std::int64_t, std::int64_t>> mlps;
    int mlp_blocks = 8, mlp_inputs = 32, mlp_outputs = 8;
    auto int_option = [](const std::string& name, const std::string& v, int lo, int hi) {
      char* end = nullptr;
      const long x = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || x < lo || x > hi)
        usage_error(name + ": '" + v + "' is not an integer in " + std::to_string(lo) + ".." +
                    std::to_string(hi));
      return static_cast<int>(x);
    };
    auto split = [](const std::string& v) {
      std::vector<std::string> items;
      std::size_t pos = 0;
      for (std::size_t c; (c = v.find(',', pos)) != std::string::npos; pos = c + 1)
        items.push_back(v.substr(pos, c - pos));
      items.push_back(v.substr(pos));
      return items;
    };
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) usage_error(a + " needs a value");
        return argv[++i];
      };
      if (a == "--mesh")
        mesh_arg = value();
      else if (a == "--out")
        out = value();
      else if (a == "--sizes")
        sizes = parse_sizes(value());
      else if (a == "--reps")
        reps = std::atoi(value().c_str());
      else if (a == "--median")
        median = true;
      else if (a == "--compute-out")
        compute_out = value();
      else if (a == "--compute-ms")
        compute_ms = std::atof(value().c_str());
      else if (a == "--mlp-blocks")
        mlp_blocks = int_option(a, value(), 1, 1024);
      else if (a == "--mlp-inputs")
        mlp_inputs = int_option(a, value(), 1, 1 << 16);
      else if (a == "--mlp-outputs")
        mlp_outputs = int_option(a, value(), 1, 1 << 16);
      else if (a == "--gemm" || a == "--mlp") {
        for (const std::string& item : split(value())) {
          try {
            if (a == "--gemm") {
              gemms.push_back(fullshard::schedule::Gemm::parse(item, "--gemm"));
            } else {  // ROWSxHIDDEN: the shapes of a residual MLP block
              if (std::count(item.begin(), item.end(), 'x') != 1 || item.find(':') != item.npos)
                usage_error("--mlp: '" + item + "' is not ROWSxHIDDEN (e.g. 64x512)");
              const auto g = fullshard::schedule::Gemm::parse(item + "x1", "--mlp");
              for (const auto& b : {fullshard::schedule::Gemm{g.m, g.n, g.n, false, true},
                                    fullshard::schedule::Gemm{g.m, g.n, g.n, false, false},
                                    fullshard::schedule::Gemm{g.n, g.n, g.m, true, false}})
                gemms.push_back(b);
              elementwise_floats = std::max(elementwise_floats, g.m * g.n);
              if (g.m > (1 << 20) || g.n > (1 << 16))
                usage_error("--mlp: '" + item + "': rows must be <= 2^20 and hidden <= 2^16");
              mlps.emplace_back(g.m, g.n);
            }
          } catch (const fullshard::InvalidArgument& e) {
            usage_error(e.what());
          }
        }
      } else
        usage_error("unknown option '" + a + "'");
    }
    if (mesh_arg.empty() || (out.empty() && compute_out.empty()))
      usage_error("--mesh and --out (or --compute-out) are required");
    if (!(compute_ms > 0)) usage_error("--compute-ms must be > 0");
    if (reps < 1) usage_error("--reps must be >= 1");
    int replicate = 1, shard = 0;
    if (const auto x = mesh_arg.find('x'); x != std::string::npos) {
      replicate = std::atoi(mesh_arg.substr(0, x).c_str());
      shard = std::atoi(mesh_arg.substr(x + 1).c_str());
    } else {
      shard = std::atoi(mesh_arg.c_str());
    }
    if (replicate < 1 || shard < 1 || replicate * shard != rt.world_size())
      usage_error("--mesh " + mesh_arg + " does not describe the " +
                  std::to_string(rt.world_size()) + " ranks of this job");
    const auto shape = fullshard::schedule::MeshShape::hsdp(replicate, shard);
    fullshard::DeviceMesh mesh =
        replicate > 1 ? fullshard::DeviceMesh(rt, {replicate, shard}, {"replicate", "shard"})
                      : fullshard::DeviceMesh(rt, {shard}, {"shard"});
    // The files it writes (rank 0), before the measurements: a bad path must not cost them.
    if (!compute_out.empty())
      fullshard::checkpoint::check_output_file(compute_out, "--compute-out", mesh);
    if (!out.empty()) fullshard::checkpoint::check_output_file(out, "--out", mesh);
    if (!compute_out.empty()) {
#ifdef FULLSHARD_CALIBRATE_COMPUTE
      fullshard::apps::ComputeCalibration what;
      what.gemms = gemms;
      if (elementwise_floats > 0) what.elementwise_floats = elementwise_floats;
      what.min_ms = compute_ms;
      what.module_reps = reps;
      for (const auto& [rows, hidden] : mlps)
        what.mlps.push_back({fullshard::apps::MlpShape{mlp_inputs, static_cast<int>(hidden),
                                                       mlp_outputs, mlp_blocks},
                             rows});
      const auto rates = fullshard::apps::calibrate_compute(mesh.world_comm(), what);
      if (rt.rank() == 0) {
        std::ofstream f(compute_out);
        f << rates.to_json(2) << "\n";
        if (!f) throw fullshard::ConfigError(compute_out + ": cannot write the compute rates");
        std::printf(
            "fullshard-calibrate: wrote %s (compute rates and the module times of %zu --mlp "
            "shapes; %d ranks, %.2f per core: %s; BLAS %s on a CPU with %s)\n",
            compute_out.c_str(), rates.module_times.size(), rt.world_size(), rates.ranks_per_core,
            rates.ranks_per_core > 1 ? "one rank at a time" : "every rank at once",
            fullshard::loaded_blas().describe().c_str(), fullshard::cpu_features().names().c_str());
      }
#else
      (void)mlp_blocks, (void)mlp_inputs, (void)mlp_outputs;
      usage_error("--compute-out: this build has no BLAS (OpenBLAS was not found)");
#endif
    }
    if (out.empty()) return 0;
    const auto model = fullshard::schedule::CostModel::calibrate(
        mesh.comm("shard"), fullshard::schedule::CostModel::defaults(shape),
        replicate > 1 ? &mesh.comm("replicate") : nullptr, sizes, reps, mesh.shm("shard"), median,
        mesh.node_split("shard"));
    if (rt.rank() == 0) {
      std::ofstream f(out);
      f << model.to_json(2) << "\n";
      if (!f) throw fullshard::ConfigError(out + ": cannot write the cost model");
      std::printf("fullshard-calibrate: wrote %s (%d ranks, mesh %s)\n", out.c_str(),
                  rt.world_size(), mesh_arg.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fullshard-calibrate: error: %s\n", e.what());
    return 2;
  }
}
