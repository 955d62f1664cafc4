// safetensors: header parsing and checks, pread of tensor bytes and boxes, the atomic streaming
// writer, conversion to and from fullshard checkpoints, and loading into a sharded model.
#include "fullshard/checkpoint/safetensors.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/checksum.hpp"
#include "fullshard/fsdp/state_dict.hpp"
#include "fullshard/tensor/sharding.hpp"
#include "lib/checkpoint/index_json.hpp"
#include "lib/checkpoint/io.hpp"

namespace fullshard::checkpoint {

using nlohmann::json;

const char* safetensors_dtype_name(DType t) noexcept {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::f64:
      return "F64";
    case DType::f16:
      return "F16";
    case DType::bf16:
      return "BF16";
  }
  return "?";
}

namespace {

constexpr const char* kMetadataKey = "__metadata__";

// Errors name the file and, when known, the tensor.
[[noreturn]] void fail(const std::string& path, const std::string& tensor, const std::string& msg) {
  throw InvalidArgument("safetensors file " + path +
                        (tensor.empty() ? "" : ": tensor '" + tensor + "'") + ": " + msg);
}

// Dtypes of the format that fullshard does not hold (refused with a clear message).
bool is_other_safetensors_dtype(const std::string& s) {
  static const char* const kOthers[] = {
      "BOOL", "U8",  "I8",      "I16",         "U16",        "I32",     "U32",
      "I64",  "U64", "F8_E4M3", "F8_E5M2",     "F8_E8M0",    "F6_E2M3", "F6_E3M2",
      "F4",   "C64", "C128",    "F8_E4M3FNUZ", "F8_E5M2FNUZ"};
  for (const char* o : kOthers)
    if (s == o) return true;
  return false;
}

bool parse_st_dtype(const std::string& s, DType& out) {
  for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16})
    if (s == safetensors_dtype_name(t)) {
      out = t;
      return true;
    }
  return false;
}

// Position of the first byte that is not well-formed UTF-8 (RFC 3629: no overlong forms, no
// surrogates, nothing above U+10FFFF), or npos.
std::size_t invalid_utf8_at(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  for (std::size_t i = 0; i < n;) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = 0;
    unsigned lo = 0x80, hi = 0xbf;  // allowed range of the second byte
    if (c >= 0xc2 && c <= 0xdf) {
      len = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
      if (c == 0xe0) lo = 0xa0;
      if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
      if (c == 0xf0) lo = 0x90;
      if (c == 0xf4) hi = 0x8f;
    } else {
      return i;
    }
    if (i + len > n) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (std::size_t k = 2; k < len; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xbf) return i;
    i += len;
  }
  return std::string::npos;
}

std::uint64_t get_u64_le(const unsigned char* b) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i)
    v = (v << 8) | b[i];
  return v;
}

void put_u64_le(std::uint64_t v, char* b) {
  for (int i = 0; i < 8; ++i)
    b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

// Parses the header text with a bounded depth, refusing a key that appears twice in one object
// (nlohmann keeps the last silently).
json parse_header(const std::string& text, const std::string& path, int max_depth) {
  struct Level {
    std::set<std::string> keys;
    std::string last;
  };
  std::vector<Level> stack;
  auto enclosing_tensor = [&]() -> std::string {
    return stack.size() >= 2 ? stack[0].last : std::string();
  };
  auto cb = [&](int /*depth*/, json::parse_event_t ev, json& parsed) -> bool {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (static_cast<int>(stack.size()) >= max_depth)
          fail(path, enclosing_tensor(),
               "the header nests deeper than " + std::to_string(max_depth) + " levels");
        stack.emplace_back();
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case json::parse_event_t::key: {
        const std::string k = parsed.get<std::string>();
        Level& l = stack.back();
        if (!l.keys.insert(k).second) {
          if (stack.size() == 1) fail(path, k, "the name appears twice in the header");
          fail(path, enclosing_tensor(), "key '" + k + "' appears twice");
        }
        l.last = k;
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text, cb);
  } catch (const json::parse_error& e) {
    fail(path, "",
         "the header is not valid JSON at byte " + std::to_string(e.byte) + " (" +
             std::string(e.what()).substr(0, 160) + ")");
  }
}

std::uint64_t unsigned_of(const json& v, bool& ok) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0)
    return static_cast<std::uint64_t>(v.get<std::int64_t>());
  ok = false;
  return 0;
}

