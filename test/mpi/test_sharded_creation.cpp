// Sharded creation of native graph models (Parameter::init_sharded): nothing is allocated
// before fully_shard, which fills each rank's rows only; the shards equal those of the full
// tensors made eagerly (init) from the same function, on any rank count; and what creation
// allocates, counted exactly through Kokkos's allocation callbacks (every tensor of the
// library is a Kokkos view), is the rank's shards, never the model.
#include <doctest/doctest.h>
#include <Kokkos_Core.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/tensor/sharding.hpp"
#include "test_support.hpp"

using namespace fullshard;
using graph::Module;
using graph::Parameter;

namespace {

// A pure function of the element index (and the parameter's stream): what a counter-based
// initialiser gives.
double value(std::uint64_t stream, std::int64_t e) {
  std::uint64_t h = (stream + 1) * 0x9e3779b97f4a7c15ull ^ static_cast<std::uint64_t>(e);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  return static_cast<double>(h % 2001) / 1000.0 - 1.0;
}

struct Shape2 {
  const char* module;
  const char* name;
  Shape shape;
};
// Uneven first dims (37, 11, 9: padding on 2 and 4 ranks), a group larger than the others.
const std::vector<Shape2> kParams = {{"a", "w", {37, 5}},   {"b", "w", {64, 3}},
                                     {"b", "bias", {11}},   {"", "r", {9}},
                                     {"c", "w", {128, 16}}, {"c", "v", {3, 4, 2}}};

std::unique_ptr<Module> make_model(bool sharded) {
  auto root = Module::make_root("model");
  std::uint64_t stream = 0;
  for (const Shape2& s : kParams) {
    Module& m = *s.module ? (root->find_module(s.module) ? root->module(s.module)
                                                         : root->add_module(s.module))
                          : *root;
    Parameter& p = m.add_param(s.name, s.shape);
    const std::uint64_t st = stream++;
    auto fn = [st](std::int64_t e) { return value(st, e); };
    if (sharded)
      p.init_sharded(fn);
    else
      p.init(fn);
  }
  return root;
}

void shard_all(Module& root, const DeviceMesh& mesh) {
  for (const char* m : {"a", "b", "c"})
    fsdp::fully_shard(root.module(m), mesh);
  fsdp::fully_shard(root, mesh);
}

// Bytes the library allocates (Kokkos views: every tensor of the library is one), by kind,
// while counting is on: "fsdp.sharded:<group>" (the groups' shards), a parameter's FQN (the
// full tensor init makes), and the rest (copy plans and other small metadata).
struct Counted {
  std::int64_t shards = 0, full = 0, other = 0, live = 0, peak = 0;
};
Counted g_counted;
bool g_counting = false;
std::set<std::string> g_fqns;
void on_allocate(Kokkos_Profiling_SpaceHandle, const char* label, const void*,
                 std::uint64_t bytes) {
  if (!g_counting) return;
  const auto b = static_cast<std::int64_t>(bytes);
  const std::string l = label;
  (l.rfind("fsdp.sharded:", 0) == 0 ? g_counted.shards
   : g_fqns.count(l)                ? g_counted.full
                                    : g_counted.other) += b;
  g_counted.live += b;
  g_counted.peak = std::max(g_counted.peak, g_counted.live);
}
void on_deallocate(Kokkos_Profiling_SpaceHandle, const char*, const void*, std::uint64_t bytes) {
  if (g_counting) g_counted.live -= static_cast<std::int64_t>(bytes);
}
// Kokkos allocates whole 8-byte words.
std::int64_t round8(std::int64_t bytes) {
  return (bytes + 7) / 8 * 8;
}

}  // namespace

