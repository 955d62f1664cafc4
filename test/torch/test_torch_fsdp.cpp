// fullshard::torch against unsharded LibTorch: the same model, weights and global batch
// trained with AdamW, sharded over the ranks (uneven dims) and unsharded on every rank.
#include "torch_doctest.hpp"  // first: LibTorch, then doctest's CHECK macros

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "fullshard/schedule/auto_plan.hpp"
#include "fullshard/schedule/plan.hpp"
#include "fullshard/torch.hpp"
#include "lib/fsdp/group_access.hpp"
#include "test_support.hpp"

namespace fs = fullshard;
namespace fst = fullshard::torch;
using fs::test::world_rank;
using fs::test::world_size;

namespace {

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t h, double dropout = 0)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", torch::nn::Linear(d, h))),
        fc2(register_module("fc2", torch::nn::Linear(h, d))),
        dropout(dropout) {}
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = torch::tanh(fc1(ln(x)));
    if (dropout > 0) h = torch::dropout(h, dropout, is_training());
    return x + fc2(h);
  }
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc1, fc2;
  double dropout;
};

// Dims not divisible by 2, 3 or 4 ranks: uneven shards, and ranks with fewer rows.
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t in, int64_t d, int64_t h, int64_t out, int n, double dropout = 0)
      : inp(register_module("inp", torch::nn::Linear(in, d))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(d, out))) {
    for (int i = 0; i < n; ++i) {
      auto b = std::make_shared<BlockImpl>(d, h, dropout);
      blocks->push_back(b);
      block_list.push_back(b);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = inp(x);
    for (auto& b : block_list)  // the one line a sharded child changes
      y = checkpointing ? fst::checkpoint(b, y) : fst::call(b, y);
    return head(y);
  }
  bool checkpointing = false;
  torch::nn::Linear inp;
  torch::nn::ModuleList blocks;
  torch::nn::Linear head;
  std::vector<std::shared_ptr<BlockImpl>> block_list;
};

// FSDP2's usual wrapping: fully_shard on every block, then on the root (returned).
auto& shard_blocks_and_root(fst::ShardedModel& sharded, NetImpl& net, const fs::DeviceMesh& mesh) {
  for (auto& b : net.block_list)
    sharded.fully_shard(*b, mesh);
  return sharded.fully_shard(net, mesh);
}

constexpr int64_t kIn = 7, kD = 10, kH = 13, kOut = 5, kBatch = 3;

std::shared_ptr<NetImpl> make_net(double dropout = 0) {
  torch::manual_seed(0);  // the same weights on every rank
  return std::make_shared<NetImpl>(kIn, kD, kH, kOut, 3, dropout);
}

// The global batch of step `step` (the same on every rank).
std::pair<torch::Tensor, torch::Tensor> global_batch(int step) {
  torch::manual_seed(1000 + step);
  const int64_t n = kBatch * world_size();
  return {torch::randn({n, kIn}), torch::randn({n, kOut})};
}

// This rank's rows [r*chunk, min(D, (r+1)*chunk)) of a full tensor (torch.chunk on dim 0).
torch::Tensor shard_rows(const torch::Tensor& full, int rank, int world) {
  const int64_t d = full.size(0);
  const int64_t chunk = (d + world - 1) / world;
  const int64_t start = std::min(d, rank * chunk);
  const int64_t end = std::min(d, (rank + 1) * chunk);
  return full.narrow(0, start, end - start);
}

double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (b.numel() == 0) return a.numel() == 0 ? 0.0 : 1.0;
  const double scale = b.abs().max().item<double>();
  return (a - b).abs().max().item<double>() / std::max(scale, 1e-30);
}

void train(const std::shared_ptr<NetImpl>& net, int steps, bool sharded) {
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = global_batch(s);
    if (sharded) {  // this rank's micro-batch; FSDP averages the gradients over the ranks
      x = x.narrow(0, world_rank() * kBatch, kBatch);
      y = y.narrow(0, world_rank() * kBatch, kBatch);
    }
    opt.zero_grad();
    torch::Tensor loss = torch::mse_loss(fst::call(net, x), y);
    loss.backward();
    opt.step();
  }
}

}  // namespace

TEST_CASE("torch: fully_shard gives dim-0 shards with the FQNs, and shard-shaped gradients") {
  fs::DeviceMesh mesh(fs::test::runtime(), {world_size()}, {"dp"});
  auto net = make_net();
  std::vector<std::pair<std::string, torch::Tensor>> full;
  for (const auto& p : net->named_parameters())
    full.emplace_back(p.key(), p.value().clone());

  fst::ShardedModel sharded(net);
  shard_blocks_and_root(sharded, *net, mesh);
  CHECK(sharded.fqn(*net->block_list[1]->fc1) == "blocks.1.fc1");

  auto params = net->named_parameters();
  REQUIRE(params.size() == full.size());
  for (std::size_t i = 0; i < full.size(); ++i) {
    CAPTURE(full[i].first);
    CHECK(params[i].key() == full[i].first);
    const torch::Tensor want = shard_rows(full[i].second, world_rank(), world_size());
    CHECK(params[i].value().sizes() == want.sizes());
    CHECK(torch::equal(params[i].value(), want));
  }

  auto [x, y] = global_batch(0);
  torch::mse_loss(fst::call(net, x.narrow(0, world_rank() * kBatch, kBatch)),
                  y.narrow(0, world_rank() * kBatch, kBatch))
      .backward();
  for (const auto& p : net->named_parameters()) {
    CAPTURE(p.key());
    REQUIRE(p.value().grad().defined());
    CHECK(p.value().grad().sizes() == p.value().sizes());
  }
  for (auto& b : net->block_list)
    CHECK(sharded.state(*b).is_sharded());
}

