// The JSON documents of a graph and of a module's fully_shard request (the graph file's forms,
// docs/graph-format.md), for the library's writers and readers; users get the text
// (graph_to_json, fullshard/graph/json_graph.hpp).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "fullshard/graph/module.hpp"

namespace fullshard::graph {

/// graph_to_json's document: an ordered_json, so that parameter order survives dump() (a
/// conversion to nlohmann::json sorts object keys and so loses parameter order).
nlohmann::ordered_json graph_document(const Module& root);

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