TEST_CASE("init_sharded: nothing before fully_shard, each rank's rows after, the eager shards") {
  DeviceMesh mesh(test::runtime(), {test::world_size()}, {"dp"});
  auto lazy = make_model(true);
  for (Parameter* p : lazy->parameters()) {
    INFO(p->fqn());
    CHECK(p->data().data() == nullptr);
    CHECK(static_cast<bool>(p->initializer()));
  }
  auto eager = make_model(false);
  shard_all(*lazy, mesh);
  shard_all(*eager, mesh);
  const std::vector<Parameter*> lp = lazy->parameters(), ep = eager->parameters();
  REQUIRE(lp.size() == ep.size());
  for (std::size_t i = 0; i < lp.size(); ++i) {
    const Parameter& p = *lp[i];
    INFO(p.fqn());
    std::uint64_t stream = 0;  // the parameter's place in kParams: its initialiser's stream
    while (stream < kParams.size() &&
           (*kParams[stream].module
                ? std::string(kParams[stream].module) + "." + kParams[stream].name
                : std::string(kParams[stream].name)) != p.fqn())
      ++stream;
    REQUIRE(stream < kParams.size());
    CHECK_FALSE(static_cast<bool>(p.initializer()));
    const Tensor& shard = p.data();
    const ShardLayout l = shard_layout(p.shape(), Placement::Shard(0), test::world_size(),
                                       test::world_rank(), p.fqn());
    REQUIRE(shard.numel() == l.local_numel());
    REQUIRE(ep[i]->data().numel() == l.local_numel());
    // Element (o, r, k) of the shard is the function's value at its index in the full tensor.
    int bad = 0;
    for (std::int64_t r = 0; r < l.local_rows; ++r)
      for (std::int64_t k = 0; k < l.inner; ++k) {
        const std::int64_t e = r * l.inner + k;
        const float want =
            static_cast<float>(value(stream, (l.global_offset[0] + r) * l.inner + k));
        if (static_cast<const float*>(shard.data())[e] != want) ++bad;
        if (static_cast<const float*>(ep[i]->data().data())[e] != want) ++bad;
      }
    CHECK(bad == 0);
  }
}

TEST_CASE("sharded creation allocates the rank's shards, the eager one the whole model first") {
  DeviceMesh mesh(test::runtime(), {test::world_size()}, {"dp"});
  // Expected, f32: per group (module) the padded shards of its members; per parameter its
  // full tensor.
  std::map<std::string, std::int64_t> group_elems;
  std::int64_t full_bytes = 0;
  for (const Shape2& s : kParams) {
    const ShardLayout l =
        shard_layout(s.shape, Placement::Shard(0), test::world_size(), test::world_rank(), s.name);
    group_elems[s.module] += l.padded_numel();
    full_bytes += round8(numel(s.shape) * 4);
    g_fqns.insert(*s.module ? std::string(s.module) + "." + s.name : std::string(s.name));
  }
  std::int64_t shard_bytes = 0, largest_group = 0;
  for (const auto& [group, elems] : group_elems) {
    shard_bytes += round8(elems * 4);
    largest_group = std::max(largest_group, elems * 4 * test::world_size());
  }
  Kokkos::Tools::Experimental::set_allocate_data_callback(on_allocate);
  Kokkos::Tools::Experimental::set_deallocate_data_callback(on_deallocate);
  auto count = [&](bool sharded) {
    g_counted = Counted();
    g_counting = true;
    auto model = make_model(sharded);
    shard_all(*model, mesh);
    g_counting = false;
    return g_counted;
  };
  const Counted lazy = count(true), eager = count(false);
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
  Kokkos::Tools::Experimental::set_deallocate_data_callback(nullptr);

  INFO("full model " << full_bytes << " B, this rank's shards " << shard_bytes
                     << " B; init_sharded: shards " << lazy.shards << ", full " << lazy.full
                     << ", other " << lazy.other << ", peak " << lazy.peak << "; init: shards "
                     << eager.shards << ", full " << eager.full << ", peak " << eager.peak);
  CHECK(lazy.full == 0);  // no full tensor, ever
  CHECK(lazy.shards == shard_bytes);
  CHECK(eager.full == full_bytes);
  CHECK(eager.shards == shard_bytes);
  CHECK(lazy.other == eager.other);  // the same metadata either way
  // What creation holds at its peak: the shards (and metadata) only, below the shards plus
  // the largest group (the bound); the eager path held the whole model beside them.
  CHECK(lazy.peak == lazy.shards + lazy.other);
  CHECK(lazy.peak - lazy.other <= shard_bytes + largest_group);
  CHECK(eager.peak > full_bytes);
}
