// A small program that CTest runs to check checkpoints across processes: a writer that may be
// killed mid-save (FULLSHARD_CKPT_FAULT), a loader that checks what it finds, and a byte
// flipper for the fullshard-ckpt verify test.
//
//   fullshard-test-ckpt-probe write DIR STEP [full]   save a model whose values encode STEP
//   fullshard-test-ckpt-probe check DIR STEP          load DIR and check it holds STEP's values
//   fullshard-test-ckpt-probe flip FILE OFFSET        flip one bit of FILE's byte at OFFSET
//   fullshard-test-ckpt-probe sign STEP_DIR           rewrite STEP_DIR/index.json.crc32c to
//                                                     match an edited index.json (a crafted
//                                                     index that only the validator can refuse)
//   fullshard-test-ckpt-probe stall DIR STEP          rank 0 saves, the others never join: the
//                                                     save must abort the job (FULLSHARD_TIMEOUT)
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>

#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/state_dict.hpp"
#include "fullshard/runtime/runtime.hpp"
#include "lib/checkpoint/io.hpp"  // index_checksum_text

namespace {

using namespace fullshard;

// Element e of parameter `which` in the checkpoint of step `step`.
double value(int which, std::int64_t e, long step) {
  return 0.5 * static_cast<double>((e * 3 + which * 7) % 23) + static_cast<double>(step);
}

std::unique_ptr<graph::Module> make_model(const DeviceMesh& mesh, long step) {
  auto root = graph::Module::make_root("model");
  graph::Module& l0 = root->add_module("l0");
  graph::Module& l1 = root->add_module("l1");
  l0.add_param("w", {9, 3}).init([step](std::int64_t e) { return value(0, e, step); });
  l1.add_param("w", {10}).init([step](std::int64_t e) { return value(1, e, step); });
  fsdp::fully_shard(l0, mesh);
  fsdp::fully_shard(l1, mesh);
  fsdp::fully_shard(*root, mesh);
  return root;
}

int flip(const std::string& file, long offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  char c = 0;
  if (!f.seekg(offset) || !f.read(&c, 1)) {
    std::fprintf(stderr, "flip: cannot read byte %ld of %s\n", offset, file.c_str());
    return 2;
  }
  c = static_cast<char>(c ^ 0x04);
  f.seekp(offset);
  f.write(&c, 1);
  std::printf("flipped a bit of byte %ld of %s\n", offset, file.c_str());
  return 0;
}

int sign(const std::string& step_dir) {
  std::ifstream in(step_dir + "/index.json", std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) {
    std::fprintf(stderr, "sign: cannot read %s/index.json\n", step_dir.c_str());
    return 2;
  }
  std::ofstream(step_dir + "/index.json.crc32c", std::ios::binary | std::ios::trunc)
      << checkpoint::detail::index_checksum_text(text);
  std::printf("signed %s/index.json (%zu bytes)\n", step_dir.c_str(), text.size());
  return 0;
}

int run(Runtime& rt, const std::string& mode, const std::string& dir, long step, bool full) {
  DeviceMesh mesh(rt, {rt.world_size()}, {"dp"});
  if (mode == "write") {
    auto model = make_model(mesh, step);
    checkpoint::SaveOptions opt;
    opt.kind = full ? checkpoint::Kind::full : checkpoint::Kind::sharded;
    const std::string path = checkpoint::save(dir, *model, nullptr, step,
                                              nlohmann::json{{"step", step}}.dump(), "", opt);
    if (rt.rank() == 0) std::printf("saved step %ld to %s\n", step, path.c_str());
    return 0;
  }
  if (mode == "stall") {
    auto model = make_model(mesh, step);
    if (rt.rank() == 0) {
      checkpoint::save(dir, *model, nullptr, step);
      std::fprintf(stderr, "stall: the save returned without the other ranks\n");
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(20));
      std::fprintf(stderr, "stall: rank %d: rank 0 did not abort the job\n", rt.rank());
    }
    std::fflush(stderr);
    std::_Exit(1);  // no MPI_Finalize: it could wait for rank 0
  }
  // check: start from other values, load, compare every local element.
  auto model = make_model(mesh, -1000);
  const checkpoint::Loaded l = checkpoint::load(dir, *model);
  int bad = l.step == step ? 0 : 1;
  for (auto& [name, st] : fsdp::sharded_state_dict(*model)) {
    const int which = name == "l0.w" ? 0 : 1;
    const std::int64_t inner = st.layout.inner;
    for (std::int64_t e = 0; e < st.local.numel(); ++e)
      bad += st.local.at(e) != value(which, st.global_offset()[0] * inner + e, step);
  }
  MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rt.rank() == 0) {
    if (bad == 0)
      std::printf("loaded step %lld from %s: ok\n", static_cast<long long>(l.step),
                  l.step_dir.c_str());
    else
      std::printf("loaded step %lld from %s: %d MISMATCHES (expected step %ld)\n",
                  static_cast<long long>(l.step), l.step_dir.c_str(), bad, step);
  }
  return bad == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "flip" && argc == 4) return flip(argv[2], std::atol(argv[3]));
  if (mode == "sign" && argc == 3) return sign(argv[2]);
  if ((mode != "write" && mode != "check" && mode != "stall") || argc < 4) {
    std::fprintf(stderr,
                 "usage: %s write|check|stall DIR STEP [full] | flip FILE OFFSET | sign STEP_DIR\n",
                 argv[0]);
    return 2;
  }
  try {
    Runtime rt(argc, argv);
    return run(rt, mode, argv[2], std::atol(argv[3]), argc > 4 && std::string(argv[4]) == "full");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