TEST_CASE("torch: 10 AdamW steps sharded equal unsharded LibTorch on the global batch") {
  fs::DeviceMesh mesh(fs::test::runtime(), {world_size()}, {"dp"});
  auto ref = make_net();
  train(ref, 10, false);

  auto net = make_net();
  fst::ShardedModel sharded(net);
  shard_blocks_and_root(sharded, *net, mesh);
  train(net, 10, true);

  auto want = ref->named_parameters();
  auto got = net->named_parameters();
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(got[i].key());
    const torch::Tensor w = shard_rows(want[i].value(), world_rank(), world_size());
    REQUIRE(got[i].value().sizes() == w.sizes());
    const double d = rel_diff(got[i].value(), w);
    worst = std::max(worst, d);
    CHECK(d <= 1e-5);
  }
  MESSAGE("worst relative difference over the parameters: " << worst);
  // Training moved the weights (the comparison is not of two untouched models).
  CHECK(rel_diff(ref->head->weight, make_net()->head->weight) > 1e-3);
}

TEST_CASE("torch: deferred initialisation: meta parameters, each rank fills only its shards") {
  fs::DeviceMesh mesh(fs::test::runtime(), {world_size()}, {"dp"});
  auto ref = make_net();  // the values the initialisation computes (rows of these tensors)
  std::map<std::string, torch::Tensor> full;
  for (const auto& p : ref->named_parameters())
    full[p.key()] = p.value().detach().clone();
  train(ref, 10, false);

  auto net = make_net();
  fst::to_meta(*net);
  for (const auto& p : net->named_parameters()) {
    CAPTURE(p.key());
    CHECK(p.value().is_meta());
    CHECK(p.value().requires_grad());
  }
  CHECK(net->block_list[0]->fc1->weight.is_meta());  // the module's own handle follows
  fst::ShardedModel sharded(net);
  shard_blocks_and_root(sharded, *net, mesh);
  for (const auto& p : net->named_parameters()) {  // this rank's shards, zeros until filled
    CAPTURE(p.key());
    CHECK(p.value().device().is_cpu());
    CHECK(p.value().sizes() == shard_rows(full[p.key()], world_rank(), world_size()).sizes());
    CHECK(p.value().abs().sum().item<double>() == 0.0);
  }
  std::map<std::string, int> visits;
  sharded.initialize([&](const fst::LocalShard& s) {
    CAPTURE(s.fqn);
    REQUIRE(full.count(s.fqn));
    const torch::Tensor& f = full[s.fqn];
    const torch::Tensor want = shard_rows(f, world_rank(), world_size());
    CHECK(s.sharded);
    CHECK(s.full_shape == f.sizes().vec());
    CHECK(s.tensor.sizes() == want.sizes());
    const int64_t chunk = (f.size(0) + world_size() - 1) / world_size();
    CHECK(s.row_offset == std::min<int64_t>(f.size(0), world_rank() * chunk));
    s.tensor.copy_(f.narrow(0, s.row_offset, s.tensor.size(0)));
    ++visits[s.fqn];
  });
  CHECK(visits.size() == full.size());
  train(net, 10, true);
  auto want = ref->named_parameters();
  auto got = net->named_parameters();
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(got[i].key());
    const double d =
        rel_diff(got[i].value(), shard_rows(want[i].value(), world_rank(), world_size()));
    worst = std::max(worst, d);
    CHECK(d <= 1e-5);
  }
  MESSAGE("deferred initialisation, worst relative difference: " << worst);

  // Buffers and ignored parameters are materialised whole (zeros), and initialised whole.
  auto other = make_net();
  other->register_buffer("counts", torch::arange(5.0));
  fst::to_meta(*other);
  fst::ShardedModel sharded2(other);
  CHECK_THROWS_WITH_AS(sharded2.initialize([](const fst::LocalShard&) {}),
                       doctest::Contains("fully_shard was not applied to the root"),
                       fs::InvalidArgument);
  fs::fsdp::FullyShardOptions o;
  o.ignored_params = {"head.bias"};
  sharded2.fully_shard(*other, mesh, o);
  std::map<std::string, std::vector<int64_t>> whole;
  sharded2.initialize([&](const fst::LocalShard& s) {
    if (s.sharded) return;
    whole[s.fqn] = s.tensor.sizes().vec();
    CHECK(s.row_offset == 0);
    CHECK(s.full_shape == s.tensor.sizes().vec());
    s.tensor.fill_(3.0);
  });
  CHECK(whole ==
        std::map<std::string, std::vector<int64_t>>{{"counts", {5}}, {"head.bias", {kOut}}});
  CHECK(torch::equal(other->named_buffers()["counts"], torch::full({5}, 3.0)));
  CHECK(torch::equal(other->head->bias, torch::full({kOut}, 3.0f)));
}

