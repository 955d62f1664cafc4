// The shard copy kernels as templates on the Kokkos execution space and the element types,
// so that the same source serves Serial/OpenMP here and CUDA/HIP where Kokkos has them.
//
// Two algorithms per kernel, chosen by the execution space (the *_on functions at the end):
// - "host" (host execution spaces): a RangePolicy over runs or blocks, each a plain loop over
//   typed pointers (std::memcpy / std::memset where no cast is needed), which the compiler
//   vectorises and which reaches memcpy speed.
// - "team"/"flat" (any execution space; used where the space is not a host space, e.g. CUDA):
//   a TeamPolicy with one team per run and a TeamThreadRange over its elements; a RangePolicy
//   over the elements for the flat kernels. On Serial they give the same results but run
//   run_copies 1.1-3x slower than the host loops (measured with bench/bench_shard_copy.cpp);
//   the unit tests run them there against the host loops.
// Every kernel makes one pass over the bytes, enqueued on its execution space instance
// without a fence: the caller orders it (ExecStream::fence, or an event on the instance's
// stream).
#pragma once

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fullshard/base/dtype.hpp"
#include "fullshard/base/error.hpp"
#include "fullshard/kernels/shard_copy.hpp"

namespace fullshard::kernels::detail {

// ---- Element types ----------------------------------------------------------------------------
// One tag per DType: the storage word and conversions to and from float and double. f16/bf16
// are raw 16-bit words converted with round-to-nearest-even (dtype.hpp).

struct F32 {
  using storage = float;
  KOKKOS_INLINE_FUNCTION static float to_float(float x) { return x; }
  KOKKOS_INLINE_FUNCTION static double to_double(float x) { return x; }
  KOKKOS_INLINE_FUNCTION static float from_float(float x) { return x; }
  KOKKOS_INLINE_FUNCTION static float from_double(double x) { return static_cast<float>(x); }
};
struct F64 {
  using storage = double;
  KOKKOS_INLINE_FUNCTION static float to_float(double x) { return static_cast<float>(x); }
  KOKKOS_INLINE_FUNCTION static double to_double(double x) { return x; }
  KOKKOS_INLINE_FUNCTION static double from_float(float x) { return x; }
  KOKKOS_INLINE_FUNCTION static double from_double(double x) { return x; }
};
struct F16 {
  using storage = std::uint16_t;
  KOKKOS_INLINE_FUNCTION static float to_float(std::uint16_t x) { return f16_to_float(x); }
  KOKKOS_INLINE_FUNCTION static double to_double(std::uint16_t x) { return f16_to_float(x); }
  KOKKOS_INLINE_FUNCTION static std::uint16_t from_float(float x) { return float_to_f16(x); }
  // Through f32, as store_from_double does.
  KOKKOS_INLINE_FUNCTION static std::uint16_t from_double(double x) {
    return float_to_f16(static_cast<float>(x));
  }
};
/// float_to_bf16 (same bits, NaN included) written for vector units: signed 32-bit lanes and a
/// select, no branch (SSE2/AVX2 have signed compares and arithmetic shifts only).
KOKKOS_INLINE_FUNCTION std::uint16_t bf16_round(float f) {
  const auto u = static_cast<std::int32_t>(fullshard::float_bits(f));
  const std::int32_t lsb = (u >> 16) & 1;
  const auto rounded = static_cast<std::int32_t>(static_cast<std::uint32_t>(u) + 0x7fffu +
                                                 static_cast<std::uint32_t>(lsb));
  const std::int32_t quiet = u | 0x00400000;  // NaN: keep the payload, set the quiet bit
  const std::int32_t r = (u & 0x7fffffff) > 0x7f800000 ? quiet : rounded;
  return static_cast<std::uint16_t>(r >> 16);
}

struct BF16 {
  using storage = std::uint16_t;
  KOKKOS_INLINE_FUNCTION static float to_float(std::uint16_t x) { return bf16_to_float(x); }
  KOKKOS_INLINE_FUNCTION static double to_double(std::uint16_t x) { return bf16_to_float(x); }
  KOKKOS_INLINE_FUNCTION static std::uint16_t from_float(float x) { return bf16_round(x); }
  KOKKOS_INLINE_FUNCTION static std::uint16_t from_double(double x) {
    return bf16_round(static_cast<float>(x));
  }
};

/// Arithmetic type of a kernel on S and D: f64 if either is f64, else f32.
template <class S, class D>
constexpr bool kWide = std::is_same<S, F64>::value || std::is_same<D, F64>::value;
template <class S, class D>
using Acc = std::conditional_t<kWide<S, D>, double, float>;

template <class T, class A>
KOKKOS_INLINE_FUNCTION A load(typename T::storage x) {
  if constexpr (std::is_same<A, double>::value)
    return T::to_double(x);
  else
    return T::to_float(x);
}
template <class T, class A>
KOKKOS_INLINE_FUNCTION typename T::storage store(A v) {
  if constexpr (std::is_same<A, double>::value)
    return T::from_double(v);
  else
    return T::from_float(v);
}

/// One element of S as D (bits kept when S == D).
template <class S, class D>
KOKKOS_INLINE_FUNCTION typename D::storage convert(typename S::storage x) {
  if constexpr (std::is_same<S, D>::value)
    return x;
  else
    return store<D, Acc<S, D>>(load<S, Acc<S, D>>(x));
}

/// One element of the reduce-scatter copy-out: (old or 0) + D(src / divisor), the division in
/// Acc<S, D>, the sum in D's arithmetic (f32 for the 16-bit types) rounded once to D.
template <class S, class D, bool Accumulate>
KOKKOS_INLINE_FUNCTION typename D::storage reduce_elem(typename S::storage x,
                                                       typename D::storage old, Acc<S, D> divisor,
                                                       bool divide) {
  using A = Acc<S, D>;
  A v = load<S, A>(x);
  if (divide) v = v / divisor;
  const typename D::storage t = store<D, A>(v);
  if constexpr (!Accumulate) {
    return t;
  } else {
    using DA = std::conditional_t<std::is_same<D, F64>::value, double, float>;
    return store<D, DA>(load<D, DA>(old) + load<D, DA>(t));
  }
}

// ---- Dispatch over the 16 (src, dst) dtype pairs ---------------------------------------------

template <class S, class F>
void dispatch_dst(DType dst_t, F&& f) {
  switch (dst_t) {
    case DType::f32:
      f(S{}, F32{});
      return;
    case DType::f64:
      f(S{}, F64{});
      return;
    case DType::f16:
      f(S{}, F16{});
      return;
    case DType::bf16:
      f(S{}, BF16{});
      return;
  }
  throw InvalidArgument("shard copy kernels: unknown destination dtype");
}

/// Calls f(S{}, D{}) with the element tags of (src_t, dst_t).
template <class F>
void dispatch(DType src_t, DType dst_t, F&& f) {
  switch (src_t) {
    case DType::f32:
      return dispatch_dst<F32>(dst_t, f);
    case DType::f64:
      return dispatch_dst<F64>(dst_t, f);
    case DType::f16:
      return dispatch_dst<F16>(dst_t, f);
    case DType::bf16:
      return dispatch_dst<BF16>(dst_t, f);
  }
  throw InvalidArgument("shard copy kernels: unknown source dtype");
}

// ---- Host loops ---------------------------------------------------------------------------------

template <class Exec>
constexpr bool kHostExec = Kokkos::SpaceAccessibility<Exec, Kokkos::HostSpace>::accessible;

/// Elements per block of the flat host kernels (and most elements per piece of a host plan):
/// large enough that the per-block cost vanishes, small enough to spread over host threads.
constexpr std::int64_t kHostBlock = std::int64_t{1} << 20;
/// Most elements per piece of a plan for the team algorithm: one team each.
constexpr std::int64_t kTeamBlock = std::int64_t{1} << 16;

// On x86-64 builds for the baseline ISA (SSE2), the host loops also get an AVX2 copy, chosen
// at run time: casts and the reduce-scatter copy-out are compute-bound at 4 lanes. No FMA, so
// both copies round exactly alike. Not in device compilers' passes (nvcc, hipcc).
#if defined(__x86_64__) && !defined(__AVX2__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(__CUDACC__) && !defined(__HIPCC__)
#define FULLSHARD_KERNELS_AVX2_CLONE 1
#define FULLSHARD_KERNELS_LOOP inline __attribute__((always_inline))
#else
#define FULLSHARD_KERNELS_AVX2_CLONE 0
#define FULLSHARD_KERNELS_LOOP inline
#endif

/// d[i] = op(s[i], d[i]) for i in [0, n): blocks of a fixed count, which GCC vectorises at -O2
/// too (its very cheap cost model wants a trip count that is a multiple of the vector length
/// and no run-time alias checks, hence the restrict pointers), then the tail one by one.
template <class T, class U, class Op>
FULLSHARD_KERNELS_LOOP void host_map_loop(const T* KOKKOS_RESTRICT s, U* KOKKOS_RESTRICT d,
                                          std::int64_t n, Op op) {
  constexpr int kLanes = 16;
  const std::int64_t body = n - n % kLanes;
  for (std::int64_t i = 0; i < body; i += kLanes)
    for (int j = 0; j < kLanes; ++j)
      d[i + j] = op(s[i + j], d[i + j]);
  for (std::int64_t i = body; i < n; ++i)
    d[i] = op(s[i], d[i]);
}

#if FULLSHARD_KERNELS_AVX2_CLONE
template <class T, class U, class Op>
__attribute__((target("avx2"))) void host_map_avx2(const T* KOKKOS_RESTRICT s, U* KOKKOS_RESTRICT d,
                                                   std::int64_t n, Op op) {
  host_map_loop(s, d, n, op);
}
inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

template <class T, class U, class Op>
inline void host_map(const T* s, U* d, std::int64_t n, Op op) {
#if FULLSHARD_KERNELS_AVX2_CLONE
  if (cpu_has_avx2()) return host_map_avx2(s, d, n, op);
#endif
  host_map_loop(s, d, n, op);
}

template <class S, class D>
inline void host_convert(const typename S::storage* s, typename D::storage* d, std::int64_t n) {
  using DS = typename D::storage;
  if (n <= 0) return;
  if constexpr (std::is_same<S, D>::value)
    std::memcpy(d, s, static_cast<std::size_t>(n) * sizeof(DS));
  else
    host_map(s, d, n, [](typename S::storage x, DS) { return convert<S, D>(x); });
}

template <class D>
inline void host_zero(typename D::storage* d, std::int64_t n) {
  // +0 is all zero bits in every dtype.
  if (n > 0) std::memset(d, 0, static_cast<std::size_t>(n) * sizeof(typename D::storage));
}

template <class S, class D, bool Accumulate>
inline void host_reduce(const typename S::storage* s, typename D::storage* d, std::int64_t n,
                        Acc<S, D> divisor, bool divide) {
  using SS = typename S::storage;
  using DS = typename D::storage;
  // Two loops so that neither tests `divide` per element.
  if (divide)
    host_map(s, d, n, [divisor](SS x, DS old) {
      return reduce_elem<S, D, Accumulate>(x, old, divisor, true);
    });
  else
    host_map(s, d, n, [divisor](SS x, DS old) {
      return reduce_elem<S, D, Accumulate>(x, old, divisor, false);
    });
}

// ---- run_copies -----------------------------------------------------------------------------

/// Host algorithm: one iteration per run, a vectorised loop (or memcpy) inside.
template <class Exec, class S, class D, class RunView>
void run_copies_host(const Exec& exec, const RunView& runs, const typename S::storage* src,
                     typename D::storage* dst) {
  static_assert(kHostExec<Exec>, "run_copies_host needs a host execution space");
  const CopyRun* r = runs.data();
  Kokkos::parallel_for("fullshard::kernels::run_copies",
                       Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(
                           exec, 0, static_cast<std::int64_t>(runs.extent(0))),
                       [=](std::int64_t k) {
                         const CopyRun run = r[k];
                         host_convert<S, D>(src + run.src_offset, dst + run.dst_offset, run.len);
                         host_zero<D>(dst + run.dst_offset + run.len, run.pad);
                       });
}

/// Portable algorithm: one team per run, its elements over the team's threads.
template <class Exec, class S, class D, class RunView>
void run_copies_team(const Exec& exec, const RunView& runs, const typename S::storage* src,
                     typename D::storage* dst) {
  using Policy = Kokkos::TeamPolicy<Exec>;
  using Member = typename Policy::member_type;
  using DS = typename D::storage;
  const int league = static_cast<int>(runs.extent(0));
  if (league == 0) return;
  Kokkos::parallel_for(
      "fullshard::kernels::run_copies", Policy(exec, league, Kokkos::AUTO),
      KOKKOS_LAMBDA(const Member& team) {
        const CopyRun run = runs(team.league_rank());
        const typename S::storage* s = src + run.src_offset;
        DS* d = dst + run.dst_offset;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, run.len),
                             [&](std::int64_t i) { d[i] = convert<S, D>(s[i]); });
        DS* z = d + run.len;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, run.pad),
                             [&](std::int64_t i) { z[i] = DS(0); });
      });
}

