#pragma once

/// \file
/// gwt::WaveletAdam: Adam with its moments kept only on the wavelet approximation subband of each
/// eligible gradient (GWT, arXiv 2501.07237), a drop-in torch::optim optimizer.

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace gwt {

namespace optim_detail {
class DeviceSteps;
}  // namespace optim_detail
namespace distributed {
class ShardedWaveletAdam;
}

/// Options of gwt::WaveletAdam, fluent like torch::optim::AdamWOptions.
///
/// A parameter is *eligible* for the wavelet path when level > 0, it has at least two dimensions
/// and at least 2^level elements along `dim`; every other parameter takes the dense path (plain
/// Adam with the same folded bias correction, eps and decoupled weight decay).
struct WaveletAdamOptions : public torch::optim::OptimizerCloneableOptions<WaveletAdamOptions> {
  WaveletAdamOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor): as torch::optim
  /// Learning rate, finite and >= 0.
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  /// Moment decay rates, each in [0, 1).
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  /// Added to sqrt(v) (inside, not bias-corrected), finite and at least the smallest normal float32
  /// (about 1.2e-38): with 0, a block of zero gradients would make 0 / 0.
  TORCH_ARG(double, eps) = 1e-6;
  /// Decoupled weight decay, applied after the update as p -= lr * weight_decay * p.
  TORCH_ARG(double, weight_decay) = 0;
  /// Wavelet name (gwt::Wavelet::available()).
  TORCH_ARG(std::string, wavelet) = "haar";
  /// Decomposition levels; the moments shrink by 2^level along `dim`. 0 selects the dense path.
  TORCH_ARG(int64_t, level) = 2;
  /// Boundary mode: "zero", "periodization" or "symmetric".
  TORCH_ARG(std::string, boundary) = "zero";
  /// Multiplies the reconstructed update of wavelet parameters (the authors use 0.25).
  TORCH_ARG(double, scale) = 1.0;
  /// Norm-growth limiter gamma (from Fira); 0 disables it.
  TORCH_ARG(double, norm_growth_limit) = 1.01;
  /// Folds sqrt(1 - b2^t) / (1 - b1^t) into the step size.
  TORCH_ARG(bool, correct_bias) = true;
  /// Dimension the 1-D transform runs along; the others are batch dimensions.
  TORCH_ARG(int64_t, dim) = -1;
  /// Use the fused kernels where they apply (transform along the last dimension of a contiguous
  /// parameter: every wavelet on the CPU, Haar levels 1 to 3 on CUDA builds); false always runs the
  /// readable ATen reference.
  TORCH_ARG(bool, fused) = true;
  /// Moment dtype: "auto" (float64 for float64 parameters, float32 otherwise) or "bfloat16"
  /// (halves the state again; the math stays in float32).
  TORCH_ARG(std::string, state_dtype) = "auto";
  /// "1d" (along `dim`) or "2d": a separable 2-D DWT over the last two dimensions
  /// (gwt::wavedec2), moments on the LL subband, each detail subband at level k divided by the LL
  /// denominator repeated 2^(L-k) times along both axes (same limiter and scale).
  TORCH_ARG(std::string, transform) = "1d";
  /// Threshold applied to the detail coefficients before normalisation (PyWavelets' `threshold`
  /// semantics); 0 = off. kept_details()/total_details() of the state report what survived.
  TORCH_ARG(double, threshold) = 0;
  /// "soft" or "hard".
  TORCH_ARG(std::string, threshold_mode) = "soft";
  /// Parameters whose last two dimensions have fewer than min_size elements take the dense path
  /// (0 = off, docs/algorithm.md#eligibility-and-the-dense-path; 32 skips matrices below 32 x 32,
  /// where compression saves little).
  TORCH_ARG(int64_t, min_size) = 0;
  /// What a NaN or an infinity in a gradient of this group skips: "skip_step" (the whole step:
  /// no parameter or state changes, as AMP's GradScaler does) or "skip_param" (that parameter
  /// keeps its value and state, the others step). With "skip_param" each parameter's norm pass and
  /// update run back to back, while its gradient is still in the cache; with "skip_step" every
  /// gradient is read once for the check before any update.
  TORCH_ARG(std::string, nonfinite) = "skip_step";

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override;
  void set_lr(const double lr) override;
  friend bool operator==(const WaveletAdamOptions& lhs, const WaveletAdamOptions& rhs);
};

