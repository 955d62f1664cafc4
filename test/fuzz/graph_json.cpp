// Fuzz target: the graph JSON loader (docs/graph-format.md) and what consumes a loaded graph.
// Any input must either load or be refused with a fullshard::Error; a loaded graph must survive
// graph_to_json and load again to the same tree, and group planning must either plan it or
// refuse it with an Error. Anything else (a crash, a sanitizer report, another exception, a
// round trip that differs) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "fullshard/schedule/groups.hpp"

namespace {

bool same_request(const fullshard::graph::ShardRequest* a,
                  const fullshard::graph::ShardRequest* b) {
  return a == nullptr ? b == nullptr : b != nullptr && *a == *b;
}

void same_tree(const fullshard::graph::Module& a, const fullshard::graph::Module& b) {
  if (a.name() != b.name() || a.num_params() != b.num_params() ||
      a.num_children() != b.num_children() ||
      !same_request(a.fully_shard_request(), b.fully_shard_request()))
    std::abort();
  for (std::size_t i = 0; i < a.num_params(); ++i)
    if (a.param(i).fqn() != b.param(i).fqn() || a.param(i).shape() != b.param(i).shape() ||
        a.param(i).dtype() != b.param(i).dtype())
      std::abort();
  for (std::size_t i = 0; i < a.num_children(); ++i)
    same_tree(a.child(i), b.child(i));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::unique_ptr<fullshard::graph::Module> g;
  try {
    g = fullshard::graph::parse_graph_json(text, "fuzz.json");
  } catch (const fullshard::Error&) {
    return 0;  // refused with a message: fine
  }
  const std::string again = fullshard::graph::graph_to_json(*g);
  same_tree(*g, *fullshard::graph::parse_graph_json(again, "round-trip.json"));
  for (int shard : {1, 3})
    try {
      (void)fullshard::schedule::plan_groups(*g, shard);
    } catch (const fullshard::Error&) {
    }
  return 0;
}