// Bytes of the data region per element of dtype t, and checked products.
bool mul_overflows(std::uint64_t a, std::uint64_t b, std::uint64_t& out) {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) return true;
  out = a * b;
  return false;
}

// Calls f(offset, shape) for consecutive row-major pieces of the box (box_off, box_shape), each
// at most `chunk` bytes (but at least one element), in storage order.
template <class F>
void for_each_piece(const std::vector<std::int64_t>& box_off, const Shape& box_shape,
                    std::size_t es, std::uint64_t chunk, F&& f) {
  const std::size_t nd = box_shape.size();
  if (numel(box_shape) == 0) return;
  if (nd == 0) {
    f(box_off, box_shape);
    return;
  }
  chunk = std::max<std::uint64_t>(chunk, es);
  // inner[d]: bytes of one index step along dim d (the dims after d, whole).
  std::vector<std::uint64_t> inner(nd);
  inner[nd - 1] = es;
  for (std::size_t d = nd - 1; d > 0; --d)
    inner[d - 1] = inner[d] * static_cast<std::uint64_t>(box_shape[d]);
  std::size_t d = 0;
  while (inner[d] > chunk)
    ++d;  // inner[nd - 1] = es <= chunk
  const std::int64_t step = static_cast<std::int64_t>(
      std::min<std::uint64_t>(chunk / inner[d], static_cast<std::uint64_t>(box_shape[d])));
  std::vector<std::int64_t> idx(d, 0);  // position in dims [0, d)
  std::vector<std::int64_t> off(box_off);
  Shape shape(box_shape);
  for (std::size_t e = 0; e < d; ++e)
    shape[e] = 1;
  for (;;) {
    for (std::size_t e = 0; e < d; ++e)
      off[e] = box_off[e] + idx[e];
    for (std::int64_t j = 0; j < box_shape[d]; j += step) {
      off[d] = box_off[d] + j;
      shape[d] = std::min(step, box_shape[d] - j);
      f(off, shape);
    }
    std::size_t e = d;
    while (e > 0) {
      --e;
      if (++idx[e] < box_shape[e]) break;
      idx[e] = 0;
      if (e == 0) return;
    }
    if (d == 0) return;
  }
}

std::string parent_dir(const std::string& path) {
  const std::string p = std::filesystem::path(path).parent_path().string();
  return p.empty() ? "." : p;
}

}  // namespace

// ---- Reader -----------------------------------------------------------------------------------

