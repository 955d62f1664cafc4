// The strict JSON reader shared by the graph loader and the cost-model loader: nlohmann's
// iterative SAX parser feeding a DOM builder that refuses what nlohmann's own parse() would
// let through or crash on. For fullshard's own loaders (graph, cost model, checkpoint index):
// a detail, not part of the user API.
//
// - Duplicate keys in one object (nlohmann keeps the last one silently) are refused.
// - Nesting deeper than a limit is refused before it is built, so that the recursive parts of
//   nlohmann (copies, conversions, dump) and of the readers stay bounded.
// - Numbers out of range ("1e999") are refused naming the JSON path.
// - Time and memory are linear in the text: objects are filled without nlohmann's linear key
//   lookup (ordered_map::emplace scans the keys) and without its callback parser (which rescans
//   the parent container after every child), and paths are only built for an error.
//
// Every error is a ConfigError "<source>: <JSON path>: <problem>" (the path left out at the top
// level); syntax errors keep the historical "<source>: invalid JSON at byte N: ..." form and
// name the path after it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "fullshard/base/text_file.hpp"

namespace fullshard::detail {

struct JsonLimits {
  /// Objects and arrays nest at most this deep (the top-level value is depth 1).
  std::size_t max_depth = 1024;
  /// When set: at most `max_nested_key` containers that are values of key `nested_key` on one
  /// path (the graph's "modules" arrays); `nested_key_problem` is the error.
  std::string nested_key;
  std::size_t max_nested_key = 0;
  std::string nested_key_problem;
  /// Duplicate keys in an object that is the value of key `first` are "duplicate <second>
  /// '<key>'" (e.g. {"params", "parameter name"}); elsewhere "duplicate key '<key>'".
  std::vector<std::pair<std::string, std::string>> duplicate_words;
};

/// Parses `text` (the whole of it) as described above.
nlohmann::ordered_json parse_json_strict(const std::string& text, const std::string& source,
                                         const JsonLimits& limits = JsonLimits());

/// "path.key" ("key" at the top level); a key that is not plain printable ASCII, or holds
/// '.', '[', ']' or '"', is written as a JSON string ("m\u00001").
std::string json_member(const std::string& path, const std::string& key);
/// "path[i]".
std::string json_element(const std::string& path, std::size_t i);
/// 'key' for plain printable ASCII, else the key as an escaped JSON string; cut after 80 bytes.
std::string json_key_shown(const std::string& key);

}  // namespace fullshard::detail
