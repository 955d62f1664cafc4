// load_safetensors into a fully_shard'ed model on 1-4 ranks: every local element equals the
// value written (computed here per global index), each rank reads exactly the header plus its
// own shards' bytes (Shard(0) rows: one range; Shard(1): the rows spanning its columns; an
// ignored parameter: all of it), and a file that does not match the model is refused on every
// rank naming the file and the tensor, leaving the model untouched. Then a checkpoint saved on
// the world converts to a safetensors file that loads the same values.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "error_check.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/checkpoint/safetensors.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/state_dict.hpp"
#include "test_support.hpp"

using namespace fullshard;
using graph::Module;
using graph::Parameter;
namespace ck = fullshard::checkpoint;
namespace fs = std::filesystem;
using test::contains;

namespace {

using test::global_index;

int R() {
  return test::world_rank();
}

std::string shared_temp_dir() {
  std::string path;
  if (R() == 0) {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/fullshard-st-mpi-XXXXXX";
    if (mkdtemp(tmpl.data())) path = tmpl;
  }
  int len = static_cast<int>(path.size());
  MPI_Bcast(&len, 1, MPI_INT, 0, MPI_COMM_WORLD);
  path.resize(static_cast<std::size_t>(len));
  MPI_Bcast(path.data(), len, MPI_CHAR, 0, MPI_COMM_WORLD);
  return path;
}

double value(const std::string& name, std::int64_t e, int seed) {
  int h = 7 + seed;
  for (char c : name)
    h = (h * 31 + static_cast<unsigned char>(c)) % 997;
  return 0.25 * static_cast<double>((e * 5 + h) % 37) - 4.0;
}

// l0 {w (7,3), b (5,)}, l1 {w (13,)}, l2 {w (4,12) Shard(1)}, root {scale (3,) ignored}.
struct Net {
  std::unique_ptr<Module> root = Module::make_root("model");
  Net(const DeviceMesh& mesh, int seed) {
    Module& l0 = root->add_module("l0");
    Module& l1 = root->add_module("l1");
    Module& l2 = root->add_module("l2");
    l0.add_param("w", {7, 3});
    l0.add_param("b", {5});
    l1.add_param("w", {13});
    l2.add_param("w", {4, 12});
    root->add_param("scale", {3}, DType::f32, false);
    for (Parameter* p : root->parameters()) {
      const std::string n = p->fqn();
      p->init([n, seed](std::int64_t e) { return value(n, e, seed); });
    }
    fsdp::FullyShardOptions l2_opts;
    l2_opts.shard_placement_fn = [](const Parameter&) { return Placement::Shard(1); };
    fsdp::fully_shard(l0, mesh);
    fsdp::fully_shard(l1, mesh);
    fsdp::fully_shard(l2, mesh, l2_opts);
    fsdp::FullyShardOptions root_opts;
    root_opts.ignored_params = {"scale"};
    fsdp::fully_shard(*root, mesh, root_opts);
  }
};

// Number of this rank's local elements differing from value(name, global index, seed).
int mismatches(Module& root, int seed) {
  int bad = 0;
  for (auto& [name, st] : fsdp::sharded_state_dict(root))
    for (std::int64_t e = 0; e < st.local.numel(); ++e)
      if (st.local.at(e) != value(name, global_index(st.layout, e), seed)) ++bad;
  return bad;
}

// Bytes a rank must read for its shards: Shard(0) and replicated: exactly its box; Shard(1):
// from its first column of row 0 to its last column of the last row (one window).
std::uint64_t expected_bytes(Module& root) {
  std::uint64_t n = 0;
  for (auto& [name, st] : fsdp::sharded_state_dict(root)) {
    const ShardLayout& l = st.layout;
    if (l.local_numel() == 0) continue;
    if (l.placement.is_shard() && l.placement.dim() == 1) {
      const std::uint64_t row = static_cast<std::uint64_t>(l.global_shape[1]) * 4;
      n += static_cast<std::uint64_t>(l.global_shape[0] - 1) * row +
           static_cast<std::uint64_t>(l.local_shape[1]) * 4;
    } else {
      n += static_cast<std::uint64_t>(l.local_numel()) * 4;
    }
  }
  return n;
}

void write_file(const std::string& path, int seed, bool drop_b = false, bool extra = false,
                bool wrong_shape = false, bool bf16_b = false) {
  const std::vector<std::pair<std::string, Shape>> params = {{"l0.w", {7, wrong_shape ? 2 : 3}},
                                                             {"l0.b", {5}},
                                                             {"l1.w", {13}},
                                                             {"l2.w", {4, 12}},
                                                             {"scale", {3}}};
  std::vector<ck::SafetensorsSpec> specs;
  for (const auto& [n, s] : params)
    if (!(drop_b && n == "l0.b"))
      specs.push_back({n, bf16_b && n == "l0.b" ? DType::bf16 : DType::f32, s});
  if (extra) specs.push_back({"l9.w", DType::f32, {2}});
  ck::SafetensorsWriter w(path, specs, {{"format", "pt"}});
  for (const ck::SafetensorsSpec& s : specs) {
    std::vector<char> v(static_cast<std::size_t>(numel(s.shape)) * dtype_size(s.dtype));
    for (std::int64_t e = 0; e < numel(s.shape); ++e)
      store_from_double(v.data(), s.dtype, static_cast<std::size_t>(e), value(s.name, e, seed));
    w.write(s.name, v.data(), v.size());
  }
  w.commit();
}

}  // namespace