SafetensorsReader::SafetensorsReader(const std::string& path, const SafetensorsLimits& limits)
    : path_(path) {
  File f = File::open_read(path);
  if (!f.valid()) fail(path, "", "does not exist");
  file_bytes_ = f.size();
  if (file_bytes_ < 8)
    fail(path, "",
         "is " + std::to_string(file_bytes_) +
             " bytes long, shorter than the 8-byte header length (not a safetensors file)");
  unsigned char len_bytes[8];
  if (f.pread_all(len_bytes, 8, 0) != 8) fail(path, "", "is truncated (the header length)");
  bytes_read_ += 8;
  const std::uint64_t n = get_u64_le(len_bytes);
  if (n > file_bytes_ - 8)
    fail(path, "",
         "the header length " + std::to_string(n) + " lies beyond the end of the file (" +
             std::to_string(file_bytes_) + " bytes): truncated, or not a safetensors file");
  if (n > limits.max_header_bytes)
    fail(path, "",
         "the header is " + std::to_string(n) + " bytes, more than the limit of " +
             std::to_string(limits.max_header_bytes));
  if (n < 2) fail(path, "", "the header is " + std::to_string(n) + " bytes: not a JSON object");
  std::string text(static_cast<std::size_t>(n), '\0');
  if (f.pread_all(text.data(), n, 8) != n) fail(path, "", "is truncated (the header)");
  bytes_read_ += n;
  data_offset_ = 8 + n;
  const std::uint64_t data_bytes = file_bytes_ - data_offset_;

  const std::size_t bad = invalid_utf8_at(text);
  if (bad != std::string::npos)
    fail(path, "", "the header is not valid UTF-8 (byte " + std::to_string(bad) + " of it)");
  if (text[0] != '{') fail(path, "", "the header does not start with '{' (not a JSON object)");
  const json header = parse_header(text, path, limits.max_depth);
  if (!header.is_object()) fail(path, "", "the header is not a JSON object");

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == kMetadataKey) {
      if (!v.is_object()) fail(path, "", "'__metadata__' must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          fail(path, "",
               "'__metadata__' value of '" + m.key() + "' must be a string, got " +
                   m.value().dump().substr(0, 64));
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (name.empty()) fail(path, "", "a tensor has an empty name");
    if (!v.is_object()) fail(path, name, "must be an object with dtype, shape and data_offsets");
    for (const char* key : {"dtype", "shape", "data_offsets"})
      if (!v.contains(key)) fail(path, name, std::string("missing '") + key + "'");
    SafetensorsTensor t;
    t.name = name;
    const json& dt = v["dtype"];
    if (!dt.is_string()) fail(path, name, "'dtype' must be a string, got " + dt.dump());
    const std::string ds = dt.get<std::string>();
    if (!parse_st_dtype(ds, t.dtype)) {
      if (is_other_safetensors_dtype(ds))
        fail(path, name,
             "dtype " + ds + " is not supported (fullshard holds F32, F64, F16 and BF16)");
      fail(path, name, "unknown dtype '" + ds.substr(0, 32) + "'");
    }
    const json& sh = v["shape"];
    if (!sh.is_array()) fail(path, name, "'shape' must be an array of non-negative integers");
    std::uint64_t elems = 1;
    for (const json& d : sh) {
      bool ok = true;
      const std::uint64_t e = unsigned_of(d, ok);
      if (!ok || e > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        fail(path, name, "'shape' must hold non-negative integers, got " + sh.dump().substr(0, 64));
      if (mul_overflows(elems, e, elems) ||
          elems > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        fail(path, name, "the element count of shape " + sh.dump().substr(0, 64) + " overflows");
      t.shape.push_back(static_cast<std::int64_t>(e));
    }
    std::uint64_t nbytes = 0;
    if (mul_overflows(elems, dtype_size(t.dtype), nbytes))
      fail(path, name, "the byte count of shape " + sh.dump().substr(0, 64) + " overflows");
    const json& off = v["data_offsets"];
    bool ok = off.is_array() && off.size() == 2;
    if (ok) {
      t.begin = unsigned_of(off[0], ok);
      t.end = unsigned_of(off[1], ok);
    }
    if (!ok)
      fail(path, name,
           "'data_offsets' must be [begin, end] (non-negative integers), got " +
               off.dump().substr(0, 64));
    if (t.end < t.begin)
      fail(path, name,
           "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
               "] end before they begin");
    if (t.end > data_bytes)
      fail(path, name,
           "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
               "] lie beyond the data region (" + std::to_string(data_bytes) +
               " bytes after the header)");
    if (t.end - t.begin != nbytes)
      fail(path, name,
           std::string(ds) + " shape " + shape_string(t.shape) + " needs " +
               std::to_string(nbytes) + " bytes, its data_offsets [" + std::to_string(t.begin) +
               ", " + std::to_string(t.end) + "] hold " + std::to_string(t.end - t.begin));
    tensors_.push_back(std::move(t));
  }

  // The tensors must tile the data region: sorted by offsets, each starts where the previous
  // ended, the last ends at the end of the file.
  std::sort(tensors_.begin(), tensors_.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              if (a.begin != b.begin) return a.begin < b.begin;
              if (a.end != b.end) return a.end < b.end;
              return a.name < b.name;
            });
  std::uint64_t covered = 0;
  const SafetensorsTensor* prev = nullptr;
  for (const SafetensorsTensor& t : tensors_) {
    if (t.begin < covered)
      fail(path, t.name,
           "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
               "] overlap tensor '" + prev->name + "' [" + std::to_string(prev->begin) + ", " +
               std::to_string(prev->end) + "]");
    if (t.begin > covered)
      fail(path, t.name,
           "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
               "] leave a hole: bytes [" + std::to_string(covered) + ", " +
               std::to_string(t.begin) + ") of the data region belong to no tensor");
    covered = t.end;
    prev = &t;
  }
  if (covered != data_bytes)
    fail(path, prev ? prev->name : std::string(),
         "the tensors cover bytes [0, " + std::to_string(covered) +
             ") of the data region, which has " + std::to_string(data_bytes) +
             " (bytes after the last tensor belong to none)");
  for (std::size_t i = 0; i < tensors_.size(); ++i)
    by_name_[tensors_[i].name] = i;
  file_ = std::make_unique<File>(std::move(f));
}

