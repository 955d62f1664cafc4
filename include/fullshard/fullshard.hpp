// fullshard: fully sharded data parallel training for C++ HPC codes. Umbrella header: the
// runtime and meshes, communication, tensors, the module graph, fully_shard and its hooks,
// the optimizers, checkpoints and the planner. (LibTorch models: fullshard/torch.hpp; C and
// Fortran: fullshard.h and the `fullshard` module.)
#pragma once

#include "fullshard/base/dtype.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/comm/communicator.hpp"
#include "fullshard/comm/mpi_communicator.hpp"
#include "fullshard/runtime/nccl_info.hpp"
#include "fullshard/comm/stream.hpp"
#include "fullshard/config.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/runtime/runtime.hpp"
#include "fullshard/runtime/settings.hpp"
#include "fullshard/tensor/buffer_pool.hpp"
#include "fullshard/tensor/placement.hpp"
#include "fullshard/tensor/shape.hpp"
#include "fullshard/tensor/sharding.hpp"
#include "fullshard/tensor/tensor.hpp"
#include "fullshard/base/bounded_comm.hpp"
#include "fullshard/checkpoint/async_save.hpp"
#include "fullshard/checkpoint/checkpoint.hpp"
#include "fullshard/checkpoint/safetensors.hpp"
#include "fullshard/fsdp/fully_shard.hpp"
#include "fullshard/fsdp/hooks.hpp"
#include "fullshard/fsdp/state_dict.hpp"
#include "fullshard/graph/json_graph.hpp"
#include "fullshard/graph/module.hpp"
#include "fullshard/optim/optimizer.hpp"
#include "fullshard/schedule/auto_plan.hpp"
#include "fullshard/schedule/plan.hpp"
