#include "lib/kernels/multi_source.hpp"

#include <Kokkos_Core.hpp>
#include <cmath>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "lib/kernels/element_update_impl.hpp"
#include "lib/kernels/multi_source_impl.hpp"

namespace fullshard::kernels {
namespace {

using HostExec = Kokkos::DefaultHostExecutionSpace;
using detail::kSourceBlock;

template <class P, class S, class D, bool Accumulate>
void reduce_sources_host(const void* const* srcs, int nsrc, typename D::storage* dst,
                         std::int64_t n, double divisor_d, bool divide) {
  using DS = typename D::storage;
  using A = detail::SumAcc<S>;
  using R = detail::Acc<S, D>;
  const R divisor = static_cast<R>(divisor_d);
  const std::int64_t blocks = (n + kSourceBlock - 1) / kSourceBlock;
  Kokkos::parallel_for(
      "fullshard::kernels::reduce_sources",
      Kokkos::RangePolicy<HostExec, Kokkos::IndexType<std::int64_t>>(HostExec(), 0, blocks),
      [=](std::int64_t b) {
        const std::int64_t begin = b * kSourceBlock;
        const std::int64_t len = n - begin < kSourceBlock ? n - begin : kSourceBlock;
        A acc[kSourceBlock];
        detail::sum_sources<P, S>(srcs, nsrc, begin, len, acc);
        DS* out = dst + begin;
        if (divide)
          detail::host_map(acc, out, len, [divisor](A a, DS old) {
            return detail::reduce_elem<S, D, Accumulate>(detail::store<S, A>(a), old, divisor,
                                                         true);
          });
        else
          detail::host_map(acc, out, len, [divisor](A a, DS old) {
            return detail::reduce_elem<S, D, Accumulate>(detail::store<S, A>(a), old, divisor,
                                                         false);
          });
      });
  HostExec().fence();
}

// The sum of each block rounded to S, divided and cast to f32 as reduce_sources would store
// it, then the update of the block's elements from those values (in L1).
template <class P, class S, class Rule>
void reduce_sources_update_host(const void* const* srcs, int nsrc, std::int64_t n, double divisor_d,
                                bool divide, const Rule& rule) {
  using A = detail::SumAcc<S>;
  using R = detail::Acc<S, detail::F32>;
  static_assert(detail::kUpdateBlock == kSourceBlock, "one block for the sum and the update");
  const R divisor = static_cast<R>(divisor_d);
  const std::int64_t blocks = (n + kSourceBlock - 1) / kSourceBlock;
  Kokkos::parallel_for(
      "fullshard::kernels::reduce_sources_update",
      Kokkos::RangePolicy<HostExec, Kokkos::IndexType<std::int64_t>>(HostExec(), 0, blocks),
      [=](std::int64_t b) {
        const std::int64_t begin = b * kSourceBlock;
        const std::int64_t len = n - begin < kSourceBlock ? n - begin : kSourceBlock;
        A acc[kSourceBlock];
        float g[kSourceBlock] = {};
        detail::sum_sources<P, S>(srcs, nsrc, begin, len, acc);
        if (divide)
          detail::host_map(acc, g, len, [divisor](A a, float) {
            return detail::reduce_elem<S, detail::F32, false>(detail::store<S, A>(a), 0.0f, divisor,
                                                              true);
          });
        else
          detail::host_map(acc, g, len, [divisor](A a, float) {
            return detail::reduce_elem<S, detail::F32, false>(detail::store<S, A>(a), 0.0f, divisor,
                                                              false);
          });
        detail::host_update(rule, begin, g, len);
      });
  HostExec().fence();
}

/// The checks both kernels make; false: nothing to do (n == 0).
bool check_sources(const void* const* srcs, int nsrc, std::int64_t n, double divisor,
                   const char* who) {
  const std::string k = std::string("fullshard::kernels::") + who;
  if (n < 0) throw InvalidArgument(k + ": negative count " + std::to_string(n));
  if (n == 0) return false;
  if (nsrc < 1 || !srcs) throw InvalidArgument(k + ": needs at least one source");
  for (int q = 0; q < nsrc; ++q)
    if (!srcs[q]) throw InvalidArgument(k + ": source " + std::to_string(q) + " is null");
  if (!(divisor > 0.0) || !std::isfinite(divisor))
    throw InvalidArgument(k + ": divisor " + std::to_string(divisor) +
                          " is not a positive finite number");
  return true;
}

}  // namespace

void reduce_sources(const void* const* srcs, int nsrc, DType src_t, DType reduce_t, void* dst,
                    DType dst_t, std::int64_t n, double divisor, bool accumulate) {
  if (!check_sources(srcs, nsrc, n, divisor, "reduce_sources")) return;
  if (!dst) throw InvalidArgument("fullshard::kernels::reduce_sources: null destination");
  const bool divide = divisor != 1.0;
  detail::dispatch(src_t, reduce_t, [&](auto p, auto s) {
    using P = decltype(p);
    using S = decltype(s);
    detail::dispatch_dst<S>(dst_t, [&](auto, auto d) {
      using D = decltype(d);
      auto* out = static_cast<typename D::storage*>(dst);
      if (accumulate)
        reduce_sources_host<P, S, D, true>(srcs, nsrc, out, n, divisor, divide);
      else
        reduce_sources_host<P, S, D, false>(srcs, nsrc, out, n, divisor, divide);
    });
  });
}

void reduce_sources_update(const void* const* srcs, int nsrc, DType src_t, DType reduce_t,
                           std::int64_t n, double divisor, const ElementUpdate& u) {
  if (!check_sources(srcs, nsrc, n, divisor, "reduce_sources_update")) return;
  detail::require_update_arrays(u, "reduce_sources_update");
  const bool divide = divisor != 1.0;
  detail::dispatch(src_t, reduce_t, [&](auto p, auto s) {
    using P = decltype(p);
    using S = decltype(s);
    detail::with_rule(u, [&](auto rule) {
      reduce_sources_update_host<P, S>(srcs, nsrc, n, divisor, divide, rule);
    });
  });
}

}  // namespace fullshard::kernels
