#include "fullshard/runtime/nccl_info.hpp"

namespace fullshard {

std::string nccl_version() {
  return {};
}

}  // namespace fullshard
