// The memory account (docs/memory.md): each part the plan predicts (schedule::plan_memory)
// equals the peak the library's memory ledger counts for it in the second step, exactly: shards,
// sharded gradients, optimizer state, the buffer pool (blocks in use and cached) and the
// shared-memory windows, for f32 and bf16 compute, SGD and AdamW, AdamW inside backward, and
// CPU offload.
// A model of a root and six blocks, created sharded, on 1, 2, 3 and 4 ranks.
#include <doctest/doctest.h>

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "fullshard/base/memory_ledger.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "fullshard/schedule/executor.hpp"
#include "fullshard/schedule/memory_account.hpp"
#include "fullshard/schedule/memory_budget.hpp"
#include "fullshard/schedule/plan.hpp"
#include "test_support.hpp"

using namespace fullshard;
using graph::Module;
using schedule::MemoryAccount;

namespace {

struct Case {
  const char* name;
  DType param_dtype;
  int states;  // optimizer state arrays: SGD 0, AdamW 2
  bool in_backward;
  bool offload = false;
  int reshard_k = 0;        // reshard_after_forward = k (the post-forward slices): W == 4
  bool hsdp = false;        // 2 replicas of W/2 (the reduction's output feeds the all-reduce)
  bool compressed = false;  // int8 both ways: the group runs on MPI, also on a shm mesh
  int per_node = 0;         // > 0: ranks pretended to share a node (two levels): W == 4
};

std::unique_ptr<Module> make_model(int blocks) {
  auto root = Module::make_root("model");
  root->add_param("r", {10, 6}).init_sharded([](std::int64_t e) { return double(e % 5) / 8; });
  for (int b = 0; b < blocks; ++b) {
    Module& m = root->add_module("b" + std::to_string(b));
    m.add_param("w", {24 + 2 * b, 12}).init_sharded([b](std::int64_t e) {
      return double((e + b) % 7) / 8;
    });
    m.add_param("bias", {24 + 2 * b}).init_sharded([](std::int64_t e) { return double(e % 3); });
    m.set_fully_shard_request(true);
  }
  root->set_fully_shard_request(true);
  return root;
}

std::uint64_t peak(const MemoryCounts& c, MemoryPart p) {
  return c.peak_of(p);
}

}  // namespace

TEST_CASE("memory account: every planned part equals the library's counted bytes") {
  const int W = test::world_size();
  constexpr int kBlocks = 6;
  for (const Case k :
       {Case{"f32 SGD", DType::f32, 0, false}, Case{"f32 AdamW", DType::f32, 2, false},
        Case{"bf16 AdamW", DType::bf16, 2, false},
        Case{"f32 AdamW inside backward", DType::f32, 2, true},
        Case{"f32 AdamW, CPU offload", DType::f32, 2, false, true},
        Case{"f32 AdamW, reshard after forward to 2 ranks", DType::f32, 2, false, false, 2},
        Case{"f32 AdamW, HSDP 2 x 2", DType::f32, 2, false, false, 0, true},
        Case{"f32 SGD, int8 collectives", DType::f32, 0, false, false, 0, false, true},
        Case{"f32 AdamW, two levels (2 nodes of 2)", DType::f32, 2, false, false, 0, false, false,
             2},
        Case{"bf16 SGD, two levels (2 nodes of 2)", DType::bf16, 0, false, false, 0, false, false,
             2},
        Case{"bf16 AdamW, reshard after forward to 2 ranks", DType::bf16, 2, false, false, 2}}) {
    const std::string name = k.name;
    CAPTURE(name);
    if ((k.reshard_k > 0 || k.hsdp || k.per_node > 0) && W != 4) continue;  // needs W = 4
    if (k.compressed && W == 1) continue;                                   // nothing to compress
    const MemoryCounts before = memory_ledger::counts();
    for (MemoryPart p : {MemoryPart::shards, MemoryPart::gradients, MemoryPart::optimizer_state,
                         MemoryPart::pool, MemoryPart::windows})
      REQUIRE(before.now_of(p) == 0);  // the previous case gave everything back
    {
      DeviceMesh mesh = k.hsdp ? DeviceMesh(test::runtime(), {2, W / 2}, {"rep", "dp"})
                        : k.per_node > 0
                            ? DeviceMesh(MPI_COMM_WORLD, {W}, {"dp"}, 60.0, HostProgress::inline_,
                                         HostCollectives::auto_, k.per_node)
                            : DeviceMesh(test::runtime(), {W}, {"dp"});
      auto root = make_model(kBlocks);
      schedule::PlanOptions o;
      if (k.param_dtype != DType::f32) o.defaults.mp_policy.param_dtype = k.param_dtype;
      if (k.in_backward) o.optimizer_in_backward_states = k.states;
      if (k.offload) o.defaults.offload_policy = fsdp::CPUOffloadPolicy{};
      if (k.reshard_k > 0)
        o.defaults.reshard_after_forward = fsdp::ReshardAfterForward::group_size(k.reshard_k);
      if (k.compressed) {
        o.defaults.compression.all_gather = kernels::QuantCode::int8;
        o.defaults.compression.reduce_scatter = kernels::QuantCode::int8;
      }
      const schedule::Plan plan = schedule::Scheduler::plan(
          *root, k.hsdp ? schedule::MeshShape::hsdp(2, W / 2) : schedule::MeshShape::fsdp(W), o);
      schedule::MemoryInputs in;
      in.optimizer_states = k.states;
      in.shared_memory = mesh.shm("dp") != nullptr || mesh.node_split("dp") != nullptr;
      in.rank = mesh.coordinate("dp");
      if (const NodeSplit* split = mesh.node_split("dp")) in.nodes = split->nodes();
      if (k.per_node > 0) REQUIRE(in.nodes == 2);
      const MemoryAccount planned = schedule::plan_memory(plan, in);

      fsdp::apply_fully_shard_requests(*root, mesh, o.defaults);
      // Every rank adds (rank + 1) to each gradient element.
      const double mine = test::world_rank() + 1;
      auto add = [mine](Module& m) {
        for (std::size_t i = 0; i < m.num_params(); ++i) {
          Tensor& g = const_cast<Tensor&>(m.param(i).grad());
          for (std::int64_t e = 0; e < g.numel(); ++e)
            g.set(e, g.at(e) + mine);
        }
      };
      root->on_backward(add);
      for (int b = 0; b < kBlocks; ++b)
        root->module("b" + std::to_string(b)).on_backward(add);
      std::unique_ptr<optim::Optimizer> opt;
      if (k.states == 0)
        opt = std::make_unique<optim::SGD>(root->parameters(), 0.01);
      else
        opt = std::make_unique<optim::AdamW>(root->parameters(), 0.01);
      if (k.in_backward) opt->run_in_backward();
      schedule::Executor ex(*root, mesh, plan);
      for (int step = 0; step < 2; ++step) {
        ex.step();
        if (!k.in_backward) opt->step();
        fsdp::fsdp_state(*root)->zero_grad();  // as a training loop does
        // The steady state: the peaks of the steps after the first (which moves the shards
        // into the all-gather windows and makes the pool's blocks).
        if (step == 0) memory_ledger::reset_peaks();
      }
      const MemoryCounts after = memory_ledger::counts();
      MemoryAccount measured;
      measured.shards = peak(after, MemoryPart::shards);
      measured.gradients = peak(after, MemoryPart::gradients);
      measured.optimizer_state = peak(after, MemoryPart::optimizer_state);
      measured.pool = peak(after, MemoryPart::pool);
      measured.windows = peak(after, MemoryPart::windows);
      INFO("planned:\n" << planned.to_text() << "measured:\n" << measured.to_text());
      CHECK(measured.shards == planned.shards);
      CHECK(measured.gradients == planned.gradients);
      CHECK(measured.optimizer_state == planned.optimizer_state);
      CHECK(measured.pool == planned.pool);
      CHECK(measured.windows == planned.windows);
      CHECK(planned.shards > 0);
      if (k.states > 0) CHECK(planned.optimizer_state > 0);
      // Compressed groups run on MPI (transport::group_kind): no windows.
      if (in.shared_memory && !k.compressed) CHECK(planned.windows > 0);
      if (k.compressed) CHECK(planned.windows == 0);
      if (k.in_backward) opt->run_in_backward(false);
    }
  }
}

