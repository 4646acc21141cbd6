#pragma once

/// \file
/// gwt::GaLoreAdam: Adam on a low-rank projection of each 2-D gradient (GaLore, arXiv 2403.03507),
/// the peer WaveletAdam is compared with, behind the same torch::optim interface.

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <string>
#include <tuple>

namespace gwt {

/// Options of gwt::GaLoreAdam. A parameter is projected when it is 2-D and 1 <= rank < min(m, n);
/// every other parameter takes the dense path (Adam with the same folded bias correction, eps and
/// decoupled weight decay).
struct GaLoreAdamOptions : public torch::optim::OptimizerCloneableOptions<GaLoreAdamOptions> {
  GaLoreAdamOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor): as torch::optim
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0;
  /// Rank r of the projection; 0 selects the dense path.
  TORCH_ARG(int64_t, rank) = 128;
  /// Steps between projector refreshes (an SVD of the gradient at steps 1, 1 + gap, ...).
  TORCH_ARG(int64_t, update_proj_gap) = 200;
  /// Multiplies the update projected back.
  TORCH_ARG(double, scale) = 0.25;
  /// "std" (project the smaller side: m >= n right, else left), "reverse_std", "left", "right".
  TORCH_ARG(std::string, proj_type) = "std";
  /// "exact" (torch.linalg.svd) or "randomized" (range finder with oversampling and power
  /// iterations: faster on large matrices).
  TORCH_ARG(std::string, svd) = "exact";
  TORCH_ARG(int64_t, oversample) = 8;
  TORCH_ARG(int64_t, power_iters) = 2;
  TORCH_ARG(bool, correct_bias) = true;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override;
  void set_lr(const double lr) override;
  friend bool operator==(const GaLoreAdamOptions& lhs, const GaLoreAdamOptions& rhs);
};

/// Per-parameter state: moments of the projected gradient R, and the projector (right: Vr^T rows,
/// [r, n]; left: Ur, [m, r]).
struct GaLoreAdamParamState
    : public torch::optim::OptimizerCloneableParamState<GaLoreAdamParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, projector);
  /// True when the projector multiplies from the right (R = G P^T), false from the left (R = P^T
  /// G).
  TORCH_ARG(bool, right) = true;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// Drop-in torch::optim optimizer. Projectors are refreshed from an SVD of the current gradient in
/// float32 (float64 for float64 gradients) every update_proj_gap steps; if LAPACK fails to
/// converge (c10::LinAlgError) or the SVD returns non-finite values, the previous projector is kept
/// (the first time: the leading coordinate vectors, P = I[:r] on the projected side) and
/// svd_fallbacks() counts it. Any other error of the SVD (out of memory, a CUDA error) propagates,
/// with nothing changed. Non-finite gradients skip the step (skipped_steps()).
///
/// - Each group's options are used exactly as given, also for groups added later with
///   add_param_group (call it on the GaLoreAdam, not through a torch::optim::Optimizer&: LibTorch's
///   version is not virtual, and replaces the options of optimizers it does not know with the
///   defaults).
/// - The state must be on the parameter's device, in its math type (float64 for float64
///   parameters, else float32), contiguous: a model converted or moved after its first step is an
///   error at step() before anything changes. Save the optimizer and load it again after converting
///   or moving the model; load() moves the state to the parameters.
/// - load() checks the checkpoint before it changes anything: shapes and options, moments and
///   projectors finite, second moments >= 0, steps and counters >= 0, and the order of the
///   parameters: the checkpoint holds a digest of each parameter's bytes, and a parameter that now
///   holds the values another position had when saved is an error (parameters reordered or moved
///   between groups). This is detected when the model's weights are loaded before the optimizer;
///   a model whose values differ from the saved ones (not loaded yet) cannot be checked.
///   Checkpoints written before digests were added load without this check.
class GaLoreAdam : public torch::optim::Optimizer {
 public:
  explicit GaLoreAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                      GaLoreAdamOptions defaults = {});
  explicit GaLoreAdam(std::vector<at::Tensor> params, GaLoreAdamOptions defaults = {});

  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// Adds a group with its own options (gwt::GaLoreAdamOptions, checked) or, without options, the
  /// defaults. Hides torch::optim::Optimizer::add_param_group (see above). Throws, with nothing
  /// changed, for options of another optimizer, invalid options, a parameter that is not a
  /// floating-point leaf tensor, or one already in this optimizer.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  /// Bytes of optimizer state (moments and projectors) for all parameters, or for one.
  int64_t state_bytes() const;
  int64_t state_bytes(const at::Tensor& param) const;
  /// Whether `param` is projected under its group's options.
  bool is_projected_param(const at::Tensor& param) const;
  int64_t skipped_steps() const { return skipped_steps_; }
  int64_t svd_fallbacks() const { return svd_fallbacks_; }
  const GaLoreAdamOptions& group_options(size_t i) const;

 private:
  int64_t skipped_steps_ = 0;
  int64_t svd_fallbacks_ = 0;
};

void validate_options(const GaLoreAdamOptions& options);

/// The top-`rank` singular triplets of a 2-D matrix: {U [m, r], S [r], Vh [r, n]}, exact
/// (at::linalg_svd) or by a randomized range finder (oversample extra columns, power_iters
/// subspace iterations, generator seeded with `seed`).
std::tuple<at::Tensor, at::Tensor, at::Tensor> truncated_svd(const at::Tensor& matrix, int64_t rank,
                                                             bool randomized,
                                                             int64_t oversample = 8,
                                                             int64_t power_iters = 2,
                                                             uint64_t seed = 0);

namespace detail {

/// Test-only, not part of the API: how the next projector SVD computed by GaLoreAdam::step fails,
/// for tests of the fallback. The fault is used up by that SVD (one per call; process-wide).
enum class SvdFault {
  none,
  linalg_error,   ///< throws c10::LinAlgError, as ATen does when LAPACK does not converge
  non_finite,     ///< the SVD returns a NaN projector
  out_of_memory,  ///< throws c10::OutOfMemoryError
  other_error,    ///< throws a plain c10::Error
};
void inject_svd_fault(SvdFault fault);

}  // namespace detail

}  // namespace gwt