SafetensorsReader::~SafetensorsReader() = default;
SafetensorsReader::SafetensorsReader(SafetensorsReader&&) noexcept = default;
SafetensorsReader& SafetensorsReader::operator=(SafetensorsReader&&) noexcept = default;

const SafetensorsTensor* SafetensorsReader::find(const std::string& name) const noexcept {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

const SafetensorsTensor& SafetensorsReader::tensor(const std::string& name) const {
  if (const SafetensorsTensor* t = find(name)) return *t;
  fail(path_, name, "no such tensor in the file");
}

void SafetensorsReader::read_bytes(const SafetensorsTensor& t, std::uint64_t offset,
                                   std::uint64_t n, void* dst) {
  if (offset > t.bytes() || n > t.bytes() - offset)
    fail(path_, t.name,
         "bytes [" + std::to_string(offset) + ", " + std::to_string(offset + n) +
             ") asked for, the tensor has " + std::to_string(t.bytes()));
  if (n == 0) return;
  const std::uint64_t got = file_->pread_all(dst, n, data_offset_ + t.begin + offset, t.name);
  bytes_read_ += got;
  if (got != n)
    fail(path_, t.name,
         "the file is truncated: it ended at byte " +
             std::to_string(data_offset_ + t.begin + offset + got) +
             " (it shrank after it was opened?)");
}

void SafetensorsReader::read(const SafetensorsTensor& t, void* dst) {
  read_bytes(t, 0, t.bytes(), dst);
}

void SafetensorsReader::read_rows(const SafetensorsTensor& t, std::int64_t first, std::int64_t rows,
                                  void* dst) {
  if (t.shape.empty()) fail(path_, t.name, "a 0-d tensor has no rows");
  if (first < 0 || rows < 0 || first > t.shape[0] || rows > t.shape[0] - first)
    fail(path_, t.name,
         "rows [" + std::to_string(first) + ", " + std::to_string(first + rows) +
             ") asked for, the tensor has " + std::to_string(t.shape[0]));
  if (t.shape[0] == 0) return;
  const std::uint64_t row_bytes = t.bytes() / static_cast<std::uint64_t>(t.shape[0]);
  read_bytes(t, static_cast<std::uint64_t>(first) * row_bytes,
             static_cast<std::uint64_t>(rows) * row_bytes, dst);
}

void SafetensorsReader::read_box(const SafetensorsTensor& t,
                                 const std::vector<std::int64_t>& offset, const Shape& shape,
                                 void* dst) {
  const std::size_t nd = t.shape.size();
  bool inside = offset.size() == nd && shape.size() == nd;
  for (std::size_t d = 0; inside && d < nd; ++d)
    inside = offset[d] >= 0 && shape[d] >= 0 && offset[d] <= t.shape[d] &&
             shape[d] <= t.shape[d] - offset[d];
  if (!inside)
    fail(path_, t.name,
         "box at " + shape_string(offset) + " of shape " + shape_string(shape) +
             " is not inside its shape " + shape_string(t.shape));
  if (numel(shape) == 0) return;
  if (nd == 0) return read(t, dst);
  auto* out = static_cast<char*>(dst);
  const std::size_t es = dtype_size(t.dtype);
  // Runs closer than kGap bytes are read as one window of at most kWindow bytes (one pread
  // instead of many small ones); a window inside one run goes straight into place.
  constexpr std::uint64_t kGap = 4096, kWindow = std::uint64_t{1} << 20;
  detail::BoxRuns runs(std::vector<std::int64_t>(nd, 0), t.shape, offset, shape, es);
  detail::ByteBuffer scratch;
  while (!runs.done()) {
    const std::uint64_t lo = runs.pending();
    const detail::Run& r = runs.run();
    std::uint64_t hi = r.src + r.len;
    detail::BoxRuns plan = runs;
    for (plan.next(); !plan.done(); plan.next()) {
      const detail::Run& q = plan.run();
      if (q.src - hi > kGap || q.src + q.len - lo > kWindow) break;
      hi = q.src + q.len;
    }
    if (hi == r.src + r.len) {  // this run only: straight into place
      read_bytes(t, lo, hi - lo, out + r.dst + (lo - r.src));
      runs.copy(nullptr, lo, hi, out);
      continue;
    }
    if (scratch.size() < hi - lo) scratch.resize(static_cast<std::size_t>(hi - lo));
    read_bytes(t, lo, hi - lo, scratch.data());
    runs.copy(scratch.data(), lo, hi, out);
  }
}

// ---- Writer -----------------------------------------------------------------------------------

namespace {

// The reference writer's order: dtype alignment, largest first; among equal sizes its Dtype
// enum order, later first (BF16 before F16); then names (bytewise).
int dtype_rank(DType t) {
  switch (t) {
    case DType::f64:
      return 3;
    case DType::f32:
      return 2;
    case DType::bf16:
      return 1;
    case DType::f16:
      return 0;
  }
  return 0;
}

}  // namespace

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<SafetensorsSpec> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), tmp_(path_ + ".tmp") {
  std::set<std::string> names;
  for (const SafetensorsSpec& s : tensors) {
    if (s.name.empty()) fail(path_, "", "a tensor to write has an empty name");
    if (s.name == kMetadataKey) fail(path_, s.name, "the name is reserved for the metadata");
    if (!names.insert(s.name).second) fail(path_, s.name, "given twice");
    for (std::int64_t d : s.shape)
      if (d < 0) fail(path_, s.name, "negative extent in shape " + shape_string(s.shape));
    if (invalid_utf8_at(s.name) != std::string::npos)
      fail(path_, s.name, "the name is not valid UTF-8");
  }
  for (const auto& [k, v] : metadata)
    if (invalid_utf8_at(k) != std::string::npos || invalid_utf8_at(v) != std::string::npos)
      fail(path_, "", "metadata '" + k + "' is not valid UTF-8");
  std::sort(tensors.begin(), tensors.end(), [](const SafetensorsSpec& a, const SafetensorsSpec& b) {
    if (dtype_rank(a.dtype) != dtype_rank(b.dtype))
      return dtype_rank(a.dtype) > dtype_rank(b.dtype);
    return a.name < b.name;
  });
  std::uint64_t pos = 0;
  std::string header = "{";
  if (!metadata.empty()) header += "\"__metadata__\":" + json(metadata).dump() + ",";
  for (const SafetensorsSpec& s : tensors) {
    SafetensorsTensor t{s.name, s.dtype, s.shape, pos, 0};
    std::uint64_t bytes = dtype_size(s.dtype);
    for (std::int64_t d : s.shape)
      if (mul_overflows(bytes, static_cast<std::uint64_t>(d), bytes))
        fail(path_, s.name, "the byte count of shape " + shape_string(s.shape) + " overflows");
    t.end = pos + bytes;
    pos = t.end;
    json shape = json::array();
    for (std::int64_t d : s.shape)
      shape.push_back(d);
    header += json(s.name).dump() + ":{\"dtype\":\"" + safetensors_dtype_name(s.dtype) +
              "\",\"shape\":" + shape.dump() + ",\"data_offsets\":[" + std::to_string(t.begin) +
              "," + std::to_string(t.end) + "]},";
    by_name_[s.name] = layout_.size();
    layout_.push_back(std::move(t));
  }
  if (header.back() == ',') header.pop_back();
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  written_.assign(layout_.size(), 0);
  data_offset_ = 8 + header.size();
  char len[8];
  put_u64_le(header.size(), len);
  file_ = std::make_unique<File>(File::create(tmp_));
  try {
    file_->write_all(len, 8);
    file_->write_all(header.data(), header.size());
  } catch (...) {
    file_.reset();
    detail::remove_quietly(tmp_);
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (committed_) return;
  file_.reset();
  detail::remove_quietly(tmp_);
}

void SafetensorsWriter::write(const std::string& name, const void* data, std::uint64_t n) {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) fail(path_, name, "not among the tensors this writer was given");
  if (committed_) fail(path_, name, "written after commit()");
  const SafetensorsTensor& t = layout_[it->second];
  std::uint64_t& done = written_[it->second];
  if (n > t.bytes() - done)
    fail(path_, name,
         std::to_string(n) + " more bytes written, it has " + std::to_string(t.bytes() - done) +
             " left of " + std::to_string(t.bytes()));
  file_->pwrite_all(data, n, data_offset_ + t.begin + done, name);
  done += n;
}