TEST_CASE(
    "torch: a deferred GPT: the full model never exists, its shards get GPT-2's init, "
    "the same values as the whole model's") {
  fs::DeviceMesh mesh(fs::test::runtime(), {world_size()}, {"dp"});
  fst::GptConfig c;
  c.vocab = 16;
  c.context = 8;
  c.d_model = 32;
  c.heads = 2;
  c.layers = 2;
  c.deferred = true;
  c.seed = 17;
  fst::Gpt gpt(c);
  for (const auto& p : gpt->named_parameters())
    CHECK(p.value().is_meta());
  fst::ShardedModel sharded(gpt);
  for (auto& b : gpt->block_list)
    sharded.fully_shard(b, mesh);
  sharded.fully_shard(gpt, mesh);
  sharded.initialize([&](const fst::LocalShard& s) { gpt->init_weights(s); });
  // Each rank's rows are those of the same GPT built whole on one rank.
  {
    fst::GptConfig whole_c = c;
    whole_c.deferred = false;
    fst::Gpt whole(whole_c);
    const auto full = whole->named_parameters();
    const int W = world_size(), r = world_rank();
    for (const auto& p : gpt->named_parameters()) {
      CAPTURE(p.key());
      const torch::Tensor& want = full[p.key()];
      const std::int64_t chunk = (want.size(0) + W - 1) / W;  // torch.chunk on dim 0
      const torch::Tensor rows =
          want.narrow(0, std::min(want.size(0), r * chunk), p.value().size(0));
      CHECK(torch::equal(p.value(), rows));
    }
  }
  for (const auto& p : gpt->named_parameters()) {
    CAPTURE(p.key());
    const torch::Tensor& t = p.value();
    const std::string& name = p.key();
    if (t.numel() == 0) continue;
    if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) {
      CHECK(t.abs().max().item<double>() == 0.0);
    } else if (t.dim() == 1) {
      CHECK(torch::equal(t, torch::ones_like(t)));  // LayerNorm gains
    } else if (t.numel() >= 500) {
      const bool residual =
          name.find(".proj.") != std::string::npos || name.find(".out.") != std::string::npos;
      const double want = residual ? 0.02 / std::sqrt(2.0 * c.layers) : 0.02;
      CHECK(std::abs(t.std().item<double>() - want) <= 0.15 * want);
    }
  }
  // Near-uniform logits at the start: the loss is about ln(vocab).
  torch::manual_seed(5);
  const torch::Tensor ids = torch::randint(0, c.vocab, {2, c.context}, torch::kLong);
  const torch::Tensor loss = gpt->loss(ids);
  loss.backward();
  CHECK(std::abs(loss.item<double>() - std::log(double(c.vocab))) <= 0.1);
}

