// State dicts of fully_shard'ed modules. Keys are parameter FQNs relative to the module
// passed in (for the root: the FQNs of the graph), unchanged by sharding.
#pragma once

#include <map>
#include <string>

#include "fullshard/graph/module.hpp"
#include "fullshard/tensor/sharded_tensor.hpp"

namespace fullshard::fsdp {

/// This rank's shards with their global metadata; no communication, no copy (the local
/// tensors view the sharded storage). Parameters outside any group (ignored) appear as
/// Replicate with their full tensor.
std::map<std::string, ShardedTensor> sharded_state_dict(graph::Module& module);

/// Full (unsharded) parameters in their original dtype, gathered with one all-gather per
/// group. Collective over the mesh. With rank0_only, ranks other than 0 of the shard group
/// return an empty map (they still take part in the gathers).
std::map<std::string, Tensor> full_state_dict(graph::Module& module, bool rank0_only = false);

/// Loads this rank's shards (e.g. from sharded_state_dict on the same mesh). Every key is
/// checked (missing, unexpected, wrong local shape or dtype) before anything is written: on
/// error nothing is loaded. Not collective.
void load_sharded_state_dict(graph::Module& module,
                             const std::map<std::string, ShardedTensor>& state);

/// Loads full tensors: each rank copies its own shard. Checked like load_sharded_state_dict.
/// Not collective. The groups must be sharded (call reshard() first).
void load_full_state_dict(graph::Module& module, const std::map<std::string, Tensor>& state);

}  // namespace fullshard::fsdp
