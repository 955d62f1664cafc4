// Model graphs from JSON files (schema: docs/graph-format.md).
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

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

/// The tree as a document of the same schema; parse_graph_json(graph_to_json(m).dump()) gives
/// an equal tree (names, order, shapes, dtypes, requires_grad, costs, fully_shard requests).
/// An ordered_json, so that parameter order survives dump(); it converts implicitly to
/// nlohmann::json, which sorts object keys and so loses parameter order.
nlohmann::ordered_json graph_to_json(const Module& root);

// The JSON form of a module's request (a graph file's "fully_shard" value; the keys of
// docs/graph-format.md). Errors are ConfigError "<path>.<key>: <problem>".

/// true, false or an object of options: reshard_after_forward (bool, null or int >= 1),
/// param_dtype, reduce_dtype, output_dtype (dtype names), ignored_params (array of FQNs),
/// offload_policy (null, false, true, "cpu" or {"pin_memory": bool}), compression
/// ({"all_gather": "int8" | "fp8_e4m3" | null, "reduce_scatter": "int8" | null, "block":
/// int}; null or false: none), group_with (array of FQNs).
ShardRequest shard_request_from_json(const nlohmann::json& value, const std::string& path);
/// The request as written in a graph file: true, false, or an object of the options it sets.
nlohmann::json shard_request_json(const ShardRequest& request);
/// reshard_after_forward as a request's value: true, false, null (automatic) or k.
nlohmann::json reshard_json(ReshardAfterForward value);
/// The value back from its JSON form; ConfigError "<path>: expected true, false, null or an
/// integer >= 1" for anything else.
ReshardAfterForward reshard_from_json(const nlohmann::json& value, const std::string& path);
/// A compression policy as a request's "compression" object.
nlohmann::json compression_json(const CompressionPolicy& policy);

}  // namespace fullshard::graph
