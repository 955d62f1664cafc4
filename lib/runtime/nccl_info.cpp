#include "fullshard/runtime/nccl_info.hpp"

#include <nccl.h>

namespace fullshard {

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // Since NCCL 2.9 the code is major*10000 + minor*100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

}  // namespace fullshard
