#include "fullshard/kernels/element_update.hpp"

#include <Kokkos_Core.hpp>
#include <cmath>
#include <string>

#include "fullshard/base/error.hpp"
#include "lib/kernels/exec_stream_impl.hpp"

namespace fullshard::kernels {

namespace {

// torch.optim.SGD's update of element e (ElementUpdate::Rule::sgd).
struct SgdUpdate {
  float* w;
  const float* g;
  float* b;  // nullptr without momentum
  double lr, momentum, weight_decay;
  bool nesterov, fresh;
  SgdUpdate(const ElementUpdate& u, const float* grad)
      : w(u.param),
        g(grad),
        b(u.state0),
        lr(u.lr),
        momentum(u.momentum),
        weight_decay(u.weight_decay),
        nesterov(u.nesterov),
        fresh(u.fresh) {}
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e) const {
    double d = static_cast<double>(g[e]) + weight_decay * static_cast<double>(w[e]);
    if (b != nullptr) {
      const double buf = fresh ? d : momentum * static_cast<double>(b[e]) + d;
      b[e] = static_cast<float>(buf);
      d = nesterov ? d + momentum * buf : buf;
    }
    w[e] = static_cast<float>(static_cast<double>(w[e]) - lr * d);
  }
};

// torch.optim.AdamW's update of element e (ElementUpdate::Rule::adamw).
struct AdamWUpdate {
  float* w;
  const float* g;
  float* m;
  float* v;
  double lr, weight_decay, beta1, beta2, eps, step_size, bc2_sqrt;
  AdamWUpdate(const ElementUpdate& u, const float* grad)
      : w(u.param),
        g(grad),
        m(u.state0),
        v(u.state1),
        lr(u.lr),
        weight_decay(u.weight_decay),
        beta1(u.beta1),
        beta2(u.beta2),
        eps(u.eps),
        step_size(u.step_size),
        bc2_sqrt(u.bc2_sqrt) {}
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e) const {
    const double gd = g[e];
    double pw = static_cast<double>(w[e]) * (1.0 - lr * weight_decay);
    const double md = beta1 * static_cast<double>(m[e]) + (1.0 - beta1) * gd;
    const double vd = beta2 * static_cast<double>(v[e]) + (1.0 - beta2) * gd * gd;
    m[e] = static_cast<float>(md);
    v[e] = static_cast<float>(vd);
    pw -= step_size * md / (::sqrt(vd) / bc2_sqrt + eps);
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
    run(on, AdamWUpdate(u, grad), n);
  else
    run(on, SgdUpdate(u, grad), n);
}

}  // namespace fullshard::kernels
