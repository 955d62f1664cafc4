#include "fullshard/checkpoint/format.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>

#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/checksum.hpp"
#include "lib/base/json_reader.hpp"
#include "lib/checkpoint/checked.hpp"
#include "lib/checkpoint/index_json.hpp"
#include "lib/checkpoint/io.hpp"

namespace fullshard::checkpoint {

using nlohmann::json;

const char* kind_name(Kind k) noexcept {
  return k == Kind::full ? "full" : "sharded";
}

const TensorInfo* Index::find(const std::string& name) const noexcept {
  for (const TensorInfo& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

// ---- Fingerprint ------------------------------------------------------------------------------

std::string model_fingerprint(const std::map<std::string, std::pair<DType, Shape>>& params) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a 64
  for (const auto& [fqn, ds] : params) {
    const std::string line =
        fqn + " " + dtype_name(ds.first) + " " + shape_string(ds.second) + "\n";
    for (unsigned char c : line) {
      h ^= c;
      h *= 1099511628211ull;
    }
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string model_fingerprint(const Index& index) {
  std::map<std::string, std::pair<DType, Shape>> params;
  for (const TensorInfo& t : index.tensors)
    if (t.is_param()) params[t.name] = {t.dtype, t.global_shape};
  return model_fingerprint(params);
}

// ---- JSON -------------------------------------------------------------------------------------

namespace {

std::string placement_name(Placement p) {
  return p.to_string();
}

json shape_json(const std::vector<std::int64_t>& v) {
  json a = json::array();
  for (auto x : v)
    a.push_back(x);
  return a;
}

// Errors while reading an index name the file and, when known, the tensor.
struct Where {
  const std::string& file;
  std::string tensor;

  [[noreturn]] void fail(const std::string& msg) const {
    throw InvalidArgument("checkpoint index " + file +
                          (tensor.empty() ? "" : ": tensor '" + tensor + "'") + ": " + msg);
  }
  const json& member(const json& j, const char* key) const {
    if (!j.is_object()) fail("expected an object holding '" + std::string(key) + "'");
    auto it = j.find(key);
    if (it == j.end()) fail("missing key '" + std::string(key) + "'");
    return *it;
  }
  std::int64_t integer(const json& j, const char* key, std::int64_t min) const {
    const json& v = member(j, key);
    if (!v.is_number_integer() || v.get<std::int64_t>() < min)
      fail("'" + std::string(key) + "' must be an integer >= " + std::to_string(min) + ", got " +
           v.dump());
    return v.get<std::int64_t>();
  }
  std::uint64_t unsigned_int(const json& j, const char* key) const {
    const json& v = member(j, key);
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<std::int64_t>() >= 0))
      fail("'" + std::string(key) + "' must be a non-negative integer, got " + v.dump());
    return v.get<std::uint64_t>();
  }
  std::string string(const json& j, const char* key) const {
    const json& v = member(j, key);
    if (!v.is_string()) fail("'" + std::string(key) + "' must be a string, got " + v.dump());
    return v.get<std::string>();
  }
  std::vector<std::int64_t> dims(const json& j, const char* key) const {
    const json& v = member(j, key);
    if (!v.is_array()) fail("'" + std::string(key) + "' must be an array of integers");
    std::vector<std::int64_t> out;
    for (const json& x : v) {
      if (!x.is_number_integer() || x.get<std::int64_t>() < 0)
        fail("'" + std::string(key) + "' must hold non-negative integers, got " + v.dump());
      out.push_back(x.get<std::int64_t>());
    }
    return out;
  }
};

Placement parse_placement(const std::string& s, const Where& w) {
  if (s == "Replicate()") return Placement::Replicate();
  int d = -1;
  if (s.size() > 7 && s.compare(0, 6, "Shard(") == 0 && s.back() == ')') {
    std::size_t used = 0;
    try {
      d = std::stoi(s.substr(6, s.size() - 7), &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == s.size() - 7 && d >= 0) return Placement::Shard(d);
  }
  w.fail("unknown placement '" + s + "' (expected Shard(d) or Replicate())");
}

DType parse_dtype_in(const std::string& s, const Where& w) {
  for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16})
    if (s == dtype_name(t)) return t;
  w.fail("unknown dtype '" + s + "'");
}

// Two boxes of one tensor (validated: inside it, so no sum overflows) share an element.
bool boxes_overlap(const ShardInfo& a, const ShardInfo& b) {
  for (std::size_t d = 0; d < a.shape.size(); ++d)
    if (a.global_offset[d] + a.shape[d] <= b.global_offset[d] ||
        b.global_offset[d] + b.shape[d] <= a.global_offset[d])
      return false;
  return true;
}

// The shards of t (each already checked to lie inside it) must tile its global shape:
// disjoint, numels adding up.
void check_tiling(const TensorInfo& t, std::int64_t want, const Where& w) {
  std::vector<const ShardInfo*> live;
  std::int64_t total = 0;
  bool more = false;
  for (const ShardInfo& s : t.shards) {
    const std::int64_t n = numel(s.shape);  // checked: at most numel(global_shape)
    if (n == 0) continue;
    if (!detail::add_ok(total, n, total) || total > want) {
      more = true;
      break;
    }
    live.push_back(&s);
  }
  if (more || total != want)
    w.fail("its shards hold " +
           (more ? "more than " + std::to_string(want) : std::to_string(total)) +
           " elements, the global shape " + shape_string(t.global_shape) + " has " +
           std::to_string(want));
  // Slabs along one dim (what fullshard writes): sort along it and compare neighbours.
  const std::size_t nd = t.global_shape.size();
  int slab_dim = -1;
  for (std::size_t d = 0; d < nd && slab_dim < 0; ++d) {
    bool ok = true;
    for (const ShardInfo* s : live)
      for (std::size_t e = 0; e < nd && ok; ++e)
        if (e != d && s->shape[e] != t.global_shape[e]) ok = false;
    if (ok) slab_dim = static_cast<int>(d);
  }
  if (slab_dim >= 0) {
    std::sort(live.begin(), live.end(), [&](const ShardInfo* a, const ShardInfo* b) {
      return a->global_offset[static_cast<std::size_t>(slab_dim)] <
             b->global_offset[static_cast<std::size_t>(slab_dim)];
    });
    for (std::size_t i = 1; i < live.size(); ++i)
      if (boxes_overlap(*live[i - 1], *live[i])) w.fail("two of its shards overlap");
    return;
  }
  // Other layouts (fullshard writes none) are compared pairwise: bounded, so that a crafted
  // index cannot make the check quadratic in millions of shards.
  if (live.size() > kMaxNonSlabShards)
    w.fail("its " + std::to_string(live.size()) +
           " non-empty shards are not slabs along one dim; at most " +
           std::to_string(kMaxNonSlabShards) + " such shards are supported");
  for (std::size_t i = 0; i < live.size(); ++i)
    for (std::size_t j = i + 1; j < live.size(); ++j)
      if (boxes_overlap(*live[i], *live[j])) w.fail("two of its shards overlap");
}

// The checks of one shard s of t against t, the files and block_bytes, in the order that
// makes each safe to compute: dims, then the box inside the tensor (so every extent sum and
// product below is bounded by the tensor's byte size), then length, file range, checksums.
void check_shard(const Index& x, const TensorInfo& t, std::size_t i, const Where& w) {
  const ShardInfo& s = t.shards[i];
  const std::size_t nd = t.global_shape.size();
  const std::string which = "shard #" + std::to_string(i);
  if (s.file >= x.files.size())
    w.fail(which + " names file #" + std::to_string(s.file) + " of " +
           std::to_string(x.files.size()));
  if (s.global_offset.size() != nd || s.shape.size() != nd)
    w.fail(which + ": its global_offset " + shape_string(s.global_offset) + " and shape " +
           shape_string(s.shape) + " must have " + std::to_string(nd) + " dims");
  for (std::size_t d = 0; d < nd; ++d) {
    std::int64_t end = 0;
    if (s.global_offset[d] < 0 || s.shape[d] < 0 ||
        !detail::add_ok(s.global_offset[d], s.shape[d], end) || end > t.global_shape[d])
      w.fail(which + " at " + shape_string(s.global_offset) + " of shape " + shape_string(s.shape) +
             " lies outside the global shape " + shape_string(t.global_shape));
  }
  std::uint64_t want = 0;
  if (!detail::nbytes_ok(s.shape, dtype_size(t.dtype), want))  // cannot fail once inside
    w.fail(which + " of shape " + shape_string(s.shape) + " has too many bytes");
  if (s.length != want)
    w.fail(which + " of shape " + shape_string(s.shape) + " has length " +
           std::to_string(s.length) + ", expected " + std::to_string(want));
  const FileInfo& fi = x.files[s.file];
  std::uint64_t end = 0;
  if (!detail::add_ok(s.offset, s.length, end) || end > fi.bytes)
    w.fail(which + " at bytes [" + std::to_string(s.offset) + ", +" + std::to_string(s.length) +
           ") lies beyond the end of file '" + fi.name + "' (" + std::to_string(fi.bytes) +
           " bytes)");
  const std::uint64_t B = x.block_bytes;  // checked > 0
  const std::uint64_t blocks = s.length / B + (s.length % B != 0 ? 1 : 0);
  if (s.crc32c.size() != blocks)
    w.fail(which + " of " + std::to_string(s.length) + " bytes has " +
           std::to_string(s.crc32c.size()) + " checksums, expected " + std::to_string(blocks) +
           " (one per " + std::to_string(B) + "-byte block)");
}

}  // namespace

json parse_metadata(const std::string& text, const std::string& who) {
  if (text.empty()) return json::object();
  if (detail::json_depth_exceeded(text, kMaxMetadataDepth) != std::string::npos)
    throw InvalidArgument(who + ": the metadata nests arrays and objects deeper than " +
                          std::to_string(kMaxMetadataDepth) + " levels");
  fullshard::detail::JsonLimits limits;
  limits.max_depth = kMaxMetadataDepth;
  try {
    // The strict reader: a key twice in one object, invalid UTF-8 or trailing text refused.
    return json(fullshard::detail::parse_json_strict(text, who + ": metadata", limits));
  } catch (const Error& e) {
    throw InvalidArgument(who + ": the metadata is not a JSON text: " + e.message());
  }
}

json to_json(const Index& index) {
  json j;
  j["format"] = "fullshard-checkpoint";
  j["format_version"] = index.format_version;
  j["kind"] = kind_name(index.kind);
  j["step"] = index.step;
  j["model_fingerprint"] = index.model_fingerprint;
  j["checksum"] = "crc32c";
  j["block_bytes"] = index.block_bytes;
  j["metadata"] = parse_metadata(index.metadata, "checkpoint index");
  j["rng_state"] = detail::hex_encode(index.rng_state);
  if (index.has_optimizer)
    j["optimizer"] = {{"step", index.optimizer_step}, {"state_names", index.optimizer_state_names}};
  else
    j["optimizer"] = nullptr;
  j["saved_by"] = parse_metadata(index.saved_by, "checkpoint index saved_by");
  json files = json::array();
  for (const FileInfo& f : index.files)
    files.push_back({{"name", f.name}, {"bytes", f.bytes}});
  j["files"] = std::move(files);
  json tensors = json::array();
  for (const TensorInfo& t : index.tensors) {
    json shards = json::array();
    for (const ShardInfo& s : t.shards)
      shards.push_back({{"file", s.file},
                        {"offset", s.offset},
                        {"length", s.length},
                        {"global_offset", shape_json(s.global_offset)},
                        {"shape", shape_json(s.shape)},
                        {"crc32c", s.crc32c}});
    tensors.push_back({{"name", t.name},
                       {"param", t.param},
                       {"state", t.state},
                       {"dtype", dtype_name(t.dtype)},
                       {"global_shape", shape_json(t.global_shape)},
                       {"placement", placement_name(t.placement)},
                       {"shards", std::move(shards)}});
  }
  j["tensors"] = std::move(tensors);
  return j;
}

void validate_index(const Index& x, const std::string& where) {
  const Where w{where, ""};
  if (x.format_version != kFormatVersion)
    w.fail("unknown format version " + std::to_string(x.format_version) +
           " (this build reads version " + std::to_string(kFormatVersion) + ")");
  if (x.step < 0) w.fail("'step' must be >= 0, got " + std::to_string(x.step));
  if (x.block_bytes == 0 || x.block_bytes > kMaxBlockBytes)
    w.fail("'block_bytes' must be in [1, " + std::to_string(kMaxBlockBytes) + "], got " +
           std::to_string(x.block_bytes));
  if (x.has_optimizer && x.optimizer_step < 0)
    w.fail("'optimizer.step' must be >= 0, got " + std::to_string(x.optimizer_step));
  for (const std::string& n : x.optimizer_state_names)
    if (n.empty()) w.fail("'optimizer.state_names' must hold non-empty strings");
  std::set<std::string> file_names;
  for (const FileInfo& fi : x.files) {
    if (fi.name.empty() || fi.name == "." || fi.name == ".." ||
        fi.name.find('/') != std::string::npos || fi.name.find('\0') != std::string::npos)
      w.fail("file name '" + fi.name + "' is not a plain file name");
    if (!file_names.insert(fi.name).second) w.fail("file '" + fi.name + "' is listed twice");
  }
  std::set<std::string> names;
  const std::set<std::string> state_names(x.optimizer_state_names.begin(),
                                          x.optimizer_state_names.end());
  for (const TensorInfo& t : x.tensors) {
    const Where tw{where, t.name};
    if (t.name.empty()) w.fail("a tensor has an empty name");
    if (!names.insert(t.name).second) tw.fail("listed twice");
    if (t.state.empty() ? t.param != t.name : t.param + "." + t.state != t.name)
      tw.fail("'param' and 'state' do not match the name");
    if (!t.state.empty() && !state_names.count(t.state))
      tw.fail("optimizer state '" + t.state + "' is not among optimizer.state_names");
    if (dtype_size(t.dtype) == 0) tw.fail("unknown dtype");
    if (t.global_shape.empty()) tw.fail("'global_shape' must have at least one dim");
    std::int64_t elems = 0;
    std::uint64_t bytes = 0;
    if (!detail::numel_ok(t.global_shape, elems) ||
        !detail::nbytes_ok(t.global_shape, dtype_size(t.dtype), bytes))
      tw.fail("global shape " + shape_string(t.global_shape) +
              " is negative or has more bytes than a 64-bit size holds");
    if (t.placement.is_shard() &&
        (t.placement.dim() < 0 ||
         static_cast<std::size_t>(t.placement.dim()) >= t.global_shape.size()))
      tw.fail("placement " + t.placement.to_string() + " names a dim it does not have");
    for (std::size_t i = 0; i < t.shards.size(); ++i)
      check_shard(x, t, i, tw);
    check_tiling(t, elems, tw);
  }
  for (const TensorInfo& t : x.tensors)
    if (!t.is_param() && !names.count(t.param))
      Where{where, t.name}.fail("its parameter '" + t.param + "' is not in the checkpoint");
}

Index index_from_json(const json& j, const std::string& where) {
  Where w{where, ""};
  if (!j.is_object()) w.fail("not a JSON object");
  if (!j.contains("format") || !j["format"].is_string() || j["format"] != "fullshard-checkpoint")
    w.fail("not a fullshard checkpoint index (\"format\" is not \"fullshard-checkpoint\")");
  // Types and values field by field here; every check of one field against another in
  // validate_index, before anything uses them.
  Index x;
  x.format_version = static_cast<int>(
      std::min<std::int64_t>(w.integer(j, "format_version", 0), std::numeric_limits<int>::max()));
  if (x.format_version != kFormatVersion)
    w.fail("unknown format version " + std::to_string(x.format_version) +
           " (this build reads version " + std::to_string(kFormatVersion) + ")");
  const std::string kind = w.string(j, "kind");
  if (kind == "sharded")
    x.kind = Kind::sharded;
  else if (kind == "full")
    x.kind = Kind::full;
  else
    w.fail("unknown kind '" + kind + "' (expected sharded or full)");
  x.step = w.integer(j, "step", 0);
  x.model_fingerprint = w.string(j, "model_fingerprint");
  if (w.string(j, "checksum") != "crc32c") w.fail("unknown checksum (expected crc32c)");
  x.block_bytes = w.unsigned_int(j, "block_bytes");
  x.metadata = w.member(j, "metadata").dump();
  x.rng_state =
      detail::hex_decode(w.string(j, "rng_state"), "checkpoint index " + where + ": rng_state");
  const json& opt = w.member(j, "optimizer");
  if (!opt.is_null()) {
    x.has_optimizer = true;
    x.optimizer_step = w.integer(opt, "step", 0);
    const json& names = w.member(opt, "state_names");
    if (!names.is_array()) w.fail("'optimizer.state_names' must be an array of strings");
    for (const json& n : names) {
      if (!n.is_string()) w.fail("'optimizer.state_names' must hold non-empty strings");
      x.optimizer_state_names.push_back(n.get<std::string>());
    }
  }
  if (j.contains("saved_by")) x.saved_by = j["saved_by"].dump();

  const json& files = w.member(j, "files");
  if (!files.is_array()) w.fail("'files' must be an array");
  for (const json& f : files)
    x.files.push_back({w.string(f, "name"), w.unsigned_int(f, "bytes")});

  const json& tensors = w.member(j, "tensors");
  if (!tensors.is_array()) w.fail("'tensors' must be an array");
  for (const json& tj : tensors) {
    TensorInfo t;
    t.name = w.string(tj, "name");
    Where tw{where, t.name};
    t.param = tw.string(tj, "param");
    t.state = tw.string(tj, "state");
    t.dtype = parse_dtype_in(tw.string(tj, "dtype"), tw);
    t.global_shape = tw.dims(tj, "global_shape");
    t.placement = parse_placement(tw.string(tj, "placement"), tw);
    const json& shards = tw.member(tj, "shards");
    if (!shards.is_array()) tw.fail("'shards' must be an array");
    for (const json& sj : shards) {
      ShardInfo s;
      const std::uint64_t file = tw.unsigned_int(sj, "file");
      s.file = file > std::numeric_limits<std::size_t>::max()
                   ? std::numeric_limits<std::size_t>::max()
                   : static_cast<std::size_t>(file);
      s.offset = tw.unsigned_int(sj, "offset");
      s.length = tw.unsigned_int(sj, "length");
      s.global_offset = tw.dims(sj, "global_offset");
      s.shape = tw.dims(sj, "shape");
      const json& crcs = tw.member(sj, "crc32c");
      if (!crcs.is_array()) tw.fail("'crc32c' must be an array");
      for (const json& c : crcs) {
        if (!c.is_number_unsigned() || c.get<std::uint64_t>() > 0xffffffffull)
          tw.fail("'crc32c' must hold 32-bit unsigned integers");
        s.crc32c.push_back(static_cast<std::uint32_t>(c.get<std::uint64_t>()));
      }
      t.shards.push_back(std::move(s));
    }
    x.tensors.push_back(std::move(t));
  }
  validate_index(x, where);
  return x;
}

namespace detail {

std::size_t json_depth_exceeded(const std::string& text, std::size_t max_depth) noexcept {
  std::size_t depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;  // the escaped character (a quote or backslash among them) cannot end the string
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return i;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return std::string::npos;
}

}  // namespace detail

Index parse_index(const std::string& text, const std::string& where) {
  // Before the parser: a value nested deeper than this is refused in linear time and constant
  // stack (nlohmann::json's copies, comparisons and dump() recurse once per level).
  const std::size_t deep = detail::json_depth_exceeded(text, kMaxIndexDepth);
  if (deep != std::string::npos)
    throw InvalidArgument("checkpoint index " + where + ": JSON nested deeper than " +
                          std::to_string(kMaxIndexDepth) + " levels (at byte " +
                          std::to_string(deep) + "; metadata may nest at most " +
                          std::to_string(kMaxMetadataDepth) + ")");
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw InvalidArgument("checkpoint index " + where + ": invalid JSON at byte " +
                          std::to_string(e.byte) + " (truncated or corrupt?)");
  } catch (const json::exception& e) {
    throw InvalidArgument("checkpoint index " + where + ": invalid JSON: " + e.what());
  }
  return index_from_json(j, where);
}

