// The optimizers' element rules as functors (private to the kernels layer): one element's
// update from its gradient value. apply_update reads the gradient from an array; the fused
// reductions (reduce_update, reduce_sources_update) hand over the value where they compute it.
// One definition, so a fused and an unfused update round alike.
#pragma once

#include <Kokkos_Core.hpp>
#include <cmath>
#include <cstdint>

#include "fullshard/kernels/element_update.hpp"
#include "lib/kernels/shard_copy_impl.hpp"

namespace fullshard::kernels::detail {

// torch.optim.SGD's update of element e (ElementUpdate::Rule::sgd) without momentum.
struct SgdRule {
  ElementUpdate u;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e, float grad) const {
    float* w = u.param;
    const double d = static_cast<double>(grad) + u.weight_decay * static_cast<double>(w[e]);
    w[e] = static_cast<float>(static_cast<double>(w[e]) - u.lr * d);
  }
};

// ... with momentum (its buffer in state0); the first step (Fresh) and Nesterov as template
// arguments: no branch per element, so the host loop vectorises.
template <bool Fresh, bool Nesterov>
struct SgdMomentumRule {
  ElementUpdate u;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e, float grad) const {
    float* w = u.param;
    float* b = u.state0;
    const double d = static_cast<double>(grad) + u.weight_decay * static_cast<double>(w[e]);
    double buf = d;
    if constexpr (!Fresh) buf = u.momentum * static_cast<double>(b[e]) + d;
    b[e] = static_cast<float>(buf);
    double step = buf;
    if constexpr (Nesterov) step = d + u.momentum * buf;
    w[e] = static_cast<float>(static_cast<double>(w[e]) - u.lr * step);
  }
};

// torch.optim.AdamW's update of element e (ElementUpdate::Rule::adamw).
struct AdamWRule {
  ElementUpdate u;
  KOKKOS_INLINE_FUNCTION void operator()(std::int64_t e, float grad) const {
    float* w = u.param;
    float* m = u.state0;
    float* v = u.state1;
    const double gd = grad;
    double pw = static_cast<double>(w[e]) * (1.0 - u.lr * u.weight_decay);
    const double md = u.beta1 * static_cast<double>(m[e]) + (1.0 - u.beta1) * gd;
    const double vd = u.beta2 * static_cast<double>(v[e]) + (1.0 - u.beta2) * gd * gd;
    m[e] = static_cast<float>(md);
    v[e] = static_cast<float>(vd);
    pw -= u.step_size * md / (::sqrt(vd) / u.bc2_sqrt + u.eps);
    w[e] = static_cast<float>(pw);
  }
};

/// InvalidArgument (naming `who`) for a null array the rule needs.
void require_update_arrays(const ElementUpdate& u, const char* who);

/// Calls f(rule) with u's rule functor.
template <class F>
void with_rule(const ElementUpdate& u, F&& f) {
  if (u.rule == ElementUpdate::Rule::adamw)
    f(AdamWRule{u});
  else if (u.state_arrays() > 0 && u.fresh)
    u.nesterov ? f(SgdMomentumRule<true, true>{u}) : f(SgdMomentumRule<true, false>{u});
  else if (u.state_arrays() > 0)
    u.nesterov ? f(SgdMomentumRule<false, true>{u}) : f(SgdMomentumRule<false, false>{u});
  else
    f(SgdRule{u});
}

template <class Rule>
FULLSHARD_KERNELS_LOOP void host_update_loop(const Rule& rule, std::int64_t first,
                                             const float* grad, std::int64_t n) {
  if (grad == nullptr) {
    for (std::int64_t i = 0; i < n; ++i)
      rule(first + i, 0.0f);
    return;
  }
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#pragma GCC ivdep
#endif
  for (std::int64_t i = 0; i < n; ++i)
    rule(first + i, grad[i]);
}

#if FULLSHARD_KERNELS_AVX2_CLONE
template <class Rule>
__attribute__((target("avx2"))) void host_update_avx2(const Rule& rule, std::int64_t first,
                                                      const float* grad, std::int64_t n) {
  host_update_loop(rule, first, grad, n);
}
#endif

/// rule(first + i, grad[i]) for i in [0, n) on the host (grad nullptr: zeros): the arrays
/// never overlap (no run-time alias check). The rules compute in double: an AVX2 copy, where
/// the CPU has it, runs 4 lanes where the baseline's SSE2 runs 2 (no FMA: the same bits).
template <class Rule>
inline void host_update(const Rule& rule, std::int64_t first, const float* grad, std::int64_t n) {
#if FULLSHARD_KERNELS_AVX2_CLONE
  if (cpu_has_avx2()) return host_update_avx2(rule, first, grad, n);
#endif
  host_update_loop(rule, first, grad, n);
}

/// Elements per block of the fused host loops: the block's gradients stay in L1 between the
/// reduction's loop and the update's.
constexpr std::int64_t kUpdateBlock = 2048;

}  // namespace fullshard::kernels::detail
