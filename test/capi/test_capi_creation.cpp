// Sharded creation through the C API: no rank ever holds the whole model. For every built-in
// family, LibTorch's CPU allocations while the model is created (counted by an allocator this
// test installs with c10::SetCPUAllocator) peak at one piece (the largest block or root layer,
// built and released to the meta device before the next), fullshard's own shard storage (the
// memory ledger) is exactly the plan's sharded bytes, and the model is the same at any rank
// count: its safetensors export from the job's mesh is byte for byte the export of the same
// configuration built on one rank. With "deferred_init": false the whole model is allocated
// (the counter sees it: the check can fail).
// First: LibTorch (its logging's CHECK), then doctest's CHECK.
#include "lib/session/torch_host_bytes.hpp"
#include "test/torch/counting_allocator.hpp"

#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fullshard/base/memory_ledger.hpp"
#include "fullshard/fullshard.h"
#include "test_support.hpp"

namespace {

using fullshard::test::CountingAllocator;

CountingAllocator& counter() {
  static CountingAllocator* a = [] {
    // Over the session's own count (installed first, at c10's default priority, so that the
    // sessions of this test measure their activations too).
    fullshard::session::TorchHostBytes::get();
    auto* c = new CountingAllocator(c10::GetCPUAllocator());  // lives to the end
    c10::SetCPUAllocator(c, /*priority=*/100);
    return c;
  }();
  return *a;
}

void require_ok(fullshard_status s) {
  INFO(fullshard_last_error());
  REQUIRE(s == FULLSHARD_OK);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The file's bytes with its own name (in the header's metadata) blanked.
std::string without_name(std::string bytes, const std::string& name) {
  for (std::size_t at = bytes.find(name); at != std::string::npos; at = bytes.find(name, at))
    bytes.replace(at, name.size(), std::string(name.size(), '_'));
  return bytes;
}

struct Family {
  const char* name;
  std::string json;            // "model" object (without deferred_init)
  std::int64_t largest_piece;  // elements of the largest block or root layer
  std::int64_t whole;          // elements of the whole model
};

}  // namespace

