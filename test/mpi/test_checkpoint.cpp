// Checkpoints on 1-4 ranks, against references computed here:
// - save on the world (FSDP, or HSDP 2x2 on 4 ranks), load on every sub-mesh of the first
//   1..W ranks and on HSDP 2x2: every local element of the parameters and the AdamW state
//   equals the saved model's (gathered into full tensors with one all-reduce), sharded and
//   full checkpoints, Shard(0), Shard(1) and an ignored (replicated) parameter;
// - offline conversion (sharded -> full -> sharded on 3 shards) loads the same values;
// - every kind of bad checkpoint gives an InvalidArgument naming the file and the tensor, on
//   every rank, and leaves the model and optimizer untouched (a missing one: an I/O error);
// - resume: 10 steps, save, load, 10 more equals 20 straight steps: bit-exact on the same mesh,
//   relative 1e-6 on other world sizes and on HSDP;
// - asynchronous saves: the files of a synchronous save byte for byte while training goes on,
//   one save in flight, test()/wait(), retention, and a failed background write raised on
//   every rank with `latest` left at the previous checkpoint.
// Sub-mesh loads are collective over the sub-mesh only; results are agreed over the world.
#include <doctest/doctest.h>
#include <mpi.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "error_check.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/async_save.hpp"
#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/fsdp/state_dict.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "lib/checkpoint/io.hpp"  // index_checksum_text, to rewrite an index consistently
#include "test_support.hpp"

using namespace fullshard;
using graph::Module;
using graph::Parameter;
namespace ck = fullshard::checkpoint;
namespace fs = std::filesystem;