namespace {

// One configuration of the conformance runs: sharded training against its unsharded
// reference, both fed the same global batches.
struct Setup {
  bool hsdp = false;  // a (replicate=2, shard=W/2) mesh
  fs::HostCollectives collectives = fs::HostCollectives::auto_;
  fs::fsdp::FullyShardOptions options;
  int micro_batches = 1;       // gradient accumulation: no_sync on all but the last
  bool bf16 = false;           // MixedPrecisionPolicy(param_dtype bf16, reduce_dtype f32)
  bool set_to_none = false;    // zero_grad sets the gradients to none (LibTorch 2.x's default)
  double dropout = 0;          // in every block
  bool checkpointing = false;  // of every block (the sharded run only)
};

constexpr int kSteps = 10;

// The batch of (step, rank, micro-batch): rows of the step's global batch.
std::pair<torch::Tensor, torch::Tensor> micro_batch(int step, int rank, int mb, int mbs) {
  torch::manual_seed(1000 + step);
  const int64_t rows = kBatch * mbs;
  torch::Tensor x = torch::randn({rows * world_size(), kIn});
  torch::Tensor y = torch::randn({rows * world_size(), kOut});
  const int64_t at = rank * rows + mb * kBatch;
  return {x.narrow(0, at, kBatch), y.narrow(0, at, kBatch)};
}

torch::Tensor loss_of(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::mse_loss(out.to(torch::kFloat), y);
}

// The reference: f32 master weights, every rank's micro-batches run in the compute dtype on
// one unsharded copy, each rank's gradient accumulated in that dtype, then (f32) summed in
// rank order and divided by the data-parallel size, as FSDP reduces them.
std::shared_ptr<NetImpl> train_reference(const Setup& su) {
  auto master = make_net(su.dropout);
  auto work = make_net(su.dropout);
  const auto dt = su.bf16 ? torch::kBFloat16 : torch::kFloat;
  work->to(dt);
  torch::optim::AdamW opt(master->parameters(),
                          torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  auto mp = master->parameters();
  auto wp = work->parameters();
  for (int s = 0; s < kSteps; ++s) {
    std::vector<torch::Tensor> sum(mp.size());
    for (int r = 0; r < world_size(); ++r) {
      {
        torch::NoGradGuard ng;
        for (std::size_t i = 0; i < mp.size(); ++i)
          wp[i].copy_(mp[i]);
      }
      for (auto& p : wp)
        p.mutable_grad() = torch::Tensor();
      for (int mb = 0; mb < su.micro_batches; ++mb) {
        auto [x, y] = micro_batch(s, r, mb, su.micro_batches);
        loss_of(work->forward(x.to(dt)), y).backward();
      }
      for (std::size_t i = 0; i < mp.size(); ++i) {
        torch::Tensor g = wp[i].grad().to(torch::kFloat);
        sum[i] = r == 0 ? g : sum[i] + g;
      }
    }
    for (std::size_t i = 0; i < mp.size(); ++i)
      mp[i].mutable_grad() = sum[i] / static_cast<float>(world_size());
    opt.step();
  }
  return master;
}

struct ShardedRun {
  std::shared_ptr<NetImpl> net;
  std::unique_ptr<fs::DeviceMesh> mesh;
  int shard_rank = 0, shard_size = 1;
  std::vector<fs::fsdp::engine::OpDesc> last_step;  // the engine's operations of the last step
};

ShardedRun train_sharded(const Setup& su) {
  ShardedRun run;
  const double timeout = 60;
  if (su.hsdp)
    run.mesh =
        std::make_unique<fs::DeviceMesh>(MPI_COMM_WORLD, std::vector<int>{2, world_size() / 2},
                                         std::vector<std::string>{"replicate", "shard"}, timeout,
                                         fs::HostProgress::inline_, su.collectives);
  else
    run.mesh = std::make_unique<fs::DeviceMesh>(MPI_COMM_WORLD, std::vector<int>{world_size()},
                                                std::vector<std::string>{"dp"}, timeout,
                                                fs::HostProgress::inline_, su.collectives);
  const std::string shard_dim = su.hsdp ? "shard" : "dp";
  run.shard_rank = run.mesh->coordinate(shard_dim);
  run.shard_size = run.mesh->size(shard_dim);
  run.net = make_net(su.dropout);
  run.net->checkpointing = su.checkpointing;
  fs::fsdp::FullyShardOptions o = su.options;
  if (su.bf16) {
    o.mp_policy.param_dtype = fs::DType::bf16;
    o.mp_policy.reduce_dtype = fs::DType::f32;
  }
  fst::ShardedModel sharded(run.net);
  for (auto& b : run.net->block_list)
    sharded.fully_shard(*b, *run.mesh, o);
  fs::fsdp::FSDPModule& root = sharded.fully_shard(*run.net, *run.mesh, o);
  torch::optim::AdamW opt(run.net->parameters(),
                          torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  for (int s = 0; s < kSteps; ++s) {
    if (su.set_to_none)
      for (auto& p : run.net->parameters())
        p.mutable_grad() = torch::Tensor();
    else
      opt.zero_grad();
    if (s == kSteps - 1) fs::fsdp::detail::record_operations(root, &run.last_step);
    for (int mb = 0; mb < su.micro_batches; ++mb) {
      root.set_requires_gradient_sync(mb == su.micro_batches - 1);
      auto [x, y] = micro_batch(s, fs::test::world_rank(), mb, su.micro_batches);
      loss_of(fst::call(run.net, x), y).backward();
    }
    opt.step();
  }
  fs::fsdp::detail::record_operations(root, nullptr);
  return run;
}

ShardedRun check_conformance(const Setup& su) {
  auto want = train_reference(su)->named_parameters();
  ShardedRun run = train_sharded(su);
  auto got = run.net->named_parameters();
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(got[i].key());
    const torch::Tensor w = shard_rows(want[i].value(), run.shard_rank, run.shard_size);
    REQUIRE(got[i].value().sizes() == w.sizes());
    const double d = rel_diff(got[i].value(), w);
    worst = std::max(worst, d);
    CHECK(d <= 1e-5);
  }
  MESSAGE("worst relative difference: " << worst);
  return run;
}

// Unshards (copy-outs into the unsharded parameters) of each group in a phase.
std::map<int, int> unshards(const std::vector<fs::fsdp::engine::OpDesc>& ops,
                            fs::fsdp::engine::Phase phase) {
  std::map<int, int> n;
  for (const auto& op : ops)
    if (op.kind == fs::fsdp::engine::OpKind::copy_out && op.phase == phase) ++n[op.group];
  return n;
}

}  // namespace

TEST_CASE("torch: sharded training equals its reference in every configuration") {
  SUBCASE("MPI collectives (no shared memory)") {
    Setup su;
    su.collectives = fs::HostCollectives::mpi;
    check_conformance(su);
  }
  SUBCASE("mixed precision: bf16 compute, f32 reduction") {
    Setup su;
    su.bf16 = true;
    check_conformance(su);
    // The policy matters: bf16 compute trains other weights than f32 compute.
    CHECK(rel_diff(train_reference(su)->head->weight, train_reference(Setup())->head->weight) >
          1e-4);
  }
  SUBCASE("reshard_after_forward false") {
    Setup su;
    su.options.reshard_after_forward = false;
    check_conformance(su);
  }
  SUBCASE("gradients set to none between steps, reshard_after_forward true and false") {
    Setup su;
    su.set_to_none = true;
    check_conformance(su);
    su.options.reshard_after_forward = false;
    check_conformance(su);
  }
  SUBCASE("reshard_after_forward 2") {
    if (world_size() % 2 == 0) {
      Setup su;
      su.options.reshard_after_forward = fs::fsdp::ReshardAfterForward::group_size(2);
      check_conformance(su);
    }
  }
  SUBCASE("gradient accumulation over 3 micro-batches") {
    Setup su;
    su.micro_batches = 3;
    check_conformance(su);
  }
  SUBCASE("activation checkpointing with dropout: one all-gather per group in backward") {
    Setup su;
    su.dropout = 0.25;
    su.checkpointing = true;
    ShardedRun run = check_conformance(su);
    const auto bwd = unshards(run.last_step, fs::fsdp::engine::Phase::backward);
    // The blocks' groups (the root's stays unsharded); one rank shows the shards as the
    // parameters, with no copy-out at all.
    CHECK(bwd.size() == (world_size() > 1 ? 3u : 0u));
    for (const auto& entry : bwd) {  // (no structured bindings: CAPTURE captures)
      const auto& group = entry.first;
      const auto& n = entry.second;
      CAPTURE(group);
      CHECK(n == 1);
    }
    // Dropout matters: without its masks restored the recomputation would differ.
    Setup plain;
    CHECK(rel_diff(train_reference(su)->head->weight, train_reference(plain)->head->weight) > 1e-4);
  }
  SUBCASE("HSDP 2x2") {
    if (world_size() == 4) {
      Setup su;
      su.hsdp = true;
      check_conformance(su);
    }
  }
}

TEST_CASE("torch: an inference forward equals the unsharded one and reshards every group") {
  fs::DeviceMesh mesh(fs::test::runtime(), {world_size()}, {"dp"});
  auto ref = make_net();
  auto net = make_net();
  fst::ShardedModel sharded(net);
  auto& root = shard_blocks_and_root(sharded, *net, mesh);
  auto [x, y] = global_batch(3);
  torch::NoGradGuard no_grad;
  const torch::Tensor got = fst::call(net, x);
  CHECK(rel_diff(got, ref->forward(x)) <= 1e-6);
  for (fs::fsdp::FSDPModule* st : root.subtree_states())
    CHECK(st->is_sharded());
  for (const auto& p : net->parameters())
    CHECK_FALSE(p.grad().defined());
}

TEST_CASE("torch: errors name the module") {
  fs::DeviceMesh mesh(fs::test::runtime(), {world_size()}, {"dp"});
  auto net = make_net();
  fst::ShardedModel sharded(net);
  sharded.fully_shard(*net->block_list[0], mesh);
  // Called before the root is sharded.
  CHECK_THROWS_WITH_AS(fst::call(net->block_list[0], torch::randn({2, kD})),
                       doctest::Contains("module 'blocks.0'"), fs::InvalidArgument);
  CHECK_THROWS_WITH_AS(sharded.fully_shard(*net->block_list[0], mesh),
                       doctest::Contains("blocks.0"), fs::Error);
  for (std::size_t i = 1; i < net->block_list.size(); ++i)
    sharded.fully_shard(*net->block_list[i], mesh);
  sharded.fully_shard(*net, mesh);
  // A sharded child called on its own, outside its root's forward.
  CHECK_THROWS_WITH_AS(fst::call(net->block_list[1], torch::randn({2, kD})),
                       doctest::Contains("module 'blocks.1' was called outside"),
                       fs::InvalidArgument);
  CHECK_THROWS_WITH_AS(sharded.fully_shard(*net->block_list[2], mesh),
                       doctest::Contains("blocks.2"), fs::InvalidArgument);
  CHECK_THROWS_WITH_AS(sharded.state(*net->inp), doctest::Contains("'inp'"), fs::InvalidArgument);

  // A parameter on another device than the mesh's: a CUDA tensor (made without a CUDA call, as
  // this LibTorch may have no CUDA: storage and dispatch keys of the device, no memory).
  auto foreign = make_net();
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0,
                       c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CUDA, 0)), nullptr,
                       false);
  at::Tensor on_gpu = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CUDA),
      caffe2::TypeMeta::Make<float>());
  foreign->block_list[0]->fc2->register_parameter("extra", on_gpu);
  fst::ShardedModel with_gpu_param(foreign);
  CHECK_THROWS_WITH_AS(with_gpu_param.fully_shard(*foreign->block_list[0], mesh),
                       doctest::Contains("parameter 'blocks.0.fc2.extra' is on cuda:0, but "
                                         "the mesh is a cpu mesh"),
                       fs::InvalidArgument);
}

