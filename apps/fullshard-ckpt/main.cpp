// fullshard-ckpt: inspects, verifies and converts checkpoints offline. A plain program (no
// mpiexec): it starts neither MPI nor Kokkos (the checkpoint format code needs neither).
//
//   fullshard-ckpt inspect ckpt/            # tensors, shapes, dtypes, sizes, checksums
//   fullshard-ckpt verify ckpt/             # every checksum; exit 1 naming file and tensor
//   fullshard-ckpt convert ckpt/ full/ --to full
//   fullshard-ckpt convert full/ sh3/ --to sharded --shards 3
//   fullshard-ckpt convert ckpt/ model.safetensors --to safetensors
//   fullshard-ckpt convert model.safetensors ckpt/ --from safetensors [--graph model.json]
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/checksum.hpp"
#include "fullshard/checkpoint/format.hpp"
#include "fullshard/checkpoint/safetensors.hpp"
#include "fullshard/graph/json_graph.hpp"

namespace {

namespace ck = fullshard::checkpoint;

const char* const kUsage =
    "usage: fullshard-ckpt inspect DIR\n"
    "       fullshard-ckpt verify DIR\n"
    "       fullshard-ckpt convert SRC DST --to full|sharded [--shards N] [--block-bytes B]\n"
    "       fullshard-ckpt convert SRC OUT.safetensors --to safetensors [--optimizer-out FILE]\n"
    "       fullshard-ckpt convert IN.safetensors DST --from safetensors [--to full|sharded]\n"
    "                      [--shards N] [--block-bytes B] [--graph GRAPH.json] [--step N]\n"
    "\n"
    "DIR and SRC are a checkpoint root (its 'latest' is followed) or one step directory.\n"
    "\n"
    "  inspect  the index: step, kind, model fingerprint, optimizer, metadata, files, and per\n"
    "           tensor its dtype, global shape, placement, shards, bytes and CRC32C; given a\n"
    "           .safetensors file: its metadata and tensors (checked like every read)\n"
    "  verify   checks the index against its checksum, re-reads every data file and checks\n"
    "           every checksum; prints each problem with its file and tensor\n"
    "  convert  writes SRC as a new checkpoint in the root DST (atomically, like a save;\n"
    "           DST, and every output file, must lie outside checkpoint directories):\n"
    "           --to full: one file; --to sharded: N shards per tensor along its saved\n"
    "           placement (default N: the number of data files of SRC; at most 1048576)\n"
    "           --to safetensors: the model's parameters as one safetensors file (FQNs as\n"
    "           names), streamed; --optimizer-out FILE: the optimizer state into a second\n"
    "           file. --from safetensors: a checkpoint (parameters only, step N, default 0)\n"
    "           of the file's tensors, one file (--to full, the default) or split along\n"
    "           dim 0 into N files (--to sharded --shards N, default 1); --graph: names,\n"
    "           shapes and dtypes must be those of the graph's parameters\n"
    "\n"
    "Exit status: 0 success; 1 verify found problems (in the index or the data); 2 bad usage,\n"
    "or DIR/SRC is not a checkpoint or cannot be read (any error of inspect and convert).\n";

struct UsageError {
  std::string message;
};

// The checkpoint directory `path` is or lies in (a root: a `latest`, a run's lock; a step
// directory: an index.json), checked for the path and each of its parents; empty when none.
std::string checkpoint_dir_of(const std::string& path) {
  namespace stdfs = std::filesystem;
  std::error_code ec;
  for (stdfs::path p = stdfs::absolute(path, ec).lexically_normal(); !p.empty();
       p = p.parent_path()) {
    for (const char* mark : {"latest", ".fullshard-lock", "index.json"})
      if (stdfs::exists(p / mark, ec)) return p.string();
    if (p == p.parent_path()) break;
  }
  return {};
}

// fullshard-ckpt never writes into a checkpoint directory (its `latest`, its step
// directories, a run's directory): an output there is refused before anything is written.
void refuse_output_in_checkpoint(const std::string& path, const char* what) {
  const std::string dir = checkpoint_dir_of(path);
  if (!dir.empty())
    throw UsageError{std::string(what) + " '" + path + "' is in the checkpoint directory '" + dir +
                     "': fullshard-ckpt writes only outside checkpoint directories (a "
                     "checkpoint's files, its 'latest' and a running job's directory are never "
                     "written over); give a new path"};
}

// Messages without the "fullshard[rank -]: " prefix (this tool has no ranks).
std::string clean(std::string s) {
  const std::string prefix = "fullshard[rank ";
  if (s.compare(0, prefix.size(), prefix) == 0) {
    const auto end = s.find("]: ");
    if (end != std::string::npos) s = s.substr(end + 3);
  }
  return s;
}

std::string crc_hex(std::uint32_t c) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", c);
  return buf;
}