void SafetensorsWriter::commit() {
  if (committed_) return;
  for (std::size_t i = 0; i < layout_.size(); ++i)
    if (written_[i] != layout_[i].bytes())
      fail(path_, layout_[i].name,
           "incomplete: " + std::to_string(written_[i]) + " of its " +
               std::to_string(layout_[i].bytes()) + " bytes written");
  file_->sync();
  file_->close();
  detail::rename_path(tmp_, path_);
  committed_ = true;
  detail::fsync_dir(parent_dir(path_));
}

// ---- Conversion -------------------------------------------------------------------------------

namespace {

void copy_tensors(Reader& ck, const std::vector<const TensorInfo*>& tensors, const std::string& dst,
                  const std::map<std::string, std::string>& metadata, std::uint64_t chunk) {
  std::vector<SafetensorsSpec> specs;
  std::map<std::string, const TensorInfo*> by_name;
  for (const TensorInfo* t : tensors) {
    specs.push_back({t->name, t->dtype, t->global_shape});
    by_name[t->name] = t;
  }
  SafetensorsWriter w(dst, std::move(specs), metadata);
  detail::ByteBuffer buf;
  for (const SafetensorsTensor& lt : w.tensors()) {  // file order: sequential writes
    const TensorInfo& t = *by_name.at(lt.name);
    const std::size_t es = dtype_size(t.dtype);
    for_each_piece(std::vector<std::int64_t>(t.global_shape.size(), 0), t.global_shape, es, chunk,
                   [&](const std::vector<std::int64_t>& off, const Shape& shape) {
                     const std::uint64_t n = static_cast<std::uint64_t>(numel(shape)) * es;
                     if (buf.size() < n) buf.resize(static_cast<std::size_t>(n));
                     ck.read_box(t, off, shape, buf.data());
                     w.write(t.name, buf.data(), n);
                   });
  }
  w.commit();
}

// A shard's bytes arriving in pieces: written, and checksummed per block on the way.
class ShardStream {
 public:
  ShardStream(File& f, std::uint64_t& file_bytes, std::uint64_t block, ShardInfo& s)
      : f_(f), file_bytes_(file_bytes), block_(block), s_(s) {
    s_.offset = file_bytes_;
    s_.length = 0;
    s_.crc32c.clear();
  }
  void add(const char* p, std::uint64_t n, const std::string& tensor) {
    f_.write_all(p, n, tensor);
    file_bytes_ += n;
    s_.length += n;
    while (n > 0) {
      const std::uint64_t take = std::min(n, block_ - in_block_);
      crc_ = crc32c(p, static_cast<std::size_t>(take), crc_);
      in_block_ += take;
      p += take;
      n -= take;
      if (in_block_ == block_) {
        s_.crc32c.push_back(crc_);
        crc_ = 0;
        in_block_ = 0;
      }
    }
  }
  void finish() {
    if (in_block_ > 0) s_.crc32c.push_back(crc_);
  }

