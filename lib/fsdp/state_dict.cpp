#include "fullshard/fsdp/state_dict.hpp"

#include <cstring>
#include <set>

#include "fullshard/base/error.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "lib/fsdp/param_group.hpp"
#include "lib/tensor/staging.hpp"

namespace fullshard::fsdp {

namespace {

struct Located {
  ParamGroup* group = nullptr;  // nullptr: not sharded (ignored)
  std::size_t index = 0;
};

// The group holding `p`: the innermost FSDP module at or above p's module whose group has it.
Located locate(graph::Parameter& p) {
  for (graph::Module* m = &p.module(); m; m = m->parent())
    if (FSDPModule* st = fsdp_state(*m)) {
      const auto& ps = group_of(*st).params();
      for (std::size_t i = 0; i < ps.size(); ++i)
        if (ps[i] == &p) return {&group_of(*st), i};
    }
  return {};
}

std::string relative(const graph::Module& m, const graph::Parameter& p) {
  const std::string& prefix = m.fqn();
  if (prefix.empty()) return p.fqn();
  return p.fqn().substr(prefix.size() + 1);
}

// Parameter i's slot in the group's sharded storage (host or device memory).
Tensor slot_of(const ParamGroup& g, std::size_t i) {
  const auto& mem = g.layout().members[i];
  return g.sharded_storage().flat_view(mem.slot_offset, mem.layout.local_shape);
}

// The stream device shards are read and written on: the mesh's compute stream (after the
// optimizer's kernels); nullptr (unused) for host shards.
void* stream_of(const ParamGroup& g) {
  return g.sharded_storage().space() == MemorySpace::device
             ? g.mesh().compute_stream().native_handle()
             : nullptr;
}

template <class Map>
void check_keys(graph::Module& module, const Map& state, const char* what) {
  std::set<std::string> expected;
  for (auto* p : module.parameters())
    expected.insert(relative(module, *p));
  for (const auto& kv : state)
    if (!expected.count(kv.first))
      throw InvalidArgument(std::string(what) + ": unexpected key '" + kv.first +
                            "' (no such parameter in module '" + module.fqn() + "')");
  for (const auto& k : expected)
    if (!state.count(k)) throw InvalidArgument(std::string(what) + ": missing key '" + k + "'");
}

// `also`: a memory space accepted besides host memory (the shard's).
void check_tensor(const Tensor& t, const Shape& shape, DType dtype, const std::string& key,
                  const char* what, MemorySpace also = MemorySpace::host) {
  if (t.shape() != shape || t.dtype() != dtype || (!t.data() && t.numel() > 0))
    throw InvalidArgument(std::string(what) + ": '" + key + "' is a " + dtype_name(t.dtype()) +
                          " tensor of shape " + shape_string(t.shape()) + ", expected " +
                          dtype_name(dtype) + " " + shape_string(shape));
  if (t.space() != MemorySpace::host && t.space() != also)
    throw InvalidArgument(std::string(what) + ": '" + key + "' is in " +
                          memory_space_name(t.space()) + " memory, expected host memory" +
                          (also != MemorySpace::host ? std::string(" or the shard's ") +
                                                           memory_space_name(also) + " memory"
                                                     : std::string()));
}

void require_sharded(const ParamGroup& g, const char* what) {
  if (!g.sharded_idle())
    throw InvalidArgument(std::string(what) + ": group " + g.name() +
                          " is unsharded or being gathered; call reshard() before loading");
}

// Copies this rank's shard of a full host tensor into host memory at `slot`.
void copy_shard(const Tensor& full, const ShardLayout& l, void* slot) {
  const std::size_t es = dtype_size(full.dtype());
  const std::int64_t D = l.global_shape[static_cast<std::size_t>(l.placement.dim())];
  const auto* src = static_cast<const std::byte*>(full.data());
  auto* dst = static_cast<std::byte*>(slot);
  for (std::int64_t o = 0; o < l.outer; ++o)
    std::memcpy(
        dst + static_cast<std::size_t>(o * l.chunk * l.inner) * es,
        src + static_cast<std::size_t>((o * D + l.global_offset[l.placement.dim()]) * l.inner) * es,
        static_cast<std::size_t>(l.local_rows * l.inner) * es);
}

int detail_world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

}  // namespace

std::map<std::string, ShardedTensor> sharded_state_dict(graph::Module& module) {
  std::map<std::string, ShardedTensor> out;
  for (auto* p : module.parameters()) {
    const Located at = locate(*p);
    if (!at.group) {
      out[relative(module, *p)] = {
          p->data(), shard_layout(p->shape(), Placement::Replicate(), 1, 0, p->fqn())};
      continue;
    }
    const auto& mem = at.group->layout().members[at.index];
    out[relative(module, *p)] = {
        at.group->sharded_storage().flat_view(mem.slot_offset, mem.layout.local_shape), mem.layout};
  }
  return out;
}

std::map<std::string, Tensor> full_state_dict(graph::Module& module, bool rank0_only) {
  std::map<std::string, Tensor> out;
  // "Rank 0" is rank 0 of the mesh the module is sharded over (the world without FSDP).
  int mesh_rank0 = detail_world_rank();
  for (graph::Module* m = &module; m; m = m->parent())
    if (FSDPModule* st = fsdp_state(*m)) mesh_rank0 = st->mesh().rank();
  std::map<ParamGroup*, Tensor> gathered;  // one gather per group, in first-use order
  for (auto* p : module.parameters()) {
    const Located at = locate(*p);
    const std::string key = relative(module, *p);
    if (!at.group) {  // not sharded: every rank holds it
      if (rank0_only && mesh_rank0 != 0) continue;
      Tensor copy = Tensor::empty(p->shape(), p->dtype(), MemorySpace::host, "fsdp.full");
      copy_bytes(copy, p->data());
      out[key] = copy;
      continue;
    }
    auto it = gathered.find(at.group);
    if (it == gathered.end()) it = gathered.emplace(at.group, at.group->gather_full()).first;
    if (rank0_only && at.group->mesh().rank() != 0) continue;
    out[key] = it->second.flat_view(at.group->layout().members[at.index].arena_offset, p->shape());
  }
  return out;
}

void load_sharded_state_dict(graph::Module& module,
                             const std::map<std::string, ShardedTensor>& state) {
  const char* what = "load_sharded_state_dict";
  check_keys(module, state, what);
  std::vector<std::pair<graph::Parameter*, const ShardedTensor*>> todo;
  for (auto* p : module.parameters()) {
    const std::string key = relative(module, *p);
    const ShardedTensor& st = state.at(key);
    const Located at = locate(*p);
    if (st.global_shape() != p->shape())
      throw InvalidArgument(std::string(what) + ": '" + key + "' has global shape " +
                            shape_string(st.global_shape()) + ", the parameter is " +
                            shape_string(p->shape()));
    if (at.group) {
      require_sharded(*at.group, what);
      const auto& l = at.group->layout().members[at.index].layout;
      if (st.placement() != l.placement)
        throw InvalidArgument(std::string(what) + ": '" + key + "' is " +
                              st.placement().to_string() + ", the parameter is sharded " +
                              l.placement.to_string());
      check_tensor(st.local, l.local_shape, p->dtype(), key, what,
                   at.group->sharded_storage().space());
    } else {
      check_tensor(st.local, p->shape(), p->dtype(), key, what);
      check_tensor(p->data(), p->shape(), p->dtype(), key + "' (the parameter's own tensor)", what);
    }
    todo.emplace_back(p, &st);
  }
  for (auto& [p, st] : todo) {
    const Located at = locate(*p);
    if (at.group) {
      const Tensor slot = slot_of(*at.group, at.index);
      if (slot.space() == MemorySpace::host && st->local.space() == MemorySpace::host)
        std::memcpy(slot.data(), st->local.data(), st->local.nbytes());
      else  // a device shard: from host or device memory, ordered on the compute stream
        ::fullshard::detail::copy_on_stream(slot, st->local, stream_of(*at.group),
                                            std::string(what) + ": '" + p->fqn() + "'");
    } else {
      copy_bytes(p->data(), st->local);
    }
  }
}

void load_full_state_dict(graph::Module& module, const std::map<std::string, Tensor>& state) {
  const char* what = "load_full_state_dict";
  check_keys(module, state, what);
  for (auto* p : module.parameters()) {
    const std::string key = relative(module, *p);
    check_tensor(state.at(key), p->shape(), p->dtype(), key, what);
    const Located at = locate(*p);
    if (at.group)
      require_sharded(*at.group, what);
    else
      check_tensor(p->data(), p->shape(), p->dtype(), key + "' (the parameter's own tensor)", what);
  }
  Tensor stage;  // device shards: this rank's shard, cut out on the host (pinned), then copied
  for (auto* p : module.parameters()) {
    const Tensor& full = state.at(relative(module, *p));
    const Located at = locate(*p);
    if (!at.group) {
      copy_bytes(p->data(), full);
      continue;
    }
    const ShardLayout& l = at.group->layout().members[at.index].layout;
    const Tensor slot = slot_of(*at.group, at.index);
    if (slot.space() == MemorySpace::host) {
      copy_shard(full, l, slot.data());
      continue;
    }
    if (stage.nbytes() < slot.nbytes())
      stage = ::fullshard::detail::pinned_host_tensor(
          {static_cast<std::int64_t>((slot.nbytes() + 7) / 8)}, DType::f64, "fsdp.load_stage");
    const Tensor host = Tensor::from_owner(stage.owner(), stage.data(), slot.shape(), slot.dtype(),
                                           MemorySpace::host);
    copy_shard(full, l, host.data());
    ::fullshard::detail::copy_on_stream(slot, host, stream_of(*at.group),
                                        std::string(what) + ": '" + p->fqn() + "'");
  }
}

}  // namespace fullshard::fsdp
