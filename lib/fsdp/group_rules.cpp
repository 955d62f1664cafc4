#include "fullshard/fsdp/detail/group_rules.hpp"

#include "fullshard/base/error.hpp"

namespace fullshard::fsdp::detail {

std::string module_group_name(const graph::Module& m) {
  if (m.fqn().empty()) return "<root>";
  return m.fqn();
}

void throw_mixed_dtypes(const std::string& group, const graph::Parameter& first,
                        const graph::Parameter& p) {
  throw InvalidArgument("fully_shard(" + group + "): parameters '" + first.fqn() + "' (" +
                        dtype_name(first.dtype()) + ") and '" + p.fqn() + "' (" +
                        dtype_name(p.dtype()) +
                        ") have different dtypes; one communication group holds one dtype, so "
                        "give them separate fully_shard calls");
}

void throw_unknown_ignored_param(const std::string& group, const std::string& fqn) {
  throw InvalidArgument("fully_shard(" + group + "): ignored parameter '" + fqn +
                        "' does not exist in the module");
}

}  // namespace fullshard::fsdp::detail
