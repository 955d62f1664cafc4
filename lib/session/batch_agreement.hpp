// The ranks' agreement on a step's batch: every rank's batch must have the same shapes but the
// first (batch) dim and the same dtypes, or the collectives of the step would mismatch (a hang
// until FULLSHARD_TIMEOUT, or wrong numbers). One all-reduce of a 64-bit hash (and its
// complement) per step; on a difference, the ranks' descriptions are exchanged and every rank
// throws the same InvalidArgument naming the ranks and their shapes. Private to lib/session.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "fullshard/base/bounded_comm.hpp"

namespace fullshard::session::detail {

/// "inputs[0] f32 (*, 4); targets[0] i64 (*)": what the ranks must agree on ('*' is the
/// batch dim, which may differ).
std::string describe_batch(const std::vector<at::Tensor>& inputs,
                           const std::vector<at::Tensor>& targets);

/// "" when every element of the floating tensors is finite; else what the first holds and
/// where: "input 0 holds nan at [3, 2]" (`what`: "input", "target").
std::string non_finite_in(const std::vector<at::Tensor>& tensors, const char* what);

/// Collective over `comm`: returns when every rank's `description` is the same; otherwise
/// throws InvalidArgument on every rank, the same message, naming `call`, the ranks and what
/// each has. `bad_data`: this rank's non_finite_in (empty: none); returns the lowest such
/// rank's, "rank R: <its bad_data>", on every rank (empty when no rank has one). One
/// all-reduce of three 64-bit words.
std::string agree_on_batch(BoundedComm& comm, const std::string& description,
                           const std::string& call, const std::string& bad_data = {});

}  // namespace fullshard::session::detail
