// fullshard::torch, the LibTorch front end: link the CMake target fullshard::torch
// (find_package(fullshard COMPONENTS torch)). See fullshard/torch/sharded_model.hpp.
#pragma once

#include "fullshard/torch/sharded_model.hpp"
