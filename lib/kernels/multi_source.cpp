#include "fullshard/kernels/multi_source.hpp"

#include <Kokkos_Core.hpp>
#include <cmath>
#include <string>
#include <vector>

#include "fullshard/base/error.hpp"
#include "lib/kernels/shard_copy_impl.hpp"

namespace fullshard::kernels {
namespace {

using HostExec = Kokkos::DefaultHostExecutionSpace;

/// Elements per block: the block's f32/f64 sums stay in L1.
constexpr std::int64_t kBlock = 2048;

/// A source element as the reduce dtype's accumulator: rounded to S first when P != S.
template <class P, class S, class A>
inline A load_as(typename P::storage x) {
  if constexpr (std::is_same<P, S>::value)
    return detail::load<S, A>(x);
  else
    return detail::load<S, A>(detail::convert<P, S>(x));
}

template <class P, class S, class D, bool Accumulate>
void reduce_sources_host(const void* const* srcs, int nsrc, typename D::storage* dst,
                         std::int64_t n, double divisor_d, bool divide) {
  using PS = typename P::storage;
  using DS = typename D::storage;
  using A = std::conditional_t<std::is_same<S, detail::F64>::value, double, float>;
  using R = detail::Acc<S, D>;
  const R divisor = static_cast<R>(divisor_d);
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
  Kokkos::parallel_for(
      "fullshard::kernels::reduce_sources",
      Kokkos::RangePolicy<HostExec, Kokkos::IndexType<std::int64_t>>(HostExec(), 0, blocks),
      [=](std::int64_t b) {
        const std::int64_t begin = b * kBlock;
        const std::int64_t len = n - begin < kBlock ? n - begin : kBlock;
        A acc[kBlock];
        const PS* first = static_cast<const PS*>(srcs[0]) + begin;
        for (std::int64_t i = 0; i < len; ++i)
          acc[i] = load_as<P, S, A>(first[i]);
        for (int q = 1; q < nsrc; ++q)
          detail::host_map(static_cast<const PS*>(srcs[q]) + begin, acc, len,
                           [](PS x, A a) { return a + load_as<P, S, A>(x); });
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

}  // namespace

void reduce_sources(const void* const* srcs, int nsrc, DType src_t, DType reduce_t, void* dst,
                    DType dst_t, std::int64_t n, double divisor, bool accumulate) {
  if (n < 0)
    throw InvalidArgument("fullshard::kernels::reduce_sources: negative count " +
                          std::to_string(n));
  if (n == 0) return;
  if (nsrc < 1 || !srcs || !dst)
    throw InvalidArgument(
        "fullshard::kernels::reduce_sources: needs at least one source and a "
        "destination");
  for (int q = 0; q < nsrc; ++q)
    if (!srcs[q])
      throw InvalidArgument("fullshard::kernels::reduce_sources: source " + std::to_string(q) +
                            " is null");
  if (!(divisor > 0.0) || !std::isfinite(divisor))
    throw InvalidArgument("fullshard::kernels::reduce_sources: divisor " + std::to_string(divisor) +
                          " is not a positive finite number");
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

}  // namespace fullshard::kernels