namespace {

// A tied embedding and output head (one tensor registered in two modules).
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(const torch::Tensor& w) : weight(register_parameter("weight", w)) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, weight.t()); }
  torch::Tensor weight;
};

struct TiedNetImpl : torch::nn::Module {
  TiedNetImpl()
      : emb(register_module("emb", torch::nn::Embedding(11, kD))),
        block(register_module("block", std::make_shared<BlockImpl>(kD, kH))),
        head(register_module("head", std::make_shared<TiedHeadImpl>(emb->weight))) {}
  torch::Tensor forward(const torch::Tensor& ids) {
    return fst::call(head, fst::call(block, emb(ids)));
  }
  torch::nn::Embedding emb;
  std::shared_ptr<BlockImpl> block;
  std::shared_ptr<TiedHeadImpl> head;
};

// Each tensor once (LibTorch's parameters() lists a tied one under both names).
std::vector<torch::Tensor> unique_params(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters())
    if (std::none_of(out.begin(), out.end(), [&](const torch::Tensor& q) { return q.is_same(p); }))
      out.push_back(p);
  return out;
}

}  // namespace

TEST_CASE("torch: a tied embedding and output head train as one parameter of the root group") {
  fs::DeviceMesh mesh(fs::test::runtime(), {world_size()}, {"dp"});
  auto make = [] {
    torch::manual_seed(0);
    return std::make_shared<TiedNetImpl>();
  };
  auto batch = [](int step) {
    torch::manual_seed(500 + step);
    return std::pair{torch::randint(11, {kBatch * world_size()}, torch::kLong),
                     torch::randint(11, {kBatch * world_size()}, torch::kLong)};
  };
  auto ref = make();
  {
    torch::optim::AdamW opt(unique_params(*ref), torch::optim::AdamWOptions(1e-2));
    for (int s = 0; s < kSteps; ++s) {
      auto [x, y] = batch(s);
      opt.zero_grad();
      torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
      opt.step();
    }
  }
  auto net = make();
  fst::ShardedModel sharded(net);
  sharded.fully_shard(*net->block, mesh);
  sharded.fully_shard(*net, mesh);
  CHECK(net->head->weight.is_same(net->emb->weight));
  torch::optim::AdamW opt(unique_params(*net), torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    opt.zero_grad();
    const int64_t at = world_rank() * kBatch;
    torch::nn::functional::cross_entropy(fst::call(net, x.narrow(0, at, kBatch)),
                                         y.narrow(0, at, kBatch))
        .backward();
    opt.step();
  }
  const torch::Tensor want = shard_rows(ref->emb->weight, world_rank(), world_size());
  CHECK(rel_diff(net->emb->weight, want) <= 1e-5);
  CHECK(rel_diff(net->head->weight, want) <= 1e-5);
  CHECK(rel_diff(net->block->fc1->weight,
                 shard_rows(ref->block->fc1->weight, world_rank(), world_size())) <= 1e-5);
}