/// Per-parameter state. For wavelet parameters exp_avg and exp_avg_sq have the approximation
/// subband's shape; for dense ones the parameter's. Moments of float16/bfloat16 parameters are kept
/// in float32.
struct WaveletAdamParamState
    : public torch::optim::OptimizerCloneableParamState<WaveletAdamParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  /// The limiter's saved ||N||_F (0-dim); undefined until the first wavelet step.
  TORCH_ARG(at::Tensor, norm);
  /// With a threshold: detail coefficients kept (non-zero) and in all, at the last step (-1 before
  /// one; not saved).
  TORCH_ARG(int64_t, kept_details) = -1;
  TORCH_ARG(int64_t, total_details) = -1;
  /// Steps this parameter skipped for a non-finite gradient of its own (nonfinite = "skip_param").
  TORCH_ARG(int64_t, skipped) = 0;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const WaveletAdamParamState& lhs, const WaveletAdamParamState& rhs);
};

/// Drop-in replacement for torch::optim::Adam / AdamW (the exact rule:
/// docs/algorithm.md#the-update).
///
/// - Each group's options are used exactly as given, by the constructor and by add_param_group
///   (LibTorch's own add_param_group would replace a custom optimizer's options with the
///   defaults). A group without options takes the defaults.
/// - A step whose gradients hold a NaN or an infinity is skipped as a whole: no parameter or state
///   changes, and skipped_steps() counts it (as AMP's GradScaler does). Groups with
///   nonfinite("skip_param") skip only the parameter whose gradient is not finite.
/// - Errors a caller can cause (bad options, sparse or mis-shaped gradients, ...) are thrown before
///   anything changes.
class WaveletAdam : public torch::optim::Optimizer {
 public:
  explicit WaveletAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                       WaveletAdamOptions defaults = {});
  explicit WaveletAdam(std::vector<at::Tensor> params, WaveletAdamOptions defaults = {});

  /// Appends a group after checking all of it (nothing changes when this throws): its own options
  /// (a gwt::WaveletAdamOptions, validated) or, without options, a copy of the defaults; every
  /// parameter a supported leaf tensor that is in no group yet. Hides
  /// torch::optim::Optimizer::add_param_group, which is not virtual: called through a
  /// torch::optim::Optimizer&, LibTorch's version runs and replaces the group's options with the
  /// defaults.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  at::Tensor step(LossClosure closure = nullptr) override;
  /// Makes every check step() makes before it changes anything (options, parameters, their
  /// gradients and state) and changes nothing: throws the c10::Error that step() would throw for
  /// the gradients as they are now. For callers that must agree on an error before anything is
  /// written (gwt::distributed::ShardedWaveletAdam: every rank checks, then every rank steps).
  void check_step() const;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// Bytes of optimizer state held for all parameters (tensors only: moments and limiter norm).
  int64_t state_bytes() const;
  /// Bytes of optimizer state held for one parameter (0 before its first step).
  int64_t state_bytes(const at::Tensor& param) const;
  /// Whether `param` takes the wavelet path under its group's options.
  bool is_wavelet_param(const at::Tensor& param) const;
  /// With thresholding: detail coefficients kept and in all at the last step, over every parameter
  /// that has been thresholded ({kept, total}; kept / total is the compression ratio of the
  /// details).
  std::pair<int64_t, int64_t> kept_details() const;
  /// Whether `param`'s step runs in a fused kernel (else the ATen reference).
  bool is_fused_param(const at::Tensor& param) const;
  /// Steps skipped because a gradient was not finite (with "skip_param" groups: steps in which
  /// at least one parameter was skipped).
  int64_t skipped_steps() const;
  /// Steps `param` skipped alone for a non-finite gradient of its own, in a "skip_param" group
  /// (whole-step skips are counted by skipped_steps() only).
  int64_t skipped_steps(const at::Tensor& param) const;
  /// The options of group i.
  const WaveletAdamOptions& group_options(size_t i) const;

 private:
  // CUDA parameters' counts and limiter norms are kept on the device between steps (the
  // multi-tensor step); this brings the host's state and skipped_steps_ up to date.
  void sync_device_steps() const;

  mutable int64_t skipped_steps_ = 0;
  // The multi-tensor step of CUDA parameters (src/optim/device_steps.h).
  std::shared_ptr<optim_detail::DeviceSteps> device_steps_;
  // Scratch of the fused Haar CPU passes (kernels::HaarAdamArgs::carry), at most 4 MB, kept
  // between steps; not optimizer state.
  std::vector<float> carry_;
  // Gathers a checkpoint (save_full) whose skip count is the sharded run's.
  friend class distributed::ShardedWaveletAdam;
};

/// Throws a TORCH_CHECK error naming the first invalid option (and what would be valid).
void validate_options(const WaveletAdamOptions& options);

}  // namespace gwt