namespace detail {

// A checkpoint that is not there, or whose files are not: an IoError (the C API's
// FULLSHARD_ERR_IO), not a bad argument.
std::string find_step_dir(const std::string& path) {
  if (detail::exists(detail::join(path, kIndexFile))) return path;
  const std::string latest = detail::join(path, "latest");
  if (detail::exists(latest)) {
    std::string name = detail::read_text(latest);
    while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' '))
      name.pop_back();
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos)
      throw IoError("checkpoint " + latest + " does not name a step directory ('" + name + "')");
    const std::string dir = detail::join(path, name);
    if (!detail::exists(detail::join(dir, kIndexFile)))
      throw IoError("checkpoint " + latest + " names '" + name + "', which has no index.json");
    return dir;
  }
  if (!detail::exists(path)) throw IoError("checkpoint directory '" + path + "' does not exist");
  throw IoError("'" + path + "' is not a checkpoint: it has no index.json and no 'latest'");
}

}  // namespace detail

std::string read_index_text(const std::string& step_dir) {
  const std::string where = detail::join(step_dir, kIndexFile);
  std::string text = detail::read_text(where);
  const std::string sum_path = detail::join(step_dir, kIndexChecksumFile);
  if (!detail::exists(sum_path)) return text;  // a checkpoint written before index checksums
  std::string sum = detail::read_text(sum_path);
  while (!sum.empty() && (sum.back() == '\n' || sum.back() == '\r'))
    sum.pop_back();
  unsigned crc = 0;
  unsigned long long bytes = 0;
  char tail = 0;
  if (std::sscanf(sum.c_str(), "crc32c %8x bytes %llu%c", &crc, &bytes, &tail) != 2)
    throw InvalidArgument("checkpoint index checksum " + sum_path + " is corrupt ('" +
                          sum.substr(0, 64) + "')");
  const unsigned got = crc32c(text.data(), text.size());
  if (got == crc && bytes == text.size()) return text;
  char buf[160];
  std::snprintf(buf, sizeof buf, "%zu bytes with crc32c %08x, %s says %llu bytes with %08x",
                text.size(), got, kIndexChecksumFile, bytes, crc);
  throw InvalidArgument("checkpoint index " + where + " does not match its checksum (" + buf +
                        "): the index is corrupt or was changed after the save");
}

