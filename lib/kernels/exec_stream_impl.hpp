// What an ExecStream holds (private to the kernels layer): the host execution space instance,
// or the device space's over a stream. Kernel files reach it through ExecStreamImpl::of.
#pragma once

#include <Kokkos_Core.hpp>
#include <memory>

#include "fullshard/kernels/shard_copy.hpp"

namespace fullshard::kernels {

using HostExec = Kokkos::DefaultHostExecutionSpace;
using DeviceExec = Kokkos::DefaultExecutionSpace;

namespace detail {

struct ExecStreamImpl {
  ExecTarget target = ExecTarget::host;
  HostExec host;
  DeviceExec device;
  static ExecStream make(std::shared_ptr<const ExecStreamImpl> i) {
    return ExecStream(std::move(i));
  }
  static const ExecStreamImpl& of(const ExecStream& s) noexcept { return *s.impl_; }
};

}  // namespace detail
}  // namespace fullshard::kernels