TEST_CASE("torch: the plan of a LibTorch model is its run: the same operations, the same peak") {
  namespace sch = fs::schedule;
  for (const bool reshard : {true, false}) {
    CAPTURE(reshard);
    fs::DeviceMesh mesh(fs::test::runtime(), {world_size()}, {"dp"});
    auto net = make_net();
    fst::ShardedModel sharded(net);
    for (auto& b : net->block_list)
      sharded.graph().module(sharded.fqn(*b)).set_fully_shard_request(true);
    sharded.graph().set_fully_shard_request(true);
    sch::PlanOptions o;
    o.external_gradients = true;
    if (!reshard) o.defaults.reshard_after_forward = false;
    const sch::Plan plan =
        sch::Scheduler::plan(sharded.graph(), sch::MeshShape::fsdp(world_size()), o);
    REQUIRE(plan.groups.size() == 4);
    sharded.apply_plan(plan, mesh);
    fs::fsdp::FSDPModule& root = sharded.state(*net);

    std::vector<fs::fsdp::engine::OpDesc> ran;  // the first step (op numbers from 0, as planned)
    fs::fsdp::detail::record_operations(root, &ran);
    {
      auto [x, y] = micro_batch(0, world_rank(), 0, 1);
      loss_of(fst::call(net, x), y).backward();
    }
    fs::fsdp::detail::record_operations(root, nullptr);
    REQUIRE(ran.size() == plan.ops.size());
    for (std::size_t i = 0; i < ran.size(); ++i) {
      const auto& p = plan.ops[i];
      const auto& r = ran[i];
      CAPTURE(i);
      CAPTURE(fs::fsdp::engine::op_kind_name(p.kind));
      CHECK(r.kind == p.kind);
      CHECK(r.stream == p.stream);
      CHECK(r.phase == p.phase);
      CHECK(r.bytes == p.bytes);
      CHECK((r.source->fqn().empty() ? std::string("<root>") : r.source->fqn()) == p.module());
      CHECK(r.deps.to_vector() == p.deps.to_vector());
    }
    CHECK(root.pool_peak_bytes() == plan.pool_peak_bytes[0]);
    // No gradient buffer of fullshard's: autograd allocates the gradients.
    for (const auto& op : plan.ops)
      CHECK(op.kind != fs::fsdp::engine::OpKind::grad_init);
  }
}

TEST_CASE("torch: auto_shard chooses and applies the fully_shard calls under a budget") {
  fs::DeviceMesh mesh(fs::test::runtime(), {world_size()}, {"dp"});
  Setup su;
  auto want = train_reference(su)->named_parameters();
  auto net = make_net();
  fst::ShardedModel sharded(net);
  fs::schedule::AutoPlanOptions ao;
  ao.memory_budget_bytes = std::size_t{1} << 30;
  ao.state_bytes_per_param_byte = 2;
  std::vector<const torch::nn::Module*> blocks;
  for (auto& b : net->block_list)
    blocks.push_back(b.get());
  const fs::schedule::AutoPlan ap = sharded.auto_shard(mesh, ao, blocks);
  for (const auto& call : ap.choice.calls)  // only blocks and the root can be groups
    CHECK((call.fqn.empty() || call.fqn.rfind("blocks.", 0) == 0));
  CHECK(ap.memory_bytes <= ao.memory_budget_bytes);
  REQUIRE_FALSE(ap.plan.groups.empty());
  fs::fsdp::FSDPModule& root = sharded.state(*net);
  CHECK(root.is_root());
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    auto [x, y] = micro_batch(s, world_rank(), 0, 1);
    loss_of(fst::call(net, x), y).backward();
    opt.step();
  }
  CHECK(root.pool_peak_bytes() == ap.plan.pool_peak_bytes[0]);
  MESSAGE(ap.choice.to_json() << " groups " << ap.plan.groups.size() << " roots "
                              << ap.plan.pool_roots.size() << " peak " << ap.plan.peak_bytes);
  auto got = net->named_parameters();
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(got[i].key());
    CHECK(rel_diff(got[i].value(), shard_rows(want[i].value(), world_rank(), world_size())) <=
          1e-5);
  }
  // An impossible budget is refused before anything is sharded.
  auto other = make_net();
  fst::ShardedModel sharded2(other);
  ao.memory_budget_bytes = 16;
  CHECK_THROWS_AS(sharded2.auto_shard(mesh, ao, {}), fs::schedule::AutoPlanInfeasible);
}

