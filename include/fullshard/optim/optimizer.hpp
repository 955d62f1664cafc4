// Optimizers for fully_shard'ed models (torch.optim on DTensor parameters): every update
// works on this rank's local shard of each parameter (Parameter::data()) from its local
// sharded gradient (Parameter::grad()), so the optimizer state is sharded exactly like the
// parameters and step() needs no communication. clip_grad_norm needs one all-reduce.
// Device shards (fully_shard on a CUDA mesh) are updated by Kokkos kernels on the CUDA
// execution space, enqueued on the mesh's compute stream (after the backward's gradients,
// before the next forward's all-gathers, with no host synchronisation); host shards by the
// same element-wise code in a loop on the host. The state lives where the shard lives.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "fullshard/graph/module.hpp"
#include "fullshard/kernels/element_update.hpp"
#include "fullshard/mesh/device_mesh.hpp"
#include "fullshard/tensor/tensor.hpp"

namespace fullshard::fsdp {
struct ShardGroupView;
}

namespace fullshard::optim {

/// Opaque: the device execution-space instances an optimizer launches on, one per stream, created
/// on first use and kept (a Kokkos::Cuda instance allocates its scratch memory when created).
/// Defined in lib/optim/optimizer.cpp.
struct DeviceExec;
/// Opaque: the ShardUpdate the FSDP groups of an optimizer inside backward call (optimizer.cpp).
class InBackward;

/// Base class: holds the parameters, the step count and per-parameter state tensors (named
/// by the subclass, allocated on a parameter's first update with its local shard's shape).
/// Parameters must be f32, in host or device memory (the state is allocated in the same
/// memory); errors are InvalidArgument naming the parameter.
class Optimizer {
 public:
  /// `params`: e.g. root.parameters(). No null pointers, no duplicates, f32 only.
  explicit Optimizer(std::vector<graph::Parameter*> params);
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// One update of every parameter that has a gradient (others are skipped). Every
  /// parameter is checked (gradient shape equals the shard's shape, f32, in the shard's
  /// memory) before any is written. Device shards: kernels on the compute stream of the
  /// parameter's FSDP mesh (the default stream outside FSDP); step() returns without waiting
  /// for them. Not collective.
  void step();
  /// Drops the gradients: FSDPModule::zero_grad on the FSDP states owning the parameters;
  /// gradients of parameters outside any FSDP module are filled with zeros.
  void zero_grad();

  /// The optimizer inside backward (fsdp/shard_update.hpp): from the next backward on, every
  /// FSDP group holding these parameters updates its shards as soon as its reduction lands,
  /// on the reduction's stream, in one pass over the group's shard (gsn elements: the same
  /// bits as step()); its parameters then show no gradient after backward. Parameters outside
  /// FSDP are still updated by step(), which then counts as the same step. The learning rate
  /// (lr) is read when a group's update is issued: set it before backward. Refused
  /// (InvalidArgument naming the group): a group with parameters this optimizer does not
  /// hold, an optimizer without an element update (a subclass that only overrides update();
  /// inside backward element_update()'s rule runs, not an override of update()), a group
  /// whose backward has begun, offloaded shards (then no group is registered); later,
  /// clip_grad_norm on its parameters and the policies fsdp/shard_update.hpp lists. false:
  /// step() updates every parameter again. Call run_in_backward(false) before destroying the
  /// optimizer: groups still registered then fail their next backward (until
  /// fsdp::update_in_backward(st, nullptr)).
  void run_in_backward(bool enable = true);
  bool runs_in_backward() const noexcept { return in_backward_ != nullptr; }

  /// Parameters updated without weight decay (torch: a parameter group with weight_decay 0;
  /// GPT-2 decays only its matrices, not biases, norms and embeddings); replaces an earlier
  /// call's list. Each must be a parameter of this optimizer (InvalidArgument naming it).
  /// Inside backward a group's update covers its whole shard with one rule: a group holding
  /// parameters with and without weight decay is refused (InvalidArgument naming the group
  /// and one parameter of each kind, here or by run_in_backward).
  void set_no_weight_decay(const std::vector<graph::Parameter*>& params);
  bool has_weight_decay(const graph::Parameter& p) const;

