// fullshard: fully sharded data parallel training for C++ HPC codes. Umbrella header.
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