TEST_CASE("C API: every built-in family is created sharded, the same at any rank count") {
  const int rank = fullshard::test::world_rank(), world = fullshard::test::world_size();
  counter();  // installed before any tensor of the model
  require_ok(fullshard_init(MPI_COMM_WORLD));
  fullshard_mesh mesh{0}, one{0};
  const int shape[1] = {world}, single[1] = {1};
  require_ok(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", &mesh));
  require_ok(fullshard_mesh_create(MPI_COMM_SELF, "cpu", 1, single, "dp", &one));

  const std::int64_t H = 96;
  const std::vector<Family> families = {
      {"mlp", R"("type": "mlp", "inputs": 10, "hidden": [96, 64, 96], "outputs": 3)", 64 * 96 + 96,
       (10 * 96 + 96) + (96 * 64 + 64) + (64 * 96 + 96) + (96 * 3 + 3)},
      {"residual_mlp",
       R"("type": "residual_mlp", "inputs": 10, "hidden": 96, "outputs": 3, "blocks": 3)",
       2 * H * H + 2 * H, (10 * H + H) + 3 * (2 * H * H + 2 * H) + (H * 3 + 3)},
      // Embeddings 50 x 32 and 8 x 32; a block: 2 LayerNorms (4 x 32), qkv 32 x 96 + 96, proj
      // 32 x 32 + 32, fc 32 x 128 + 128, out 128 x 32 + 32; ln_f 2 x 32.
      {"gpt", R"("type": "gpt", "vocab": 50, "context": 8, "d_model": 32, "heads": 2, "layers": 2)",
       4 * 32 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32),
       50 * 32 + 8 * 32 +
           2 * (4 * 32 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32)) +
           2 * 32},
      // Convolutions 1 -> 8 (stride 1), 8 -> 16, 16 -> 32 (stride 2), transposed 32 -> 16,
      // 16 -> 8 (4 x 4), output 8 -> 1.
      {"conv_autoencoder", R"("type": "conv_autoencoder", "channels": 1, "width": 8, "levels": 2)",
       32 * 16 * 16 + 16,
       (8 * 9 + 8) + (16 * 8 * 9 + 16) + (32 * 16 * 9 + 32) + (32 * 16 * 16 + 16) +
           (16 * 8 * 16 + 8) + (1 * 8 * 9 + 1)},
  };
  for (const Family& f : families) {
    CAPTURE(f.name);
    for (const bool deferred : {true, false}) {
      CAPTURE(deferred);
      const std::string json = std::string(R"({"model": {)") + f.json +
                               (deferred ? "" : R"(, "deferred_init": false)") +
                               R"(}, "seed": 11})";
      const std::int64_t torch_before = counter().now();
      counter().reset_peak();
      const std::uint64_t shards_before =
          fullshard::memory_ledger::counts().now_of(fullshard::MemoryPart::shards);
      fullshard_model model{0};
      require_ok(fullshard_model_create_from_json(mesh, json.c_str(), "creation.json", &model));
      const std::int64_t torch_peak = counter().peak() - torch_before;
      const std::uint64_t shards =
          fullshard::memory_ledger::counts().now_of(fullshard::MemoryPart::shards) - shards_before;
      fullshard_plan_info info{};
      require_ok(fullshard_model_plan(model, &info));
      INFO("LibTorch peak while creating " << torch_peak << " B; largest piece "
                                           << f.largest_piece * 4 << " B; whole model "
                                           << f.whole * 4 << " B; shards " << shards << " B");
      CHECK(static_cast<std::int64_t>(shards) == info.sharded_bytes);
      if (deferred) {
        CHECK(torch_peak <= f.largest_piece * 4);
        CHECK(torch_peak > 0);
        // The same model on one rank: the same file, byte for byte.
        // Names of one length: the header's metadata names the file.
        const std::string prefix =
            std::string("creation_") + f.name + "_np" + std::to_string(world);
        const std::string here = prefix + "_job.safetensors";
        const std::string alone = prefix + "_1r" + std::to_string(rank) + ".safetensors";
        require_ok(fullshard_export_safetensors(model, here.c_str()));
        fullshard_model single_model{0};
        require_ok(
            fullshard_model_create_from_json(one, json.c_str(), "creation.json", &single_model));
        require_ok(fullshard_export_safetensors(single_model, alone.c_str()));
        require_ok(fullshard_model_free(&single_model));
        MPI_Barrier(MPI_COMM_WORLD);  // the job's file is written
        // The same tensors, byte for byte (the header's metadata names the file).
        const std::string a = without_name(read_file(here), here),
                          b = without_name(read_file(alone), alone);
        CHECK(a.size() > 8);
        CHECK(a == b);
        std::remove(alone.c_str());
        MPI_Barrier(MPI_COMM_WORLD);
        if (rank == 0) std::remove(here.c_str());
      } else {
        CHECK(torch_peak >= f.whole * 4);  // built whole on every rank
      }
      require_ok(fullshard_model_free(&model));
    }
  }
  require_ok(fullshard_mesh_free(&one));
  require_ok(fullshard_mesh_free(&mesh));
  require_ok(fullshard_finalize());
}

