// Fuzz target: the checkpoint index parser and validator (checkpoint::parse_index). Any input
// must either be accepted or refused with a fullshard::Error; an accepted index must survive
// to_json and be accepted again with the same fingerprint.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/checkpoint/format.hpp"
#include "lib/checkpoint/index_json.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace ck = fullshard::checkpoint;
  const std::string text(reinterpret_cast<const char*>(data), size);
  ck::Index index;
  try {
    index = ck::parse_index(text, "fuzz/index.json");
  } catch (const fullshard::Error&) {
    return 0;
  }
  const ck::Index again = ck::parse_index(ck::to_json(index).dump(), "round-trip/index.json");
  if (ck::model_fingerprint(again) != ck::model_fingerprint(index) ||
      again.tensors.size() != index.tensors.size() || again.files.size() != index.files.size())
    std::abort();
  return 0;
}