 private:
  File& f_;
  std::uint64_t& file_bytes_;
  std::uint64_t block_;
  ShardInfo& s_;
  std::uint64_t in_block_ = 0;
  std::uint32_t crc_ = 0;
};

std::string relative_fqn(const graph::Module& root, const graph::Parameter& p) {
  return root.fqn().empty() ? p.fqn() : p.fqn().substr(root.fqn().size() + 1);
}

// Every parameter of `model` in the file with its shape and dtype, nothing else.
void check_against_model(const SafetensorsReader& r, graph::Module& model, bool cast = false) {
  std::set<std::string> want;
  for (graph::Parameter* p : model.parameters()) {
    const std::string name = relative_fqn(model, *p);
    want.insert(name);
    const SafetensorsTensor* t = r.find(name);
    if (!t) fail(r.path(), name, "missing: the model has this parameter, the file does not");
    if (t->shape != p->shape())
      fail(r.path(), name,
           "has shape " + shape_string(t->shape) + ", the model's parameter is " +
               shape_string(p->shape()));
    if (t->dtype != p->dtype() && !cast)
      fail(r.path(), name,
           std::string("is ") + safetensors_dtype_name(t->dtype) + ", the model's parameter is " +
               safetensors_dtype_name(p->dtype()) + " (" + dtype_name(p->dtype()) + ")");
  }
  for (const SafetensorsTensor& t : r.tensors())
    if (!want.count(t.name)) fail(r.path(), t.name, "unexpected: the model has no such parameter");
}

}  // namespace

