// A module's fully_shard request: the policy values' out-of-line parts and the request's JSON
// form (a graph file's "fully_shard" value).
#include "fullshard/graph/shard_request.hpp"

#include <limits>

#include "fullshard/base/error.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "lib/graph/json_forms.hpp"

namespace fullshard::graph {

std::string ReshardAfterForward::to_string() const {
  if (v_ == 0) return "automatic";
  if (v_ == -1) return "true";
  if (v_ == 1) return "false";
  return std::to_string(v_);
}

void ReshardAfterForward::refuse(int world, const std::string& group) const {
  if (v_ < -1) throw InvalidArgument("fully_shard(" + group + "): bad reshard_after_forward");
  throw InvalidArgument("fully_shard(" + group + "): reshard_after_forward=" + std::to_string(v_) +
                        " must divide the shard group size " + std::to_string(world));
}

nlohmann::json reshard_json(ReshardAfterForward value) {
  if (value.is_automatic()) return nullptr;
  if (value.reshards()) return true;
  if (value.keeps_unsharded()) return false;
  return value.value();
}

ReshardAfterForward reshard_from_json(const nlohmann::json& v, const std::string& path) {
  if (v.is_null()) return ReshardAfterForward::automatic();
  if (v.is_boolean()) return ReshardAfterForward(v.get<bool>());
  if (v.is_number_integer() && v.get<long long>() >= 1 &&
      v.get<long long>() <= std::numeric_limits<int>::max())
    return ReshardAfterForward::group_size(v.get<int>());
  throw ConfigError(path + ": expected true, false, null or an integer >= 1");
}

nlohmann::json compression_json(const CompressionPolicy& policy) {
  auto code = [](const std::optional<kernels::QuantCode>& c) {
    return c ? nlohmann::json(kernels::quant_code_name(*c)) : nlohmann::json(nullptr);
  };
  return {{"all_gather", code(policy.all_gather)},
          {"reduce_scatter", code(policy.reduce_scatter)},
          {"block", policy.block}};
}

namespace {

// "compression": {"all_gather": "int8" | "fp8_e4m3" | null, "reduce_scatter": "int8" | null,
// "block": int}; null or false: none.
CompressionPolicy compression_from_json(const nlohmann::json& v, const std::string& path) {
  CompressionPolicy c;
  if (v.is_null() || (v.is_boolean() && !v.get<bool>())) return c;
  if (!v.is_object())
    throw ConfigError(path +
                      ": expected null, false or an object with all_gather, "
                      "reduce_scatter, block");
  for (auto f = v.begin(); f != v.end(); ++f) {
    const std::string at = path + "." + f.key();
    const auto& x = f.value();
    if (f.key() == "all_gather" || f.key() == "reduce_scatter") {
      auto& code = f.key() == "all_gather" ? c.all_gather : c.reduce_scatter;
      if (x.is_null())
        code.reset();
      else if (x.is_string())
        code = kernels::parse_quant_code(x.get<std::string>(), at);
      else
        throw ConfigError(at + ": expected \"int8\", \"fp8_e4m3\" or null");
    } else if (f.key() == "block") {
      if (!x.is_number_integer() || x.get<long long>() < 8 || x.get<long long>() > (1 << 20))
        throw ConfigError(at + ": expected an integer from 8 to 1048576 (a power of two)");
      c.block = x.get<int>();
    } else {
      throw ConfigError(at +
                        ": unknown compression field (allowed: all_gather, reduce_scatter, "
                        "block)");
    }
  }
  return c;
}

// null or false: none; true or "cpu": CPUOffloadPolicy(); {"pin_memory": bool}.
std::optional<CPUOffloadPolicy> offload_from_json(const nlohmann::json& v,
                                                  const std::string& path) {
  if (v.is_null() || (v.is_boolean() && !v.get<bool>())) return std::nullopt;
  if ((v.is_boolean() && v.get<bool>()) || (v.is_string() && v == "cpu")) return CPUOffloadPolicy{};
  if (!v.is_object())
    throw ConfigError(path + ": expected null, true, false, \"cpu\" or {\"pin_memory\": bool}");
  CPUOffloadPolicy c;
  for (auto f = v.begin(); f != v.end(); ++f) {
    if (f.key() != "pin_memory")
      throw ConfigError(path + "." + f.key() +
                        ": unknown CPUOffloadPolicy field (allowed: pin_memory)");
    if (!f.value().is_boolean()) throw ConfigError(path + ".pin_memory: expected true or false");
    c.pin_memory = f.value().get<bool>();
  }
  return c;
}

// An array of FQN strings.
std::vector<std::string> fqns_from_json(const nlohmann::json& v, const std::string& path,
                                        const char* what) {
  if (!v.is_array()) throw ConfigError(path + ": expected an array of " + what + " FQNs");
  std::vector<std::string> out;
  out.reserve(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string())
      throw ConfigError(path + "[" + std::to_string(i) + "]: expected a " + what + " FQN string");
    out.push_back(v[i].get<std::string>());
  }
  return out;
}

}  // namespace

