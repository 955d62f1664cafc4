// Fuzz target: the cost-model JSON (CostModel::parse_json). Any input must either load or be
// refused with a fullshard::Error; a loaded model must survive to_json and load again equal.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/schedule/cost_model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using fullshard::schedule::CostModel;
  const std::string text(reinterpret_cast<const char*>(data), size);
  const CostModel base = CostModel::defaults(fullshard::schedule::MeshShape::hsdp(2, 2));
  CostModel c;
  try {
    c = CostModel::parse_json(text, base, "fuzz.json");
  } catch (const fullshard::Error&) {
    return 0;
  }
  if (!(CostModel::parse_json(c.to_json(), base, "round-trip.json") == c)) std::abort();
  return 0;
}