std::string resolve_step_dir(const std::string& path) {
  const std::string dir = detail::find_step_dir(path);
  (void)read_index_text(dir);
  return dir;
}

// ---- Reader -----------------------------------------------------------------------------------

// Open data files: at most kMaxOpenFiles descriptors, the least recently used closed first (a
// checkpoint of thousands of ranks read by a few, or by fullshard-ckpt, would exhaust the
// process's descriptors otherwise).
constexpr std::size_t kMaxOpenFiles = 64;

struct Reader::Files {
  std::vector<File> open;               // by file index
  std::vector<std::uint64_t> last_use;  // by file index
  std::vector<std::size_t> lru;         // indices of the open files
  std::uint64_t clock = 0;
  detail::ByteBuffer scratch;
};

Reader::Reader(const std::string& path) : dir_(detail::find_step_dir(path)) {
  index_ = parse_index(read_index_text(dir_), index_path());
  files_ = std::make_unique<Files>();
}

Reader::Reader(std::string step_dir, Index index)
    : dir_(std::move(step_dir)), index_(std::move(index)), files_(std::make_unique<Files>()) {
  validate_index(index_, index_path());
}

Reader::~Reader() = default;
Reader::Reader(Reader&&) noexcept = default;
Reader& Reader::operator=(Reader&&) noexcept = default;