void checkpoint_to_safetensors(const std::string& src, const std::string& dst,
                               const ToSafetensorsOptions& options) {
  Reader ck(src);
  const Index& x = ck.index();
  std::vector<const TensorInfo*> params, states;
  for (const TensorInfo& t : x.tensors)
    (t.is_param() ? params : states).push_back(&t);
  std::map<std::string, std::string> meta = {{"format", "pt"},
                                             {"fullshard.step", std::to_string(x.step)},
                                             {"fullshard.model_fingerprint", x.model_fingerprint},
                                             {"fullshard.source", ck.step_dir()}};
  if (!options.optimizer_path.empty()) {
    if (!x.has_optimizer)
      throw InvalidArgument("checkpoint " + ck.index_path() +
                            " holds no optimizer state: nothing to write to '" +
                            options.optimizer_path + "'");
    if (options.optimizer_path == dst)
      throw InvalidArgument("safetensors: the model and optimizer files are both '" + dst + "'");
  }
  copy_tensors(ck, params, dst, meta, options.chunk_bytes);
  if (!options.optimizer_path.empty()) {
    meta["fullshard.optimizer_step"] = std::to_string(x.optimizer_step);
    copy_tensors(ck, states, options.optimizer_path, meta, options.chunk_bytes);
  }
}

