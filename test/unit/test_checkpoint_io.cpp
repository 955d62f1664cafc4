// The checkpoint layer's building blocks, on one rank, against references computed here:
// - CRC32C: known answers (RFC 3720 B.4, "123456789"), continuation and combination, and the
//   SSE4.2 path equal to the table path on 64 KiB+ buffers at odd offsets and lengths;
// - BoxRuns: every element of random box intersections lands where an element-by-element
//   copy puts it, with the source fed in windows of any size; one run for slabs;
// - I/O errors name the file and the tensor (writes to /dev/full); a directory is not opened;
// - the index checksum file: written by commit_step, checked by read_index_text, a flipped
//   byte is an error naming the index; begin_step creates a nested root;
// - hostile indexes, re-signed so that their checksum matches: every field checked against
//   the others (overflowing offsets and sizes, block_bytes, checksum counts, overlaps, gaps),
//   metadata nested 100,000 deep, FIFOs, directories and devices in place of files: refused
//   by Reader, verify and convert with a message naming the file and the tensor, no crash,
//   no hang.
#include <doctest/doctest.h>

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "error_check.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/checksum.hpp"
#include "fullshard/checkpoint/format.hpp"
#include "lib/checkpoint/crc32c_variants.hpp"
#include "lib/checkpoint/index_json.hpp"
#include "lib/checkpoint/io.hpp"

using namespace fullshard;
namespace ck = fullshard::checkpoint;
namespace fs = std::filesystem;

namespace {

std::uint32_t crc_of(const std::string& s) {
  return ck::crc32c(s.data(), s.size());
}

std::vector<unsigned char> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v)
    b = static_cast<unsigned char>(g());
  return v;
}