std::string Reader::index_path() const {
  return detail::join(dir_, kIndexFile);
}

const TensorInfo& Reader::tensor(const std::string& name) const {
  if (const TensorInfo* t = index_.find(name)) return *t;
  throw InvalidArgument("checkpoint index " + index_path() + " has no tensor '" + name + "'");
}

namespace {

struct ShardReader {
  const Index& index;
  const std::string& dir;
  const TensorInfo& t;
  std::size_t s;
  const File& file;
  std::uint64_t& bytes_read;

  const ShardInfo& shard() const { return t.shards[s]; }

  // Reads shard bytes [a, b) into dst; a short read means the file shrank.
  void read(char* dst, std::uint64_t a, std::uint64_t b) const {
    const std::uint64_t got = file.pread_all(dst, b - a, shard().offset + a, t.name);
    bytes_read += got;
    if (got != b - a)
      throw InvalidArgument("checkpoint file " + file.path() + " is truncated: tensor '" + t.name +
                            "' needs bytes [" + std::to_string(shard().offset + a) + ", " +
                            std::to_string(shard().offset + b) + ")");
  }

  // Checks the blocks of shard bytes [a, b) held at data; a is block-aligned, b is aligned or
  // the shard's end.
  void verify(const char* data, std::uint64_t a, std::uint64_t b) const {
    const std::uint64_t B = index.block_bytes;
    for (std::uint64_t pos = a; pos < b; pos += B) {
      const std::uint64_t len = std::min(B, shard().length - pos);
      const std::uint32_t got = crc32c(data + (pos - a), static_cast<std::size_t>(len));
      const std::uint32_t want = shard().crc32c[static_cast<std::size_t>(pos / B)];
      if (got != want) {
        char buf[64];
        std::snprintf(buf, sizeof buf, "crc32c 0x%08x, the index says 0x%08x", got, want);
        throw InvalidArgument("checkpoint file " + file.path() + ": checksum mismatch in tensor '" +
                              t.name + "' (shard " + std::to_string(s) + ", block " +
                              std::to_string(pos / B) + " at file bytes [" +
                              std::to_string(shard().offset + pos) + ", " +
                              std::to_string(shard().offset + pos + len) + ")): " + buf);
      }
    }
  }
};

// Bytes read (and then verified) per pread: big enough to amortise the call, small enough to be
// checksummed from cache (1 MiB measured faster than 4 MiB and 512 KiB: warm 256 MiB loads
// 0.81-0.96 of a plain pread against 0.71). Reads are sequential, so the kernel's readahead
// fetches the next window while this one is checksummed (an explicit POSIX_FADV_WILLNEED
// measured slower).
constexpr std::uint64_t kWindowBytes = std::uint64_t{1} << 20;

}  // namespace

