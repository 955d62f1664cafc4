#include "fullshard/kernels/element_update.hpp"

#include <Kokkos_Core.hpp>
#include <cmath>
#include <string>

#include "fullshard/base/error.hpp"
#include "lib/kernels/exec_stream_impl.hpp"

namespace fullshard::kernels {

namespace {

// torch.optim.SGD's update of element e (ElementUpdate::Rule::sgd); b: nullptr without
// momentum.
struct SgdUpdate {
  ElementUpdate u;
  const float* g;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e) const {
    float* w = u.param;
    float* b = u.state0;
    double d = static_cast<double>(g[e]) + u.weight_decay * static_cast<double>(w[e]);
    if (b != nullptr) {
      const double buf = u.fresh ? d : u.momentum * static_cast<double>(b[e]) + d;
      b[e] = static_cast<float>(buf);
      d = u.nesterov ? d + u.momentum * buf : buf;
    }
    w[e] = static_cast<float>(static_cast<double>(w[e]) - u.lr * d);
  }
};

// torch.optim.AdamW's update of element e (ElementUpdate::Rule::adamw).
struct AdamWUpdate {
  ElementUpdate u;
  const float* g;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e) const {
    float* w = u.param;
    float* m = u.state0;
    float* v = u.state1;
    const double gd = g[e];
    double pw = static_cast<double>(w[e]) * (1.0 - u.lr * u.weight_decay);
    const double md = u.beta1 * static_cast<double>(m[e]) + (1.0 - u.beta1) * gd;
    const double vd = u.beta2 * static_cast<double>(v[e]) + (1.0 - u.beta2) * gd * gd;
    m[e] = static_cast<float>(md);
    v[e] = static_cast<float>(vd);
    pw -= u.step_size * md / (::sqrt(vd) / u.bc2_sqrt + u.eps);
    w[e] = static_cast<float>(pw);
  }
};

// k(e) for e in [0, n) on the host: the arrays never overlap (no run-time alias check).
template <class Kernel>
inline void host_loop(const Kernel& k, std::int64_t n) {
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#pragma GCC ivdep
#endif
  for (std::int64_t e = 0; e < n; ++e)
    k(e);
}

template <class Kernel>
void run(const ExecStream& on, const Kernel& k, std::int64_t n) {
  if (on.target() == ExecTarget::host) {
    host_loop(k, n);
    return;
  }
  const auto& exec = detail::ExecStreamImpl::of(on).device;
  Kokkos::parallel_for("fullshard::kernels::apply_update",
                       Kokkos::RangePolicy<DeviceExec, Kokkos::IndexType<std::int64_t>>(exec, 0, n),
                       k);
}

}  // namespace

void apply_update(const ExecStream& on, const ElementUpdate& u, const float* grad, std::int64_t n) {
  if (n < 0)
    throw InvalidArgument("fullshard::kernels::apply_update: negative count " + std::to_string(n));
  if (n == 0) return;
  const bool adamw = u.rule == ElementUpdate::Rule::adamw;
  if (u.param == nullptr || grad == nullptr || (u.state_arrays() > 0 && u.state0 == nullptr) ||
      (adamw && u.state1 == nullptr))
    throw InvalidArgument("fullshard::kernels::apply_update: null parameter, gradient or state");
  if (adamw)
    run(on, AdamWUpdate{u, grad}, n);
  else
    run(on, SgdUpdate{u, grad}, n);
}

}  // namespace fullshard::kernels