// A fresh directory under $TMPDIR (or /tmp), removed at the end.
struct TempDir {
  std::string path;
  TempDir() {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/fullshard-ckpt-unit-XXXXXX";
    if (mkdtemp(tmpl.data())) path = tmpl;
    REQUIRE(!path.empty());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string read_file_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

}  // namespace

TEST_CASE("crc32c: known answers, continuation, combination") {
  CHECK(crc_of("123456789") == 0xe3069283u);
  CHECK(crc_of("") == 0u);
  CHECK(ck::crc32c(nullptr, 0, 0x12345678u) == 0x12345678u);
  // RFC 3720 B.4: 32 zero bytes, 32 0xff bytes, 0..31, 31..0.
  std::string zeros(32, '\0'), ones(32, '\xff'), up(32, '\0'), down(32, '\0');
  for (int i = 0; i < 32; ++i) {
    up[static_cast<std::size_t>(i)] = static_cast<char>(i);
    down[static_cast<std::size_t>(i)] = static_cast<char>(31 - i);
  }
  CHECK(crc_of(zeros) == 0x8a9136aau);
  CHECK(crc_of(ones) == 0x62a8ab43u);
  CHECK(crc_of(up) == 0x46dd794eu);
  CHECK(crc_of(down) == 0x113fdb5cu);
  CHECK(ck::detail::crc32c_table("123456789", 9) == 0xe3069283u);

  const auto data = random_bytes(100003, 1);
  const std::uint32_t whole = ck::crc32c(data.data(), data.size());
  for (std::size_t cut :
       {std::size_t{0}, std::size_t{1}, std::size_t{4095}, std::size_t{65536}, data.size()}) {
    CAPTURE(cut);
    const std::uint32_t a = ck::crc32c(data.data(), cut);
    const std::uint32_t b = ck::crc32c(data.data() + cut, data.size() - cut);
    CHECK(ck::crc32c(data.data() + cut, data.size() - cut, a) == whole);  // continuation
    CHECK(ck::crc32c_combine(a, b, data.size() - cut) == whole);
  }
}

TEST_CASE("crc32c: the machine's implementation equals the table one on large odd buffers") {
  MESSAGE("crc32c implementation: " << std::string(ck::crc32c_implementation()));
  const auto data = random_bytes((std::size_t{1} << 18) + 64, 2);
  for (std::size_t off : {0, 1, 3, 7, 13})
    for (std::size_t len : {std::size_t{65536}, std::size_t{65537}, std::size_t{3 * 8192 * 3 + 5},
                            std::size_t{200001}, (std::size_t{1} << 18) - 13}) {
      CAPTURE(off);
      CAPTURE(len);
      const unsigned char* p = data.data() + off;
      CHECK(ck::crc32c(p, len) == ck::detail::crc32c_table(p, len));
      CHECK(ck::crc32c(p, len, 0xdeadbeefu) == ck::detail::crc32c_table(p, len, 0xdeadbeefu));
    }
}

TEST_CASE("copy_crc32c: copies like memcpy and checksums like crc32c, at any alignment") {
  const auto data = random_bytes((std::size_t{1} << 18) + 64, 3);
  std::vector<unsigned char> out(data.size() + 64);
  for (std::size_t src_off : {0, 5, 16})
    for (std::size_t dst_off : {0, 3, 8, 17})
      for (std::size_t len :
           {std::size_t{0}, std::size_t{1}, std::size_t{63}, std::size_t{4097},
            std::size_t{6 * 8192}, std::size_t{6 * 8192 + 77}, (std::size_t{1} << 18) - 13}) {
        CAPTURE(src_off);
        CAPTURE(dst_off);
        CAPTURE(len);
        std::fill(out.begin(), out.end(), static_cast<unsigned char>(0xa5));
        const unsigned char* p = data.data() + src_off;
        CHECK(ck::detail::copy_crc32c(out.data() + dst_off, p, len, 0x1234u) ==
              ck::detail::crc32c_table(p, len, 0x1234u));
        CHECK(std::equal(p, p + len, out.begin() + static_cast<std::ptrdiff_t>(dst_off)));
        // Nothing outside [dst_off, dst_off + len) written.
        CHECK(std::all_of(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(dst_off),
                          [](unsigned char c) { return c == 0xa5; }));
        CHECK(std::all_of(out.begin() + static_cast<std::ptrdiff_t>(dst_off + len), out.end(),
                          [](unsigned char c) { return c == 0xa5; }));
      }
}

TEST_CASE("BoxRuns: random box intersections copy like an element-by-element copy") {
  std::mt19937 g(3);
  auto uniform = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(g);
  };
  int checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const std::size_t nd = static_cast<std::size_t>(uniform(1, 3));
    Shape global(nd);
    std::vector<std::int64_t> so(nd), doff(nd);
    Shape ss(nd), ds(nd);
    for (std::size_t d = 0; d < nd; ++d) {
      global[d] = uniform(1, 9);
      so[d] = uniform(0, global[d] - 1);
      ss[d] = uniform(1, global[d] - so[d]);
      doff[d] = uniform(0, global[d] - 1);
      ds[d] = uniform(1, global[d] - doff[d]);
    }
    // Spanning whole dims now and then, so that trailing dims merge into longer runs.
    if (trial % 3 == 0)
      for (std::size_t d = 1; d < nd; ++d) {
        so[d] = doff[d] = 0;
        ss[d] = ds[d] = global[d];
      }
    const std::size_t es = trial % 2 ? 4 : 2;
    const std::int64_t sn = numel(ss), dn = numel(ds);
    std::vector<unsigned char> src(static_cast<std::size_t>(sn) * es);
    for (std::size_t i = 0; i < src.size(); ++i)
      src[i] = static_cast<unsigned char>(i * 7 + 1);
    // Reference: every element of the source box inside the destination box.
    std::vector<unsigned char> want(static_cast<std::size_t>(dn) * es, 0);
    std::vector<std::int64_t> idx(nd, 0);
    for (std::int64_t e = 0; e < sn; ++e) {
      std::int64_t r = e, di = 0;
      bool inside = true;
      for (std::size_t d = nd; d-- > 0;) {
        idx[d] = r % ss[d];
        r /= ss[d];
      }
      for (std::size_t d = 0; d < nd; ++d) {
        const std::int64_t x = so[d] + idx[d] - doff[d];
        inside = inside && x >= 0 && x < ds[d];
        di = di * ds[d] + x;
      }
      if (inside)
        std::memcpy(&want[static_cast<std::size_t>(di) * es],
                    &src[static_cast<std::size_t>(e) * es], es);
    }
    // BoxRuns, fed the source in windows of a random size.
    ck::detail::BoxRuns runs(so, ss, doff, ds, es);
    std::vector<unsigned char> got(want.size(), 0);
    const std::uint64_t w = static_cast<std::uint64_t>(uniform(1, 40));
    for (std::uint64_t lo = 0; lo < src.size(); lo += w) {
      const std::uint64_t hi = std::min<std::uint64_t>(src.size(), lo + w);
      runs.copy(reinterpret_cast<const char*>(src.data()) + lo, lo, hi,
                reinterpret_cast<char*>(got.data()));
    }
    CHECK(runs.done());
    CHECK(got == want);
    // The vector form lists the same runs, in increasing order.
    const auto list = ck::detail::box_runs(so, ss, doff, ds, es);
    ck::detail::BoxRuns again(so, ss, doff, ds, es);
    CHECK(list.size() == again.count());
    for (std::size_t i = 1; i < list.size(); ++i)
      CHECK(list[i].src >= list[i - 1].src + list[i - 1].len);
    ++checked;
  }
  CHECK(checked == 300);
  // A dim-0 slab of a row-major tensor is one run; a column slab one per row.
  CHECK(ck::detail::BoxRuns({2, 0}, {3, 5}, {0, 0}, {8, 5}, 4).count() == 1);
  CHECK(ck::detail::BoxRuns({0, 1}, {8, 2}, {0, 0}, {8, 5}, 4).count() == 8);
  CHECK(ck::detail::BoxRuns({0, 0}, {8, 2}, {0, 3}, {8, 2}, 4).done());  // disjoint
}

