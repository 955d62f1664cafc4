#include "fullshard/transport/fusions.hpp"

namespace fullshard::transport {

const char* kind_name(Kind k) noexcept {
  switch (k) {
    case Kind::mpi:
      return "mpi";
    case Kind::shm:
      return "shm";
    case Kind::nccl:
      return "nccl";
    case Kind::two_level:
      return "shm+mpi";
  }
  return "?";
}

std::string Geometry::wire_text() const {
  if (wire == 0) return "";
  const char* gather = (wire & 3) == 0 ? "none" : kernels::quant_code_name(gather_code());
  return std::string(gather) + "/" + ((wire & 4) != 0 ? "int8" : "none") + "/" +
         std::to_string(quant_block());
}

}  // namespace fullshard::transport