TEST_CASE("load_safetensors: each rank reads its own shards, values exact") {
  const std::string dir = shared_temp_dir();
  REQUIRE(!dir.empty());
  const std::string path = dir + "/w.safetensors";
  if (R() == 0) write_file(path, 3);
  MPI_Barrier(MPI_COMM_WORLD);
  DeviceMesh mesh(test::runtime(), {test::world_size()}, {"dp"});
  Net net(mesh, /*seed=*/0);
  CHECK(mismatches(*net.root, 3) > 0);  // the initial values differ from the file's
  const ck::SafetensorsLoaded l = ck::load_safetensors(path, *net.root);
  CHECK(l.tensors == 5);
  CHECK(l.metadata.at("format") == "pt");
  CHECK(mismatches(*net.root, 3) == 0);
  const ck::SafetensorsReader r(path);
  CHECK(l.bytes_read == r.data_offset() + expected_bytes(*net.root));
  CHECK(test::all_ranks(true));

  // Mismatches: refused on every rank, naming the file and the tensor; nothing changes.
  struct Case {
    bool drop_b, extra, wrong_shape, bf16_b;
    const char* text;
  };
  const Case cases[] = {
      {true, false, false, false, "tensor 'l0.b': missing"},
      {false, true, false, false, "tensor 'l9.w': unexpected"},
      {false, false, true, false,
       "tensor 'l0.w': has shape (7, 2), the model's parameter is (7, 3)"},
      {false, false, false, true, "tensor 'l0.b': is BF16, the model's parameter is F32"},
  };
  int k = 0;
  for (const Case& c : cases) {
    CAPTURE(c.text);
    const std::string bad = dir + "/bad" + std::to_string(k++) + ".safetensors";
    if (R() == 0) write_file(bad, 5, c.drop_b, c.extra, c.wrong_shape, c.bf16_b);
    MPI_Barrier(MPI_COMM_WORLD);
    const std::string e =
        test::error_of<InvalidArgument>([&] { (void)ck::load_safetensors(bad, *net.root); });
    CHECK_MESSAGE(contains(e, "safetensors file " + bad), e);
    CHECK_MESSAGE(contains(e, c.text), e);
    CHECK(mismatches(*net.root, 3) == 0);
  }

  // With cast, a BF16 tensor goes into the f32 parameter (the values are exact in bf16).
  {
    const std::string b16 = dir + "/bad3.safetensors";  // l0.b in BF16, seed 5
    ck::SafetensorsLoadOptions lo;
    lo.cast = true;
    const ck::SafetensorsLoaded c = ck::load_safetensors(b16, *net.root, lo);
    CHECK(c.cast == 1);
    CHECK(mismatches(*net.root, 5) == 0);
  }

  // A checkpoint saved on the world, converted: the same values load back.
  Net saved(mesh, 9);
  ck::save(dir + "/ck", *saved.root, nullptr, 2);
  if (R() == 0) ck::checkpoint_to_safetensors(dir + "/ck", dir + "/ck.safetensors");
  MPI_Barrier(MPI_COMM_WORLD);
  (void)ck::load_safetensors(dir + "/ck.safetensors", *net.root);
  CHECK(mismatches(*net.root, 9) == 0);

  MPI_Barrier(MPI_COMM_WORLD);
  std::error_code ec;
  if (R() == 0) fs::remove_all(dir, ec);
}

TEST_CASE("load_safetensors on HSDP 2x2: each replica reads the shards of its shard group") {
  if (test::world_size() != 4) return;
  const std::string dir = shared_temp_dir();
  REQUIRE(!dir.empty());
  const std::string path = dir + "/w.safetensors";
  if (R() == 0) write_file(path, 4);
  MPI_Barrier(MPI_COMM_WORLD);
  DeviceMesh mesh(test::runtime(), {2, 2}, {"replicate", "shard"});
  Net net(mesh, 0);
  const ck::SafetensorsLoaded l = ck::load_safetensors(path, *net.root);
  CHECK(mismatches(*net.root, 4) == 0);
  CHECK(l.bytes_read == ck::SafetensorsReader(path).data_offset() + expected_bytes(*net.root));
  MPI_Barrier(MPI_COMM_WORLD);
  std::error_code ec;
  if (R() == 0) fs::remove_all(dir, ec);
}
