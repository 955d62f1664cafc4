// Kernels that read several source buffers at once: the reduce side of the node-local
// shared-memory collectives (lib/comm/shm.hpp), where the sources are the peers'
// segments of a window. Host execution space only (peers' memory is host memory).
#pragma once

#include <cstdint>

#include "fullshard/base/dtype.hpp"
#include "fullshard/kernels/element_update.hpp"

namespace fullshard::kernels {

/// The reduce-scatter of one rank, fused with its copy-in and copy-out: for i < n,
///   sum[i] = r(srcs[0][i]) + ... + r(srcs[nsrc-1][i])
/// where r() rounds a src_t element to reduce_t (the copy-in's cast; nothing when they are
/// equal), accumulated in f32 (f64 when reduce_t is f64) in source order and rounded once to
/// reduce_t, then
///   dst[i] = (accumulate ? dst[i] : 0) + cast<dst_t>(sum[i] / divisor)
/// exactly as reduce_copy_out does it (divisor 1: no division). With dst_t == reduce_t,
/// divisor 1 and no accumulation this is the plain reduce-scatter output. One pass over the
/// sources, on Kokkos::DefaultHostExecutionSpace; returns when it is done. nsrc >= 1.
void reduce_sources(const void* const* srcs, int nsrc, DType src_t, DType reduce_t, void* dst,
                    DType dst_t, std::int64_t n, double divisor, bool accumulate);

/// reduce_sources into f32 (no accumulation) fused with the update (the optimizer inside
/// backward): `u` at element i with the gradient reduce_sources would have stored at dst[i];
/// the gradient is never stored. Bitwise the two-pass result; returns when it is done.
void reduce_sources_update(const void* const* srcs, int nsrc, DType src_t, DType reduce_t,
                           std::int64_t n, double divisor, const ElementUpdate& u);

}  // namespace fullshard::kernels