void Reader::read_box(const TensorInfo& t, const std::vector<std::int64_t>& offset,
                      const Shape& shape, void* dst) {
  const std::size_t nd = t.global_shape.size();
  bool inside = offset.size() == nd && shape.size() == nd;
  for (std::size_t d = 0; inside && d < nd; ++d) {
    std::int64_t end = 0;
    inside = offset[d] >= 0 && shape[d] >= 0 && detail::add_ok(offset[d], shape[d], end) &&
             end <= t.global_shape[d];
  }
  if (!inside)
    throw InvalidArgument("checkpoint: box at " + shape_string(offset) + " of shape " +
                          shape_string(shape) + " is not inside tensor '" + t.name + "' of shape " +
                          shape_string(t.global_shape));
  if (numel(shape) == 0) return;
  auto* out = static_cast<char*>(dst);
  const std::size_t es = dtype_size(t.dtype);
  const std::uint64_t B = index_.block_bytes;
  const std::uint64_t window = std::max(B, kWindowBytes / B * B);
  for (std::size_t s = 0; s < t.shards.size(); ++s) {
    const ShardInfo& sh = t.shards[s];
    // `runs` copies; `plan` runs ahead of it to size each read.
    detail::BoxRuns runs(sh.global_offset, sh.shape, offset, shape, es);
    if (runs.done()) continue;
    detail::BoxRuns plan = runs;
    const ShardReader rd{index_, dir_, t, s, open_file(sh.file, t), bytes_read_};
    while (!runs.done()) {
      // A read: from the block of the first byte not copied yet, over the blocks the next runs
      // touch, up to the window size or to a block no run touches (skipped: a Shard(1) box
      // reads the blocks holding its columns, not the whole shard).
      const std::uint64_t lo = runs.pending() / B * B;
      const std::uint64_t cap = std::min(sh.length, lo + window);
      std::uint64_t hi = lo;
      while (!plan.done()) {
        const detail::Run& r = plan.run();
        const std::uint64_t a = std::max(r.src, lo);
        if (a >= cap || (hi > lo && a / B * B > hi)) break;
        const std::uint64_t end = r.src + r.len;
        hi = std::min(cap, (end + B - 1) / B * B);
        if (end > cap) break;  // continues in the next read
        plan.next();
      }
      const detail::Run& r = runs.run();
      if (r.src <= lo && hi <= r.src + r.len) {  // inside one run: straight into place
        char* p = out + r.dst + (lo - r.src);
        rd.read(p, lo, hi);
        rd.verify(p, lo, hi);
        runs.copy(nullptr, lo, hi, out);
        continue;
      }
      detail::ByteBuffer& scratch = files_->scratch;
      if (scratch.size() < hi - lo) scratch.resize(static_cast<std::size_t>(hi - lo));
      rd.read(scratch.data(), lo, hi);
      rd.verify(scratch.data(), lo, hi);
      runs.copy(scratch.data(), lo, hi, out);
    }
  }
}

