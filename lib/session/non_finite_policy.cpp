#include "lib/session/non_finite_policy.hpp"

#include <cstdio>
#include <limits>
#include <utility>

#include "fullshard/base/error.hpp"

namespace fullshard::session {

NonFinitePolicy::NonFinitePolicy(NonFiniteSpec spec, std::string stop_hint, std::string limit_hint)
    : spec_(std::move(spec)), stop_hint_(std::move(stop_hint)), limit_hint_(std::move(limit_hint)) {
  if (spec_.policy != "skip" && spec_.policy != "stop")
    throw InvalidArgument("non-finite policy '" + spec_.policy + "': expected skip or stop");
}

double NonFinitePolicy::bad_step(std::int64_t step, const std::string& what, bool applied,
                                 int rank) {
  const std::string name = "step " + std::to_string(step);
  if (applied)
    throw InvalidArgument(name + ": " + what +
                          "; the optimizer inside backward applied the step before it could be "
                          "checked, so the run stops (resume from the last checkpoint)");
  ++skipped_;
  if (spec_.policy == "stop")
    throw InvalidArgument(name + ": " + what + "; the step was not applied (" + stop_hint_ + ")");
  if (skipped_ > spec_.max_skipped)
    throw InvalidArgument(name + ": " + what + "; the step was not applied (" +
                          std::to_string(skipped_) + " steps skipped, more than " + limit_hint_ +
                          ")");
  if (rank == 0)
    std::fprintf(stderr, "fullshard[rank 0]: warning: %s skipped (%lld so far): %s\n", name.c_str(),
                 static_cast<long long>(skipped_), what.c_str());
  return std::numeric_limits<double>::quiet_NaN();
}

}  // namespace fullshard::session
