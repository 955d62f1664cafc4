// Checkpoints of a LibTorch model sharded with fullshard::torch, with its torch::optim state:
// fullshard's checkpoint format (docs/checkpoint-format.md), so a checkpoint saved on N ranks
// loads on M (each rank reads the blocks of its own shards), is committed atomically, and
// converts to safetensors (fullshard-ckpt). The optimizer state (AdamW's exp_avg and
// exp_avg_sq, SGD's momentum_buffer, and the step count) is stored per parameter like the
// parameters themselves, so it reshards with them.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>

#include "fullshard/checkpoint/async_save.hpp"
#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/torch/sharded_model.hpp"

namespace fullshard::torch {

/// Saves the parameters and, with `optimizer` (torch::optim::AdamW without amsgrad, or
/// torch::optim::SGD), its state as a new step directory under `dir` (see
/// checkpoint::save). Collective over the model's mesh; call outside forward and backward.
/// InvalidArgument for another optimizer, parameters the optimizer does not hold, or
/// parameters that are not f32 (the checkpoint's optimizer state is f32 per shard).
/// `metadata`: the text of any JSON document, kept in the index (checkpoint::Loaded::metadata).
std::string save_checkpoint(const std::string& dir, ShardedModel& model,
                            const ::torch::optim::Optimizer* optimizer, std::int64_t step,
                            const checkpoint::SaveOptions& options = {},
                            const std::string& metadata = std::string());

/// save_checkpoint in the background (checkpoint::save_async): returns once this rank's shards
/// and optimizer state are copied into host staging memory, so training may go on; the handle's
/// test() at a step boundary, or wait(), commits. The files are save_checkpoint's.
checkpoint::AsyncSave save_checkpoint_async(const std::string& dir, ShardedModel& model,
                                            const ::torch::optim::Optimizer* optimizer,
                                            std::int64_t step,
                                            const checkpoint::SaveOptions& options = {},
                                            const std::string& metadata = std::string());

/// Loads a checkpoint of save_checkpoint (saved on any number of ranks) into the model and,
/// with `optimizer`, its state (replacing what it had). Collective; checked before anything
/// changes (checkpoint::load's errors).
checkpoint::Loaded load_checkpoint(const std::string& dir, ShardedModel& model,
                                   ::torch::optim::Optimizer* optimizer = nullptr);

}  // namespace fullshard::torch
