#pragma once

/// \file
/// gwt::FoamAdam: Adam with its moments kept on block means of each gradient (FOAM, arXiv
/// 2512.07112, by the GWT authors), a drop-in torch::optim optimizer. The rule:
/// docs/algorithm.md#foam; the page: docs/foam.md.

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace gwt {

namespace optim_detail {
class DeviceSteps;
}  // namespace optim_detail

/// Options of gwt::FoamAdam, fluent like torch::optim::AdamWOptions.
///
/// Every parameter of a group with level > 0 is *folded* (any number of dimensions, a 1-D bias
/// too, as the authors' FOAM), unless min_size keeps it dense; the parameters of a level-0 group
/// take the dense path (plain Adam with the same folded bias correction, eps and decoupled weight
/// decay).
struct FoamAdamOptions : public torch::optim::OptimizerCloneableOptions<FoamAdamOptions> {
  FoamAdamOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor): as torch::optim
  /// Learning rate, finite and >= 0.
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  /// Moment decay rates, each in [0, 1).
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  /// Added to sqrt(V) (not bias-corrected), finite and at least the smallest normal float32 (about
  /// 1.2e-38): with 0, a block of zero gradients would make 0 / 0. 1e-8 as the authors.
  TORCH_ARG(double, eps) = 1e-8;
  /// Decoupled weight decay, applied after the update as p -= lr * weight_decay * p.
  TORCH_ARG(double, weight_decay) = 0;
  /// Blocks of 2^level elements along `dim` share one moment each. 0 selects the dense path.
  TORCH_ARG(int64_t, level) = 2;
  /// Multiplies the update of folded parameters (the authors use 0.25).
  TORCH_ARG(double, scale) = 1.0;
  /// rho: weight of the residual g - unfold(blockmean(g)) in the first moment (rho) and of its
  /// square in the second (rho^2).
  TORCH_ARG(double, res_scale) = 1.0;
  /// Folds sqrt(1 - b2^t) / (1 - b1^t) into the step size.
  TORCH_ARG(bool, correct_bias) = true;
  /// Dimension the blocks run along; the others are batch dimensions.
  TORCH_ARG(int64_t, dim) = -1;
  /// Fused kernels where they apply (is_fused_param()): a contiguous CPU parameter folded along
  /// its last dimension steps in one pass over its values; a dense float32/float64 one in one
  /// loop. false: every parameter takes the readable ATen reference.
  TORCH_ARG(bool, fused) = true;
  /// Moment dtype: "auto" (float64 for float64 parameters, float32 otherwise) or "bfloat16"
  /// (halves the state again; the math stays in float32, float64 for float64 parameters).
  TORCH_ARG(std::string, state_dtype) = "auto";
  /// What a NaN or an infinity in a gradient of this group skips: "skip_step" (the whole step:
  /// no parameter or state changes, as AMP's GradScaler does) or "skip_param" (that parameter
  /// keeps its value and state, the others step).
  TORCH_ARG(std::string, nonfinite) = "skip_step";
  /// With min_size > 0, parameters with fewer than two dimensions, or fewer than min_size elements
  /// along either of their last two, take the dense path (as WaveletAdam's min_size). 0 = off.
  TORCH_ARG(int64_t, min_size) = 0;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override;
  void set_lr(const double lr) override;
  friend bool operator==(const FoamAdamOptions& lhs, const FoamAdamOptions& rhs);
};

/// Per-parameter state. For folded parameters exp_avg and exp_avg_sq have the parameter's shape
/// with ceil(n / 2^level) in place of the length n along `dim`; for dense ones the parameter's.
struct FoamAdamParamState : public torch::optim::OptimizerCloneableParamState<FoamAdamParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  /// Steps this parameter skipped for a non-finite gradient of its own (nonfinite = "skip_param").
  TORCH_ARG(int64_t, skipped) = 0;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const FoamAdamParamState& lhs, const FoamAdamParamState& rhs);
};

/// Drop-in replacement for torch::optim::Adam / AdamW with FOAM's folded moments (the exact rule:
/// docs/algorithm.md#foam).
///
/// - Each group's options are used exactly as given, by the constructor and by add_param_group
///   (LibTorch's own add_param_group would replace a custom optimizer's options with the
///   defaults). A group without options takes the defaults.
/// - A step whose gradients hold a NaN or an infinity is skipped as a whole: no parameter or state
///   changes, and skipped_steps() counts it. Groups with nonfinite("skip_param") skip only the
///   parameter whose gradient is not finite.
/// - Errors a caller can cause (bad options, sparse or mis-shaped gradients, state that does not
///   fit, a corrupt checkpoint) are thrown before anything changes.
/// - Contiguous CPU parameters folded along their last dimension (and dense float32/float64 ones)
///   step in fused kernels (FoamAdamOptions::fused), the others by the readable ATen reference;
///   the kernels are tested against it within a rounding bound derived from the data.
class FoamAdam : public torch::optim::Optimizer {
 public:
  explicit FoamAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                    FoamAdamOptions defaults = {});
  explicit FoamAdam(std::vector<at::Tensor> params, FoamAdamOptions defaults = {});

  /// Appends a group after checking all of it (nothing changes when this throws): its own options
  /// (a gwt::FoamAdamOptions, validated) or, without options, a copy of the defaults; every
  /// parameter a supported leaf tensor that is in no group yet, `dim` in range for it. Hides
  /// torch::optim::Optimizer::add_param_group, which is not virtual: called through a
  /// torch::optim::Optimizer&, LibTorch's version runs and replaces the group's options with the
  /// defaults.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  at::Tensor step(LossClosure closure = nullptr) override;
  /// torch::save / torch::load: options and state of every group, the skip counter and a digest of
  /// each parameter; load() checks all of it before it changes anything, and training then goes
  /// on bit-identically.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// Bytes of optimizer state held for all parameters (the moments).
  int64_t state_bytes() const;
  /// Bytes of optimizer state held for one parameter (0 before its first step).
  int64_t state_bytes(const at::Tensor& param) const;
  /// Whether `param` takes the folded path under its group's options.
  bool is_folded_param(const at::Tensor& param) const;
  /// Whether `param`'s step runs in a fused kernel (else the ATen reference): fused(true),
  /// contiguous, float32/float64/float16/bfloat16, and folded along its last dimension, or dense
  /// (on the CPU with moments of its own float32/float64 dtype; on a CUDA device any).
  bool is_fused_param(const at::Tensor& param) const;
  /// Steps skipped because a gradient was not finite (with "skip_param" groups: steps in which
  /// at least one parameter was skipped).
  int64_t skipped_steps() const;
  /// Steps `param` skipped alone for a non-finite gradient of its own, in a "skip_param" group
  /// (whole-step skips are counted by skipped_steps() only).
  int64_t skipped_steps(const at::Tensor& param) const;
  /// The options of group i.
  const FoamAdamOptions& group_options(size_t i) const;

 private:
  // Brings the host's step and skip counts of CUDA parameters up from the device.
  void sync_device_steps() const;

  mutable int64_t skipped_steps_ = 0;
  // The multi-tensor step of CUDA parameters (src/optim/device_steps.h).
  std::shared_ptr<optim_detail::DeviceSteps> device_steps_;
};

/// Throws a TORCH_CHECK error naming the first invalid option (and what would be valid).
void validate_options(const FoamAdamOptions& options);

}  // namespace gwt
