#include "mlp_cost.hpp"

#include "bounded_comm.hpp"

#include <mpi.h>
#include <sched.h>
#include <unistd.h>
#include "cblas_api.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/comm/stream.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/optim/optimizer.hpp"

namespace fullshard::apps {

using schedule::Gemm;
using schedule::ModuleWork;

MlpWork residual_mlp_work(const MlpShape& s, std::int64_t rows) {
  if (rows < 0) throw InvalidArgument("residual_mlp_work: rows must be >= 0");
  const std::int64_t r = rows, H = s.hidden, I = s.inputs, O = s.outputs;
  const double f = 4.0;  // bytes per f32
  MlpWork w;
  // Byte counts per rows x width array pass: 1 for a write or read only (bias broadcast,
  // column sum), 2 for read + write (ReLU, copy, add, mask).
  w.input_forward.elementwise_bytes = f * r * H;          // bias broadcast
  w.input_backward.elementwise_bytes = f * r * H;         // db: column sums of d_h
  w.block_forward.elementwise_bytes = 7.0 * f * r * H;    // bias, ReLU, copy h, add b2
  w.block_backward.elementwise_bytes = 6.0 * f * r * H;   // ReLU, 2 column sums, mask
  w.output_forward.elementwise_bytes = 4.0 * f * r * O;   // bias, loss (y, t -> dy)
  w.output_backward.elementwise_bytes = 1.0 * f * r * O;  // db
  if (rows == 0) return w;
  // CBLAS row-major (m, n, k, op(A), op(B)), as linear_forward / linear_backward call it.
  w.input_forward.gemms = {{r, H, I, false, true}};
  w.input_backward.gemms = {{H, I, r, true, false}};  // dW only (no input gradient)
  w.block_forward.gemms = {{r, H, H, false, true}, {r, H, H, false, true}};
  w.block_backward.gemms = {{H, H, r, true, false},    // dW2
                            {r, H, H, false, false},   // d_a = d_h W2
                            {H, H, r, true, false},    // dW1
                            {r, H, H, false, false}};  // d_h += d_a W1
  w.output_forward.gemms = {{r, O, H, false, true}};
  w.output_backward.gemms = {{O, H, r, true, false}, {r, H, O, false, false}};
  return w;
}

std::vector<Gemm> residual_mlp_block_gemms(std::int64_t hidden, std::int64_t rows) {
  return {{rows, hidden, hidden, false, true},
          {rows, hidden, hidden, false, false},
          {hidden, hidden, rows, true, false}};
}

std::map<std::string, std::int64_t> residual_mlp_key(const MlpShape& s, std::int64_t rows) {
  return {{"rows", rows}, {"hidden", s.hidden}, {"inputs", s.inputs}, {"outputs", s.outputs}};
}

CostSource declare_costs(ResidualMlp& model, const schedule::ComputeRates& rates,
                         std::int64_t rows) {
  graph::Module& root = model.root();
  const auto blocks = model.shape().blocks;
  if (const schedule::MeasuredModules* m =
          rates.measured_modules(kResidualMlpModel, residual_mlp_key(model.shape(), rows))) {
    auto cost = [&](const std::string& name) {
      graph::Cost c;
      const auto it = m->modules.find(name);
      if (it == m->modules.end())
        throw ConfigError("declare_costs: the measured module times of residual_mlp at rows " +
                          std::to_string(rows) + " have no module '" + name + "'");
      c.forward_ms = it->second.forward_ms;
      c.backward_ms = it->second.backward_ms;
      c.declared = true;
      return c;
    };
    root.module("input").cost() = cost("input");
    root.module("output").cost() = cost("output");
    if (blocks > 0) {
      const graph::Cost b = cost("block");
      for (int i = 0; i < blocks; ++i)
        root.module("blocks." + std::to_string(i)).cost() = b;
    }
    return CostSource::measured_modules;
  }
  const MlpWork w = residual_mlp_work(model.shape(), rows);
  root.module("input").cost() = schedule::cost_from_work(rates, w.input_forward, w.input_backward);
  root.module("output").cost() =
      schedule::cost_from_work(rates, w.output_forward, w.output_backward);
  for (int i = 0; i < blocks; ++i)
    root.module("blocks." + std::to_string(i)).cost() =
        schedule::cost_from_work(rates, w.block_forward, w.block_backward);
  return CostSource::flop_model;
}

schedule::MeasuredModules time_residual_mlp_modules(const MlpShape& shape, std::int64_t rows,
                                                    int reps, int warmup) {
  if (rows < 1 || rows > INT_MAX || reps < 1 || warmup < 0 || shape.blocks < 1)
    throw InvalidArgument("time_residual_mlp_modules: rows (" + std::to_string(rows) +
                          ") must be in 1..2^31-1, reps (" + std::to_string(reps) +
                          ") >= 1, warmup (" + std::to_string(warmup) + ") >= 0 and blocks (" +
                          std::to_string(shape.blocks) + ") >= 1");
  ResidualMlp model(shape, 7);
  model.materialize();  // timed unsharded
  for (graph::Parameter* p : model.root().parameters())
    p->set_grad(Tensor::zeros(p->shape(), DType::f32));
  const auto r = static_cast<std::size_t>(rows);
  std::vector<float> x(r * static_cast<std::size_t>(shape.inputs)),
      t(r * static_cast<std::size_t>(shape.outputs));
  for (std::size_t e = 0; e < x.size(); ++e)
    x[e] = static_cast<float>(normal01(11, 0, e));
  for (std::size_t e = 0; e < t.size(); ++e)
    t[e] = static_cast<float>(normal01(11, 1, e));
  model.set_batch(x.data(), t.data(), static_cast<int>(rows), rows);

  graph::Module& root = model.root();
  std::vector<graph::Module*> order = {&root.module("input")};
  for (int i = 0; i < shape.blocks; ++i)
    order.push_back(&root.module("blocks." + std::to_string(i)));
  order.push_back(&root.module("output"));
  using Clock = std::chrono::steady_clock;
  auto run = [](graph::Module& m, bool forward) {
    const auto t0 = Clock::now();
    (forward ? m.forward_callback() : m.backward_callback())(m);
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  // Per repetition: input, block (mean over the blocks), output; forward then backward.
  std::vector<std::vector<double>> samples(6);
  for (int rep = 0; rep < warmup + reps; ++rep) {
    double f[3] = {0, 0, 0}, b[3] = {0, 0, 0};
    for (std::size_t i = 0; i < order.size(); ++i)
      f[i == 0 ? 0 : i + 1 == order.size() ? 2 : 1] += run(*order[i], true);
    for (std::size_t i = order.size(); i-- > 0;)
      b[i == 0 ? 0 : i + 1 == order.size() ? 2 : 1] += run(*order[i], false);
    if (rep < warmup) continue;
    for (int k = 0; k < 3; ++k) {
      const double n = k == 1 ? double(shape.blocks) : 1.0;
      samples[2 * k].push_back(f[k] / n);
      samples[2 * k + 1].push_back(b[k] / n);
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  };
  schedule::MeasuredModules out;
  out.model = kResidualMlpModel;
  out.shape = residual_mlp_key(shape, rows);
  out.reps = reps;
  const char* names[] = {"input", "block", "output"};
  for (int k = 0; k < 3; ++k)
    out.modules[names[k]] = {median(samples[2 * k]), median(samples[2 * k + 1])};
  return out;
}

double scheduler_slice_ms() {
  if (const char* env = std::getenv("FULLSHARD_SCHED_SLICE_MS")) {
    char* end = nullptr;
    const double v = std::strtod(env, &end);
    if (*env == '\0' || *end != '\0' || !(v > 0) || !std::isfinite(v))
      throw InvalidArgument("FULLSHARD_SCHED_SLICE_MS: '" + std::string(env) +
                            "' is not a number of milliseconds > 0");
    return v;
  }
  if (std::ifstream f("/sys/kernel/debug/sched/base_slice_ns"); f) {
    double ns = 0;
    if (f >> ns && ns > 0) return ns * 1e-6;
  }
  const long cpus = std::max(1L, std::min(8L, sysconf(_SC_NPROCESSORS_ONLN)));
  int log2 = 0;
  while ((2L << log2) <= cpus)
    ++log2;
  return 0.75 * (1 + log2);
}

double job_ranks_per_core(double timeout_s) {
  BoundedComm node(BoundedComm::split_node(MPI_COMM_WORLD, "ranks_per_core.node", timeout_s),
                   "ranks_per_core.node", timeout_s);
  cpu_set_t all;
  CPU_ZERO(&all);
  if (sched_getaffinity(0, sizeof(all), &all) != 0) CPU_SET(0, &all);
  const int node_ranks = node.size();
  // The union of the node's affinity masks: the CPUs its ranks may run on.
  node.allreduce(&all, static_cast<int>(sizeof(cpu_set_t)), MPI_BYTE, MPI_BOR,
                 "union of the affinity masks");
  MPI_Comm node_comm = node.get();
  MPI_Comm_free(&node_comm);
  double most = double(node_ranks) / double(std::max(1, CPU_COUNT(&all)));
  BoundedComm world(MPI_COMM_WORLD, "ranks_per_core.world", timeout_s);
  world.allreduce(&most, 1, MPI_DOUBLE, MPI_MAX, "the most ranks per core of a node");
  return most;
}

namespace {

/// Work per millisecond of `op` (which returns the work it did: flops or bytes) on the
/// slowest rank, run for min_ms of wall time from a barrier: on every rank at once, or (solo)
/// on one rank after the other while the others wait in a barrier.
double rate_once(comm::Communicator& c, comm::Stream& s, double min_ms, bool solo,
                 const std::function<double()>& op) {
  auto measure = [&] {
    const double t0 = MPI_Wtime();
    double work = 0.0, ms = 0.0;
    do {
      work += op();
      ms = (MPI_Wtime() - t0) * 1e3;
    } while (ms < min_ms);
    return work / ms;
  };
  double rate = std::numeric_limits<double>::infinity();
  for (int r = 0; r < (solo ? c.size() : 1); ++r) {
    c.barrier(s).wait();
    if (!solo || r == c.rank()) rate = measure();
  }
  double slowest = rate;
  c.all_reduce(&rate, &slowest, 1, DType::f64, comm::ReduceOp::min, s).wait();
  return slowest;
}

}  // namespace

schedule::ComputeRates calibrate_compute(const comm::Communicator& comm_in,
                                         const ComputeCalibration& what) {
  if (what.elementwise_floats < 1 || what.optimizer_elements < 1 || !(what.min_ms > 0))
    throw InvalidArgument(
        "calibrate_compute: elementwise_floats and optimizer_elements must be >= 1 and min_ms > "
        "0");
  std::unique_ptr<comm::Communicator> c = comm_in.dup(comm_in.name() + ".compute");
  comm::Stream s = comm::Stream::caller("fullshard.calibrate.compute");
  const double ranks_per_core =
      what.ranks_per_core > 0 ? what.ranks_per_core : job_ranks_per_core(comm_in.timeout_s());
  const bool solo = ranks_per_core > 1.0;
  // Every measurement is an op returning its work; each holds its own buffers.
  std::vector<std::function<double()>> ops;

  for (const Gemm& g : what.gemms) {
    const auto m = static_cast<int>(g.m), n = static_cast<int>(g.n), k = static_cast<int>(g.k);
    // Operands as a training step finds them: not in this core's L2 cache (each module has
    // its own weights and activations), so the GEMMs cycle through sets of operands that
    // together exceed the L2 (16 MiB).
    const std::size_t sa = static_cast<std::size_t>(m) * k, sb = static_cast<std::size_t>(k) * n,
                      sc = static_cast<std::size_t>(m) * n;
    const std::size_t sets = std::max<std::size_t>(
        1, std::min<std::size_t>(64, (std::size_t(16) << 20) / (4 * (sa + sb + sc)) + 1));
    auto a = std::make_shared<std::vector<float>>(sa * sets, 0.5f);
    auto b = std::make_shared<std::vector<float>>(sb * sets, 0.25f);
    auto cc = std::make_shared<std::vector<float>>(sc * sets, 0.f);
    auto next = std::make_shared<std::size_t>(0);
    const int lda = g.trans_a ? m : k, ldb = g.trans_b ? k : n;
    ops.push_back([=] {
      const std::size_t i = (*next)++ % sets;
      cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
                  g.trans_b ? CblasTrans : CblasNoTrans, m, n, k, 1.f, a->data() + i * sa, lda,
                  b->data() + i * sb, ldb, 1.f, cc->data() + i * sc, n);
      return g.flops();
    });
  }

  // Elementwise: the MLP's passes over rows x hidden arrays (bias broadcast of one row,
  // ReLU, copy, add a row), bytes read + written counted as residual_mlp_work counts them.
  {
    const std::size_t W = 512, R = std::max<std::size_t>(1, what.elementwise_floats / W), N = R * W;
    auto x = std::make_shared<std::vector<float>>(N, 0.5f);
    auto y = std::make_shared<std::vector<float>>(N, -0.25f);
    auto z = std::make_shared<std::vector<float>>(N, 0.f);
    auto row = std::make_shared<std::vector<float>>(W, 0.1f);
    for (std::size_t e = 0; e < N; e += 2)
      (*x)[e] = -(*x)[e];
    ops.push_back([=] {
      float* zp = z->data();
      for (std::size_t r = 0; r < R; ++r)  // bias broadcast: 1
        std::memcpy(zp + r * W, row->data(), sizeof(float) * W);
      for (std::size_t e = 0; e < N; ++e)  // ReLU: 2
        (*y)[e] = (*x)[e] > 0.f ? (*x)[e] : 0.f;
      std::memcpy(zp, y->data(), sizeof(float) * N);  // residual copy: 2
      for (std::size_t r = 0; r < R; ++r)             // bias add: 2
        for (std::size_t j = 0; j < W; ++j)
          zp[r * W + j] += (*row)[j];
      (*x)[0] = zp[N - 1] * 1e-30f;
      return 7.0 * 4.0 * double(N);
    });
  }

  // Optimizers: one step of a parameter of optimizer_elements (its own root module).
  std::vector<std::unique_ptr<graph::Module>> roots;
  std::vector<std::shared_ptr<optim::Optimizer>> opts;
  for (int kind = 0; kind < 2; ++kind) {
    roots.push_back(graph::Module::make_root("calibrate"));
    graph::Parameter& p = roots.back()->add_param("w", {what.optimizer_elements});
    p.init([](std::int64_t e) { return 1e-3 * double(e % 17); });
    // Gradients of both signs and a spread of magnitudes, as a training step's.
    Tensor g = Tensor::zeros({what.optimizer_elements}, DType::f32);
    float* gd = g.data_as<float>();
    for (std::int64_t e = 0; e < what.optimizer_elements; ++e)
      gd[e] = 1e-3f * (static_cast<float>((e * 2654435761LL) % 2001) - 1000.f) / 1000.f;
    p.set_grad(g);
    std::shared_ptr<optim::Optimizer> opt;
    if (kind == 0)
      opt = std::make_shared<optim::AdamW>(std::vector<graph::Parameter*>{&p}, 1e-6, 0.9, 0.999,
                                           1e-8, 0.0);
    else
      opt = std::make_shared<optim::SGD>(std::vector<graph::Parameter*>{&p}, 1e-6, 0.9, 0.0);
    const double elements = double(what.optimizer_elements);
    ops.push_back([opt, elements] {
      opt->step();
      return elements;
    });
  }

  // Three rounds over every measurement (a warm-up call first: page faults, caches, OpenBLAS
  // buffers); each keeps its best round, so a slow second of the machine spoils one round of
  // a measurement, not all three.
  std::vector<double> best(ops.size(), 0.0);
  for (auto& op : ops)
    op();
  for (int round = 0; round < 3; ++round)
    for (std::size_t i = 0; i < ops.size(); ++i)
      best[i] = std::max(best[i], rate_once(*c, s, what.min_ms, solo, ops[i]));

  schedule::ComputeRates rates;
  rates.ranks = c->size();
  rates.ranks_per_core = ranks_per_core;
  // The modules, timed as a step runs them (at once or one rank after the other); the
  // slowest rank's median of each counts.
  for (const auto& [shape, rows] : what.mlps) {
    schedule::MeasuredModules mine;
    for (int r = 0; r < (solo ? c->size() : 1); ++r) {
      c->barrier(s).wait();
      if (!solo || r == c->rank()) mine = time_residual_mlp_modules(shape, rows, what.module_reps);
    }
    std::vector<double> t, slowest;
    for (const auto& [name, m] : mine.modules) {
      t.push_back(m.forward_ms);
      t.push_back(m.backward_ms);
    }
    slowest.resize(t.size());
    c->all_reduce(t.data(), slowest.data(), t.size(), DType::f64, comm::ReduceOp::max, s).wait();
    std::size_t k = 0;
    for (auto& [name, m] : mine.modules) {
      m.forward_ms = slowest[k++];
      m.backward_ms = slowest[k++];
    }
    if (!rates.measured_modules(mine.model, mine.shape))
      rates.module_times.push_back(std::move(mine));
  }
  std::size_t i = 0;
  for (const Gemm& g : what.gemms)
    rates.gemm.push_back({g, best[i++] / 1e6});  // flop per ms -> GFLOP/s
  if (!rates.gemm.empty()) {
    double sum = 0;
    for (const auto& r : rates.gemm)
      sum += r.gflop_per_s;
    rates.default_gemm_gflop_per_s = sum / double(rates.gemm.size());
  }
  rates.elementwise_gb_per_s = best[i++] / 1e6;  // B per ms -> GB/s
  rates.adamw_ns_per_element = 1e6 / best[i++];
  rates.sgd_ns_per_element = 1e6 / best[i++];
  return rates;
}

}  // namespace fullshard::apps