TEST_CASE(
    "torch: a checkpoint with the AdamW state saved on N ranks (also in the background) resumes on "
    "N - 1, deferred") {
  // The global batch (12 rows) splits evenly over 1 to 4 ranks.
  constexpr int64_t kRows = 12;
  auto batch = [](int step, int rank, int ranks) {
    torch::manual_seed(2000 + step);
    torch::Tensor x = torch::randn({kRows, kIn}), y = torch::randn({kRows, kOut});
    const int64_t n = kRows / ranks;
    return std::pair{x.narrow(0, rank * n, n), y.narrow(0, rank * n, n)};
  };
  auto opts = torch::optim::AdamWOptions(1e-2).weight_decay(0.01);
  auto train = [&](const std::shared_ptr<NetImpl>& net, torch::optim::AdamW& opt, int from, int to,
                   int rank, int ranks) {
    for (int s = from; s < to; ++s) {
      auto [x, y] = batch(s, rank, ranks);
      opt.zero_grad();
      loss_of(fst::call(net, x), y).backward();
      opt.step();
    }
  };
  auto ref = make_net();  // unsharded, the global batch
  {
    torch::optim::AdamW opt(ref->parameters(), opts);
    train(ref, opt, 0, 10, 0, 1);
  }
  auto check = [&](const std::shared_ptr<NetImpl>& net, int rank, int ranks) {
    auto want = ref->named_parameters();
    auto got = net->named_parameters();
    for (std::size_t i = 0; i < got.size(); ++i) {
      CAPTURE(got[i].key());
      CHECK(rel_diff(got[i].value(), shard_rows(want[i].value(), rank, ranks)) <= 1e-5);
    }
  };
  fs::test::SharedTempDir dir("fullshard-torch-ckpt");
  {  // 5 steps on every rank, a checkpoint, 5 more
    fs::DeviceMesh mesh(fs::test::runtime(), {world_size()}, {"dp"});
    auto net = make_net();
    fst::ShardedModel sharded(net);
    shard_blocks_and_root(sharded, *net, mesh);
    torch::optim::AdamW opt(net->parameters(), opts);
    train(net, opt, 0, 5, world_rank(), world_size());
    fst::save_checkpoint(dir.path, sharded, &opt, 5);
    // The same step in the background while 5 more steps train: save_checkpoint's files.
    fs::checkpoint::AsyncSave pending =
        fst::save_checkpoint_async(dir.path + "/async", sharded, &opt, 5);
    train(net, opt, 5, 10, world_rank(), world_size());
    CHECK(pending.wait() == dir.path + "/async/step-00000005");
    check(net, world_rank(), world_size());
    if (world_rank() == 0)
      for (const char* f : {"index.json", "rank-00000.bin"}) {
        CAPTURE(f);
        auto bytes = [&](const std::string& d) {
          std::ifstream in(d + "/step-00000005/" + f, std::ios::binary);
          return std::string(std::istreambuf_iterator<char>(in), {});
        };
        CHECK(!bytes(dir.path).empty());
        CHECK(bytes(dir.path + "/async") == bytes(dir.path));
      }
  }
  // Resumed on N - 1 ranks (N on one rank) from fresh weights and a fresh optimizer.
  const int m = std::max(1, world_size() - 1);
  MPI_Comm sub = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank() < m ? 0 : MPI_UNDEFINED, world_rank(), &sub);
  if (sub != MPI_COMM_NULL) {
    {
      fs::DeviceMesh mesh(sub, {m}, {"dp"}, 60.0);
      // Deferred initialisation: the checkpoint gives the values (each rank reads its rows).
      auto net = std::make_shared<NetImpl>(kIn, kD, kH, kOut, 3);
      fst::to_meta(*net);
      fst::ShardedModel sharded(net);
      shard_blocks_and_root(sharded, *net, mesh);
      torch::optim::AdamW opt(net->parameters(), opts);
      // From the asynchronous checkpoint (step 5, although training went on while it was written).
      const fs::checkpoint::Loaded loaded =
          fst::load_checkpoint(dir.path + "/async", sharded, &opt);
      CHECK(loaded.step == 5);
      train(net, opt, 5, 10, world_rank(), m);
      check(net, world_rank(), m);
    }
    MPI_Comm_free(&sub);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("torch: parameters view fullshard's shards in place, and the whole tensors are freed") {
  fs::DeviceMesh mesh(fs::test::runtime(), {world_size()}, {"dp"});
  auto net = make_net();
  // Weak references to the whole tensors' storages: expired once nothing holds them.
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> whole;
  for (const torch::Tensor& p : net->parameters())
    whole.push_back(p.storage().getWeakStorageImpl());
  fst::ShardedModel sharded(net);
  shard_blocks_and_root(sharded, *net, mesh);
  for (const auto& w : whole)
    CHECK(w.expired());
  // Each LibTorch parameter is this rank's shard itself (no copy): the same address.
  std::map<std::string, fs::graph::Parameter*> by_name;
  for (fs::graph::Parameter* p : sharded.graph().parameters())
    by_name[p->fqn()] = p;
  for (const auto& p : net->named_parameters()) {
    CAPTURE(p.key());
    REQUIRE(by_name.count(p.key()) == 1);
    const fs::Tensor& shard = by_name[p.key()]->data();
    CHECK(p.value().numel() == shard.numel());
    if (shard.numel() > 0) CHECK(p.value().data_ptr() == shard.data());
  }
}

TEST_CASE("torch: explicit forward prefetch through the front end gathers in the order given") {
  // Block 0 prefetches block 2: its all-gather comes before block 1's; the losses stay. (One
  // rank gathers nothing.)
  if (world_size() == 1) return;
  auto first_gathers = [](bool explicit_prefetch, double& loss) {
    fs::DeviceMesh mesh(fs::test::runtime(), {world_size()}, {"dp"});
    auto net = make_net();
    fst::ShardedModel sharded(net);
    shard_blocks_and_root(sharded, *net, mesh);
    if (explicit_prefetch)
      sharded.state(*net->block_list[0])
          .set_modules_to_forward_prefetch(
              {&sharded.graph().module(sharded.fqn(*net->block_list[2]))});
    fs::fsdp::FSDPModule& root = sharded.state(*net);
    std::vector<fs::fsdp::engine::OpDesc> ran;
    fs::fsdp::detail::record_operations(root, &ran);
    auto [x, y] = micro_batch(0, world_rank(), 0, 1);
    const torch::Tensor l = loss_of(fst::call(net, x), y);
    loss = l.item<double>();
    l.backward();
    fs::fsdp::detail::record_operations(root, nullptr);
    std::vector<std::string> order;  // the modules' forward all-gathers, in the order issued
    for (const auto& op : ran)
      if (op.kind == fs::fsdp::engine::OpKind::all_gather &&
          op.phase == fs::fsdp::engine::Phase::forward)
        order.push_back(op.source->fqn());
    return order;
  };
  double implicit_loss = 0, explicit_loss = 0;
  const std::vector<std::string> implicit = first_gathers(false, implicit_loss);
  const std::vector<std::string> given = first_gathers(true, explicit_loss);
  auto at = [](const std::vector<std::string>& v, const std::string& m) {
    return std::find(v.begin(), v.end(), m) - v.begin();
  };
  CAPTURE(given.size());
  CHECK(at(implicit, "blocks.1") < at(implicit, "blocks.2"));
  CHECK(at(given, "blocks.2") < at(given, "blocks.1"));
  CHECK(at(given, "blocks.1") < std::ptrdiff_t(given.size()));
  CHECK(explicit_loss == implicit_loss);
}

namespace {

// Two blocks whose second output the loss never uses: its backward never runs.
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl()
      : used(register_module("used", std::make_shared<BlockImpl>(kIn, kH))),
        unused(register_module("unused", std::make_shared<BlockImpl>(kIn, kH))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor out = fst::call(used, x);
    fst::call(unused, x);  // computed, never part of the loss
    return out;
  }
  std::shared_ptr<BlockImpl> used, unused;
};

}  // namespace