  /// Number of step() calls (or the loaded "step"); inside backward, of steps taken.
  std::int64_t steps() const noexcept { return step_; }
  const std::vector<graph::Parameter*>& params() const noexcept { return params_; }
  /// Names of the per-parameter state tensors ("momentum_buffer", "exp_avg", ...).
  virtual std::vector<std::string> state_names() const = 0;

  /// Copies of the state in host memory: "<fqn>.<state name>" for every parameter whose state
  /// exists (local shard shape, f32; device state is copied after the kernels enqueued on the
  /// compute stream), and "step" (f64, shape (1,)).
  std::map<std::string, Tensor> state_dict() const;
  /// The state tensors themselves (in the shard's memory), keyed like state_dict() but without
  /// "step" (steps()): no copy; valid until the next step() or load_state_dict(). Checkpoints
  /// are written from these (device state staged through pinned host memory).
  std::map<std::string, Tensor> state_views() const;
  /// Replaces the state (parameters absent from `state` lose theirs, as in torch). Checked
  /// before anything is written: "step" missing or not a non-negative integer, a key that
  /// names no parameter/state (unexpected), a parameter with only some of its state keys
  /// (missing), a wrong shape or dtype, a tensor neither in host memory nor in the shard's:
  /// InvalidArgument naming the key. Host tensors for a device shard are copied to the device.
  void load_state_dict(const std::map<std::string, Tensor>& state);
  /// The same, taking the state tensors instead of copying them (the caller must not use
  /// them afterwards): checkpoint loads read straight into the tensors the optimizer keeps
  /// (tensors in another memory than the shard's are copied into the shard's memory).
  void load_state_dict(std::map<std::string, Tensor>&& state);
  /// load_state_dict's checks without writing anything: InvalidArgument as it would throw.
  void check_state_dict(const std::map<std::string, Tensor>& state) const;

 protected:
  /// Updates p.data() from `grad`; `state` holds state_names().size() tensors of the
  /// shard's shape, zero-filled when `fresh` (the parameter's first update). `step` counts
  /// from 1. The default runs element_update()'s rule (kernels::apply_update, where the shard
  /// is); a subclass without one overrides this.
  virtual void update(graph::Parameter& p, const Tensor& grad, std::vector<Tensor>& state,
                      bool fresh, std::int64_t step);
  /// The scalars of one update (u.rule and its hyper-parameters; the arrays are filled in by
  /// the caller) for the element-wise optimizers; false (the default): this optimizer has no
  /// element update, and cannot run inside backward.
  virtual bool element_update(kernels::ElementUpdate& /*u*/, bool /*fresh*/,
                              std::int64_t /*step*/) const {
    return false;
  }
  /// During update(): the cudaStream_t device kernels of that parameter go on (the compute
  /// stream of its FSDP mesh; nullptr for host shards and outside FSDP).
  void* stream() const noexcept { return stream_; }
  /// The instances device kernels are launched on (see DeviceExec).
  DeviceExec& device_exec() const noexcept { return *exec_; }

 private:
  std::int64_t checked_step(const std::map<std::string, Tensor>& state,
                            std::vector<bool>* has_state = nullptr) const;
  friend class InBackward;
  /// With `in_backward`: InvalidArgument when a group of these parameters mixes parameters
  /// with and without weight decay.
  void check_group_decay(bool in_backward) const;
  /// The update of one group inside backward: its state in slot layout (made on the group's
  /// first update, from the per-parameter state when there is some), its step count.
  kernels::ElementUpdate prepare_group(const fsdp::ShardGroupView& g);
  struct GroupState {
    std::vector<Tensor> state;  // gsn elements per state name; state_ views them
    std::int64_t step = 0;
  };

  std::vector<graph::Parameter*> params_;
  std::vector<std::vector<Tensor>> state_;  // per parameter: empty until first update
  std::vector<bool> no_decay_;              // per parameter: updated without weight decay
  bool updating_no_decay_ = false;          // during update(): the parameter's no_decay_
  std::int64_t step_ = 0;
  void* stream_ = nullptr;
  std::shared_ptr<DeviceExec> exec_;
  std::shared_ptr<InBackward> in_backward_;   // null: step() updates everything
  std::map<const void*, GroupState> groups_;  // by group layout, inside backward
  std::unordered_map<const graph::Parameter*, std::size_t> index_;  // into params_ (all of them)
  std::int64_t base_step_ = 0;        // a group's count starts here (run_in_backward, load)
  bool stepped_in_backward_ = false;  // a group updated since the last step()
};

/// torch.optim.SGD (dampening 0): g = grad + weight_decay * p; with momentum,
/// b = g on the first update, else b = momentum * b + g, and g = nesterov ? g + momentum * b
/// : b; p -= lr * g. Computed in double per element, stored as f32.
class SGD : public Optimizer {
 public:
  SGD(std::vector<graph::Parameter*> params, double lr, double momentum = 0.0,
      double weight_decay = 0.0, bool nesterov = false);
  std::vector<std::string> state_names() const override;
  double lr = 0.0;

