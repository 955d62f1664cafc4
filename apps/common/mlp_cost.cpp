#include "mlp_cost.hpp"

#include <cblas.h>
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/comm/stream.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/optim/optimizer.hpp"

namespace fullshard::apps {

using schedule::Gemm;
using schedule::Work;

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

void declare_costs(ResidualMlp& model, const schedule::ComputeRates& rates, std::int64_t rows) {
  const MlpWork w = residual_mlp_work(model.shape(), rows);
  graph::Module& root = model.root();
  root.module("input").cost() = schedule::cost_from_work(rates, w.input_forward, w.input_backward);
  root.module("output").cost() =
      schedule::cost_from_work(rates, w.output_forward, w.output_backward);
  for (int i = 0; i < model.shape().blocks; ++i)
    root.module("blocks." + std::to_string(i)).cost() =
        schedule::cost_from_work(rates, w.block_forward, w.block_backward);
}

namespace {

/// Work per millisecond of `op` (which returns the work it did: flops or bytes) on the
/// slowest rank, run from a barrier for min_ms of wall time on every rank at once.
double rate_once(comm::Communicator& c, comm::Stream& s, double min_ms,
                 const std::function<double()>& op) {
  c.barrier(s).wait();
  const double t0 = MPI_Wtime();
  double work = 0.0, ms = 0.0;
  do {
    work += op();
    ms = (MPI_Wtime() - t0) * 1e3;
  } while (ms < min_ms);
  double rate = work / ms, slowest = rate;
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
      best[i] = std::max(best[i], rate_once(*c, s, what.min_ms, ops[i]));

  schedule::ComputeRates rates;
  rates.ranks = c->size();
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
