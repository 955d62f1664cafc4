// checkpoint::check_torchscript_archive on the fuzz corpus's archives (test/fuzz/corpus/
// torchscript_archive): a file torch.jit.save wrote (PyTorch 1.13) is accepted with its folder,
// records and storages; each kind of bad file is refused naming the file and the record.
#include <doctest/doctest.h>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "lib/checkpoint/torchscript_archive.hpp"

namespace ck = fullshard::checkpoint;

namespace {

const std::string kCorpus = FULLSHARD_TORCHSCRIPT_CORPUS;

std::string refusal(const std::string& name) {
  try {
    ck::check_torchscript_archive(kCorpus + "/" + name);
  } catch (const fullshard::IoError& e) {
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST_CASE("torchscript archive: a file of torch.jit.save is accepted, with what it declares") {
  // seq.pt: test/capi/make_torchscript.py's nn.Sequential of three Block(5) (a Linear(5, 5)
  // each: weight and bias), its code records deflated.
  const ck::TorchScriptArchive a = ck::check_torchscript_archive(kCorpus + "/seq.pt");
  CHECK(a.prefix == "seq");
  CHECK(a.storages == 6);
  CHECK(a.storage_bytes == 3 * (5 * 5 + 5) * 4);
  CHECK(a.records > 4);
  // The same bytes from memory.
  std::ifstream in(kCorpus + "/seq.pt", std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  CHECK(ck::check_torchscript_archive(bytes.data(), bytes.size(), "seq.pt").storages == 6);
  // Cut anywhere, it is refused (never read past its end).
  for (std::size_t cut : {std::size_t(0), std::size_t(21), bytes.size() / 2, bytes.size() - 1})
    CHECK_THROWS_AS(ck::check_torchscript_archive(bytes.data(), cut, "cut.pt"), fullshard::IoError);
}

TEST_CASE("torchscript archive: bad files are refused naming the file and the record") {
  CHECK(refusal("short_record.pt")
            .find("short_record.pt': record 'seq/data/0' holds 4 bytes, but its storage declares "
                  "100 (torch.FloatStorage x 25)") != std::string::npos);
  CHECK(
      refusal("case_twins.pt").find("appears twice (names are compared without regard to case)") !=
      std::string::npos);
  // Deep nesting and many copies of one string: refused or accepted, quickly, without a crash.
  CHECK(!refusal("deep_tuples.pt").empty());
  CHECK(!refusal("many_dups.pt").empty());
  CHECK(refusal("nowhere.pt").find("nowhere.pt': cannot open it") != std::string::npos);
}