TEST_CASE("I/O errors name the file and the tensor") {
  ck::detail::Fault none;
  if (fs::exists("/dev/full")) {
    ck::detail::DataFileWriter w("/dev/full", 4096, none);
    std::vector<char> data(100, 'x');
    ck::ShardInfo s;
    const std::string msg = test::error_of<Error>([&] { w.append(data.data(), 100, s, "l0.w"); });
    CHECK_MESSAGE(test::contains(msg, "'/dev/full'"), msg);
    CHECK_MESSAGE(test::contains(msg, "tensor 'l0.w'"), msg);
  }
  // Only regular files are opened for reading: a directory is refused at open, naming it.
  TempDir tmp;
  const std::string msg =
      test::error_of<InvalidArgument>([&] { (void)ck::File::open_read(tmp.path); });
  CHECK_MESSAGE(test::contains(msg, "'" + tmp.path + "' is a directory, not a regular file"), msg);
  CHECK_FALSE(ck::File::open_read(tmp.path + "/none").valid());  // missing: no error
}

TEST_CASE("index checksum: written with the index, checked on read, any flipped byte found") {
  TempDir tmp;
  const std::string root = tmp.path + "/a/b/root";  // created, parents included
  ck::detail::Fault none;
  const ck::detail::PendingStep p = ck::detail::begin_step(root, 4);
  const std::string text = "{\"step\": 4, \"metadata\": {\"loss\": 2.5}}\n";
  const std::string step_dir = ck::detail::commit_step(p, text, none);
  CHECK(step_dir == root + "/step-00000004");
  CHECK(ck::read_index_text(step_dir) == text);
  std::ifstream sum(step_dir + "/index.json.crc32c");
  std::string line;
  std::getline(sum, line);
  char want[64];
  std::snprintf(want, sizeof want, "crc32c %08x bytes %zu",
                static_cast<unsigned>(ck::crc32c(text.data(), text.size())), text.size());
  CHECK(line == want);
  for (std::size_t at : {std::size_t{9}, text.find("2.5"), text.size() - 1}) {
    CAPTURE(at);
    std::string bad = text;
    bad[at] = static_cast<char>(bad[at] ^ 0x01);
    std::ofstream(step_dir + "/index.json", std::ios::binary | std::ios::trunc) << bad;
    const std::string msg =
        test::error_of<InvalidArgument>([&] { (void)ck::read_index_text(step_dir); });
    CHECK_MESSAGE(test::contains(msg, step_dir + "/index.json does not match its checksum"), msg);
    CHECK_THROWS_AS((void)ck::resolve_step_dir(root), InvalidArgument);
  }
  // Without a checksum file (a checkpoint written before them): read unchecked.
  fs::remove(step_dir + "/index.json.crc32c");
  CHECK(ck::read_index_text(step_dir) != text);
}

// ---- Hostile indexes: one validator, checked arithmetic, depth bound, regular files only ----

