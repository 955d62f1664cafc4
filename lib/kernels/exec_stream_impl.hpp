// What an ExecStream and a CopyPlan hold (private to the kernels layer): the host execution
// space instance, or the device space's over a stream; the plan's runs in its target's memory.
// Kernel files reach them through ExecStreamImpl::of and CopyPlanImpl::of.
#pragma once

#include <Kokkos_Core.hpp>
#include <memory>

#include "fullshard/kernels/shard_copy.hpp"

namespace fullshard::kernels {

using HostExec = Kokkos::DefaultHostExecutionSpace;
using DeviceExec = Kokkos::DefaultExecutionSpace;

struct ExecStreamImpl {
  ExecTarget target = ExecTarget::host;
  HostExec host;
  DeviceExec device;
  static ExecStream make(std::shared_ptr<const ExecStreamImpl> i) {
    return ExecStream(std::move(i));
  }
  static const ExecStreamImpl& of(const ExecStream& s) noexcept { return *s.impl_; }
};

struct CopyPlanImpl {
  ExecTarget target = ExecTarget::host;
  std::size_t size = 0;  // runs given (the stored pieces may be more)
  std::int64_t read = 0;
  std::int64_t written = 0;
  Kokkos::View<CopyRun*, HostExec::memory_space> host_runs;      // target host
  Kokkos::View<CopyRun*, DeviceExec::memory_space> device_runs;  // target device
  /// The plan's state; null for a default-constructed plan (no runs).
  static const CopyPlanImpl* of(const CopyPlan& p) noexcept { return p.impl_.get(); }
};

}  // namespace fullshard::kernels
