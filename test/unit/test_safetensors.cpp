// safetensors on one process, no model: the writer's layout (the reference writer's order and
// padding), round trips of every dtype with whole, row, byte and box reads against the values
// written, the writer's atomicity, conversion to and from fullshard checkpoints (streamed in
// small pieces, verified), and one case per kind of bad file, each refused with a message
// naming the file and the tensor.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "error_check.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/format.hpp"
#include "fullshard/checkpoint/safetensors.hpp"
#include "fullshard/graph/module.hpp"

using namespace fullshard;
namespace ck = fullshard::checkpoint;
namespace fs = std::filesystem;
using test::contains;
using test::error_of;

namespace {

class TempDir {
 public:
  TempDir() {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/fullshard-st-test-XXXXXX";
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i)
    s[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A file: the header length of `header`, the header, `data` bytes of value 0x11.
std::string st_file(const std::string& header, std::size_t data) {
  return le64(header.size()) + header + std::string(data, '\x11');
}

// The value of element e of tensor `salt` (exact in bf16: small multiples of 1/4).
double value(int salt, std::int64_t e) {
  return 0.25 * static_cast<double>((e * 7 + salt * 13) % 41) - 5.0;
}

std::vector<char> values(DType t, const Shape& shape, int salt) {
  std::vector<char> out(static_cast<std::size_t>(numel(shape)) * dtype_size(t));
  for (std::int64_t e = 0; e < numel(shape); ++e)
    store_from_double(out.data(), t, static_cast<std::size_t>(e), value(salt, e));
  return out;
}

struct Spec {
  std::string name;
  DType dtype;
  Shape shape;
  int salt;
};

const std::vector<Spec> kSpecs = {
    {"layers.1.w", DType::f32, {5, 3}, 1}, {"layers.0.w", DType::f32, {4, 6}, 2},
    {"emb", DType::bf16, {7, 2}, 3},       {"norm", DType::f16, {3}, 4},
    {"head", DType::f64, {2, 3, 4}, 5},    {"empty", DType::f32, {0, 4}, 6},
    {"scalar", DType::f32, {}, 7}};

void write_specs(const std::string& path, const std::map<std::string, std::string>& meta = {}) {
  std::vector<ck::SafetensorsSpec> specs;
  for (const Spec& s : kSpecs)
    specs.push_back({s.name, s.dtype, s.shape});
  ck::SafetensorsWriter w(path, specs, meta);
  for (const Spec& s : kSpecs) {  // in pieces, in declaration (not file) order
    const std::vector<char> v = values(s.dtype, s.shape, s.salt);
    const std::size_t half = v.size() / 2;
    w.write(s.name, v.data(), half);
    w.write(s.name, v.data() + half, v.size() - half);
  }
  w.commit();
}

}  // namespace

TEST_CASE("safetensors writer: the reference writer's order, padding and alignment") {
  TempDir dir;
  const std::string path = dir.sub("m.safetensors");
  write_specs(path, {{"format", "pt"}});
  const std::string bytes = read_file(path);
  REQUIRE(bytes.size() > 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  CHECK(n % 8 == 0);
  const std::string header = bytes.substr(8, n);
  // Metadata first, then F64, F32 (by name), BF16, F16: the Python package's order.
  CHECK(header.rfind("{\"__metadata__\":{\"format\":\"pt\"},\"head\":{\"dtype\":\"F64\",\"shape\":"
                     "[2,3,4],\"data_offsets\":[0,192]},\"empty\":",
                     0) == 0);
  std::vector<std::string> order;
  ck::SafetensorsReader r(path);
  for (const auto& t : r.tensors()) {
    order.push_back(t.name);
    CHECK((r.data_offset() + t.begin) % dtype_size(t.dtype) == 0);
  }
  // "empty" and "layers.0.w" both start at 192 (empty has no bytes): ordered by end, name.
  CHECK(order == std::vector<std::string>{"head", "empty", "layers.0.w", "layers.1.w", "scalar",
                                          "emb", "norm"});
  CHECK(header.find_last_not_of(' ') + 1 > header.size() - 8);
  CHECK(r.metadata().at("format") == "pt");
  CHECK(r.file_bytes() == bytes.size());
}

TEST_CASE("safetensors round trip: every dtype; whole, rows, bytes and boxes") {
  TempDir dir;
  const std::string path = dir.sub("m.safetensors");
  write_specs(path);
  ck::SafetensorsReader r(path);
  CHECK(r.bytes_read() == r.data_offset());  // the header only
  for (const Spec& s : kSpecs) {
    const ck::SafetensorsTensor& t = r.tensor(s.name);
    CHECK(t.dtype == s.dtype);
    CHECK(t.shape == s.shape);
    const std::vector<char> want = values(s.dtype, s.shape, s.salt);
    std::vector<char> got(want.size() + 1, 'x');
    r.read(t, got.data());
    CHECK(std::string(got.data(), want.size()) == std::string(want.data(), want.size()));
    CHECK(got.back() == 'x');
  }
  const ck::SafetensorsTensor& w = r.tensor("layers.1.w");  // (5, 3) f32
  std::vector<float> rows(6);
  const std::uint64_t before = r.bytes_read();
  r.read_rows(w, 2, 2, rows.data());
  CHECK(r.bytes_read() - before == 24);  // exactly those rows
  for (int e = 0; e < 6; ++e)
    CHECK(rows[static_cast<std::size_t>(e)] == value(1, 6 + e));
  float one = 0;
  r.read_bytes(w, 4 * 14, 4, &one);
  CHECK(one == value(1, 14));
  // A column box of (2, 3, 4) f64: [0:2, 1:3, 2:3].
  const ck::SafetensorsTensor& h = r.tensor("head");
  std::vector<double> box(4);
  r.read_box(h, {0, 1, 2}, {2, 2, 1}, box.data());
  const std::vector<std::int64_t> idx = {0 * 12 + 1 * 4 + 2, 0 * 12 + 2 * 4 + 2, 12 + 4 + 2,
                                         12 + 8 + 2};
  for (std::size_t i = 0; i < 4; ++i)
    CHECK(box[i] == value(5, idx[i]));
  const std::string e1 = error_of<InvalidArgument>([&] { r.read_rows(w, 4, 2, rows.data()); });
  CHECK(contains(e1, path));
  CHECK(contains(e1, "'layers.1.w'"));
  CHECK(contains(e1, "rows [4, 6)"));
  const std::string e2 = error_of<InvalidArgument>([&] { (void)r.tensor("nope"); });
  CHECK(contains(e2, "'nope'"));
}

TEST_CASE("safetensors writer: atomic, complete, checked") {
  TempDir dir;
  const std::string path = dir.sub("w.safetensors");
  {
    ck::SafetensorsWriter w(path, {{"a", DType::f32, {2}}, {"b", DType::f16, {3}}});
    const float a[2] = {1, 2};
    w.write("a", a, sizeof a);
    CHECK(!fs::exists(path));
    CHECK(fs::exists(path + ".tmp"));
    const std::string e = error_of<InvalidArgument>([&] { w.commit(); });
    CHECK(contains(e, path));
    CHECK(contains(e, "tensor 'b'"));
    CHECK(contains(e, "incomplete: 0 of its 6 bytes"));
    const std::string e2 = error_of<InvalidArgument>([&] { w.write("a", a, 4); });
    CHECK(contains(e2, "tensor 'a'"));
    const std::string e3 = error_of<InvalidArgument>([&] { w.write("c", a, 4); });
    CHECK(contains(e3, "tensor 'c'"));
  }  // destroyed uncommitted: nothing left
  CHECK(!fs::exists(path));
  CHECK(!fs::exists(path + ".tmp"));
  const std::string e = error_of<InvalidArgument>([&] {
    ck::SafetensorsWriter w(path, {{"a", DType::f32, {2}}, {"a", DType::f32, {1}}});
  });
  CHECK(contains(e, "tensor 'a'"));
  CHECK(contains(e, "given twice"));
  // An empty file is valid: "{}" padded to 8 bytes.
  {
    ck::SafetensorsWriter w(path, {});
    w.commit();
  }
  CHECK(read_file(path) == le64(8) + "{}      ");
  CHECK(ck::SafetensorsReader(path).tensors().empty());
}

TEST_CASE("safetensors <-> fullshard checkpoint: streamed, verified, same bytes") {
  TempDir dir;
  const std::string src = dir.sub("m.safetensors");
  std::vector<ck::SafetensorsSpec> specs;
  std::vector<Spec> used;
  for (const Spec& s : kSpecs)
    if (!s.shape.empty()) {  // checkpoints hold tensors of >= 1 dim
      specs.push_back({s.name, s.dtype, s.shape});
      used.push_back(s);
    }
  {
    ck::SafetensorsWriter w(src, specs, {{"origin", "test"}});
    for (const Spec& s : used) {
      const std::vector<char> v = values(s.dtype, s.shape, s.salt);
      w.write(s.name, v.data(), v.size());
    }
    w.commit();
  }
  for (ck::Kind kind : {ck::Kind::full, ck::Kind::sharded}) {
    CAPTURE(ck::kind_name(kind));
    ck::FromSafetensorsOptions fo;
    fo.kind = kind;
    fo.shards = 3;
    fo.block_bytes = 8;   // blocks across the pieces
    fo.chunk_bytes = 12;  // pieces of a few elements
    fo.step = 4;
    const std::string root = dir.sub(std::string("ck-") + ck::kind_name(kind));
    const std::string step_dir = ck::safetensors_to_checkpoint(src, root, fo);
    CHECK(ck::verify(step_dir).empty());
    ck::Reader ckr(step_dir);
    CHECK(ckr.index().step == 4);
    CHECK(ckr.index().files.size() == (kind == ck::Kind::full ? 1u : 3u));
    CHECK(nlohmann::json::parse(ckr.index().metadata)["safetensors_metadata"]["origin"] == "test");
    for (const Spec& s : used) {
      const std::vector<char> want = values(s.dtype, s.shape, s.salt);
      std::vector<char> got(want.size());
      ckr.read_full(ckr.tensor(s.name), got.data());
      CHECK_MESSAGE(got == want, s.name);
    }
    // And back, in small pieces: the same tensors, the same bytes.
    const std::string back = dir.sub(std::string("back-") + ck::kind_name(kind) + ".safetensors");
    ck::ToSafetensorsOptions to;
    to.chunk_bytes = 20;
    ck::checkpoint_to_safetensors(root, back, to);
    ck::SafetensorsReader a(src), b(back);
    REQUIRE(a.tensors().size() == b.tensors().size());
    CHECK(b.metadata().at("fullshard.step") == "4");
    CHECK(b.metadata().at("format") == "pt");
    for (std::size_t i = 0; i < a.tensors().size(); ++i) {
      const auto& ta = a.tensors()[i];
      const auto& tb = b.tensors()[i];
      CHECK(ta.name == tb.name);
      CHECK(ta.begin == tb.begin);
      std::vector<char> x(ta.bytes()), y(tb.bytes());
      a.read(ta, x.data());
      b.read(tb, y.data());
      CHECK_MESSAGE(x == y, ta.name);
    }
    CHECK(read_file(src).substr(a.data_offset()) == read_file(back).substr(b.data_offset()));
  }
  // A 0-d tensor cannot become a checkpoint tensor.
  const std::string s0 = dir.sub("scalar.safetensors");
  {
    ck::SafetensorsWriter w(s0, {{"s", DType::f32, {}}});
    const float v = 1;
    w.write("s", &v, 4);
    w.commit();
  }
  const std::string e =
      error_of<InvalidArgument>([&] { ck::safetensors_to_checkpoint(s0, dir.sub("ck0")); });
  CHECK(contains(e, s0));
  CHECK(contains(e, "tensor 's'"));
  CHECK(contains(e, "0-d"));
  CHECK(!fs::exists(dir.sub("ck0/latest")));
}

TEST_CASE("safetensors to checkpoint: checked against a graph") {
  TempDir dir;
  const std::string src = dir.sub("m.safetensors");
  {
    ck::SafetensorsWriter w(src, {{"l0.w", DType::f32, {3, 2}}, {"l0.b", DType::f32, {3}}});
    const std::vector<float> v(6, 1.0f);
    w.write("l0.w", v.data(), 24);
    w.write("l0.b", v.data(), 12);
    w.commit();
  }
  auto graph_with = [](Shape w_shape, bool extra, DType b_dtype) {
    auto root = graph::Module::make_root("model");
    auto& l0 = root->add_module("l0");
    l0.add_param("w", w_shape);
    l0.add_param("b", {3}, b_dtype);
    if (extra) l0.add_param("u", {1});
    return root;
  };
  auto convert = [&](graph::Module& m) {
    ck::FromSafetensorsOptions fo;
    fo.expect = &m;
    return ck::safetensors_to_checkpoint(src, dir.sub("ck"), fo);
  };
  auto good = graph_with({3, 2}, false, DType::f32);
  CHECK(ck::Reader(convert(*good)).index().tensors.size() == 2);
  struct Case {
    std::unique_ptr<graph::Module> g;
    const char* tensor;
    const char* text;
  };
  std::vector<Case> cases;
  cases.push_back({graph_with({2, 3}, false, DType::f32), "tensor 'l0.w'", "has shape (3, 2)"});
  cases.push_back({graph_with({3, 2}, true, DType::f32), "tensor 'l0.u'", "missing"});
  cases.push_back({graph_with({3, 2}, false, DType::bf16), "tensor 'l0.b'", "is F32"});
  auto fewer = graph::Module::make_root("model");
  fewer->add_module("l0").add_param("w", {3, 2});
  cases.push_back({std::move(fewer), "tensor 'l0.b'", "unexpected"});
  for (Case& c : cases) {
    const std::string e = error_of<InvalidArgument>([&] { (void)convert(*c.g); });
    CHECK(contains(e, src));
    CHECK_MESSAGE(contains(e, c.tensor), e);
    CHECK_MESSAGE(contains(e, c.text), e);
  }
}

TEST_CASE("safetensors reader: every bad file is refused naming the file and the tensor") {
  TempDir dir;
  const std::string path = dir.sub("bad.safetensors");
  struct Bad {
    const char* what;
    std::string bytes;
    const char* tensor;  // "" when the problem is not a tensor's
    const char* text;
  };
  const std::string ok_entry = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  std::string deep = R"({"w":{"dtype":"F32","shape":)";
  for (int i = 0; i < 40; ++i)
    deep += "[";
  const std::vector<Bad> cases = {
      {"shorter than 8 bytes", "abc", "", "shorter than the 8-byte header length"},
      {"header length beyond the file", le64(1000) + "{}", "", "beyond the end of the file"},
      {"huge header length (no allocation)", le64(~0ull) + "{}", "", "beyond the end of the file"},
      {"not UTF-8",
       st_file("{\"w\xff\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8), "",
       "not valid UTF-8 (byte 3"},
      {"invalid JSON", st_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8), "",
       "not valid JSON"},
      {"not an object", st_file("[1, 2]", 0), "", "does not start with '{'"},
      {"nested too deep", st_file(deep, 0), "'w'", "nests deeper than 16"},
      {"duplicate name", st_file("{" + ok_entry + "," + ok_entry + "}", 8), "'w'", "appears twice"},
      {"duplicate key",
       st_file(R"({"w":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}})", 8), "'w'",
       "key 'dtype' appears twice"},
      {"unknown dtype", st_file(R"({"w":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", 8),
       "'w'", "unknown dtype 'F33'"},
      {"unsupported dtype", st_file(R"({"w":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", 8),
       "'w'", "dtype I64 is not supported"},
      {"bytes differ from the shape",
       st_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "'w'",
       "needs 12 bytes, its data_offsets [0, 8] hold 8"},
      {"element count overflows",
       st_file(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
       "'w'", "overflows"},
      {"byte count overflows",
       st_file(R"({"w":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", 8),
       "'w'", "overflows"},
      {"negative dim", st_file(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
       "'w'", "non-negative integers"},
      {"offsets beyond the data",
       st_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 8), "'w'",
       "beyond the data region (8 bytes"},
      {"offsets backwards", st_file(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", 8),
       "'w'", "end before they begin"},
      {"overlap",
       st_file(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           12),
       "'b'", "overlap tensor 'a'"},
      {"hole",
       st_file(
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
           12),
       "'b'", "leave a hole: bytes [4, 8)"},
      {"not starting at 0", st_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
       "'a'", "leave a hole: bytes [0, 4)"},
      {"bytes after the last tensor", st_file("{" + ok_entry + "}", 12), "'w'",
       "cover bytes [0, 8) of the data region, which has 12"},
      {"missing data_offsets", st_file(R"({"w":{"dtype":"F32","shape":[2]}})", 8), "'w'",
       "missing 'data_offsets'"},
      {"bad data_offsets", st_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8),
       "'w'", "'data_offsets' must be [begin, end]"},
      {"entry not an object", st_file(R"({"w":[1]})", 0), "'w'", "must be an object"},
      {"metadata not strings",
       st_file(R"({"__metadata__":{"k":1},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
               8),
       "", "'__metadata__' value of 'k' must be a string"},
      {"empty name", st_file(R"({"":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8), "",
       "empty name"},
  };
  for (const Bad& b : cases) {
    const std::string what = b.what;
    CAPTURE(what);
    write_file(path, b.bytes);
    const std::string e = error_of<InvalidArgument>([&] { ck::SafetensorsReader r(path); });
    CHECK_MESSAGE(contains(e, "safetensors file " + path), e);
    if (*b.tensor) CHECK_MESSAGE(contains(e, std::string("tensor ") + b.tensor), e);
    CHECK_MESSAGE(contains(e, b.text), e);
  }
  // The header size cap: refused before the header is read.
  write_file(path, st_file("{" + ok_entry + "}", 8));
  ck::SafetensorsLimits small;
  small.max_header_bytes = 16;
  const std::string e = error_of<InvalidArgument>([&] { ck::SafetensorsReader r(path, small); });
  CHECK(contains(e, "more than the limit of 16"));
  CHECK(contains(e, path));
  // A file that does not exist.
  const std::string e2 =
      error_of<InvalidArgument>([&] { ck::SafetensorsReader r(dir.sub("none.safetensors")); });
  CHECK(contains(e2, "none.safetensors: does not exist"));
  // The same bytes, well formed, are accepted (the cases differ from it by their defect only).
  ck::SafetensorsReader r(path);
  CHECK(r.tensor("w").bytes() == 8);
}

TEST_CASE("safetensors reader: every one-byte change and every truncation is read or refused") {
  // Never a crash, never another exception: each variant of a valid file either parses (and
  // then every tensor reads) or is refused with an InvalidArgument naming the file.
  TempDir dir;
  const std::string good = dir.sub("good.safetensors");
  write_specs(good, {{"format", "pt"}});
  const std::string bytes = read_file(good);
  const std::string path = dir.sub("v.safetensors");
  std::size_t header_end = 0;
  {
    ck::SafetensorsReader r(good);
    header_end = static_cast<std::size_t>(r.data_offset());
  }
  int accepted = 0, refused = 0, other = 0;
  auto attempt = [&](const std::string& v) {
    write_file(path, v);
    try {
      ck::SafetensorsReader r(path);
      std::vector<char> buf;
      for (const auto& t : r.tensors()) {
        buf.resize(static_cast<std::size_t>(t.bytes()));
        r.read(t, buf.data());
      }
      ++accepted;
    } catch (const InvalidArgument& e) {
      if (contains(e.what(), path))
        ++refused;
      else
        ++other;
    } catch (...) {
      ++other;
    }
  };
  for (std::size_t i = 0; i < header_end; ++i)
    for (unsigned char x : {0x00, 0x22, 0x5b, 0x7d, 0x31, 0xff}) {
      std::string v = bytes;
      if (static_cast<unsigned char>(v[i]) == x) continue;
      v[i] = static_cast<char>(x);
      attempt(v);
    }
  for (std::size_t n = 0; n < bytes.size(); n += 3)
    attempt(bytes.substr(0, n));
  CHECK(other == 0);
  CHECK(refused > 1000);
  CHECK(accepted > 0);  // a changed letter of a name or of the metadata is still a valid file
  MESSAGE("variants accepted " << accepted << ", refused " << refused);
}
