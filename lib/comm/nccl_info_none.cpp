#include "fullshard/comm/nccl_info.hpp"

namespace fullshard::comm {

std::string nccl_version() {
  return {};
}

}  // namespace fullshard::comm
