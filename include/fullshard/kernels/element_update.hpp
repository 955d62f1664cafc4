// The optimizers' element-wise updates (torch.optim.SGD with dampening 0, torch.optim.AdamW)
// as kernels of the kernels layer: the optim layer keeps the state and the hyper-parameters
// and fills in an ElementUpdate for one step; the kernel runs over flat f32 arrays on the
// host or on a device stream. One source for both callers: Optimizer::step over each
// parameter's shard, and the reduction of a group whose optimizer runs inside backward
// (fsdp/shard_update.hpp) over the group's whole shard (slot layout; padding stays zero).
#pragma once

#include <cstdint>

#include "fullshard/kernels/shard_copy.hpp"

namespace fullshard::kernels {

/// One step's update of f32 elements. Computed in double per element, stored as f32.
struct ElementUpdate {
  enum class Rule : std::uint8_t { sgd, adamw };
  Rule rule = Rule::sgd;
  float* param = nullptr;   ///< updated in place
  float* state0 = nullptr;  ///< SGD: the momentum buffer (momentum != 0); AdamW: exp_avg
  float* state1 = nullptr;  ///< AdamW: exp_avg_sq
  double lr = 0.0;
  double weight_decay = 0.0;
  // SGD: g = grad + weight_decay * p; b = fresh ? g : momentum * b + g;
  // g = nesterov ? g + momentum * b : b; p -= lr * g.
  double momentum = 0.0;
  bool nesterov = false;
  bool fresh = false;  ///< the momentum buffer's first update
  // AdamW: p *= 1 - lr * wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
  // p -= step_size * m / (sqrt(v) / bc2_sqrt + eps), step_size = lr / (1 - b1^t),
  // bc2_sqrt = sqrt(1 - b2^t).
  double beta1 = 0.0, beta2 = 0.0, eps = 0.0, step_size = 0.0, bc2_sqrt = 1.0;

  /// State arrays read and written besides the parameters (0, 1 or 2).
  int state_arrays() const noexcept { return rule == Rule::adamw ? 2 : (momentum != 0.0 ? 1 : 0); }
  /// Bytes one element's update reads and writes: parameter read and written, gradient
  /// read, each state array read and written (SGD with momentum 5 x 4, AdamW 7 x 4).
  std::int64_t bytes_per_element() const noexcept { return 4 * (3 + 2 * state_arrays()); }
  /// The same step with every array advanced by `offset` elements.
  ElementUpdate at(std::int64_t offset) const noexcept;
};

/// Runs `u` over elements [0, n) with gradient `grad` (f32, n elements, where `on` runs;
/// nullptr: zeros, e.g. a shard's padding): host loop or device kernel enqueued on `on` (no
/// fence). InvalidArgument for a negative n or a null array the rule needs.
void apply_update(const ExecStream& on, const ElementUpdate& u, const float* grad, std::int64_t n);

/// The reduce-scatter's copy-out fused with the update (the optimizer inside backward): for e
/// in [0, n), `u` at element e with the gradient reduce_copy_out (f32, no accumulation) would
/// have stored, src[e] / divisor rounded once to f32; the gradient is never stored. Where `on`
/// runs (host loop, or device kernel enqueued without a fence); bitwise the two-pass result.
/// InvalidArgument for a negative n, a null array or a divisor that is not positive and finite.
void reduce_update(const ExecStream& on, const void* src, DType src_t, std::int64_t n,
                   double divisor, const ElementUpdate& u);

}  // namespace fullshard::kernels
