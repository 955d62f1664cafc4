// The checkpoint layer's building blocks, on one rank, against references computed here:
// - CRC32C: known answers (RFC 3720 B.4, "123456789"), continuation and combination, and the
//   SSE4.2 path equal to the table path on 64 KiB+ buffers at odd offsets and lengths;
// - BoxRuns: every element of random box intersections lands where an element-by-element
//   copy puts it, with the source fed in windows of any size; one run for slabs;
// - I/O errors name the file and the tensor (writes to /dev/full, reads of a directory);
// - the index checksum file: written by commit_step, checked by read_index_text, a flipped
//   byte is an error naming the index; begin_step creates a nested root.
#include <doctest/doctest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "error_check.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/checksum.hpp"
#include "fullshard/checkpoint/format.hpp"
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
  TempDir tmp;
  const ck::detail::File dir = ck::detail::File::open_read(tmp.path);  // reading it: EISDIR
  REQUIRE(dir.valid());
  char buf[8];
  const std::string msg = test::error_of<Error>([&] { dir.pread_all(buf, 8, 0, "l1.b"); });
  CHECK_MESSAGE(test::contains(msg, "read from '" + tmp.path + "'"), msg);
  CHECK_MESSAGE(test::contains(msg, "tensor 'l1.b'"), msg);
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
