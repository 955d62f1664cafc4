#include "lib/transport/device.hpp"

#include "fullshard/base/error.hpp"
#include "lib/transport/devices.hpp"

namespace fullshard::transport {

comm::Work Device::submit(comm::StreamKind c, comm::Stream& s, const std::string& label,
                          std::function<void()> op) {
  comm::Work before = last(c);
  return s.submit(label, [before, o = std::move(op)] {
    before.test();
    o();
  });
}

Tensor Device::scratch(comm::StreamKind, std::int64_t, DType, const char* what,
                       const std::string& group) {
  throw InvalidArgument(std::string("fsdp group ") + group + ": scratch device memory for '" +
                        what + "' on a host device (internal)");
}

Tensor Device::reserve(std::int64_t numel, DType dtype, const char* what,
                       const std::string& group) {
  return acquire(comm::StreamKind::compute, numel, dtype, what, group);
}

std::unique_ptr<Device> make_device(const DeviceMesh& mesh, const std::string& group) {
  if (mesh.device_type() == DeviceType::cuda) return detail::make_cuda_device(mesh, group);
  return detail::make_host_device(mesh);
}

}  // namespace fullshard::transport
