// What a training loop does with a step found holding a NaN or an infinity (the session's
// "non_finite" configuration, fullshard-train's --non-finite): count it, and skip it or stop.
// One rule for every front end, and for a loop of one's own (no LibTorch needed):
//
//   fullshard::session::NonFinitePolicy policy(spec, "--non-finite stop", "--max-skipped 10");
//   double loss = mean_over_ranks(local_loss, grads_ok);   // NaN when any rank's is bad
//   if (std::isfinite(loss)) opt.step(); else loss = policy.bad_step(step, "...", false, rank);
#pragma once

#include <cstdint>
#include <string>

#include "fullshard/session/config.hpp"

namespace fullshard::session {

class NonFinitePolicy {
 public:
  /// `stop_hint`, `limit_hint`: how the user chose the policy and the limit, named in the
  /// refusal (a configuration's keys, a program's options).
  NonFinitePolicy(NonFiniteSpec spec, std::string stop_hint, std::string limit_hint);

  /// Step `step` (counted from 1) holds a non-finite value (`what`, the same on every rank):
  /// counted; an InvalidArgument (the same on every rank) when the policy is stop, when more
  /// than max_skipped steps were skipped, or when the update was already `applied` (the
  /// optimizer inside backward); else rank 0 prints one line and NaN is returned (the step's
  /// loss: skipped).
  double bad_step(std::int64_t step, const std::string& what, bool applied, int rank);
  std::int64_t skipped() const noexcept { return skipped_; }

 private:
  NonFiniteSpec spec_;
  std::string stop_hint_, limit_hint_;
  std::int64_t skipped_ = 0;
};

}  // namespace fullshard::session