namespace {

// A real two-file checkpoint written here without MPI: tensor "w" f32 (4, 3) as two Shard(0)
// slabs of 2 rows, one per file, and "b" f32 (5,) in file 0; block_bytes 16 (several CRCs per
// shard). Returns the step directory (the root is root/).
std::string write_small_checkpoint(const std::string& root) {
  ck::detail::Fault none;
  const ck::detail::PendingStep p = ck::detail::begin_step(root, 7);
  ck::Index x;
  x.kind = ck::Kind::sharded;
  x.step = 7;
  x.block_bytes = 16;
  x.metadata = R"({"loss":1.5})";
  std::vector<float> w(12), b(5);
  for (std::size_t i = 0; i < w.size(); ++i)
    w[i] = 0.5f * static_cast<float>(i);
  for (std::size_t i = 0; i < b.size(); ++i)
    b[i] = -1.0f - static_cast<float>(i);
  ck::TensorInfo tw{"w", "w", "", DType::f32, {4, 3}, Placement::Shard(0), {}};
  ck::TensorInfo tb{"b", "b", "", DType::f32, {5}, Placement::Shard(0), {}};
  for (int f = 0; f < 2; ++f) {
    const std::string name = "rank-0000" + std::to_string(f) + ".bin";
    ck::detail::DataFileWriter out(p.tmp + "/" + name, x.block_bytes, none);
    ck::ShardInfo s;
    s.file = static_cast<std::size_t>(f);
    s.global_offset = {2 * f, 0};
    s.shape = {2, 3};
    out.append(w.data() + 6 * f, 24, s, "w");
    tw.shards.push_back(s);
    if (f == 0) {
      ck::ShardInfo sb;
      sb.global_offset = {0};
      sb.shape = {5};
      out.append(b.data(), 20, sb, "b");
      tb.shards.push_back(sb);
    }
    out.finish();
    x.files.push_back({name, out.bytes()});
  }
  x.tensors = {tb, tw};
  std::map<std::string, std::pair<DType, Shape>> params{{"b", {DType::f32, {5}}},
                                                        {"w", {DType::f32, {4, 3}}}};
  x.model_fingerprint = ck::model_fingerprint(params);
  return ck::detail::commit_step(p, ck::to_json(x).dump(1) + "\n", none);
}

// Rewrites step_dir/index.json as `text` and re-signs it (index.json.crc32c matches): only the
// validator can tell.
void write_signed_index(const std::string& step_dir, const std::string& text) {
  std::ofstream(step_dir + "/index.json", std::ios::binary | std::ios::trunc) << text;
  std::ofstream(step_dir + "/index.json.crc32c", std::ios::binary | std::ios::trunc)
      << ck::detail::index_checksum_text(text);
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

// Every reader of a checkpoint refuses it with a message holding every one of `parts`:
// Reader (fullshard-ckpt inspect, and what load and convert use), verify (one issue, about
// the index file), convert.
void expect_refused(const std::string& root, const std::string& step_dir,
                    const std::vector<std::string>& parts) {
  const std::string msg = test::error_of<InvalidArgument>([&] { ck::Reader r(root); });
  for (const std::string& p : parts)
    CHECK_MESSAGE(test::contains(msg, p), "'" << p << "' not in: " << msg);
  const std::vector<ck::VerifyIssue> issues = ck::verify(root);
  REQUIRE(issues.size() == 1);
  CHECK(issues[0].file == step_dir + "/index.json");
  for (const std::string& p : parts)
    CHECK_MESSAGE(test::contains(issues[0].message, p),
                  "'" << p << "' not in: " << issues[0].message);
  const std::string conv = test::error_of<InvalidArgument>(
      [&] { ck::convert(root, root + "-converted", ck::ConvertOptions{}); });
  for (const std::string& p : parts)
    CHECK_MESSAGE(test::contains(conv, p), "'" << p << "' not in: " << conv);
  CHECK_FALSE(fs::exists(root + "-converted/latest"));
}

}  // namespace

TEST_CASE("hostile index: every field is checked against the others before use") {
  TempDir tmp;
  const std::string root = tmp.path + "/c";
  const std::string step_dir = write_small_checkpoint(root);
  const nlohmann::json good = read_json(step_dir + "/index.json");
  REQUIRE(ck::verify(root).empty());
  {  // the untouched checkpoint reads back exactly
    ck::Reader r(root);
    std::vector<float> w(12);
    r.read_full(r.tensor("w"), w.data());
    for (std::size_t i = 0; i < w.size(); ++i)
      CHECK(w[i] == 0.5f * static_cast<float>(i));
  }
  const std::string index = step_dir + "/index.json";
  const std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  // Tensor 1 is "w" (shards 0 and 1), tensor 0 is "b".
  auto shard = [](nlohmann::json& j, int s) -> nlohmann::json& {
    return j["tensors"][1]["shards"][s];
  };
  struct Case {
    const char* what;
    std::function<void(nlohmann::json&)> edit;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {"a global offset whose sum with the shape overflows",
       [&](nlohmann::json& j) {
         shard(j, 1)["global_offset"] = {kMax, 0};
       },
       {index, "tensor 'w'", "shard #1 at (9223372036854775807, 0) of shape (2, 3)",
        "lies outside the global shape (4, 3)"}},
      {"a shard just past its tensor",
       [&](nlohmann::json& j) {
         shard(j, 1)["global_offset"] = {3, 0};
       },
       {index, "tensor 'w'", "lies outside the global shape (4, 3)"}},
      {"block_bytes 2^64-1 and empty checksum lists (the block count wrapped to 0)",
       [&](nlohmann::json& j) {
         j["block_bytes"] = std::numeric_limits<std::uint64_t>::max();
         for (auto& t : j["tensors"])
           for (auto& s : t["shards"])
             s["crc32c"] = nlohmann::json::array();
       },
       {index, "'block_bytes' must be in [1, 1073741824], got 18446744073709551615"}},
      {"block_bytes 0",
       [&](nlohmann::json& j) { j["block_bytes"] = 0; },
       {index, "'block_bytes' must be in [1, 1073741824], got 0"}},
      {"a checksum list shorter than the block count",
       [&](nlohmann::json& j) { shard(j, 0)["crc32c"].erase(0); },
       {index, "tensor 'w'", "shard #0 of 24 bytes has 1 checksums, expected 2"}},
      {"shapes whose element count overflows (2^32 x 2^32 counted as 0 elements)",
       [&](nlohmann::json& j) {
         j["tensors"][1]["global_shape"] = {4294967296ll, 4294967296ll};
         shard(j, 0)["shape"] = {4294967296ll, 4294967296ll};
       },
       {index, "tensor 'w'", "global shape (4294967296, 4294967296)",
        "more bytes than a 64-bit size holds"}},
      {"a byte range that wraps around the end of the file",
       [&](nlohmann::json& j) {
         shard(j, 0)["offset"] = std::numeric_limits<std::uint64_t>::max() - 7;
       },
       {index, "tensor 'w'", "lies beyond the end of file 'rank-00000.bin'"}},
      {"a length that does not match the shape",
       [&](nlohmann::json& j) { shard(j, 0)["length"] = 25; },
       {index, "tensor 'w'", "has length 25, expected 24"}},
      {"overlapping shards",
       [&](nlohmann::json& j) {
         shard(j, 1)["global_offset"] = {1, 0};
       },
       {index, "tensor 'w'", "two of its shards overlap"}},
      {"a gap",
       [&](nlohmann::json& j) { j["tensors"][1]["shards"].erase(1); },
       {index, "tensor 'w'", "its shards hold 6 elements, the global shape (4, 3) has 12"}},
      {"an unknown dtype",
       [&](nlohmann::json& j) { j["tensors"][1]["dtype"] = "f128"; },
       {index, "tensor 'w'", "unknown dtype 'f128'"}},
      {"a negative dim",
       [&](nlohmann::json& j) {
         shard(j, 0)["shape"] = {-2, 3};
       },
       {index, "tensor 'w'", "'shape' must hold non-negative integers"}},
      {"a file that is not listed",
       [&](nlohmann::json& j) { shard(j, 1)["file"] = 7; },
       {index, "tensor 'w'", "shard #1 names file #7 of 2"}},
      {"a huge file number",
       [&](nlohmann::json& j) { shard(j, 1)["file"] = 18446744073709551615ull; },
       {index, "tensor 'w'", "names file #"}},
      {"dims that do not match the tensor's",
       [&](nlohmann::json& j) { shard(j, 1)["global_offset"] = {2}; },
       {index, "tensor 'w'", "must have 2 dims"}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    nlohmann::json j = good;
    c.edit(j);
    write_signed_index(step_dir, j.dump(1));
    expect_refused(root, step_dir, c.parts);
  }
  // validate_index is what a Reader given an index from elsewhere (a broadcast) runs too.
  ck::Index bad = ck::index_from_json(good, index);
  bad.tensors[1].shards[1].global_offset = {kMax, 0};
  const std::string msg = test::error_of<InvalidArgument>([&] { ck::Reader r(step_dir, bad); });
  CHECK_MESSAGE(test::contains(msg, "lies outside the global shape"), msg);
  write_signed_index(step_dir, good.dump(1));
  CHECK(ck::verify(root).empty());
}

TEST_CASE("hostile index: nesting deeper than the limit is refused before parsing") {
  // The scan skips brackets inside strings, escaped quotes included.
  CHECK(ck::detail::json_depth_exceeded(R"({"a": [[1]], "s": "[[[[{{{{\"[[["})", 3) ==
        std::string::npos);
  CHECK(ck::detail::json_depth_exceeded(R"({"a": [[[1]]]})", 3) == 8);
  CHECK(ck::detail::json_depth_exceeded(R"([[], [], [[]]])", 3) == std::string::npos);
  CHECK(ck::detail::json_depth_exceeded(R"([[], [], [[]]])", 2) == 10);
  CHECK(ck::detail::json_depth_exceeded(R"([[], [], [[[]]]])", 3) == 11);
  nlohmann::json deep = nlohmann::json::array();
  for (std::size_t i = 1; i < ck::kMaxMetadataDepth; ++i)
    deep = nlohmann::json::array({deep});
  CHECK(ck::detail::json_depth_exceeded(deep.dump(), ck::kMaxMetadataDepth) == std::string::npos);
  deep = nlohmann::json::object({{"k", deep}});
  // {"k":[[...: the innermost [ is the first one deeper than the limit.
  CHECK(ck::detail::json_depth_exceeded(deep.dump(), ck::kMaxMetadataDepth) ==
        4 + ck::kMaxMetadataDepth);

  TempDir tmp;
  const std::string root = tmp.path + "/c";
  const std::string step_dir = write_small_checkpoint(root);
  const std::string good = read_file_text(step_dir + "/index.json");
  // Metadata nested 100,000 deep (a recursive copy or dump() of it overflows the stack).
  const std::string meta = "\"metadata\": {\"loss\": 1.5}";
  std::string text = good;
  const auto at = text.find("\"metadata\"");
  REQUIRE(at != std::string::npos);
  const auto end = text.find('}', at);
  text.replace(at, end + 1 - at,
               "\"metadata\": " + std::string(100000, '[') + std::string(100000, ']'));
  write_signed_index(step_dir, text);
  expect_refused(root, step_dir,
                 {step_dir + "/index.json", "JSON nested deeper than 257 levels", "at byte"});
  // The deepest metadata allowed reads (and its index is 257 deep).
  text = good;
  text.replace(at, end + 1 - at,
               "\"metadata\": " + std::string(ck::kMaxMetadataDepth, '[') +
                   std::string(ck::kMaxMetadataDepth, ']'));
  write_signed_index(step_dir, text);
  CHECK(ck::verify(root).empty());
  CHECK(nlohmann::json::parse(ck::Reader(root).index().metadata).is_array());
}

TEST_CASE("hostile files: a FIFO, a directory or a device in place of a checkpoint file") {
  TempDir tmp;
  const std::string root = tmp.path + "/c";
  const std::string step_dir = write_small_checkpoint(root);
  auto replace_with_fifo = [](const std::string& path) {
    fs::rename(path, path + ".saved");
    REQUIRE(::mkfifo(path.c_str(), 0644) == 0);
  };
  auto put_back = [](const std::string& path) {
    fs::remove(path);
    fs::rename(path + ".saved", path);
  };
  // Each would block open() forever without the check (no writer ever comes).
  SUBCASE("index.json") {
    replace_with_fifo(step_dir + "/index.json");
    const std::string msg = test::error_of<InvalidArgument>([&] { ck::Reader r(root); });
    CHECK_MESSAGE(test::contains(msg, "'" + step_dir + "/index.json' is a FIFO"), msg);
    const auto issues = ck::verify(root);
    REQUIRE(issues.size() == 1);
    CHECK(test::contains(issues[0].message, "is a FIFO, not a regular file"));
    put_back(step_dir + "/index.json");
  }
  SUBCASE("index.json.crc32c") {
    replace_with_fifo(step_dir + "/index.json.crc32c");
    const std::string msg = test::error_of<InvalidArgument>([&] { ck::Reader r(root); });
    CHECK_MESSAGE(test::contains(msg, "index.json.crc32c' is a FIFO"), msg);
    put_back(step_dir + "/index.json.crc32c");
  }
  SUBCASE("a rank file") {
    const std::string file = step_dir + "/rank-00001.bin";
    replace_with_fifo(file);
    ck::Reader r(root);
    std::vector<float> w(12);
    const std::string msg =
        test::error_of<InvalidArgument>([&] { r.read_full(r.tensor("w"), w.data()); });
    CHECK_MESSAGE(test::contains(msg, "'" + file + "' is a FIFO"), msg);
    CHECK_MESSAGE(test::contains(msg, "(needed for tensor 'w')"), msg);
    const auto issues = ck::verify(root);
    REQUIRE(issues.size() == 1);
    CHECK(issues[0].file == file);
    CHECK(issues[0].tensor == "w");
    CHECK_MESSAGE(test::contains(issues[0].message, "is a FIFO"), issues[0].message);
    put_back(file);
  }
  SUBCASE("latest") {
    replace_with_fifo(root + "/latest");
    const std::string msg = test::error_of<InvalidArgument>([&] { ck::Reader r(root); });
    CHECK_MESSAGE(test::contains(msg, "'" + root + "/latest' is a FIFO"), msg);
    CHECK_THROWS_AS(ck::verify(root), InvalidArgument);
    put_back(root + "/latest");
  }
  SUBCASE("a directory and a device") {
    const std::string file = step_dir + "/rank-00000.bin";
    fs::rename(file, file + ".saved");
    fs::create_directory(file);
    auto issues = ck::verify(root);
    REQUIRE(issues.size() == 1);
    CHECK_MESSAGE(test::contains(issues[0].message, "is a directory"), issues[0].message);
    fs::remove(file);
    if (fs::exists("/dev/zero")) {
      fs::create_symlink("/dev/zero", file);
      issues = ck::verify(root);
      REQUIRE(issues.size() == 1);
      CHECK_MESSAGE(test::contains(issues[0].message, "is a device"), issues[0].message);
      fs::remove(file);
    }
    fs::rename(file + ".saved", file);
  }
  CHECK(ck::verify(root).empty());
}

TEST_CASE("hostile index: a layout of many non-slab shards is refused, a small one checked") {
  // An n x n tensor of n*n single-element shards: not slabs along one dim, so compared pairwise.
  auto index_of = [](int n) {
    nlohmann::json shards = nlohmann::json::array();
    for (int k = 0; k < n * n; ++k)
      shards.push_back({{"file", 0},
                        {"offset", 4 * k},
                        {"length", 4},
                        {"global_offset", {k / n, k % n}},
                        {"shape", {1, 1}},
                        {"crc32c", {0u}}});
    return nlohmann::json{{"format", "fullshard-checkpoint"},
                          {"format_version", ck::kFormatVersion},
                          {"kind", "sharded"},
                          {"step", 1},
                          {"model_fingerprint", "0"},
                          {"checksum", "crc32c"},
                          {"block_bytes", 1024},
                          {"metadata", nlohmann::json::object()},
                          {"rng_state", ""},
                          {"optimizer", nullptr},
                          {"files", {{{"name", "rank-00000.bin"}, {"bytes", 4 * n * n}}}},
                          {"tensors",
                           {{{"name", "w"},
                             {"param", "w"},
                             {"state", ""},
                             {"dtype", "f32"},
                             {"global_shape", {n, n}},
                             {"placement", "Shard(0)"},
                             {"shards", shards}}}}};
  };
  CHECK(ck::index_from_json(index_of(3), "x/index.json").tensors[0].shards.size() == 9);
  nlohmann::json overlap = index_of(3);
  overlap["tensors"][0]["shards"][4]["global_offset"] = {0, 0};  // (1, 1) left uncovered
  const std::string msg =
      test::error_of<InvalidArgument>([&] { (void)ck::index_from_json(overlap, "x/index.json"); });
  CHECK_MESSAGE(test::contains(msg, "tensor 'w': two of its shards overlap"), msg);
  const std::string many = test::error_of<InvalidArgument>(
      [&] { (void)ck::index_from_json(index_of(130), "x/index.json"); });
  CHECK_MESSAGE(test::contains(many,
                               "its 16900 non-empty shards are not slabs along one dim; "
                               "at most 16384"),
                many);
}
