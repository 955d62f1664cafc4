// An index and its JSON document (the schema of docs/checkpoint-format.md): the writers build
// the document, the readers parse the text (parse_index, fullshard/checkpoint/format.hpp).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "fullshard/checkpoint/format.hpp"

namespace fullshard::checkpoint {

/// The index as JSON (the schema of docs/checkpoint-format.md).
nlohmann::json to_json(const Index& index);
/// Parses an index (types field by field) and validates it (validate_index).
Index index_from_json(const nlohmann::json& j, const std::string& where);

}  // namespace fullshard::checkpoint
