#include "fullshard/kernels/element_update.hpp"

#include <Kokkos_Core.hpp>
#include <cmath>
#include <string>

#include "fullshard/base/error.hpp"
#include "lib/kernels/element_update_impl.hpp"
#include "lib/kernels/exec_stream_impl.hpp"
#include "lib/kernels/shard_copy_impl.hpp"

namespace fullshard::kernels {

namespace detail {

void require_update_arrays(const ElementUpdate& u, const char* who) {
  if (u.param == nullptr || (u.state_arrays() > 0 && u.state0 == nullptr) ||
      (u.rule == ElementUpdate::Rule::adamw && u.state1 == nullptr))
    throw InvalidArgument(std::string("fullshard::kernels::") + who +
                          ": null parameter or state array");
}

}  // namespace detail

namespace {

/// The update of element e with the gradient read from an array (nullptr: zero).
template <class Rule>
struct FromArray {
  Rule rule;
  const float* g;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e) const {
    rule(e, g != nullptr ? g[e] : 0.0f);
  }
};

/// The update of element e with the gradient reduce_copy_out would have written (no
/// accumulation, f32): src[e] / divisor, rounded once.
template <class S, class Rule>
struct FromReduction {
  Rule rule;
  const typename S::storage* src;
  detail::Acc<S, detail::F32> divisor;
  bool divide;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e) const {
    rule(e, detail::reduce_elem<S, detail::F32, false>(src[e], 0.0f, divisor, divide));
  }
};

template <class Kernel>
void run_on_device(const ExecStream& on, const Kernel& k, std::int64_t n) {
  const auto& exec = ExecStreamImpl::of(on).device;
  Kokkos::parallel_for("fullshard::kernels::apply_update",
                       Kokkos::RangePolicy<DeviceExec, Kokkos::IndexType<std::int64_t>>(exec, 0, n),
                       k);
}

void require_count(std::int64_t n, const char* who) {
  if (n < 0)
    throw InvalidArgument(std::string("fullshard::kernels::") + who + ": negative count " +
                          std::to_string(n));
}

}  // namespace

ElementUpdate ElementUpdate::at(std::int64_t offset) const noexcept {
  ElementUpdate u = *this;
  u.param = param + offset;
  if (state0 != nullptr) u.state0 = state0 + offset;
  if (state1 != nullptr) u.state1 = state1 + offset;
  return u;
}

void apply_update(const ExecStream& on, const ElementUpdate& u, const float* grad, std::int64_t n) {
  require_count(n, "apply_update");
  if (n == 0) return;
  detail::require_update_arrays(u, "apply_update");
  detail::with_rule(u, [&](auto rule) {
    if (on.target() == ExecTarget::host)
      detail::host_update(rule, 0, grad, n);
    else
      run_on_device(on, FromArray<decltype(rule)>{rule, grad}, n);
  });
}

void reduce_update(const ExecStream& on, const void* src, DType src_t, std::int64_t n,
                   double divisor, const ElementUpdate& u) {
  require_count(n, "reduce_update");
  if (n == 0) return;
  if (src == nullptr) throw InvalidArgument("fullshard::kernels::reduce_update: null source");
  if (!(divisor > 0.0) || !std::isfinite(divisor))
    throw InvalidArgument("fullshard::kernels::reduce_update: divisor " + std::to_string(divisor) +
                          " is not a positive finite number");
  detail::require_update_arrays(u, "reduce_update");
  const bool divide = divisor != 1.0;
  detail::dispatch(src_t, DType::f32, [&](auto s, auto) {
    using S = decltype(s);
    using A = detail::Acc<S, detail::F32>;
    using SS = typename S::storage;
    const auto* in = static_cast<const SS*>(src);
    const A div = static_cast<A>(divisor);
    detail::with_rule(u, [&](auto rule) {
      if (on.target() != ExecTarget::host) {
        run_on_device(on, FromReduction<S, decltype(rule)>{rule, in, div, divide}, n);
        return;
      }
      constexpr std::int64_t kBlock = detail::kUpdateBlock;
      const auto& host = ExecStreamImpl::of(on).host;
      Kokkos::parallel_for(
          "fullshard::kernels::reduce_update",
          Kokkos::RangePolicy<HostExec, Kokkos::IndexType<std::int64_t>>(host, 0,
                                                                         (n + kBlock - 1) / kBlock),
          [=](std::int64_t b) {
            const std::int64_t begin = b * kBlock;
            const std::int64_t len = n - begin < kBlock ? n - begin : kBlock;
            float g[kBlock] = {};
            if (divide)
              detail::host_map(in + begin, g, len, [div](SS x, float) {
                return detail::reduce_elem<S, detail::F32, false>(x, 0.0f, div, true);
              });
            else
              detail::host_map(in + begin, g, len, [div](SS x, float) {
                return detail::reduce_elem<S, detail::F32, false>(x, 0.0f, div, false);
              });
            detail::host_update(rule, begin, g, len);
          });
    });
  });
}

}  // namespace fullshard::kernels
