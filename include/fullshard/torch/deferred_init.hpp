// Deferred initialisation of a LibTorch model (FSDP2's meta-device initialisation), so that
// the full model never exists on any rank:
//
//   auto model = std::make_shared<Net>();       // built block by block, each released at once:
//   //   in Net's constructor: auto b = Block(...); fst::to_meta(*b); blocks->push_back(b);
//   fst::ShardedModel sharded(model);           // meta parameters: shapes and dtypes only
//   for (auto& b : model->blocks) sharded.fully_shard(*b, mesh);
//   sharded.fully_shard(*model, mesh);          // each rank allocates its shards (zeros) ...
//   sharded.initialize(init);                   // ... and fills them, or:
//   fst::load_checkpoint(dir, sharded);         //     a checkpoint (each rank reads its rows)
//
// LibTorch's C++ modules allocate and initialise their parameters when they are constructed
// and C++ has no default device (Python's `with torch.device("meta")`): a model is built on the
// CPU and released to the meta device piece by piece, so that at most one piece (a block)
// exists at a time.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fullshard::torch {

/// Releases the memory of `module`'s parameters and buffers (its submodules' too): each
/// becomes a meta tensor of the same shape and dtype (no storage). The tensor objects stay the
/// ones the modules hold (`linear->weight` and parameters() see the change), and
/// requires_grad is kept. fully_shard gives such a parameter its shard, and the root's
/// fully_shard the buffers (and ignored parameters) their full tensors, all zeros until
/// ShardedModel::initialize or a checkpoint fills them.
void to_meta(::torch::nn::Module& module);

/// What ShardedModel::initialize hands its function: one tensor whose values were deferred.
struct LocalShard {
  std::string fqn;  ///< the parameter's or buffer's FQN in the model
  /// This rank's part, written in place (under NoGradGuard): rows [row_offset, row_offset +
  /// tensor.size(0)) of the full tensor (the torch.chunk rule over the shard dim; no rows on
  /// ranks past the last chunk) for a sharded parameter; the whole tensor for a buffer or an
  /// ignored parameter. On the mesh's device.
  at::Tensor tensor;
  std::vector<std::int64_t> full_shape;  ///< the full tensor's shape
  std::int64_t row_offset = 0;           ///< the first full-tensor row `tensor` holds
  bool sharded = false;                  ///< a dim-0 shard (else the whole tensor)
};

}  // namespace fullshard::torch
