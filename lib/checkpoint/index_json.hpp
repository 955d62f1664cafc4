// An index and its JSON document (the schema of docs/checkpoint-format.md): the writers build
// the document, the readers parse the text (parse_index, fullshard/checkpoint/format.hpp).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "fullshard/checkpoint/format.hpp"

namespace fullshard::checkpoint {

/// A caller's metadata text as a document: "" is {}; InvalidArgument "<who>: the metadata
/// nests arrays and objects deeper than kMaxMetadataDepth levels" (checked on the text, before
/// it is parsed) or "<who>: the metadata is not a JSON text: ..." (the strict reader's
/// errors: syntax, a key twice in one object, invalid UTF-8). checkpoint::save, the index
/// writer and the session's set_checkpoint_metadata read metadata this one way.
nlohmann::json parse_metadata(const std::string& text, const std::string& who);
/// The index as JSON (the schema of docs/checkpoint-format.md).
nlohmann::json to_json(const Index& index);
/// Parses an index (types field by field) and validates it (validate_index).
Index index_from_json(const nlohmann::json& j, const std::string& where);

}  // namespace fullshard::checkpoint
