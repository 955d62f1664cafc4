// Device selection (lib/runtime/device_binding.cpp): the pure choice, checked on any machine.
#include <doctest/doctest.h>

#include <string>

#include "fullshard/base/error.hpp"
#include "lib/runtime/device_binding.hpp"

using fullshard::ConfigError;
using fullshard::detail::select_device;

namespace {
std::string error_of(int index, int group, int visible, const char* cvd) {
  try {
    select_device(index, group, visible, cvd);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("ranks that see the same GPUs take one each, in local-rank order") {
  CHECK(select_device(0, 4, 4, nullptr) == 0);
  CHECK(select_device(3, 4, 4, nullptr) == 3);
  CHECK(select_device(1, 2, 8, "0,1,2,3,4,5,6,7") == 1);
}

TEST_CASE("a rank given its own GPU by CUDA_VISIBLE_DEVICES uses device 0") {
  // srun --gpus-per-task=1: four ranks on the node, each sees one different device, so each
  // is alone in its visibility group.
  CHECK(select_device(0, 1, 1, "2") == 0);
}

TEST_CASE("no visible GPU: no binding") {
  CHECK(select_device(0, 4, 0, nullptr) == -1);
  CHECK(select_device(2, 4, 0, "") == -1);
}

TEST_CASE("more ranks than GPUs is an error naming the counts and CUDA_VISIBLE_DEVICES") {
  const std::string m = error_of(2, 3, 2, "0,1");
  INFO(m);
  CHECK(m.find("this node runs 3 ranks that all see the same 2 GPUs") != std::string::npos);
  CHECK(m.find("CUDA_VISIBLE_DEVICES='0,1'") != std::string::npos);
  CHECK(m.find("FULLSHARD_BIND_DEVICE=0") != std::string::npos);
  CHECK(error_of(1, 2, 1, nullptr).find("CUDA_VISIBLE_DEVICES unset") != std::string::npos);
}
