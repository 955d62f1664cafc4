// The two devices behind transport::Device. Private to lib/transport.
#pragma once

#include <memory>
#include <string>

#include "lib/transport/device.hpp"

namespace fullshard::transport::detail {

/// Host memory and host kernels; a channel's operations run on the group mesh's channel
/// stream (a worker thread, or the caller), the compute channel on the host itself.
std::unique_ptr<Device> make_host_device(const DeviceMesh& mesh);
/// A CUDA device: every channel is one of the root mesh's CUDA streams, buffers come from a
/// stream-ordered device pool, and streams are ordered by CUDA events only.
std::unique_ptr<Device> make_cuda_device(const DeviceMesh& mesh, const std::string& group);

}  // namespace fullshard::transport::detail