// ---- cast_copy --------------------------------------------------------------------------------

template <class Exec, class S, class D>
void cast_copy_host(const Exec& exec, const typename S::storage* src, typename D::storage* dst,
                    std::int64_t n) {
  static_assert(kHostExec<Exec>, "cast_copy_host needs a host execution space");
  const std::int64_t blocks = (n + kHostBlock - 1) / kHostBlock;
  Kokkos::parallel_for("fullshard::kernels::cast_copy",
                       Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(exec, 0, blocks),
                       [=](std::int64_t b) {
                         const std::int64_t begin = b * kHostBlock;
                         const std::int64_t len = n - begin < kHostBlock ? n - begin : kHostBlock;
                         host_convert<S, D>(src + begin, dst + begin, len);
                       });
}

template <class Exec, class S, class D>
void cast_copy_flat(const Exec& exec, const typename S::storage* src, typename D::storage* dst,
                    std::int64_t n) {
  Kokkos::parallel_for(
      "fullshard::kernels::cast_copy",
      Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(exec, 0, n),
      KOKKOS_LAMBDA(std::int64_t i) { dst[i] = convert<S, D>(src[i]); });
}

// ---- reduce_copy_out ----------------------------------------------------------------------------

template <class Exec, class S, class D, bool Accumulate>
void reduce_copy_out_host(const Exec& exec, const typename S::storage* src,
                          typename D::storage* dst, std::int64_t n, Acc<S, D> divisor,
                          bool divide) {
  static_assert(kHostExec<Exec>, "reduce_copy_out_host needs a host execution space");
  const std::int64_t blocks = (n + kHostBlock - 1) / kHostBlock;
  Kokkos::parallel_for("fullshard::kernels::reduce_copy_out",
                       Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(exec, 0, blocks),
                       [=](std::int64_t b) {
                         const std::int64_t begin = b * kHostBlock;
                         const std::int64_t len = n - begin < kHostBlock ? n - begin : kHostBlock;
                         host_reduce<S, D, Accumulate>(src + begin, dst + begin, len, divisor,
                                                       divide);
                       });
}