 protected:
  bool element_update(kernels::ElementUpdate& u, bool fresh, std::int64_t step) const override;

 private:
  double momentum_, weight_decay_;
  bool nesterov_;
};

/// torch.optim.AdamW: p *= 1 - lr * wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
/// p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps). t is the optimizer's step
/// count (torch's per-parameter step when every parameter has a gradient at every step).
/// Computed in double per element, stored as f32.
class AdamW : public Optimizer {
 public:
  AdamW(std::vector<graph::Parameter*> params, double lr, double beta1 = 0.9, double beta2 = 0.999,
        double eps = 1e-8, double weight_decay = 0.01);
  std::vector<std::string> state_names() const override;
  double lr = 0.0;

 protected:
  bool element_update(kernels::ElementUpdate& u, bool fresh, std::int64_t step) const override;

 private:
  double beta1_, beta2_, eps_, weight_decay_;
};

/// What local_sum_squares sums.
enum class Values { gradients, parameters };

/// The sum of squares (f64) of this rank's local shards of the parameters' gradients (those
/// that have one) or of the parameters themselves: clip_grad_norm's local part, and a
/// non-finite check (the sum is finite exactly when every element is: an f32 square cannot
/// overflow f64). Not collective. Device tensors (f32): kernels on the mesh's compute stream and
/// one copy of the per-tensor sums to the host.
double local_sum_squares(const std::vector<graph::Parameter*>& params, const DeviceMesh& mesh,
                         Values which = Values::gradients);

/// Whether every element of this rank's local shards of the gradients (or of the parameters)
/// is finite: local_sum_squares' answer, cheaper (host f32: one pass over the exponent bits).
/// Not collective.
bool local_all_finite(const std::vector<graph::Parameter*>& params, const DeviceMesh& mesh,
                      Values which = Values::gradients);

/// torch.nn.utils.clip_grad_norm_ for sharded gradients: the L2 norm of the full gradient
/// (local sums of squares, one f64 all-reduce over the mesh's last (shard) dim: under HSDP
/// the replicate dim holds copies); every local gradient is scaled by
/// min(1, max_norm / (norm + 1e-6)). Returns the norm. Collective over the shard dim.
/// Device gradients (f32): sums of squares and the scaling are Kokkos kernels on the mesh's
/// compute stream; the only host round trip is one copy of the per-parameter sums.
/// Parameters without a gradient are skipped. InvalidArgument for a negative or non-finite
/// max_norm.
double clip_grad_norm(const std::vector<graph::Parameter*>& params, double max_norm,
                      const DeviceMesh& mesh);

/// clip_grad_norm's last part, for a caller that all-reduces the local sums of squares itself
/// (with other values in the same all-reduce: the training session folds its non-finite check
/// into it): scales every local gradient by min(1, max_norm / (norm + 1e-6)); nothing for a
/// norm within max_norm or not finite. Not collective.
void scale_to_max_norm(const std::vector<graph::Parameter*>& params, double norm, double max_norm,
                       const DeviceMesh& mesh);

/// Learning rate: linear warm-up from 0 at step 0 to base_lr at warmup_steps, then cosine
/// decay to min_lr at total_steps (and min_lr after). InvalidArgument unless
/// 0 <= min_lr <= base_lr (finite), 0 <= warmup_steps < total_steps.
class WarmupCosine {
 public:
  WarmupCosine(double base_lr, int warmup_steps, int total_steps, double min_lr = 0.0);
  /// InvalidArgument for step < 0.
  double lr(int step) const;

 private:
  double base_lr_, min_lr_;
  int warmup_, total_;
};

}  // namespace fullshard::optim