void Reader::read_full(const TensorInfo& t, void* dst) {
  read_box(t, std::vector<std::int64_t>(t.global_shape.size(), 0), t.global_shape, dst);
}

void Reader::verify_shard(const TensorInfo& t, std::size_t s) {
  const ShardInfo& sh = t.shards.at(s);
  const ShardReader rd{index_, dir_, t, s, open_file(sh.file, t), bytes_read_};
  const std::uint64_t B = index_.block_bytes;
  const std::uint64_t window = std::max(B, kWindowBytes / B * B);
  detail::ByteBuffer& scratch = files_->scratch;
  const std::uint64_t need = std::min(window, sh.length);
  if (scratch.size() < need) scratch.resize(static_cast<std::size_t>(need));
  for (std::uint64_t w = 0; w < sh.length; w += window) {
    const std::uint64_t n = std::min(window, sh.length - w);
    rd.read(scratch.data(), w, w + n);
    rd.verify(scratch.data(), w, w + n);
  }
}

const File& Reader::open_file(std::size_t i, const TensorInfo& t) {
  Files& f = *files_;
  if (f.open.size() != index_.files.size()) {
    f.open.resize(index_.files.size());
    f.last_use.assign(index_.files.size(), 0);
  }
  f.last_use[i] = ++f.clock;
  if (f.open[i].valid()) return f.open[i];
  if (f.lru.size() >= kMaxOpenFiles) {  // close the least recently used
    auto oldest = std::min_element(f.lru.begin(), f.lru.end(), [&](std::size_t a, std::size_t b) {
      return f.last_use[a] < f.last_use[b];
    });
    f.open[*oldest] = File();
    *oldest = f.lru.back();
    f.lru.pop_back();
  }
  const std::string path = detail::join(dir_, index_.files[i].name);
  File file = File::open_read(path, t.name);
  if (!file.valid())
    throw InvalidArgument("checkpoint file " + path + " is missing (needed for tensor '" + t.name +
                          "')");
  const std::uint64_t size = file.size();
  const std::uint64_t want = index_.files[i].bytes;
  if (size != want)
    throw InvalidArgument("checkpoint file " + path + " is " +
                          (size < want ? "truncated" : "longer than the index says") + ": " +
                          std::to_string(size) + " bytes, the index says " + std::to_string(want) +
                          " (reading tensor '" + t.name + "')");
  f.open[i] = std::move(file);
  f.lru.push_back(i);
  return f.open[i];
}

