// read_config / parse_config over a mesh (fullshard/session/config.hpp): the ranks agree on
// the configuration before anything is built.
#include <optional>
#include <utility>

#include "fullshard/base/error.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/session/config.hpp"
#include "lib/base/json_reader.hpp"
#include "lib/mesh/agreement.hpp"

namespace fullshard::session {

Config read_config(const DeviceMesh& mesh, const std::string& path) {
  std::string text, error;
  try {
    text = fullshard::read_text_file(path, "configuration");
  } catch (const Error& e) {
    error = e.message();
  }
  return parse_config(mesh, text, path, error);
}

Config parse_config(const DeviceMesh& mesh, const std::string& text, const std::string& source,
                    std::string read_error) {
  std::optional<Config> c;
  if (read_error.empty()) {
    try {
      c = parse_config(text, source);
    } catch (const ConfigError& e) {
      read_error = e.message();
    }
  }
  std::vector<std::string> items = {read_error.empty() ? std::string("configuration read")
                                                       : "configuration refused: " + read_error};
  if (c) items.insert(items.end(), c->canonical.begin(), c->canonical.end());
  agree_across_ranks(mesh, items, "the configuration " + source);
  if (!c) throw ConfigError(read_error);
  return std::move(*c);
}

}  // namespace fullshard::session
