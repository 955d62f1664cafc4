// The checks of a store's options and their agreement across its ranks: every rank validates
// its own options, the ranks learn whether any rank's are bad (every rank then throws
// InvalidArgument with the first bad rank's problem, so no rank waits in a later collective for
// a rank that threw), and only then compare them (RankMismatch).
#pragma once

#include <string>
#include <vector>

#include "fullshard/base/bounded_comm.hpp"
#include "fullshard/store/sample_store.hpp"

namespace fullshard::store {

/// The options' first problem ("" when none), the same text on every rank that has it.
std::string options_problem(const StoreOptions& o, Role role);

/// The options as `key = value` lines: what the ranks compare, and what a mismatch names.
std::vector<std::string> canonical_lines(const StoreOptions& o);

/// Every rank passes its own options' problem ("" when none: options_problem(), or a binding's
/// refusal): one bounded allreduce finds the first rank with one, which broadcasts its text, and
/// every rank throws InvalidArgument("<label>: bad options on rank r: <text>"). Returns when no
/// rank has a problem.
void refuse_bad_options(BoundedComm& comm, const std::string& problem, const std::string& label);

/// The ranks compare `lines` (first_difference: one fingerprint allreduce when they agree).
/// On a difference, RankMismatch on every rank naming the first differing entry, rank 0's
/// version and the first other rank's.
void agree_on_options(BoundedComm& comm, const std::vector<std::string>& lines,
                      const std::string& label);

}  // namespace fullshard::store
