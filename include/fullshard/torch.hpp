// fullshard::torch, the LibTorch front end: link the CMake target fullshard::torch
// (find_package(fullshard COMPONENTS torch)). ShardedModel, call and checkpoint
// (fullshard/torch/sharded_model.hpp), the intra-op threads of a rank (threads.hpp), and a
// GPT-style decoder and fullshard-train's residual MLP ready for fully_shard (gpt.hpp,
// residual_mlp.hpp), checkpoints with torch::optim state (checkpoint.hpp), deferred
// initialisation (deferred_init.hpp).
#pragma once

#include "fullshard/torch/checkpoint.hpp"
#include "fullshard/torch/deferred_init.hpp"
#include "fullshard/torch/gpt.hpp"
#include "fullshard/torch/residual_mlp.hpp"
#include "fullshard/torch/sharded_model.hpp"
#include "fullshard/torch/threads.hpp"