namespace {

using test::global_index;

int W() {
  return test::world_size();
}
int R() {
  return test::world_rank();
}

void bcast_string(std::string& s) {
  int len = static_cast<int>(s.size());
  MPI_Bcast(&len, 1, MPI_INT, 0, MPI_COMM_WORLD);
  s.resize(static_cast<std::size_t>(len));
  MPI_Bcast(s.data(), len, MPI_CHAR, 0, MPI_COMM_WORLD);
}

// A directory under $TMPDIR (or /tmp) shared by every rank; rank 0 creates and removes it.
class SharedTempDir {
 public:
  SharedTempDir() {
    if (R() == 0) {
      const char* t = std::getenv("TMPDIR");
      std::string tmpl = std::string(t && *t ? t : "/tmp") + "/fullshard-ckpt-test-XXXXXX";
      if (mkdtemp(tmpl.data())) path_ = tmpl;
    }
    bcast_string(path_);
    REQUIRE(!path_.empty());
  }
  ~SharedTempDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    std::error_code ec;
    if (R() == 0) fs::remove_all(path_, ec);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Runs f on rank 0, then every rank waits for it. An exception (a failed REQUIRE included) is
// a failed check that does not skip the barrier, so the other ranks never wait forever.
void on_rank0(const std::function<void()>& f) {
  if (R() == 0) {
    try {
      f();
    } catch (const std::exception& e) {
      const std::string msg = std::string("on rank 0: ") + e.what();
      FAIL_CHECK(msg);
    } catch (...) {
      FAIL_CHECK("on rank 0: a check failed");
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// A mesh over the first `ranks` world ranks; empty on the others.
struct SubMesh {
  std::optional<DeviceMesh> mesh;
  SubMesh(int ranks, std::vector<int> shape, std::vector<std::string> names) {
    MPI_Comm sub = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, R() < ranks ? 0 : MPI_UNDEFINED, R(), &sub);
    if (sub != MPI_COMM_NULL) {
      mesh.emplace(sub, std::move(shape), std::move(names), 60.0);
      MPI_Comm_free(&sub);
    }
  }
  std::string name;
};

// The meshes a checkpoint is saved on: FSDP over the world, and HSDP 2x2 on 4 ranks.
std::vector<std::unique_ptr<SubMesh>> source_meshes() {
  std::vector<std::unique_ptr<SubMesh>> out;
  out.push_back(
      std::make_unique<SubMesh>(W(), std::vector<int>{W()}, std::vector<std::string>{"dp"}));
  out.back()->name = "FSDP on " + std::to_string(W());
  if (W() == 4) {
    out.push_back(std::make_unique<SubMesh>(4, std::vector<int>{2, 2},
                                            std::vector<std::string>{"replicate", "shard"}));
    out.back()->name = "HSDP 2x2";
  }
  return out;
}

std::vector<std::unique_ptr<SubMesh>> target_meshes() {
  std::vector<std::unique_ptr<SubMesh>> out;
  for (int m = 1; m <= W(); ++m) {
    out.push_back(
        std::make_unique<SubMesh>(m, std::vector<int>{m}, std::vector<std::string>{"dp"}));
    out.back()->name = "FSDP on " + std::to_string(m);
  }
  if (W() == 4) {
    out.push_back(std::make_unique<SubMesh>(4, std::vector<int>{2, 2},
                                            std::vector<std::string>{"replicate", "shard"}));
    out.back()->name = "HSDP 2x2";
  }
  return out;
}

int salt(const std::string& fqn) {
  int h = 7;
  for (char c : fqn)
    h = (h * 31 + static_cast<unsigned char>(c)) % 1000;
  return h;
}

// Variants of the test model for the mismatch cases.
enum class Variant { normal, wrong_shape, extra_param, no_l2, other };

// l0 {w (7,3), b (5,)}, l1 {w (13,)}, l2 {w (4,12) Shard(1)}, root {scale (3,), ignored}; each
// layer and the root fully_shard'ed. Values depend on `seed`; gradients are rank-dependent
// multiples of 1/4.
struct Net {
  std::unique_ptr<Module> root = Module::make_root("model");
  int k = 0;

  Net(const DeviceMesh& mesh, int seed, Variant v = Variant::normal) {
    std::vector<Module*> layers;
    if (v == Variant::other) {
      Module& a = root->add_module("enc");
      a.add_param("kernel", {9, 2});
      layers.push_back(&a);
    } else {
      Module& l0 = root->add_module("l0");
      Module& l1 = root->add_module("l1");
      l0.add_param("w", {7, v == Variant::wrong_shape ? 4 : 3});
      l0.add_param("b", {5});
      l1.add_param("w", {13});
      if (v == Variant::extra_param) l1.add_param("u", {3});
      layers = {&l0, &l1};
      if (v != Variant::no_l2) {
        Module& l2 = root->add_module("l2");
        l2.add_param("w", {4, 12});
        layers.push_back(&l2);
      }
      root->add_param("scale", {3}, DType::f32, false);
    }
    for (Parameter* p : root->parameters()) {
      const int s = salt(p->fqn()) + 13 * seed;
      p->init([s](std::int64_t e) { return 0.25 * static_cast<double>((e * 7 + s) % 29) - 3.0; });
    }
    for (Module* m : layers)
      m->on_backward([this](Module& mod) {
        for (std::size_t i = 0; i < mod.num_params(); ++i) {
          Parameter& p = mod.param(i);
          Tensor g = p.grad();
          for (std::int64_t e = 0; e < g.numel(); ++e)
            g.set(e, g.at(e) + test::sample(R(), static_cast<std::size_t>(e),
                                            salt(p.fqn()) + 100 * k, true));
        }
      });
    fsdp::FullyShardOptions l2_opts;
    l2_opts.shard_placement_fn = [](const Parameter&) { return Placement::Shard(1); };
    for (Module* m : layers)
      fsdp::fully_shard(*m, mesh, m->name() == "l2" ? l2_opts : fsdp::FullyShardOptions{});
    fsdp::FullyShardOptions root_opts;
    if (v != Variant::other) root_opts.ignored_params = {"scale"};
    fsdp::fully_shard(*root, mesh, root_opts);
  }

  void iteration(int iter) {
    k = iter;
    fsdp::forward(*root);
    fsdp::backward(*root);
  }
};

std::unique_ptr<optim::AdamW> adamw(Module& root) {
  return std::make_unique<optim::AdamW>(root.parameters(), 0.01, 0.9, 0.999, 1e-8, 0.1);
}

// Full values of a model's tensors: name -> row-major values.
using Full = std::map<std::string, std::vector<double>>;

// This rank's tensors (parameters and optimizer states) with their layouts.
std::map<std::string, std::pair<Tensor, ShardLayout>> local_tensors(Module& root,
                                                                    const optim::Optimizer* opt) {
  std::map<std::string, std::pair<Tensor, ShardLayout>> out;
  auto sd = fsdp::sharded_state_dict(root);
  for (auto& [name, st] : sd)
    out[name] = {st.local, st.layout};
  if (opt)
    for (auto& [key, t] : opt->state_dict())
      if (key != "step") {
        const std::string param = key.substr(0, key.rfind('.'));
        out[key] = {t, sd.at(param).layout};
      }
  return out;
}

// Full tensors named in `shapes`, summed over the world from the ranks where `contribute`
// (one copy of each element: HSDP replicas and replicated parameters contribute once).
Full gather(const std::map<std::string, Shape>& shapes, Module* root, const optim::Optimizer* opt,
            bool contribute, bool lead) {
  Full out;
  std::map<std::string, std::pair<Tensor, ShardLayout>> local;
  if (contribute && root) local = local_tensors(*root, opt);
  for (const auto& [name, shape] : shapes) {
    std::vector<double> v(static_cast<std::size_t>(numel(shape)), 0.0);
    auto it = local.find(name);
    if (it != local.end() && (it->second.second.placement.is_shard() || lead))
      for (std::int64_t e = 0; e < it->second.first.numel(); ++e)
        v[static_cast<std::size_t>(global_index(it->second.second, e))] = it->second.first.at(e);
    MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_DOUBLE, MPI_SUM,
                  MPI_COMM_WORLD);
    out[name] = std::move(v);
  }
  return out;
}

std::map<std::string, Shape> shapes_of(Module& root, const optim::Optimizer* opt) {
  std::map<std::string, Shape> out;
  for (Parameter* p : root.parameters()) {
    out[p->fqn()] = p->shape();
    if (opt && p->requires_grad())
      for (const std::string& s : opt->state_names())
        out[p->fqn() + "." + s] = p->shape();
  }
  return out;
}

bool replicate_lead(const DeviceMesh& mesh) {
  const auto& c = mesh.coordinates();
  for (std::size_t d = 0; d + 1 < c.size(); ++d)
    if (c[d] != 0) return false;
  return true;
}

// Local elements of root/opt that differ from `ref` (rel 0: bit-exact).
int mismatches(Module& root, const optim::Optimizer* opt, const Full& ref, double rel) {
  int bad = 0;
  for (auto& [name, tl] : local_tensors(root, opt)) {
    auto it = ref.find(name);
    if (it == ref.end()) {
      MESSAGE("no reference for " << name);
      ++bad;
      continue;
    }
    for (std::int64_t e = 0; e < tl.first.numel(); ++e) {
      const double want = it->second[static_cast<std::size_t>(global_index(tl.second, e))];
      const double got = tl.first.at(e);
      const bool ok =
          rel == 0 ? got == want : std::fabs(got - want) <= rel * std::max(1.0, std::fabs(want));
      if (!ok && bad++ < 5)
        MESSAGE(name << "[" << global_index(tl.second, e) << "]: " << got << ", expected " << want);
    }
  }
  return bad;
}

// Runs f, turning an exception into a failed check (so that this rank still reaches the next
// world-wide agreement instead of leaving the others waiting). Anything else f throws (a
// failed REQUIRE throws doctest's own exception) is a failure too: use CHECK inside f.
bool no_throw(const std::string& what, const std::function<void()>& f) {
  try {
    f();
    return true;
  } catch (const std::exception& e) {
    const std::string msg = what + ": " + e.what();
    FAIL_CHECK(msg);
  } catch (...) {
    const std::string msg = what + ": a check failed";
    FAIL_CHECK(msg);
  }
  return false;
}

// Writes an index text and the checksum file that matches it (a consistent index with other
// contents, as another writer could have produced).
void write_index(const std::string& step_dir, const std::string& text) {
  std::ofstream(step_dir + "/index.json", std::ios::binary | std::ios::trunc) << text;
  std::ofstream(step_dir + "/" + ck::kIndexChecksumFile, std::ios::binary | std::ios::trunc)
      << ck::detail::index_checksum_text(text);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

}  // namespace

TEST_CASE("sharded and full checkpoints: save on one mesh, load bit-exact on every other") {
  SharedTempDir tmp;
  std::vector<std::unique_ptr<SubMesh>> sources = source_meshes();
  auto targets = target_meshes();
  int case_no = 0;
  // 20-byte checksum blocks: every shard spans several blocks, cut inside rows and elements.
  const std::pair<ck::Kind, std::uint64_t> cases[] = {{ck::Kind::sharded, ck::kDefaultBlockBytes},
                                                      {ck::Kind::full, ck::kDefaultBlockBytes},
                                                      {ck::Kind::sharded, 20}};
  for (const auto& kb : cases)
    for (auto& src : sources) {
      const ck::Kind kind = kb.first;
      const std::uint64_t block = kb.second;
      const std::string kind_name = ck::kind_name(kind);
      CAPTURE(kind_name);
      CAPTURE(block);
      CAPTURE(src->name);
      const DeviceMesh& mesh = *src->mesh;  // sources span the world
      Net a(mesh, 1);
      auto opt = adamw(*a.root);
      for (int k = 0; k < 2; ++k) {
        opt->zero_grad();
        a.iteration(k);
        opt->step();
      }
      const auto shapes = shapes_of(*a.root, opt.get());
      const Full ref =
          gather(shapes, a.root.get(), opt.get(), replicate_lead(mesh), mesh.rank() == 0);
      const std::string dir = tmp.sub("ck" + std::to_string(case_no++));
      const std::string rng("rng\x00\x01\xff state", 13);
      std::string path;
      REQUIRE(test::all_ranks(no_throw("save", [&] {
        path = ck::save(dir, *a.root, opt.get(), 7, R"({"note": "x", "k": 2})", rng, {kind, block});
      })));
      CHECK(path == dir + "/step-00000007");
      CHECK(fs::exists(dir + "/latest"));
      if (kind == ck::Kind::full) {
        CHECK(fs::exists(path + "/model.bin"));
        CHECK(!fs::exists(path + "/rank-00000.bin"));
      } else {
        CHECK(fs::exists(path + "/rank-0000" + std::to_string(mesh.shape().back() - 1) + ".bin"));
      }
      for (auto& tgt : targets) {
        CAPTURE(tgt->name);
        bool ok = true;
        if (tgt->mesh) {
          Net b(*tgt->mesh, 2);
          auto opt_b = adamw(*b.root);
          ok = no_throw("load", [&] {
            const ck::Loaded l = ck::load(dir, *b.root, opt_b.get());
            CHECK(l.step == 7);
            CHECK(l.rng_state == rng);
            CHECK(nlohmann::json::parse(l.metadata) == nlohmann::json{{"note", "x"}, {"k", 2}});
            CHECK(l.kind == kind);
            CHECK(l.step_dir == path);
            CHECK(opt_b->steps() == 2);
            CHECK(mismatches(*b.root, opt_b.get(), ref, 0) == 0);
          });
        }
        CHECK(test::all_ranks(ok));
      }
    }
}

TEST_CASE("metadata depth: save refuses what a load would refuse, the deepest allowed loads") {
  SharedTempDir tmp;
  DeviceMesh mesh(test::runtime(), {W()}, {"dp"});
  Net a(mesh, 1);
  nlohmann::json deep = nlohmann::json::array();  // 1 level
  for (std::size_t i = 0; i < ck::kMaxMetadataDepth; ++i)
    deep = nlohmann::json::array({deep});  // kMaxMetadataDepth + 1 levels
  const std::string msg = test::error_of<InvalidArgument>(
      [&] { ck::save(tmp.sub("d"), *a.root, nullptr, 1, deep.dump()); });
  CHECK_MESSAGE(test::contains(msg, "metadata nests arrays and objects deeper than 256 levels"),
                msg);
  const nlohmann::json ok = deep[0];  // kMaxMetadataDepth levels
  ck::save(tmp.sub("d"), *a.root, nullptr, 2, ok.dump());
  CHECK(nlohmann::json::parse(ck::load(tmp.sub("d"), *a.root).metadata) == ok);
  // Text that is not JSON is refused naming the metadata.
  const std::string bad =
      test::error_of<InvalidArgument>([&] { ck::save(tmp.sub("e"), *a.root, nullptr, 1, "{"); });
  CHECK_MESSAGE(test::contains(bad, "the metadata is not a JSON text"), bad);
}

TEST_CASE("offline conversion: sharded -> full -> 3 shards loads the same values (in place)") {
  SharedTempDir tmp;
  DeviceMesh mesh(test::runtime(), {W()}, {"dp"});
  Net a(mesh, 3);
  auto opt = adamw(*a.root);
  opt->zero_grad();
  a.iteration(0);
  opt->step();
  const Full ref = gather(shapes_of(*a.root, opt.get()), a.root.get(), opt.get(), true, R() == 0);
  REQUIRE(
      test::all_ranks(no_throw("save", [&] { ck::save(tmp.sub("s"), *a.root, opt.get(), 4); })));
  std::string err;
  on_rank0([&] {
    try {
      const std::string full = ck::convert(tmp.sub("s"), tmp.sub("f"), {ck::Kind::full, 0});
      CHECK(full == tmp.sub("f") + "/step-00000004");
      ck::convert(tmp.sub("f"), tmp.sub("t"), {ck::Kind::sharded, 3});
      CHECK(ck::verify(tmp.sub("t")).empty());
      CHECK(ck::Reader(tmp.sub("t")).index().files.size() == 3);
      CHECK(ck::Reader(tmp.sub("f")).index().kind == ck::Kind::full);
    } catch (const std::exception& e) {
      err = e.what();
    }
  });
  bcast_string(err);
  REQUIRE_MESSAGE(err.empty(), err);
  for (auto& tgt : target_meshes()) {
    CAPTURE(tgt->name);
    bool ok = true;
    if (tgt->mesh) {
      Net b(*tgt->mesh, 5);
      auto opt_b = adamw(*b.root);
      ok = no_throw("load", [&] {
        // Converted checkpoint, read straight into the storage the groups adopt.
        CHECK(ck::load(tmp.sub("t"), *b.root, opt_b.get()).step == 4);
        CHECK(mismatches(*b.root, opt_b.get(), ref, 0) == 0);
      });
    }
    CHECK(test::all_ranks(ok));
  }
}

TEST_CASE("bad checkpoints: errors name the file and the tensor on every rank; nothing loads") {
  SharedTempDir tmp;
  DeviceMesh mesh(test::runtime(), {W()}, {"dp"});
  const std::string dir = tmp.sub("c");
  {
    Net a(mesh, 1);
    auto opt = adamw(*a.root);
    opt->zero_grad();
    a.iteration(0);
    opt->step();
    ck::save(dir, *a.root, opt.get(), 3, R"({"lr": 0.5})");
    ck::save(tmp.sub("noopt"), *a.root, nullptr, 3);
    Net other(mesh, 1, Variant::other);
    ck::save(tmp.sub("other"), *other.root, nullptr, 3);
  }
  const std::string step_dir = dir + "/step-00000003";
  const std::string file0 = step_dir + "/rank-00000.bin";
  const std::string index = step_dir + "/index.json";
  const std::string index_sum = step_dir + "/index.json.crc32c";

  Net b(mesh, 2);
  auto opt_b = adamw(*b.root);
  const Full before = gather(shapes_of(*b.root, nullptr), b.root.get(), nullptr, true, R() == 0);
  auto untouched = [&] {
    return mismatches(*b.root, nullptr, before, 0) == 0 && opt_b->steps() == 0 &&
           opt_b->state_dict().size() == 1;
  };
  // Loads `from` into `net` (default: b) and checks the message on every rank.
  auto expect = [&](const std::vector<std::string>& parts, Net* net = nullptr,
                    const std::string& from = "", optim::Optimizer* o = nullptr) {
    Net& target = net ? *net : b;
    const std::string msg = test::error_of<InvalidArgument>(
        [&] { ck::load(from.empty() ? dir : from, *target.root, o ? o : opt_b.get()); });
    for (const auto& p : parts)
      CHECK_MESSAGE(test::contains(msg, p), "'" << p << "' not in: " << msg);
    CHECK(untouched());
  };
  auto backup = [&](const std::string& f) {
    on_rank0([&] {
      fs::copy_file(f, f + ".bak");
      if (f == index) fs::copy_file(index_sum, index_sum + ".bak");
    });
  };
  auto restore = [&](const std::string& f) {
    on_rank0([&] {
      fs::rename(f + ".bak", f);
      if (f == index) fs::rename(index_sum + ".bak", index_sum);
    });
  };

  SUBCASE("a flipped byte") {
    backup(file0);
    on_rank0([&] {
      // A byte of l0.w's shard in rank 0's file.
      const ck::Reader r(dir);
      std::uint64_t at = 0;
      for (const auto& s : r.tensor("l0.w").shards)
        if (r.index().files[s.file].name == "rank-00000.bin") at = s.offset + 5;
      std::fstream f(file0, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(static_cast<std::streamoff>(at));
      char c = 0;
      f.read(&c, 1);
      c = static_cast<char>(c ^ 0x10);
      f.seekp(static_cast<std::streamoff>(at));
      f.write(&c, 1);
    });
    expect({"rank-00000.bin", "checksum mismatch", "tensor 'l0.w'"});
    on_rank0([&] {
      const auto issues = ck::verify(dir);
      CHECK(issues.size() == 1);
      if (issues.empty()) return;
      CHECK(issues[0].file == file0);
      CHECK(issues[0].tensor == "l0.w");
    });
    restore(file0);
  }
  SUBCASE("a truncated file") {
    backup(file0);
    on_rank0([&] { fs::resize_file(file0, 10); });
    expect({"rank-00000.bin", "truncated", "tensor 'l0.b'"});
    restore(file0);
  }
  SUBCASE("a missing file") {
    backup(file0);
    on_rank0([&] { fs::remove(file0); });
    expect({"rank-00000.bin", "is missing", "tensor 'l0.b'"});
    restore(file0);
  }
  SUBCASE("an unknown format version") {
    backup(index);
    on_rank0([&] {
      nlohmann::json j = nlohmann::json::parse(std::ifstream(index));
      j["format_version"] = 99;
      write_index(step_dir, j.dump());
    });
    expect({"index.json", "unknown format version 99"});
    restore(index);
  }
  SUBCASE("a truncated index") {
    backup(index);
    on_rank0([&] { fs::resize_file(index, fs::file_size(index) / 2); });
    expect({"index.json", "does not match its checksum"});
    // Without the checksum file (a checkpoint from before it existed): the JSON parser finds it.
    on_rank0([&] { fs::remove(index_sum); });
    expect({"index.json", "invalid JSON"});
    restore(index);
  }
  SUBCASE("a flipped byte in the index: its step, its metadata, its checksum file") {
    backup(index);
    const std::string good = R() == 0 ? read_file(index) : "";
    // Each edit leaves valid JSON with other values: only the checksum can tell.
    for (const auto& edit : std::vector<std::pair<std::string, std::string>>{
             {"\"step\": 3", "\"step\": 7"}, {"\"lr\": 0.5", "\"lr\": 0.7"}}) {
      const std::string& from = edit.first;  // not structured bindings: the lambda
      const std::string& to = edit.second;   // captures them (C++20 in nvcc's eyes)
      CAPTURE(from);
      on_rank0([&] {
        std::string text = good;
        const auto at = text.find(from);
        REQUIRE(at != std::string::npos);
        text.replace(at, from.size(), to);
        std::ofstream(index, std::ios::binary | std::ios::trunc) << text;
      });
      expect({index, "does not match its checksum", "index.json.crc32c"});
      on_rank0([&] {
        CHECK_THROWS_WITH_AS(ck::Reader{dir}, doctest::Contains("does not match its checksum"),
                             InvalidArgument);
        const auto issues = ck::verify(dir);
        CHECK(issues.size() == 1);
        if (!issues.empty()) CHECK(issues[0].file == index);
      });
    }
    on_rank0([&] {
      std::ofstream(index, std::ios::binary | std::ios::trunc) << good;
      std::ofstream(index_sum, std::ios::binary | std::ios::trunc) << "crc32c zz\n";
    });
    expect({"index.json.crc32c", "is corrupt"});
    restore(index);
  }
  SUBCASE("a checksum list that does not match the data") {
    backup(index);
    on_rank0([&] {
      nlohmann::json j = nlohmann::json::parse(std::ifstream(index));
      for (auto& t : j["tensors"])
        if (t["name"] == "l1.w") t["shards"][0]["crc32c"][0] = 12345;
      write_index(step_dir, j.dump());
    });
    expect({"checksum mismatch", "tensor 'l1.w'", ".bin"});
    restore(index);
  }
  SUBCASE("a parameter of the wrong shape") {
    Net c(mesh, 2, Variant::wrong_shape);
    auto o = adamw(*c.root);
    expect({"index.json", "tensor 'l0.w' has shape (7, 3)", "(7, 4)"}, &c, "", o.get());
  }
  SUBCASE("a parameter the checkpoint lacks") {
    Net c(mesh, 2, Variant::extra_param);
    auto o = adamw(*c.root);
    expect({"index.json", "parameter 'l1.u' is missing"}, &c, "", o.get());
  }
  SUBCASE("a parameter the model lacks") {
    Net c(mesh, 2, Variant::no_l2);
    auto o = adamw(*c.root);
    expect({"index.json", "unexpected parameter 'l2.w'"}, &c, "", o.get());
  }
  SUBCASE("an index from another model") {
    backup(index);
    on_rank0(
        [&] { write_index(step_dir, read_file(tmp.sub("other") + "/step-00000003/index.json")); });
    expect({"index.json", "'l0.b' is missing", "another model"});
    restore(index);
  }
  SUBCASE("optimizer state of another optimizer, or none") {
    optim::SGD sgd(b.root->parameters(), 0.1, 0.9);
    expect({"index.json", "optimizer state names [exp_avg, exp_avg_sq]", "momentum_buffer"},
           nullptr, "", &sgd);
    expect({"index.json", "holds no optimizer state"}, nullptr, tmp.sub("noopt"));
  }
  // Crafted indexes, re-signed so that the checksum matches: the validator refuses them before
  // a byte is read (they used to load uninitialised memory, or spin past FULLSHARD_TIMEOUT).
  SUBCASE("a shard whose offset overflows: [INT64_MAX, 0]") {
    backup(index);
    on_rank0([&] {
      nlohmann::json j = nlohmann::json::parse(std::ifstream(index));
      for (auto& t : j["tensors"])
        if (t["name"] == "l0.w")
          t["shards"][0]["global_offset"] = {std::numeric_limits<std::int64_t>::max(), 0};
      write_index(step_dir, j.dump());
    });
    expect({"index.json", "tensor 'l0.w'", "9223372036854775807", "lies outside the global shape"});
    restore(index);
  }
  SUBCASE("block_bytes 2^64-1 with empty checksum lists") {
    backup(index);
    on_rank0([&] {
      nlohmann::json j = nlohmann::json::parse(std::ifstream(index));
      j["block_bytes"] = std::numeric_limits<std::uint64_t>::max();
      for (auto& t : j["tensors"])
        for (auto& sh : t["shards"])
          sh["crc32c"] = nlohmann::json::array();
      write_index(step_dir, j.dump());
    });
    expect({"index.json", "'block_bytes' must be in [1, 1073741824]"});
    restore(index);
  }
  SUBCASE("metadata nested 100,000 deep") {
    backup(index);
    on_rank0([&] {
      nlohmann::json j = nlohmann::json::parse(std::ifstream(index));
      j["metadata"] = "DEEP";
      std::string text = j.dump();
      const auto at = text.find("\"DEEP\"");
      REQUIRE(at != std::string::npos);
      text.replace(at, 6, std::string(100000, '[') + std::string(100000, ']'));
      write_index(step_dir, text);
    });
    expect({"index.json", "JSON nested deeper than 257 levels"});
    restore(index);
  }
  SUBCASE("a FIFO in place of a rank file") {
    backup(file0);
    on_rank0([&] {
      fs::remove(file0);
      REQUIRE(::mkfifo(file0.c_str(), 0644) == 0);
    });
    expect({"rank-00000.bin' is a FIFO, not a regular file", "(needed for tensor '"});
    on_rank0([&] { fs::remove(file0); });
    restore(file0);
  }
  SUBCASE("no checkpoint at all: an I/O error (the C API's FULLSHARD_ERR_IO), not a bad argument") {
    auto io_error = [&](const std::string& from) -> std::string {
      try {
        ck::load(from, *b.root, opt_b.get());
      } catch (const InvalidArgument& e) {
        FAIL_CHECK("an InvalidArgument: " << e.what());
        return "";
      } catch (const IoError& e) {
        return e.what();
      }
      FAIL_CHECK("no exception thrown");
      return "";
    };
    const std::string nothing = io_error(tmp.sub("nothing"));
    CHECK(test::contains(nothing,
                         "checkpoint directory '" + tmp.sub("nothing") + "' does not exist"));
    on_rank0([&] { fs::create_directories(tmp.sub("empty")); });
    const std::string empty = io_error(tmp.sub("empty"));
    CHECK(test::contains(empty, tmp.sub("empty") + "' is not a checkpoint"));
    CHECK(untouched());
  }
  // After every case the checkpoint is intact again and loads.
  CHECK(test::all_ranks(
      no_throw("load", [&] { CHECK(ck::load(dir, *b.root, opt_b.get()).step == 3); })));
}

namespace {

// The resume model: gradients depend on the weights (loss 0.5 * sum_j (w - t_j)^2 over a
// global batch of 12 samples split over the ranks, scaled by a random factor per step), so a
// wrong restore of parameters, AdamW state, step count or RNG changes the result.
struct Trainer {
  static constexpr int kBatch = 12;
  std::unique_ptr<Module> root = Module::make_root("model");
  std::unique_ptr<optim::AdamW> opt;
  std::mt19937_64 rng{42};
  double scale = 1.0;
  int k = 0;
  int ranks, rank;

  explicit Trainer(const DeviceMesh& mesh) : ranks(mesh.size()), rank(mesh.rank()) {
    Module& l0 = root->add_module("l0");
    Module& l1 = root->add_module("l1");
    Module& l2 = root->add_module("l2");
    l0.add_param("w", {6, 4});
    l0.add_param("b", {6});
    l1.add_param("w", {10});
    l2.add_param("w", {4, 12});
    for (Parameter* p : root->parameters()) {
      const int s = salt(p->fqn());
      p->init([s](std::int64_t e) { return 0.1 * static_cast<double>((e * 5 + s) % 17) - 0.8; });
    }
    for (Module* m : {&l0, &l1, &l2})
      m->on_backward([this](Module& mod) {
        for (std::size_t i = 0; i < mod.num_params(); ++i) {
          Parameter& p = mod.param(i);
          Tensor g = p.grad();
          const Tensor& w = p.data();
          for (std::int64_t e = 0; e < g.numel(); ++e) {
            double local = 0;
            for (int j = rank; j < kBatch; j += ranks)
              local += w.at(e) - test::sample(j, static_cast<std::size_t>(e),
                                              salt(p.fqn()) + 1000 * k, false);
            g.set(e, g.at(e) + local * ranks / kBatch * scale);
          }
        }
      });
    fsdp::FullyShardOptions l2_opts;
    l2_opts.shard_placement_fn = [](const Parameter&) { return Placement::Shard(1); };
    fsdp::fully_shard(l0, mesh);
    fsdp::fully_shard(l1, mesh);
    fsdp::fully_shard(l2, mesh, l2_opts);
    fsdp::fully_shard(*root, mesh);
    opt = std::make_unique<optim::AdamW>(root->parameters(), 0.01, 0.9, 0.999, 1e-8, 0.01);
  }

  void step(int iter) {
    k = iter;
    scale = std::uniform_real_distribution<double>(0.5, 1.5)(rng);
    opt->zero_grad();
    fsdp::forward(*root);
    fsdp::backward(*root);
    opt->step();
  }
  std::string rng_state() const {
    std::ostringstream s;
    s << rng;
    return s.str();
  }
  void set_rng_state(const std::string& state) {
    std::istringstream s(state);
    s >> rng;
  }
};

}  // namespace

TEST_CASE("resume: 10 steps + save + load + 10 steps equals 20 steps, on any mesh") {
  SharedTempDir tmp;
  DeviceMesh world(test::runtime(), {W()}, {"dp"});
  Full ref;
  {
    Trainer t(world);
    for (int k = 0; k < 20; ++k)
      t.step(k);
    ref = gather(shapes_of(*t.root, t.opt.get()), t.root.get(), t.opt.get(), true, R() == 0);
  }
  {
    Trainer t(world);
    for (int k = 0; k < 10; ++k)
      t.step(k);
    ck::save(tmp.sub("r"), *t.root, t.opt.get(), 10, nlohmann::json{{"world", W()}}.dump(),
             t.rng_state());
  }
  for (auto& tgt : target_meshes()) {
    CAPTURE(tgt->name);
    const bool same = tgt->mesh && tgt->mesh->ndim() == 1 && tgt->mesh->size() == W();
    bool ok = true;
    if (tgt->mesh) {
      Trainer t(*tgt->mesh);
      ok = no_throw("resume", [&] {
        const ck::Loaded l = ck::load(tmp.sub("r"), *t.root, t.opt.get());
        CHECK(l.step == 10);
        if (l.step != 10) return;
        CHECK(nlohmann::json::parse(l.metadata)["world"] == W());
        t.set_rng_state(l.rng_state);
        for (auto k = l.step; k < 20; ++k)
          t.step(static_cast<int>(k));
        CHECK(t.opt->steps() == 20);
        CHECK(mismatches(*t.root, t.opt.get(), ref, same ? 0.0 : 1e-6) == 0);
      });
    }
    CHECK(test::all_ranks(ok));
  }
}

TEST_CASE("a save failing on one rank while it prepares a tensor fails on every rank, no hang") {
  // FULLSHARD_CKPT_FAULT=prepare_tensor@R: rank R throws (as if out of memory) where a full save
  // allocates rank 0's buffer or a sender's host copy, and where a sharded save stages a shard.
  SharedTempDir tmp;
  DeviceMesh mesh(test::runtime(), {W()}, {"dp"});
  Net a(mesh, 1);
  auto opt = adamw(*a.root);
  opt->zero_grad();
  a.iteration(0);
  opt->step();
  const Full ref = gather(shapes_of(*a.root, opt.get()), a.root.get(), opt.get(), true, R() == 0);
  const std::string dir = tmp.sub("c");
  REQUIRE(test::all_ranks(no_throw("save", [&] { ck::save(dir, *a.root, opt.get(), 1); })));
  std::vector<int> bad_ranks{0};
  if (W() > 1) bad_ranks.push_back(W() - 1);
  for (const int bad : bad_ranks)
    for (const ck::Kind kind : {ck::Kind::full, ck::Kind::sharded}) {
      CAPTURE(bad);
      const std::string kind_name = ck::kind_name(kind);
      CAPTURE(kind_name);
      const std::string fault = "prepare_tensor@" + std::to_string(bad);
      setenv("FULLSHARD_CKPT_FAULT", fault.c_str(), 1);
      const std::string msg = test::error_of<Error>([&] {
        ck::save(dir, *a.root, opt.get(), 2, {}, "", {kind, ck::kDefaultBlockBytes});
      });
      unsetenv("FULLSHARD_CKPT_FAULT");
      CHECK_MESSAGE(test::contains(msg, "FULLSHARD_CKPT_FAULT=prepare_tensor: injected failure"),
                    msg);
      if (R() != bad) CHECK_MESSAGE(test::contains(msg, "failed on another rank"), msg);
      on_rank0([&] {
        for (const auto& e : fs::directory_iterator(dir))
          CHECK_MESSAGE(e.path().filename().string().rfind(".tmp-", 0) != 0, e.path());
        CHECK(read_file(dir + "/latest") == "step-00000001\n");
      });
    }
  // The checkpoint of step 1 is intact.
  Net b(mesh, 2);
  auto opt_b = adamw(*b.root);
  CHECK(test::all_ranks(no_throw("load", [&] {
    CHECK(ck::load(dir, *b.root, opt_b.get()).step == 1);
    CHECK(mismatches(*b.root, opt_b.get(), ref, 0) == 0);
  })));
}

namespace {

// A model of two tensors much larger than the checksum blocks of its test: l0.w (640, 2400)
// Shard(0), 5.9 MiB (two 4 MiB read windows), and l1.w (448, 2400) Shard(1), 4.1 MiB (2400
// columns: divisible by 1-4 ranks and by 100 shards).
constexpr std::int64_t kBigCols = 2400;
const Shape kBigShapes[2] = {{640, kBigCols}, {448, kBigCols}};

// Element e of l0.w (which = 0) or l1.w (1): exact in f32.
double big_value(int which, std::int64_t e) {
  return static_cast<double>((e * 13 + which * 101) % 4093 - 2046) * 0.125;
}

struct BigNet {
  std::unique_ptr<Module> root = Module::make_root("model");
  BigNet(const DeviceMesh& mesh, bool zero) {
    Module& l0 = root->add_module("l0");
    Module& l1 = root->add_module("l1");
    l0.add_param("w", kBigShapes[0]).init([zero](std::int64_t e) {
      return zero ? 0.0 : big_value(0, e);
    });
    l1.add_param("w", kBigShapes[1]).init([zero](std::int64_t e) {
      return zero ? 0.0 : big_value(1, e);
    });
    fsdp::FullyShardOptions cols;
    cols.shard_placement_fn = [](const Parameter&) { return Placement::Shard(1); };
    fsdp::fully_shard(l0, mesh);
    fsdp::fully_shard(l1, mesh, cols);
    fsdp::fully_shard(*root, mesh);
  }
};

int big_mismatches(Module& root) {
  int bad = 0;
  for (auto& [name, st] : fsdp::sharded_state_dict(root)) {
    const int which = name == "l0.w" ? 0 : 1;
    for (std::int64_t e = 0; e < st.local.numel(); ++e) {
      const std::int64_t g = global_index(st.layout, e);
      if (st.local.at(e) != big_value(which, g) && bad++ < 5)
        MESSAGE(name << "[" << g << "]: " << st.local.at(e) << ", expected "
                     << big_value(which, g));
    }
  }
  return bad;
}

// Entries of /proc/self/fd (open descriptors), or -1 where there is no /proc.
long open_fds() {
  std::error_code ec;
  long n = 0;
  for (fs::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end; it.increment(ec))
    ++n;
  return ec ? -1 : n;
}

}  // namespace

TEST_CASE("small blocks, tensors of several windows: exact loads; Shard(1) reads its columns") {
  constexpr std::uint64_t kBlock = 512;  // a row (9600 bytes) spans 19-20 blocks
  SharedTempDir tmp;
  {
    DeviceMesh mesh(test::runtime(), {W()}, {"dp"});
    REQUIRE(test::all_ranks(no_throw("save", [&] {
      BigNet a(mesh, false);
      ck::save(tmp.sub("s"), *a.root, nullptr, 1, {}, "", {ck::Kind::sharded, kBlock});
      ck::save(tmp.sub("f"), *a.root, nullptr, 1, {}, "", {ck::Kind::full, kBlock});
    })));
  }
  for (const std::string src : {"s", "f"})
    for (auto& tgt : target_meshes()) {
      CAPTURE(src);
      CAPTURE(tgt->name);
      bool ok = true;
      if (tgt->mesh)
        ok = no_throw("load", [&] {  // the model too: a rank that throws must reach all_ranks
          BigNet b(*tgt->mesh, true);
          const ck::Loaded l = ck::load(tmp.sub(src), *b.root);
          CHECK(big_mismatches(*b.root) == 0);
          if (src != "f") return;
          // From one shard per tensor: the bytes of this rank's elements, plus at most the two
          // partial blocks at the ends of each run (the Shard(0) slab is one run, the Shard(1)
          // slab one per row), never the blocks between the rows of a column slab.
          std::uint64_t need = 0, runs = 0;
          for (auto& [name, st] : fsdp::sharded_state_dict(*b.root)) {
            const std::int64_t n = st.layout.local_numel();
            need += static_cast<std::uint64_t>(n) * 4;
            if (n > 0)
              runs += name == "l1.w" ? static_cast<std::uint64_t>(st.layout.local_shape[0]) : 1;
          }
          CHECK(l.bytes_read >= need);
          CHECK(l.bytes_read <= need + runs * 2 * kBlock);
        });
      CHECK(test::all_ranks(ok));
    }
  on_rank0([&] {
    // Boxes cut anywhere: partial rows and columns, across the 4 MiB window boundary.
    ck::Reader r(tmp.sub("f"));
    for (int which = 0; which < 2; ++which) {
      const std::vector<std::int64_t> off{which ? 5 : 100, 3};
      const Shape shape{which ? 400 : 500, 1001};
      std::vector<float> got(static_cast<std::size_t>(numel(shape)));
      r.read_box(r.tensor(which ? "l1.w" : "l0.w"), off, shape, got.data());
      int bad = 0;
      for (std::int64_t i = 0; i < shape[0]; ++i)
        for (std::int64_t j = 0; j < shape[1]; ++j)
          bad += got[static_cast<std::size_t>(i * shape[1] + j)] !=
                 big_value(which, (off[0] + i) * kBigCols + off[1] + j);
      CHECK(bad == 0);
    }
    // 100 data files: reading them all keeps at most 64 open.
    ck::convert(tmp.sub("f"), tmp.sub("c"), {ck::Kind::sharded, 100, kBlock});
    ck::Reader c(tmp.sub("c"));
    CHECK(c.index().files.size() == 100);
    const long before = open_fds();
    for (int which = 0; which < 2; ++which) {
      std::vector<float> got(static_cast<std::size_t>(numel(kBigShapes[which])));
      c.read_full(c.tensor(which ? "l1.w" : "l0.w"), got.data());
      int bad = 0;
      for (std::size_t e = 0; e < got.size(); ++e)
        bad += got[e] != big_value(which, static_cast<std::int64_t>(e));
      CHECK(bad == 0);
    }
    if (before >= 0) CHECK(open_fds() - before <= 64);
    CHECK(ck::verify(tmp.sub("c")).empty());
  });
}

// ---- Asynchronous saves (checkpoint::save_async) ----------------------------------------------

namespace {

// Every file of a step directory, by name.
std::map<std::string, std::string> files_of(const std::string& step_dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(step_dir))
    out[e.path().filename().string()] = read_file(e.path().string());
  return out;
}

// test() on every rank until it is true (at most about 30 s); the number of calls.
int poll_until_committed(ck::AsyncSave& s) {
  int calls = 1;
  while (!s.test() && calls < 3000) {
    ++calls;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return calls;
}

}  // namespace

TEST_CASE("asynchronous save: save()'s files byte for byte, a snapshot while training goes on") {
  SharedTempDir tmp;
  int case_no = 0;
  for (auto& src : source_meshes())
    for (const std::uint64_t block : {ck::kDefaultBlockBytes, std::uint64_t{20}}) {
      CAPTURE(src->name);
      CAPTURE(block);
      const DeviceMesh& mesh = *src->mesh;
      const std::string sync_dir = tmp.sub("s" + std::to_string(case_no));
      const std::string async_dir = tmp.sub("a" + std::to_string(case_no++));
      const nlohmann::json meta = {{"note", "async"}};
      // Reference: 10 straight steps.
      Full ref;
      {
        Trainer t(mesh);
        for (int k = 0; k < 10; ++k)
          t.step(k);
        ref = gather(shapes_of(*t.root, t.opt.get()), t.root.get(), t.opt.get(),
                     replicate_lead(mesh), mesh.rank() == 0);
      }
      // 5 steps, a synchronous and an asynchronous save of step 5, 5 more steps while the
      // asynchronous one is written and committed.
      Trainer t(mesh);
      for (int k = 0; k < 5; ++k)
        t.step(k);
      const ck::SaveOptions options{ck::Kind::sharded, block};
      const std::string sync_path =
          ck::save(sync_dir, *t.root, t.opt.get(), 5, meta.dump(), t.rng_state(), options);
      ck::AsyncSave pending =
          ck::save_async(async_dir, *t.root, t.opt.get(), 5, meta.dump(), t.rng_state(), options);
      CHECK(pending.valid());
      CHECK(pending.step() == 5);
      const bool writer = replicate_lead(mesh);
      CHECK((pending.staging_bytes() > 0) == writer);
      for (int k = 5; k < 10; ++k) {
        t.step(k);
        pending.test();
      }
      const std::string async_path = pending.wait();
      CHECK(pending.done());
      CHECK(async_path == async_dir + "/step-00000005");
      CHECK(pending.wait() == async_path);  // again: the same, no communication
      CHECK(mismatches(*t.root, t.opt.get(), ref, 0) == 0);
      on_rank0([&] {
        const auto a = files_of(async_path), s = files_of(sync_path);
        CHECK(a.size() == s.size());
        for (const auto& entry : s) {  // (no structured bindings: CAPTURE captures)
          const auto& name = entry.first;
          const auto& bytes = entry.second;
          CAPTURE(name);
          REQUIRE(a.count(name) == 1);
          CHECK(a.at(name) == bytes);
        }
        CHECK(read_file(async_dir + "/latest") == "step-00000005\n");
      });
      // The checkpoint holds step 5 (not what training did after): resuming from it and
      // training 5 steps gives the straight run's values, bit-exact.
      Trainer r(mesh);
      CHECK(test::all_ranks(no_throw("resume", [&] {
        const ck::Loaded l = ck::load(async_dir, *r.root, r.opt.get());
        CHECK(l.step == 5);
        CHECK(nlohmann::json::parse(l.metadata) == meta);
        r.set_rng_state(l.rng_state);
        for (int k = 5; k < 10; ++k)
          r.step(k);
        CHECK(mismatches(*r.root, r.opt.get(), ref, 0) == 0);
      })));
    }
}

TEST_CASE("reserve_async_staging: before the first step, the staging the first save uses") {
  SharedTempDir tmp;
  int case_no = 0;
  for (auto& src : source_meshes()) {
    CAPTURE(src->name);
    const DeviceMesh& mesh = *src->mesh;
    Trainer t(mesh);
    // No AdamW state exists yet: counted as f32 of each shard.
    REQUIRE(t.opt->state_views().empty());
    const std::uint64_t reserved = ck::reserve_async_staging(*t.root, t.opt.get());
    CHECK((reserved > 0) == replicate_lead(mesh));
    CHECK(ck::reserve_async_staging(*t.root, t.opt.get()) == reserved);  // again: the same
    t.step(0);
    ck::AsyncSave s =
        ck::save_async(tmp.sub("r" + std::to_string(case_no++)), *t.root, t.opt.get(), 1);
    CHECK(s.staging_bytes() == reserved);
    // A save in flight: reserving what the buffer already holds is fine (nothing moves).
    CHECK(ck::reserve_async_staging(*t.root, t.opt.get()) == reserved);
    s.wait();
  }
}

TEST_CASE("asynchronous save: one in flight, test() and wait(), retention, refused uses") {
  SharedTempDir tmp;
  DeviceMesh mesh(test::runtime(), {W()}, {"dp"});
  Trainer t(mesh);
  t.step(0);
  const std::string dir = tmp.sub("one");
  // The second save completes the first (which is then done on every rank).
  ck::AsyncSave a = ck::save_async(dir, *t.root, t.opt.get(), 1);
  t.step(1);
  ck::AsyncSave b = ck::save_async(dir, *t.root, t.opt.get(), 2);
  CHECK(a.done());
  CHECK(a.wait() == dir + "/step-00000001");
  CHECK(b.wait() == dir + "/step-00000002");
  // A dropped handle: the next (synchronous) save completes it.
  t.step(2);
  { (void)ck::save_async(dir, *t.root, t.opt.get(), 3); }
  t.step(3);
  ck::save(dir, *t.root, t.opt.get(), 4);
  on_rank0([&] {
    CHECK(fs::exists(dir + "/step-00000003/index.json"));
    CHECK(read_file(dir + "/latest") == "step-00000004\n");
  });
  // test() is false while any rank's writer is still at work (FULLSHARD_CKPT_FAULT=slow_write:
  // each writer sleeps 3 s first), then true once committed; retention runs at the commit.
  setenv("FULLSHARD_CKPT_FAULT", "slow_write", 1);
  ck::SaveOptions keep2;
  keep2.keep_last = 2;
  ck::AsyncSave c = ck::save_async(dir, *t.root, t.opt.get(), 5, {}, "", keep2);
  unsetenv("FULLSHARD_CKPT_FAULT");
  CHECK_FALSE(c.test());
  CHECK_FALSE(c.done());
  CHECK(poll_until_committed(c) > 1);
  CHECK(c.done());
  on_rank0([&] {
    std::vector<std::string> steps;
    for (const auto& e : fs::directory_iterator(dir))
      steps.push_back(e.path().filename().string());
    std::sort(steps.begin(), steps.end());
    CHECK(steps == std::vector<std::string>{"latest", "step-00000004", "step-00000005"});
  });
  // Refused: a default handle, a full checkpoint.
  ck::AsyncSave none;
  CHECK_FALSE(none.valid());
  CHECK(test::contains(test::error_of<InvalidArgument>([&] { none.wait(); }), "names no save"));
  const std::string msg = test::error_of<InvalidArgument>([&] {
    ck::save_async(dir, *t.root, t.opt.get(), 6, {}, "", {ck::Kind::full, ck::kDefaultBlockBytes});
  });
  CHECK_MESSAGE(test::contains(msg, "sharded checkpoints only"), msg);
}

TEST_CASE("asynchronous save: a failed background write is raised on every rank, latest stays") {
  SharedTempDir tmp;
  DeviceMesh mesh(test::runtime(), {W()}, {"dp"});
  Trainer t(mesh);
  t.step(0);
  const std::string dir = tmp.sub("fail");
  ck::save(dir, *t.root, t.opt.get(), 1);
  const Full ref =
      gather(shapes_of(*t.root, t.opt.get()), t.root.get(), t.opt.get(), true, R() == 0);
  t.step(1);
  // The writers sleep 3 s; meanwhile rank 0 removes the temporary step directory, so every
  // writer fails to create its file.
  setenv("FULLSHARD_CKPT_FAULT", "slow_write", 1);
  ck::AsyncSave s = ck::save_async(dir, *t.root, t.opt.get(), 2);
  unsetenv("FULLSHARD_CKPT_FAULT");
  on_rank0([&] {
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().filename().string().rfind(".tmp-", 0) == 0) fs::remove_all(e.path());
  });
  const std::string msg = test::error_of<Error>([&] { s.wait(); });
  CHECK_MESSAGE(test::contains(msg, "rank-0000"), msg);
  CHECK_MESSAGE(test::contains(msg, "No such file or directory"), msg);
  if (R() != 0) CHECK_MESSAGE(test::contains(msg, "failed on another rank"), msg);
  CHECK(s.done());
  // Raised again by the handle, without communication; the next save goes ahead.
  CHECK(test::contains(test::error_of<Error>([&] { s.wait(); }), "No such file or directory"));
  on_rank0([&] {
    CHECK(read_file(dir + "/latest") == "step-00000001\n");
    for (const auto& e : fs::directory_iterator(dir))
      CHECK_MESSAGE(e.path().filename().string().rfind(".tmp-", 0) != 0, e.path());
  });
  Trainer r(mesh);
  CHECK(test::all_ranks(no_throw("load", [&] {
    CHECK(ck::load(dir, *r.root, r.opt.get()).step == 1);
    CHECK(mismatches(*r.root, r.opt.get(), ref, 0) == 0);
  })));
}