std::string safetensors_to_checkpoint(const std::string& src, const std::string& dst,
                                      const FromSafetensorsOptions& options) {
  if (options.block_bytes == 0)
    throw InvalidArgument("safetensors to checkpoint: block_bytes must be > 0");
  if (options.shards < 1)
    throw InvalidArgument("safetensors to checkpoint: shards must be >= 1, got " +
                          std::to_string(options.shards));
  if (options.step < 0)
    throw InvalidArgument("safetensors to checkpoint: step must be >= 0, got " +
                          std::to_string(options.step));
  SafetensorsReader r(src);
  if (options.expect) check_against_model(r, *options.expect);
  const int shards = options.kind == Kind::full ? 1 : options.shards;

  Index out;
  out.kind = options.kind;
  out.step = options.step;
  out.block_bytes = options.block_bytes;
  out.metadata =
      nlohmann::json{{"converted_from", src}, {"safetensors_metadata", r.metadata()}}.dump();
  out.saved_by = nlohmann::json{{"converted_from_safetensors", src}, {"shards", shards}}.dump();
  std::vector<const SafetensorsTensor*> order;
  for (const SafetensorsTensor& t : r.tensors())
    order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const SafetensorsTensor* a, const SafetensorsTensor* b) {
    return a->name < b->name;
  });
  for (const SafetensorsTensor* t : order) {
    if (t->shape.empty())
      fail(src, t->name,
           "is a 0-d scalar: fullshard checkpoints and parameters have at least one dim");
    TensorInfo ti;
    ti.name = ti.param = t->name;
    ti.dtype = t->dtype;
    ti.global_shape = t->shape;
    ti.placement = Placement::Shard(0);
    out.tensors.push_back(std::move(ti));
  }
  out.model_fingerprint = model_fingerprint(out);

  const detail::PendingStep pending = detail::begin_step(dst, options.step);
  try {
    detail::ByteBuffer buf;
    for (int q = 0; q < shards; ++q) {
      char fname[32];
      std::snprintf(fname, sizeof fname, "rank-%05d.bin", q);
      const std::string name = options.kind == Kind::full ? "model.bin" : fname;
      File f = File::create(detail::join(pending.tmp, name));
      std::uint64_t file_bytes = 0;
      for (std::size_t i = 0; i < order.size(); ++i) {
        const SafetensorsTensor& t = *order[i];
        const ShardLayout l =
            shard_layout(t.shape, Placement::Shard(0), shards, q, "tensor '" + t.name + "'");
        if (l.local_numel() == 0) continue;
        ShardInfo s;
        s.file = out.files.size();
        s.global_offset = l.global_offset;
        s.shape = l.local_shape;
        ShardStream stream(f, file_bytes, out.block_bytes, s);
        const std::size_t es = dtype_size(t.dtype);
        for_each_piece(l.global_offset, l.local_shape, es, options.chunk_bytes,
                       [&](const std::vector<std::int64_t>& off, const Shape& shape) {
                         const std::uint64_t n = static_cast<std::uint64_t>(numel(shape)) * es;
                         if (buf.size() < n) buf.resize(static_cast<std::size_t>(n));
                         r.read_box(t, off, shape, buf.data());
                         stream.add(buf.data(), n, t.name);
                       });
        stream.finish();
        out.tensors[i].shards.push_back(std::move(s));
      }
      f.sync();
      f.close();
      out.files.push_back({name, file_bytes});
    }
    out = index_from_json(to_json(out), detail::join(pending.tmp, kIndexFile));
    return detail::commit_step(pending, to_json(out).dump(1), detail::Fault{});
  } catch (...) {
    detail::abandon_step(pending);
    throw;
  }
}

// ---- Loading into a model ---------------------------------------------------------------------

SafetensorsLoaded load_safetensors(const std::string& path, graph::Module& model,
                                   const SafetensorsLoadOptions& options) {
  SafetensorsReader r(path, options.limits);
  check_against_model(r, model, options.cast);
  const auto sd = fsdp::sharded_state_dict(model);
  std::map<std::string, ShardedTensor> staged;
  SafetensorsLoaded out;
  detail::ByteBuffer raw;
  for (const auto& [name, st] : sd) {
    const SafetensorsTensor& t = r.tensor(name);
    const DType want = st.local.dtype();
    ShardedTensor s;
    s.layout = st.layout;
    s.local = Tensor::empty(st.layout.local_shape, want, MemorySpace::host, "safetensors.load");
    if (t.dtype == want) {
      r.read_box(t, st.layout.global_offset, st.layout.local_shape, s.local.data());
    } else {  // options.cast
      const auto n = static_cast<std::size_t>(numel(st.layout.local_shape));
      raw.resize(n * dtype_size(t.dtype));
      r.read_box(t, st.layout.global_offset, st.layout.local_shape, raw.data());
      for (std::size_t e = 0; e < n; ++e)
        store_from_double(s.local.data(), want, e, load_as_double(raw.data(), t.dtype, e));
      ++out.cast;
    }
    staged.emplace(name, std::move(s));
  }
  fsdp::load_sharded_state_dict(model, staged);
  out.tensors = staged.size();
  out.bytes_read = r.bytes_read();
  out.metadata = r.metadata();
  return out;
}

}  // namespace fullshard::checkpoint