TEST_CASE("torch: a sharded module whose backward never runs is resharded; the step goes on") {
  fs::DeviceMesh mesh(fs::test::runtime(), {world_size()}, {"dp"});
  torch::manual_seed(0);
  auto sharded_net = std::make_shared<TwoHeadsImpl>();
  torch::manual_seed(0);
  auto reference = std::make_shared<TwoHeadsImpl>();
  fst::ShardedModel sharded(sharded_net);
  sharded.fully_shard(*sharded_net->used, mesh);
  sharded.fully_shard(*sharded_net->unused, mesh);
  sharded.fully_shard(*sharded_net, mesh);
  torch::optim::SGD opt(sharded_net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(2000 + step);
    const torch::Tensor x = torch::randn({kBatch * world_size(), kIn});
    const torch::Tensor y = torch::randn({kBatch * world_size(), kIn});
    opt.zero_grad();
    const torch::Tensor mine = x.narrow(0, world_rank() * kBatch, kBatch);
    torch::mse_loss(fst::call(sharded_net, mine), y.narrow(0, world_rank() * kBatch, kBatch))
        .backward();
    // The unused block took no gradient and shows its shards again, like every other group.
    for (const torch::Tensor& p : sharded_net->unused->parameters())
      CHECK(!(p.grad().defined() && p.grad().abs().sum().item<double>() > 0));
    CHECK(sharded.state(*sharded_net->unused).is_sharded());
    CHECK(sharded.state(*sharded_net->used).is_sharded());
    opt.step();
    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(x), y).backward();
    ref_opt.step();
  }
  // The used block trained as the unsharded reference did; the unused one stayed as it was.
  for (const auto& [name, block] :
       {std::make_pair("used", std::make_pair(sharded_net->used, reference->used)),
        std::make_pair("unused", std::make_pair(sharded_net->unused, reference->unused))}) {
    CAPTURE(name);
    const auto mine = block.first->named_parameters(), want = block.second->named_parameters();
    for (std::size_t i = 0; i < mine.size(); ++i) {
      CAPTURE(mine[i].key());
      CHECK(rel_diff(mine[i].value(),
                     shard_rows(want[i].value().detach(), world_rank(), world_size())) <= 1e-5);
    }
  }
}

TEST_CASE("torch: LibTorch's threads are the launcher's cores unless the user chose them") {
  const fs::Runtime& rt = fs::test::runtime();
  const int before = at::get_num_threads();
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const std::string saved = omp ? omp : "";
  unsetenv("OMP_NUM_THREADS");
  unsetenv("FULLSHARD_TORCH_THREADS");
  at::set_num_threads(rt.cores().threads + 5);  // LibTorch's own default: every core
  CHECK(fst::use_launcher_cores(rt) == rt.cores().threads);
  CHECK(at::get_num_threads() == rt.cores().threads);
  setenv("FULLSHARD_TORCH_THREADS", "3", 1);  // the override
  CHECK(fst::use_launcher_cores(rt) == 3);
  CHECK(at::get_num_threads() == 3);
  setenv("FULLSHARD_TORCH_THREADS", "0", 1);
  CHECK_THROWS_AS(fst::use_launcher_cores(rt), fs::SettingsError);
  unsetenv("FULLSHARD_TORCH_THREADS");
  setenv("OMP_NUM_THREADS", "2", 1);  // the user's, which LibTorch read itself: kept
  at::set_num_threads(rt.cores().threads + 2);
  CHECK(fst::use_launcher_cores(rt) == rt.cores().threads + 2);
  if (saved.empty())
    unsetenv("OMP_NUM_THREADS");
  else
    setenv("OMP_NUM_THREADS", saved.c_str(), 1);
  at::set_num_threads(before);
}