TEST_CASE("C API: a TorchScript file is loaded whole, and no full parameter outlives creation") {
  // wide.pt (make_torchscript.py): 4 residual blocks, each a 64 x 64 linear layer and its bias.
  const std::int64_t block = (64 * 64 + 64) * 4, whole = 4 * block;
  counter();
  require_ok(fullshard_init(MPI_COMM_WORLD));
  fullshard_mesh mesh{0};
  const int shape[1] = {fullshard::test::world_size()};
  require_ok(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", &mesh));
  const std::string json = std::string(R"({"model": {"type": "torchscript", "file": ")") +
                           FULLSHARD_TORCHSCRIPT_DIR + R"(/wide.pt"}, "seed": 11})";
  const std::int64_t torch_before = counter().now();
  counter().reset_peak();
  const std::uint64_t shards_before =
      fullshard::memory_ledger::counts().now_of(fullshard::MemoryPart::shards);
  fullshard_model model{0};
  require_ok(fullshard_model_create_from_json(mesh, json.c_str(), "torchscript.json", &model));
  const std::int64_t torch_peak = counter().peak() - torch_before,
                     torch_after = counter().now() - torch_before,
                     together = counter().with_shards_peak() - torch_before -
                                static_cast<std::int64_t>(shards_before);
  const std::uint64_t shards =
      fullshard::memory_ledger::counts().now_of(fullshard::MemoryPart::shards) - shards_before;
  fullshard_plan_info info{};
  require_ok(fullshard_model_plan(model, &info));
  INFO("LibTorch peak while creating " << torch_peak << " B, held after " << torch_after
                                       << " B, with the shards " << together << " B; whole model "
                                       << whole << " B; shards " << shards << " B");
  // LibTorch reads the file whole (the documented peak of this path)...
  CHECK(torch_peak >= whole);
  CHECK(torch_peak <= whole + block);
  // ... and every full parameter is released once its group is sharded: LibTorch holds none
  // of them after creation, fullshard holds the rank's rows.
  CHECK(torch_after < block / 4);
  // Group by group: a group's full parameters go as soon as its shards exist, so the file and
  // the shards together peak at the file and one group's shards.
  CHECK(together <= whole + block / fullshard::test::world_size() + block / 4);
  CHECK(static_cast<std::int64_t>(shards) == info.sharded_bytes);
  require_ok(fullshard_model_free(&model));
  require_ok(fullshard_mesh_free(&mesh));
  require_ok(fullshard_finalize());
}

TEST_CASE("C API: fullshard_model_memory gives the account, planned and measured") {
  const int world = fullshard::test::world_size();
  require_ok(fullshard_init(MPI_COMM_WORLD));
  fullshard_mesh mesh{0};
  const int shape[1] = {world};
  require_ok(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", &mesh));
  fullshard_model m{0};
  require_ok(fullshard_model_create_from_json(
      mesh,
      R"({"model": {"type": "residual_mlp", "inputs": 10, "hidden": 96, "outputs": 3,
                    "blocks": 3}, "optimizer": {"type": "adamw"}})",
      "memory.json", &m));
  const auto sum = [](const fullshard_memory_parts& p) {
    return p.baseline + p.shards + p.gradients + p.optimizer_state + p.pool + p.windows +
           p.activations + p.untracked;
  };
  fullshard_memory_parts planned{}, measured{};
  fullshard_plan_info info{};
  require_ok(fullshard_model_memory(m, &planned, nullptr));
  require_ok(fullshard_model_plan(m, &info));
  CHECK(planned.process_peak == info.process_peak_bytes);
  CHECK(planned.process_peak == sum(planned));
  CHECK(planned.shards == info.sharded_bytes);
  CHECK(planned.gradients == info.sharded_bytes);
  CHECK(planned.optimizer_state > 0);
  CHECK(planned.activations == 0);  // not declared: measured by the first step
  const std::int64_t rows = 8;
  std::vector<float> x(std::size_t(rows * 10)), y(std::size_t(rows * 3));
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = float(std::sin(0.3 * double(i)));
  for (std::size_t i = 0; i < y.size(); ++i)
    y[i] = float(std::cos(0.7 * double(i)));
  const std::int64_t xs[2] = {rows, 10}, ys[2] = {rows, 3};
  const fullshard_array in = fullshard_array_contiguous(x.data(), FULLSHARD_FLOAT32, 2, xs);
  const fullshard_array target = fullshard_array_contiguous(y.data(), FULLSHARD_FLOAT32, 2, ys);
  for (int k = 0; k < 2; ++k)
    require_ok(fullshard_train_step(m, 1, &in, 1, &target, nullptr));
  require_ok(fullshard_model_memory(m, &planned, &measured));
  require_ok(fullshard_model_plan(m, &info));
  CHECK(planned.activations > 0);
  CHECK(planned.process_peak == sum(planned));
  CHECK(planned.process_peak == info.process_peak_bytes);
  // The library's parts as its ledger holds them between steps are the plan's, byte for byte.
  CHECK(measured.shards == planned.shards);
  CHECK(measured.gradients == planned.gradients);
  CHECK(measured.optimizer_state == planned.optimizer_state);
  CHECK(measured.pool == planned.pool);
  CHECK(measured.windows == planned.windows);
  CHECK(measured.process_peak > planned.baseline);
  // Refused: no place for the planned parts, a freed model.
  CHECK(fullshard_model_memory(m, nullptr, &measured) == FULLSHARD_ERR_ARGUMENT);
  CHECK(std::string(fullshard_last_error()).find("planned") != std::string::npos);
  fullshard_model freed = m;
  require_ok(fullshard_model_free(&m));
  CHECK(fullshard_model_memory(freed, &planned, nullptr) == FULLSHARD_ERR_HANDLE);
  require_ok(fullshard_mesh_free(&mesh));
  require_ok(fullshard_finalize());
}

