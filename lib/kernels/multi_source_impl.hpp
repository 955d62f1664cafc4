// The block sum of the multi-source kernels (private to the kernels layer), shared by
// reduce_sources and reduce_sources_update so that both sum alike.
#pragma once

#include <cstdint>
#include <type_traits>

#include "lib/kernels/shard_copy_impl.hpp"

namespace fullshard::kernels::detail {

/// Elements per block: the block's f32/f64 sums stay in L1.
constexpr std::int64_t kSourceBlock = 2048;

/// The accumulator of a sum in S: f64 for f64, else f32.
template <class S>
using SumAcc = std::conditional_t<std::is_same<S, F64>::value, double, float>;

/// A source element as the reduce dtype's accumulator: rounded to S first when P != S.
template <class P, class S, class A>
inline A load_as(typename P::storage x) {
  if constexpr (std::is_same<P, S>::value)
    return load<S, A>(x);
  else
    return load<S, A>(convert<P, S>(x));
}

/// acc[i] = the sum over q, in source order, of srcs[q][begin + i] as S, for i < len
/// (len <= kSourceBlock).
template <class P, class S>
inline void sum_sources(const void* const* srcs, int nsrc, std::int64_t begin, std::int64_t len,
                        SumAcc<S>* acc) {
  using PS = typename P::storage;
  using A = SumAcc<S>;
  const PS* first = static_cast<const PS*>(srcs[0]) + begin;
  for (std::int64_t i = 0; i < len; ++i)
    acc[i] = load_as<P, S, A>(first[i]);
  for (int q = 1; q < nsrc; ++q)
    host_map(static_cast<const PS*>(srcs[q]) + begin, acc, len,
             [](PS x, A a) { return a + load_as<P, S, A>(x); });
}

}  // namespace fullshard::kernels::detail
