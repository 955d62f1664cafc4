#include "lib/fsdp/group_rules.hpp"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "fullshard/base/error.hpp"
#include "fullshard/fsdp/fully_shard.hpp"

namespace fullshard::fsdp::detail {

const std::string& module_group_name(const graph::Module& m) {
  static const std::string root = "<root>";
  return m.fqn().empty() ? root : m.fqn();
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

namespace {

bool declares_list(const graph::Module& m) {
  const graph::ShardRequest* r = m.fully_shard_request();
  return r && r->shard && !r->group_with.empty();
}

bool any_list(const graph::Module& m) {
  if (declares_list(m)) return true;
  for (std::size_t i = 0; i < m.num_children(); ++i)
    if (any_list(m.child(i))) return true;
  return false;
}

bool is_ancestor(const graph::Module& up, const graph::Module& m) {
  for (const graph::Module* p = m.parent(); p; p = p->parent())
    if (p == &up) return true;
  return false;
}

}  // namespace

std::vector<GraphListGroup> graph_list_groups(const graph::Module& root) {
  std::vector<GraphListGroup> lists;
  if (!any_list(root)) return lists;
  auto& graph = const_cast<graph::Module&>(root);  // (read only: the walks are non-const)
  std::unordered_map<const graph::Module*, std::size_t> list_of;  // member -> its list
  std::vector<std::string> paths;                                 // each list's group_with
  for (graph::Module* m : graph.modules_preorder()) {
    if (!declares_list(*m)) continue;
    const std::string path = request_path(*m) + ".group_with";
    const std::vector<std::string>& with = m->fully_shard_request()->group_with;
    GraphListGroup g;
    g.modules.push_back(m);
    if (list_of.count(m))
      throw ConfigError(path + ": module '" + module_group_name(*m) +
                        "' is already in the list group of '" +
                        module_group_name(*lists[list_of.at(m)].modules.front()) + "'");
    list_of.emplace(m, lists.size());
    for (std::size_t i = 0; i < with.size(); ++i) {
      const std::string at = path + "[" + std::to_string(i) + "]";
      const std::string& fqn = with[i];
      const graph::Module* w = graph.find_module(fqn);
      if (!w) throw ConfigError(at + ": no module " + graph::quoted_name(fqn) + " in the graph");
      if (std::find(g.modules.begin(), g.modules.end(), w) != g.modules.end())
        throw ConfigError(at + ": module '" + module_group_name(*w) +
                          "' is listed twice in this group");
      if (list_of.count(w))
        throw ConfigError(at + ": module '" + module_group_name(*w) +
                          "' is already in the list group of '" +
                          module_group_name(*lists[list_of.at(w)].modules.front()) + "'");
      if (w->requests_fully_shard())
        throw ConfigError(at + ": module '" + module_group_name(*w) +
                          "' has its own fully_shard request (" + request_path(*w) +
                          "); a module is in one fully_shard call");
      list_of.emplace(w, lists.size());
      g.modules.push_back(w);
    }
    lists.push_back(std::move(g));
    paths.push_back(path);
  }
  // Where each list is formed: its module met last in post-order.
  std::unordered_map<const graph::Module*, std::size_t> post;
  {
    std::size_t i = 0;
    for (graph::Module* m : graph.modules_postorder())
      if (list_of.count(m)) post.emplace(m, i++);
  }
  const auto requesting = [&](const graph::Module& m) {
    return m.requests_fully_shard() || list_of.count(&m) != 0;
  };
  for (std::size_t l = 0; l < lists.size(); ++l) {
    GraphListGroup& g = lists[l];
    const std::string& path = paths[l];
    g.last = *std::max_element(g.modules.begin(), g.modules.end(),
                               [&](auto* a, auto* b) { return post.at(a) < post.at(b); });
    // (Every requested ancestor of a module but the last holds the last too, so all of
    // them lie under the same outermost one.)
    for (const graph::Module* mp : g.modules) {
      const graph::Module& m = *mp;
      const graph::Module* outermost = nullptr;
      for (const graph::Module* up = m.parent(); up; up = up->parent()) {
        if (list_of.count(up) && list_of.at(up) == l)
          throw ConfigError(path + ": module '" + module_group_name(m) + "' is inside module '" +
                            module_group_name(*up) + "', also in this group");
        if (!requesting(*up)) continue;
        outermost = up;
        if (&m != g.last && !is_ancestor(*up, *g.last))
          throw ConfigError(path + ": module '" + module_group_name(*up) +
                            "' is fully_shard'ed and holds '" + module_group_name(m) +
                            "' of this group but not '" + module_group_name(*g.last) +
                            "': its group would take their parameters first (fully_shard "
                            "applies bottom-up)");
      }
      if (!outermost)
        throw ConfigError(path + ": module '" + module_group_name(m) +
                          "' is under no fully_shard'ed module; a list group lies under one "
                          "(usually the root: give the root \"fully_shard\": true)");
    }
  }
  return lists;
}

}  // namespace fullshard::fsdp::detail