TEST_CASE("C API: a memory budget the plan exceeds is refused on every rank before the shards") {
  const int world = fullshard::test::world_size();
  require_ok(fullshard_init(MPI_COMM_WORLD));
  fullshard_mesh mesh{0};
  const int shape[1] = {world};
  require_ok(fullshard_mesh_create(MPI_COMM_WORLD, "cpu", 1, shape, "dp", &mesh));
  const std::string model =
      R"({"model": {"type": "residual_mlp", "inputs": 10, "hidden": 96, "outputs": 3,
                    "blocks": 3}, )";
  // The process's baseline alone (LibTorch, MPI) is far above 1 MiB.
  const std::string tight = model + R"("memory": {"budget_mb": 1}})";
  const std::uint64_t shards_before =
      fullshard::memory_ledger::counts().now_of(fullshard::MemoryPart::shards);
  fullshard_model m{0};
  const fullshard_status s =
      fullshard_model_create_from_json(mesh, tight.c_str(), "budget.json", &m);
  const std::string what = fullshard_last_error();
  CAPTURE(what);
  CHECK(s == FULLSHARD_ERR_CONFIG);
  CHECK(m.id == 0);
  CHECK(what.find("exceeds the memory a rank can have: 1.00 MiB") != std::string::npos);
  CHECK(what.find("(memory.budget_mb)") != std::string::npos);
  CHECK(what.find("optimizer state") != std::string::npos);
  // No shard was allocated.
  CHECK(fullshard::memory_ledger::counts().now_of(fullshard::MemoryPart::shards) == shards_before);
  // Every rank refused with the same message.
  const int length = static_cast<int>(what.size());
  int lengths[2] = {length, -length};
  MPI_Allreduce(MPI_IN_PLACE, lengths, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  CHECK(lengths[0] == length);
  CHECK(-lengths[1] == length);

  // "warn" creates it; so does a budget it fits. The planned process peak is in the plan's
  // information (the largest over the ranks below).
  std::int64_t peak = 0;
  for (const char* memory :
       {R"("memory": {"budget_mb": 1, "check": "warn"}})", R"("memory": {"budget_mb": 100000}})",
        R"("memory": {"check": "off"}})"}) {
    CAPTURE(memory);
    const std::string json = model + memory;
    require_ok(fullshard_model_create_from_json(mesh, json.c_str(), "budget.json", &m));
    CHECK(fullshard::memory_ledger::counts().now_of(fullshard::MemoryPart::shards) > shards_before);
    fullshard_plan_info info{};
    require_ok(fullshard_model_plan(m, &info));
    // Shards, gradients and AdamW's two states (over the rank's rows), the pool, the baseline.
    CHECK(info.process_peak_bytes > info.sharded_bytes + info.peak_bytes);
    peak = std::max<std::int64_t>(peak, info.process_peak_bytes);
    require_ok(fullshard_model_free(&m));
  }
  MPI_Allreduce(MPI_IN_PLACE, &peak, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  // The budget is held against that peak: 10 % below refuses, 10 % above creates (the
  // baseline, measured at each creation, moves by far less).
  const double mib = 1024.0 * 1024.0;
  for (const double factor : {0.9, 1.1}) {
    CAPTURE(factor);
    const std::string json =
        model + R"("memory": {"budget_mb": )" + std::to_string(factor * peak / mib) + "}}";
    const fullshard_status st =
        fullshard_model_create_from_json(mesh, json.c_str(), "budget.json", &m);
    INFO(fullshard_last_error());
    CHECK(st == (factor < 1 ? FULLSHARD_ERR_CONFIG : FULLSHARD_OK));
    if (st == FULLSHARD_OK) require_ok(fullshard_model_free(&m));
  }
  require_ok(fullshard_mesh_free(&mesh));
  require_ok(fullshard_finalize());
}
