// Fuzz target: the training session's configuration file (session::parse_config, the C API's
// and Fortran's too). Any input must either be accepted or refused with a fullshard::Error
// naming the file and the key; an accepted configuration must survive to_json and parse to the
// same canonical lines (what the ranks compare).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/session/config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace ss = fullshard::session;
  const std::string text(reinterpret_cast<const char*>(data), size);
  ss::Config c;
  try {
    c = ss::parse_config(text, "fuzz.json");
  } catch (const fullshard::Error&) {
    return 0;
  }
  const ss::Config again = ss::parse_config(ss::to_json(c), "round-trip.json");
  if (ss::canonical_lines(again) != ss::canonical_lines(c)) std::abort();
  return 0;
}