ShardRequest shard_request_from_json(const nlohmann::json& req, const std::string& where) {
  if (req.is_boolean()) return req.get<bool>() ? ShardRequest() : ShardRequest::never();
  if (!req.is_object()) throw ConfigError(where + ": expected true, false or an object of options");
  ShardRequest r;
  for (auto it = req.begin(); it != req.end(); ++it) {
    const std::string& key = it.key();
    const auto& v = it.value();
    const std::string path = where + "." + key;
    if (key == "reshard_after_forward") {
      r.reshard_after_forward = reshard_from_json(v, path);
    } else if (key == "param_dtype" || key == "reduce_dtype" || key == "output_dtype") {
      if (!v.is_string()) throw ConfigError(path + ": expected a dtype name such as \"bf16\"");
      (key == "param_dtype"    ? r.param_dtype
       : key == "reduce_dtype" ? r.reduce_dtype
                               : r.output_dtype) = parse_dtype(v.get<std::string>(), path);
    } else if (key == "ignored_params") {
      r.ignored_params = fqns_from_json(v, path, "parameter");
    } else if (key == "offload_policy") {
      r.offload_policy = offload_from_json(v, path);
    } else if (key == "compression") {
      r.compression = compression_from_json(v, path);
    } else if (key == "group_with") {
      if (!v.is_array() || v.empty())
        throw ConfigError(path +
                          ": expected a non-empty array of module FQNs (relative to the root)");
      r.group_with = fqns_from_json(v, path, "module");
    } else {
      throw ConfigError(path +
                        ": unknown fully_shard option (allowed: reshard_after_forward, "
                        "param_dtype, reduce_dtype, output_dtype, ignored_params, "
                        "offload_policy, compression, group_with)");
    }
  }
  return r;
}

nlohmann::json shard_request_json(const ShardRequest& r) {
  if (!r.shard) return false;
  if (r.sets_no_option() && r.group_with.empty()) return true;
  nlohmann::json j = nlohmann::json::object();
  if (r.reshard_after_forward) j["reshard_after_forward"] = reshard_json(*r.reshard_after_forward);
  if (r.param_dtype) j["param_dtype"] = dtype_name(*r.param_dtype);
  if (r.reduce_dtype) j["reduce_dtype"] = dtype_name(*r.reduce_dtype);
  if (r.output_dtype) j["output_dtype"] = dtype_name(*r.output_dtype);
  if (r.ignored_params) j["ignored_params"] = *r.ignored_params;
  if (r.offload_policy)
    j["offload_policy"] = *r.offload_policy
                              ? nlohmann::json{{"pin_memory", (*r.offload_policy)->pin_memory}}
                              : nlohmann::json(nullptr);
  if (r.compression) j["compression"] = compression_json(*r.compression);
  if (!r.group_with.empty()) j["group_with"] = r.group_with;
  return j;
}

}  // namespace fullshard::graph