// ---- verify -----------------------------------------------------------------------------------

std::vector<VerifyIssue> verify(const std::string& path) {
  std::vector<VerifyIssue> issues;
  const std::string dir = detail::find_step_dir(path);  // not a checkpoint: thrown
  const std::string where = detail::join(dir, kIndexFile);
  Index index;
  try {
    index = parse_index(read_index_text(dir), where);
  } catch (const Error& e) {
    issues.push_back({where, "", e.what()});
    return issues;
  }
  Reader reader(dir, index);
  // Shards in file order, each file front to back: every file is opened once and read
  // sequentially. `user`: a tensor stored in each file, for the messages.
  std::vector<std::pair<std::size_t, std::size_t>> order;  // (tensor, shard)
  std::vector<std::string> user(index.files.size());
  for (std::size_t ti = 0; ti < index.tensors.size(); ++ti)
    for (std::size_t s = 0; s < index.tensors[ti].shards.size(); ++s) {
      const ShardInfo& sh = index.tensors[ti].shards[s];
      if (sh.length == 0) continue;
      order.emplace_back(ti, s);
      if (user[sh.file].empty()) user[sh.file] = index.tensors[ti].name;
    }
  auto shard_of = [&](const std::pair<std::size_t, std::size_t>& x) -> const ShardInfo& {
    return index.tensors[x.first].shards[x.second];
  };
  std::sort(order.begin(), order.end(), [&](const auto& a, const auto& b) {
    const ShardInfo& x = shard_of(a);
    const ShardInfo& y = shard_of(b);
    return x.file != y.file ? x.file < y.file : x.offset < y.offset;
  });
  std::vector<char> bad(index.files.size(), 0);
  for (std::size_t i = 0; i < index.files.size(); ++i) {
    const std::string fpath = detail::join(dir, index.files[i].name);
    std::string problem;
    File f;
    try {
      f = File::open_read(fpath);
    } catch (const Error& e) {  // not a regular file, or cannot be opened
      problem = e.what();
    }
    if (!problem.empty()) {
    } else if (!f.valid()) {
      problem = "checkpoint file " + fpath + " is missing";
    } else if (f.size() != index.files[i].bytes) {
      problem = "checkpoint file " + fpath + " has " + std::to_string(f.size()) +
                " bytes, the index says " + std::to_string(index.files[i].bytes) +
                (f.size() < index.files[i].bytes ? " (truncated)" : "");
    }
    if (problem.empty()) continue;
    bad[i] = 1;
    issues.push_back(
        {fpath, user[i], problem + (user[i].empty() ? "" : " (holds tensor '" + user[i] + "')")});
  }
  for (const auto& x : order) {
    const TensorInfo& t = index.tensors[x.first];
    const std::size_t file = shard_of(x).file;
    if (bad[file]) continue;
    try {
      reader.verify_shard(t, x.second);
    } catch (const Error& e) {
      issues.push_back({detail::join(dir, index.files[file].name), t.name, e.what()});
    }
  }
  return issues;
}

}  // namespace fullshard::checkpoint
