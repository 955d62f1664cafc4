// Model graphs from JSON files (schema: docs/graph-format.md).
#pragma once

#include <memory>
#include <string>

#include "fullshard/graph/module.hpp"

namespace fullshard::graph {

/// Builds the module tree described by `text`. Every module gets its json_path(); parameter
/// order is the order of the keys of each "params" object. Throws ConfigError
/// "<source>: <JSON path>: <problem>" on invalid JSON (with the byte position), unknown keys,
/// wrong types, bad shapes or dtypes, shapes whose size overflows, invalid or duplicate names,
/// out-of-range numbers, and graphs beyond the limits of docs/graph-format.md ("Limits":
/// kMaxModuleDepth, 1024 levels of JSON nesting, kMaxFqnBytes). Time and memory are linear in
/// the text's size; nothing recurses deeper than the limits.
std::unique_ptr<Module> parse_graph_json(const std::string& text,
                                         const std::string& source = "<string>");

/// parse_graph_json on the contents of the file at `path` (the path is the source name).
/// ConfigError naming the path when the file cannot be read.
std::unique_ptr<Module> load_graph_json(const std::string& path);

/// The tree as a document of the same schema, as JSON text (`indent` < 0: on one line, else
/// that many spaces per level); parse_graph_json(graph_to_json(m)) gives an equal tree
/// (names, order, parameter order, shapes, dtypes, requires_grad, costs, fully_shard
/// requests).
std::string graph_to_json(const Module& root, int indent = -1);

}  // namespace fullshard::graph