TEST_CASE("memory budget: a job over it is refused on every rank with the same message") {
  BoundedComm comm(MPI_COMM_WORLD, "test.memory", 60.0);
  MemoryAccount planned;
  planned.baseline = 100 << 20;
  planned.shards = std::size_t(3 + comm.rank()) << 20;  // the last rank has the largest peak
  planned.pool = 7 << 20;
  // The machine's own budget: the cgroup limit or MemAvailable, named.
  const schedule::MemoryBudget machine = schedule::rank_memory_budget(comm);
  CHECK(machine.bytes > planned.process_peak());
  CHECK(!machine.source.empty());
  CHECK(schedule::check_memory_budget(comm, planned, machine, schedule::MemoryCheck::refuse,
                                      "advice") == "");
  // An explicit budget one byte below the largest peak: every rank throws the same message.
  const std::size_t largest = (100 + 3 + 7 + std::size_t(comm.size() - 1)) << 20;
  const schedule::MemoryBudget tight = schedule::rank_memory_budget(comm, largest - 1, "--budget");
  CHECK(tight.bytes == largest - 1);
  std::string message;
  try {
    schedule::check_memory_budget(comm, planned, tight, schedule::MemoryCheck::refuse,
                                  "use more ranks");
  } catch (const schedule::MemoryBudgetExceeded& e) {
    message = e.message();
  }
  INFO(message);
  CHECK(message.find("the planned peak of rank " + std::to_string(comm.size() - 1)) == 0);
  CHECK(message.find("(--budget)") != std::string::npos);
  CHECK(message.find("shards " + std::to_string(3 + comm.size() - 1) + ".00 MiB") !=
        std::string::npos);
  CHECK(message.find("use more ranks") != std::string::npos);
  std::uint64_t h = std::hash<std::string>{}(message), lo = h, hi = h;
  MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  CHECK(lo == hi);
  // At the budget: fits; warn returns the message instead of throwing.
  const schedule::MemoryBudget exact = schedule::rank_memory_budget(comm, largest, "--budget");
  CHECK(schedule::check_memory_budget(comm, planned, exact, schedule::MemoryCheck::refuse, "") ==
        "");
  CHECK(schedule::check_memory_budget(comm, planned, tight, schedule::MemoryCheck::warn, "") != "");
}
