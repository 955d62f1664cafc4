// Copy plans and the run-time dispatch of the shard copy kernels (lib/kernels/shard_copy_impl.hpp)
// over the execution target and the 16 (src, dst) dtype pairs.
//
// ExecTarget::host runs on DefaultHostExecutionSpace, ExecTarget::device on
// DefaultExecutionSpace (the same host space with a host-only Kokkos); each space gets its
// algorithm (host loops on host spaces, teams elsewhere; see shard_copy_impl.hpp).
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "fullshard/base/error.hpp"
#include "fullshard/kernels/shard_copy.hpp"
#include "lib/kernels/exec_stream_impl.hpp"
#include "lib/kernels/shard_copy_impl.hpp"

namespace fullshard::kernels {

namespace {

// Splits runs longer than `block` elements (copy and zeros together) into pieces, so that a
// few long runs still spread over threads or teams.
std::vector<CopyRun> split(const std::vector<CopyRun>& runs, std::int64_t block) {
  std::vector<CopyRun> out;
  out.reserve(runs.size());
  for (const CopyRun& r : runs) {
    const std::int64_t total = r.len + r.pad;
    for (std::int64_t a = 0; a < total; a += block) {
      const std::int64_t b = std::min(total, a + block);
      CopyRun p;
      p.src_offset = r.src_offset + std::min(a, r.len);
      p.dst_offset = r.dst_offset + a;
      p.len = std::max<std::int64_t>(0, std::min(b, r.len) - a);
      p.pad = (b - a) - p.len;
      out.push_back(p);
    }
  }
  return out;
}

void require_data(const void* p, const char* what, const char* op) {
  if (p == nullptr)
    throw InvalidArgument(std::string("fullshard::kernels::") + op + ": " + what +
                          " is null but there are elements to copy");
}

void require_count(std::int64_t n, const char* op) {
  if (n < 0)
    throw InvalidArgument(std::string("fullshard::kernels::") + op + ": negative element count " +
                          std::to_string(n));
}

}  // namespace

CopyPlan::CopyPlan(ExecTarget where, const std::vector<CopyRun>& runs) {
  auto impl = std::make_shared<CopyPlanImpl>();
  impl->target = where;
  impl->size = runs.size();
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const CopyRun& r = runs[i];
    if (r.src_offset < 0 || r.dst_offset < 0 || r.len < 0 || r.pad < 0)
      throw InvalidArgument("CopyPlan: run " + std::to_string(i) + " (src " +
                            std::to_string(r.src_offset) + ", dst " + std::to_string(r.dst_offset) +
                            ", len " + std::to_string(r.len) + ", pad " + std::to_string(r.pad) +
                            ") has a negative field");
    impl->read += r.len;
    impl->written += r.len + r.pad;
  }
  const auto pieces = split(runs, where == ExecTarget::host ? detail::kPlanBlock<HostExec>
                                                            : detail::kPlanBlock<DeviceExec>);
  if (pieces.size() > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    throw InvalidArgument("CopyPlan: " + std::to_string(pieces.size()) + " runs are too many");
  Kokkos::View<CopyRun*, HostExec::memory_space> host(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "fullshard::kernels::CopyPlan"),
      pieces.size());
  for (std::size_t i = 0; i < pieces.size(); ++i)
    host(i) = pieces[i];
  if (where == ExecTarget::host) {
    impl->host_runs = host;
  } else {
    impl->device_runs = Kokkos::View<CopyRun*, DeviceExec::memory_space>(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "fullshard::kernels::CopyPlan"),
        pieces.size());
    Kokkos::deep_copy(impl->device_runs, host);
  }
  impl_ = std::move(impl);
}

ExecTarget CopyPlan::target() const noexcept {
  return impl_ ? impl_->target : ExecTarget::host;
}
std::size_t CopyPlan::size() const noexcept {
  return impl_ ? impl_->size : 0;
}
std::int64_t CopyPlan::elements_read() const noexcept {
  return impl_ ? impl_->read : 0;
}
std::int64_t CopyPlan::elements_written() const noexcept {
  return impl_ ? impl_->written : 0;
}

// ---- execution streams ------------------------------------------------------------------------

ExecStream ExecStream::host() {
  auto i = std::make_shared<ExecStreamImpl>();
  i->target = ExecTarget::host;
  return ExecStreamImpl::make(std::move(i));
}

ExecStream ExecStream::device(void* cuda_stream) {
  auto i = std::make_shared<ExecStreamImpl>();
  i->target = ExecTarget::device;
#if defined(KOKKOS_ENABLE_CUDA)
  if (cuda_stream) i->device = Kokkos::Cuda(static_cast<cudaStream_t>(cuda_stream));
#else
  (void)cuda_stream;
#endif
  return ExecStreamImpl::make(std::move(i));
}

ExecTarget ExecStream::target() const noexcept {
  return impl_->target;
}