template <class Exec, class S, class D, bool Accumulate>
void reduce_copy_out_flat(const Exec& exec, const typename S::storage* src,
                          typename D::storage* dst, std::int64_t n, Acc<S, D> divisor,
                          bool divide) {
  Kokkos::parallel_for(
      "fullshard::kernels::reduce_copy_out",
      Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(exec, 0, n),
      KOKKOS_LAMBDA(std::int64_t i) {
        dst[i] = reduce_elem<S, D, Accumulate>(src[i], dst[i], divisor, divide);
      });
}

// ---- The algorithm of an execution space --------------------------------------------------------

/// Most elements per piece of a copy plan run on Exec.
template <class Exec>
constexpr std::int64_t kPlanBlock = kHostExec<Exec> ? kHostBlock : kTeamBlock;

template <class Exec, class S, class D, class RunView>
void run_copies_on(const Exec& exec, const RunView& runs, const typename S::storage* src,
                   typename D::storage* dst) {
  if constexpr (kHostExec<Exec>)
    run_copies_host<Exec, S, D>(exec, runs, src, dst);
  else
    run_copies_team<Exec, S, D>(exec, runs, src, dst);
}

template <class Exec, class S, class D>
void cast_copy_on(const Exec& exec, const typename S::storage* src, typename D::storage* dst,
                  std::int64_t n) {
  if constexpr (kHostExec<Exec>)
    cast_copy_host<Exec, S, D>(exec, src, dst, n);
  else
    cast_copy_flat<Exec, S, D>(exec, src, dst, n);
}