std::string human(std::uint64_t b) {
  char buf[32];
  if (b < 1024)
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(b));
  else if (b < (1ull << 20))
    std::snprintf(buf, sizeof buf, "%.1f KiB", static_cast<double>(b) / 1024.0);
  else if (b < (1ull << 30))
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / 1048576.0);
  else
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / 1073741824.0);
  return buf;
}

// CRC32C of a shard's bytes, from its block CRCs.
std::uint32_t shard_crc(const ck::ShardInfo& s, std::uint64_t block) {
  std::uint32_t crc = 0;
  std::uint64_t pos = 0;
  for (std::uint32_t b : s.crc32c) {
    const std::uint64_t len = std::min(block, s.length - pos);
    crc = pos == 0 ? b : ck::crc32c_combine(crc, b, len);
    pos += len;
  }
  return crc;
}

// CRC32C of the tensor's row-major bytes when its shards are dim-0 slabs (Shard(0), full);
// false otherwise.
bool tensor_crc(const ck::TensorInfo& t, std::uint64_t block, std::uint32_t& out) {
  std::vector<const ck::ShardInfo*> live;
  for (const auto& s : t.shards) {
    if (s.length == 0) continue;
    for (std::size_t d = 1; d < t.global_shape.size(); ++d)
      if (s.shape[d] != t.global_shape[d]) return false;
    live.push_back(&s);
  }
  std::sort(live.begin(), live.end(), [](const ck::ShardInfo* a, const ck::ShardInfo* b) {
    return a->global_offset[0] < b->global_offset[0];
  });
  std::uint32_t crc = 0;
  for (std::size_t i = 0; i < live.size(); ++i)
    crc = i == 0 ? shard_crc(*live[i], block)
                 : ck::crc32c_combine(crc, shard_crc(*live[i], block), live[i]->length);
  out = crc;
  return true;
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

int inspect_safetensors(const std::string& path) {
  ck::SafetensorsReader r(path);
  std::uint64_t bytes = 0;
  for (const auto& t : r.tensors())
    bytes += t.bytes();
  std::printf("safetensors  %s\n", path.c_str());
  std::printf("header       %llu bytes (data at byte %llu)\n",
              static_cast<unsigned long long>(r.data_offset() - 8),
              static_cast<unsigned long long>(r.data_offset()));
  std::printf("metadata     %zu\n", r.metadata().size());
  for (const auto& [k, v] : r.metadata())
    std::printf("  %s: %s\n", k.c_str(), v.c_str());
  std::printf("tensors      %zu, %s\n", r.tensors().size(), human(bytes).c_str());
  std::printf("  %-40s %-5s %-18s %14s %14s\n", "name", "dtype", "shape", "begin", "bytes");
  for (const auto& t : r.tensors())
    std::printf("  %-40s %-5s %-18s %14llu %14llu\n", t.name.c_str(),
                ck::safetensors_dtype_name(t.dtype), fullshard::shape_string(t.shape).c_str(),
                static_cast<unsigned long long>(t.begin),
                static_cast<unsigned long long>(t.bytes()));
  return 0;
}

int inspect(const std::string& path) {
  if (is_regular_file(path)) return inspect_safetensors(path);
  ck::Reader r(path);
  const ck::Index& x = r.index();
  std::uint64_t total = 0;
  for (const auto& f : x.files)
    total += f.bytes;
  std::printf("checkpoint   %s\n", r.step_dir().c_str());
  std::printf("format       fullshard-checkpoint version %d, %s\n", x.format_version,
              ck::kind_name(x.kind));
  std::printf("step         %lld\n", static_cast<long long>(x.step));
  std::printf("model        fingerprint %s\n", x.model_fingerprint.c_str());
  if (x.has_optimizer) {
    std::string names;
    for (const auto& n : x.optimizer_state_names)
      names += (names.empty() ? "" : ", ") + n;
    std::printf("optimizer    step %lld, states [%s]\n", static_cast<long long>(x.optimizer_step),
                names.c_str());
  } else {
    std::printf("optimizer    none\n");
  }
  std::printf("saved by     %s\n", x.saved_by.c_str());
  std::printf("metadata     %s\n", x.metadata.c_str());
  std::printf("rng state    %zu bytes\n", x.rng_state.size());
  std::printf("checksums    crc32c per %llu-byte block\n",
              static_cast<unsigned long long>(x.block_bytes));
  std::printf("files        %zu, %s\n", x.files.size(), human(total).c_str());
  for (const auto& f : x.files)
    std::printf("  %-20s %14llu bytes\n", f.name.c_str(), static_cast<unsigned long long>(f.bytes));
  std::printf("tensors      %zu\n", x.tensors.size());
  std::printf("  %-40s %-5s %-18s %-11s %6s %12s %8s\n", "name", "dtype", "shape", "placement",
              "shards", "bytes", "crc32c");
  for (const auto& t : x.tensors) {
    std::uint32_t crc = 0;
    const std::string c = tensor_crc(t, x.block_bytes, crc) ? crc_hex(crc) : "(n/a)";
    std::size_t live = 0;
    for (const auto& s : t.shards)
      live += s.length > 0 ? 1 : 0;
    std::printf("  %-40s %-5s %-18s %-11s %6zu %12llu %8s\n", t.name.c_str(),
                fullshard::dtype_name(t.dtype), fullshard::shape_string(t.global_shape).c_str(),
                t.placement.to_string().c_str(), live, static_cast<unsigned long long>(t.bytes()),
                c.c_str());
  }
  return 0;
}

// Exit 1 for problems found in a checkpoint; not a checkpoint at all is thrown (exit 2).
int verify(const std::string& path) {
  const auto issues = ck::verify(path);
  if (issues.empty()) {
    ck::Reader r(path);
    std::uint64_t total = 0;
    for (const auto& f : r.index().files)
      total += f.bytes;
    std::printf("ok: %s: %zu tensors in %zu files, %llu bytes, every checksum matches\n",
                r.step_dir().c_str(), r.index().tensors.size(), r.index().files.size(),
                static_cast<unsigned long long>(total));
    return 0;
  }
  for (const auto& i : issues)
    std::printf("FAILED: file %s%s: %s\n", i.file.c_str(),
                i.tensor.empty() ? "" : (", tensor '" + i.tensor + "'").c_str(),
                clean(i.message).c_str());
  std::printf("%zu problem%s found\n", issues.size(), issues.size() == 1 ? "" : "s");
  return 1;
}

// The most --shards: one file each (and ConvertOptions::shards is an int).
constexpr std::uint64_t kMaxShards = std::uint64_t{1} << 20;

std::uint64_t parse_count(const std::string& flag, const std::string& v, std::uint64_t min,
                          std::uint64_t max) {
  std::size_t used = 0;
  unsigned long long x = 0;
  try {
    x = std::stoull(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || v.empty() || v[0] == '-' || x < min || x > max)
    throw UsageError{flag + " expects an integer in [" + std::to_string(min) + ", " +
                     std::to_string(max) + "], got '" + v + "'"};
  return x;
}

int convert(const std::vector<std::string>& args) {
  std::vector<std::string> pos;
  ck::ConvertOptions opt;
  std::string to, from, optimizer_out, graph;
  std::int64_t step = -1;
  bool have_shards = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) throw UsageError{a + " needs a value"};
      return args[++i];
    };
    if (a == "--to") {
      to = value();
      if (to != "full" && to != "sharded" && to != "safetensors")
        throw UsageError{"--to expects full, sharded or safetensors, got '" + to + "'"};
      opt.to = to == "sharded" ? ck::Kind::sharded : ck::Kind::full;
    } else if (a == "--from") {
      from = value();
      if (from != "safetensors")
        throw UsageError{
            "--from expects safetensors (a fullshard checkpoint needs no --from), "
            "got '" +
            from + "'"};
    } else if (a == "--shards") {
      opt.shards = static_cast<int>(parse_count("--shards", value(), 1, kMaxShards));
      have_shards = true;
    } else if (a == "--block-bytes") {
      opt.block_bytes = parse_count("--block-bytes", value(), 1, ck::kMaxBlockBytes);
    } else if (a == "--optimizer-out") {
      optimizer_out = value();
    } else if (a == "--graph") {
      graph = value();
    } else if (a == "--step") {
      step = static_cast<std::int64_t>(parse_count("--step", value(), 0, std::uint64_t{1} << 62));
    } else if (a.rfind("--", 0) == 0) {
      throw UsageError{"unknown option '" + a + "'"};
    } else {
      pos.push_back(a);
    }
  }
  if (pos.size() != 2) throw UsageError{"convert needs SRC and DST"};
  if (to.empty() && from.empty())
    throw UsageError{
        "convert needs --to full or --to sharded (or --to safetensors, --from safetensors)"};
  if (have_shards && opt.to == ck::Kind::full)
    throw UsageError{"--shards applies to --to sharded only"};
  if (!optimizer_out.empty() && to != "safetensors")
    throw UsageError{"--optimizer-out applies to --to safetensors only"};
  if ((!graph.empty() || step >= 0) && from.empty())
    throw UsageError{std::string(graph.empty() ? "--step" : "--graph") +
                     " applies to --from safetensors only"};

  refuse_output_in_checkpoint(pos[1], to == "safetensors" ? "the output file" : "DST");
  if (!optimizer_out.empty()) refuse_output_in_checkpoint(optimizer_out, "--optimizer-out");
  if (to == "safetensors") {
    if (!from.empty()) throw UsageError{"--to safetensors and --from safetensors together"};
    if (have_shards) throw UsageError{"--shards does not apply to --to safetensors"};
    ck::ToSafetensorsOptions so;
    so.optimizer_path = optimizer_out;
    ck::checkpoint_to_safetensors(pos[0], pos[1], so);
    const ck::SafetensorsReader r(pos[1]);
    std::printf("wrote safetensors %s (%zu tensors, %llu bytes)\n", pos[1].c_str(),
                r.tensors().size(), static_cast<unsigned long long>(r.file_bytes()));
    if (!optimizer_out.empty()) {
      const ck::SafetensorsReader o(optimizer_out);
      std::printf("wrote safetensors %s (%zu optimizer tensors, %llu bytes)\n",
                  optimizer_out.c_str(), o.tensors().size(),
                  static_cast<unsigned long long>(o.file_bytes()));
    }
    return 0;
  }
  std::string out;
  if (!from.empty()) {
    ck::FromSafetensorsOptions fo;
    fo.kind = opt.to;
    fo.shards = opt.to == ck::Kind::sharded ? (have_shards ? opt.shards : 1) : 1;
    fo.block_bytes = opt.block_bytes;
    if (step >= 0) fo.step = step;
    std::unique_ptr<fullshard::graph::Module> model;
    if (!graph.empty()) {
      model = fullshard::graph::load_graph_json(graph);
      fo.expect = model.get();
    }
    out = ck::safetensors_to_checkpoint(pos[0], pos[1], fo);
  } else {
    out = ck::convert(pos[0], pos[1], opt);
  }
  ck::Reader r(out);
  std::printf("wrote %s checkpoint %s (%zu tensors, %zu files)\n", ck::kind_name(r.index().kind),
              out.c_str(), r.index().tensors.size(), r.index().files.size());
  return 0;
}

int run(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string cmd = args[0];
  args.erase(args.begin());
  if (cmd == "inspect" || cmd == "verify") {
    if (args.size() != 1) throw UsageError{cmd + " needs exactly one DIR"};
    return cmd == "inspect" ? inspect(args[0]) : verify(args[0]);
  }
  if (cmd == "convert") return convert(args);
  throw UsageError{"unknown command '" + cmd + "'"};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "fullshard-ckpt: error: %s\n(run fullshard-ckpt --help)\n",
                 e.message.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fullshard-ckpt: error: %s\n", clean(e.what()).c_str());
    return 2;
  }
}