void ExecStream::fence() const {
  if (impl_->target == ExecTarget::host)
    impl_->host.fence();
  else
    impl_->device.fence();
}

namespace {
// The default instance of a target (the fencing forms).
ExecStream default_stream(ExecTarget t) {
  return t == ExecTarget::host ? ExecStream::host() : ExecStream::device();
}
}  // namespace

// ---- kernels ----------------------------------------------------------------------------------

void run_copies(const CopyPlan& plan, const void* src, DType src_t, void* dst, DType dst_t,
                const ExecStream& on) {
  if (!plan.impl_ || plan.impl_->written == 0) return;
  const CopyPlanImpl& p = *plan.impl_;
  if (on.target() != p.target)
    throw InvalidArgument("fullshard::kernels::run_copies: the copy plan was built for the " +
                          std::string(p.target == ExecTarget::host ? "host" : "device") +
                          " but the stream runs on the " +
                          (on.target() == ExecTarget::host ? "host" : "device"));
  if (p.read > 0) require_data(src, "src", "run_copies");
  require_data(dst, "dst", "run_copies");
  detail::dispatch(src_t, dst_t, [&](auto s, auto d) {
    using S = decltype(s);
    using D = decltype(d);
    const auto* in = static_cast<const typename S::storage*>(src);
    auto* out = static_cast<typename D::storage*>(dst);
    if (p.target == ExecTarget::host)
      detail::run_copies_on<HostExec, S, D>(on.impl_->host, p.host_runs, in, out);
    else
      detail::run_copies_on<DeviceExec, S, D>(on.impl_->device, p.device_runs, in, out);
  });
}

void run_copies(const CopyPlan& plan, const void* src, DType src_t, void* dst, DType dst_t) {
  const ExecStream on = default_stream(plan.target());
  run_copies(plan, src, src_t, dst, dst_t, on);
  on.fence();
}

void cast_copy(const ExecStream& on, const void* src, DType src_t, void* dst, DType dst_t,
               std::int64_t n) {
  require_count(n, "cast_copy");
  if (n == 0) return;
  require_data(src, "src", "cast_copy");
  require_data(dst, "dst", "cast_copy");
  if (src == dst && src_t == dst_t) return;  // in place, nothing to convert
  detail::dispatch(src_t, dst_t, [&](auto s, auto d) {
    using S = decltype(s);
    using D = decltype(d);
    const auto* in = static_cast<const typename S::storage*>(src);
    auto* out = static_cast<typename D::storage*>(dst);
    if (on.target() == ExecTarget::host)
      detail::cast_copy_on<HostExec, S, D>(on.impl_->host, in, out, n);
    else
      detail::cast_copy_on<DeviceExec, S, D>(on.impl_->device, in, out, n);
  });
}

void cast_copy(ExecTarget where, const void* src, DType src_t, void* dst, DType dst_t,
               std::int64_t n) {
  const ExecStream on = default_stream(where);
  cast_copy(on, src, src_t, dst, dst_t, n);
  on.fence();
}

void reduce_copy_out(const ExecStream& on, const void* src, DType src_t, void* dst, DType dst_t,
                     std::int64_t n, double divisor, bool accumulate) {
  require_count(n, "reduce_copy_out");
  if (n == 0) return;
  require_data(src, "src", "reduce_copy_out");
  require_data(dst, "dst", "reduce_copy_out");
  if (!(divisor > 0.0) || !std::isfinite(divisor))
    throw InvalidArgument("fullshard::kernels::reduce_copy_out: divisor " +
                          std::to_string(divisor) + " is not a positive finite number");
  const bool divide = divisor != 1.0;
  detail::dispatch(src_t, dst_t, [&](auto s, auto d) {
    using S = decltype(s);
    using D = decltype(d);
    using A = detail::Acc<S, D>;
    const auto* in = static_cast<const typename S::storage*>(src);
    auto* out = static_cast<typename D::storage*>(dst);
    const A div = static_cast<A>(divisor);
    if (on.target() == ExecTarget::host) {
      const HostExec& e = on.impl_->host;
      if (accumulate)
        detail::reduce_copy_out_on<HostExec, S, D, true>(e, in, out, n, div, divide);
      else
        detail::reduce_copy_out_on<HostExec, S, D, false>(e, in, out, n, div, divide);
    } else {
      const DeviceExec& e = on.impl_->device;
      if (accumulate)
        detail::reduce_copy_out_on<DeviceExec, S, D, true>(e, in, out, n, div, divide);
      else
        detail::reduce_copy_out_on<DeviceExec, S, D, false>(e, in, out, n, div, divide);
    }
  });
}

void reduce_copy_out(ExecTarget where, const void* src, DType src_t, void* dst, DType dst_t,
                     std::int64_t n, double divisor, bool accumulate) {
  const ExecStream on = default_stream(where);
  reduce_copy_out(on, src, src_t, dst, dst_t, n, divisor, accumulate);
  on.fence();
}

}  // namespace fullshard::kernels
