// Fuzz target: the TorchScript archive check (checkpoint::check_torchscript_archive), which
// reads a zip's central directory and its pickles before LibTorch does. Any input must either
// be accepted or refused with a fullshard::Error; an accepted archive's declared storage bytes
// must fit in the input (every storage's record was checked to be inside it).
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "fullshard/base/error.hpp"
#include "lib/checkpoint/torchscript_archive.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace ck = fullshard::checkpoint;
  ck::TorchScriptLimits limits;
  limits.max_records = 4096;
  limits.max_pickle_bytes = 1 << 20;
  ck::TorchScriptArchive a;
  try {
    a = ck::check_torchscript_archive(data, size, "fuzz.pt", limits);
  } catch (const fullshard::Error&) {
    return 0;
  }
  if (a.prefix.empty() || a.records < 1 || a.storages < 0 || a.storage_bytes < 0) std::abort();
  // Storages may share a record (views of one storage), so only each one fits, not their sum.
  return 0;
}