template <class Exec, class S, class D, bool Accumulate>
void reduce_copy_out_on(const Exec& exec, const typename S::storage* src, typename D::storage* dst,
                        std::int64_t n, Acc<S, D> divisor, bool divide) {
  if constexpr (kHostExec<Exec>)
    reduce_copy_out_host<Exec, S, D, Accumulate>(exec, src, dst, n, divisor, divide);
  else
    reduce_copy_out_flat<Exec, S, D, Accumulate>(exec, src, dst, n, divisor, divide);
}

// ---- Kokkos::Cuda: explicit instantiations ---------------------------------------------------
// With a CUDA-enabled Kokkos, every (src, dst) pair of the three kernels is instantiated for
// Kokkos::Cuda once, in lib/kernels/shard_copy_cuda.cpp; other translation units (shard_copy.cpp)
// see these extern declarations and do not compile the device code again.
#if defined(KOKKOS_ENABLE_CUDA)
using CudaRunView = Kokkos::View<CopyRun*, Kokkos::CudaSpace>;
#define FULLSHARD_KERNELS_CUDA_PAIR(EXTERN, S, D)                                               \
  EXTERN template void run_copies_on<Kokkos::Cuda, S, D, CudaRunView>(                          \
      const Kokkos::Cuda&, const CudaRunView&, const S::storage*, D::storage*);                 \
  EXTERN template void cast_copy_on<Kokkos::Cuda, S, D>(const Kokkos::Cuda&, const S::storage*, \
                                                        D::storage*, std::int64_t);             \
  EXTERN template void reduce_copy_out_on<Kokkos::Cuda, S, D, true>(                            \
      const Kokkos::Cuda&, const S::storage*, D::storage*, std::int64_t, Acc<S, D>, bool);      \
  EXTERN template void reduce_copy_out_on<Kokkos::Cuda, S, D, false>(                           \
      const Kokkos::Cuda&, const S::storage*, D::storage*, std::int64_t, Acc<S, D>, bool);
#define FULLSHARD_KERNELS_CUDA_SRC(EXTERN, S) \
  FULLSHARD_KERNELS_CUDA_PAIR(EXTERN, S, F32) \
  FULLSHARD_KERNELS_CUDA_PAIR(EXTERN, S, F64) \
  FULLSHARD_KERNELS_CUDA_PAIR(EXTERN, S, F16) \
  FULLSHARD_KERNELS_CUDA_PAIR(EXTERN, S, BF16)
#define FULLSHARD_KERNELS_CUDA_ALL(EXTERN) \
  FULLSHARD_KERNELS_CUDA_SRC(EXTERN, F32)  \
  FULLSHARD_KERNELS_CUDA_SRC(EXTERN, F64)  \
  FULLSHARD_KERNELS_CUDA_SRC(EXTERN, F16)  \
  FULLSHARD_KERNELS_CUDA_SRC(EXTERN, BF16)
#if !defined(FULLSHARD_KERNELS_INSTANTIATE_CUDA)
FULLSHARD_KERNELS_CUDA_ALL(extern)
#endif
#endif

}  // namespace fullshard::kernels::detail
