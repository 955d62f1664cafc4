// What the NCCL library linked into this build is (empty when built without NCCL).
#pragma once

#include <string>

namespace fullshard {

/// "2.27.3" for the NCCL library found at run time, or "" when fullshard was built without
/// NCCL. Needs no GPU.
std::string nccl_version();

}  // namespace fullshard
