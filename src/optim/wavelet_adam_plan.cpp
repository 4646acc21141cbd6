// The plan of a parameter's step (gwt::WaveletAdam): what it does under its group's options, and
// which implementation computes it, decided before anything changes.

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common.h"
#include "gwt/optim/wavelet_adam.h"
#include "gwt/wavelet.h"
#include "kernels/kernels.h"
#include "wavelet_adam_detail.h"
#include "wavelet_adam_step.h"

namespace gwt {

// ----------------------------------------------------------------------------------------------
// Planning: what a parameter's step does, decided before anything changes
// ----------------------------------------------------------------------------------------------

namespace wavelet_adam_detail {

using optim_detail::compute_dtype;

const Wavelet& wavelet_named(const std::string& name) {
  static const std::vector<Wavelet> all = [] {
    std::vector<Wavelet> out;
    for (const auto& n : Wavelet::available()) out.emplace_back(n);
    return out;
  }();
  const auto it =
      std::find_if(all.begin(), all.end(), [&](const Wavelet& w) { return w.name() == name; });
  if (it == all.end()) (void)Wavelet(name);  // throws, naming the valid wavelets
  TORCH_CHECK(it != all.end(), "gwt: unknown wavelet '", name, "'");
  return *it;
}

at::ScalarType state_dtype(const at::Tensor& param, const WaveletAdamOptions& o) {
  TORCH_INTERNAL_ASSERT(o.state_dtype() == "auto" || o.state_dtype() == "bfloat16", "state_dtype '",
                        o.state_dtype(), "' was not validated");
  return o.state_dtype() == "bfloat16" ? at::kBFloat16 : optim_detail::compute_dtype(param);
}

Plan plan_for(const at::Tensor& param, const WaveletAdamOptions& o) {
  Plan plan;
  plan.state_shape = param.sizes().vec();
  if (o.level() == 0 || param.dim() < 2) return plan;
  const int64_t block = int64_t{1} << o.level();
  const int64_t rows = param.size(-2), cols = param.size(-1);
  if (rows < o.min_size() || cols < o.min_size()) return plan;
  const Wavelet& wavelet = wavelet_named(o.wavelet());
  const BoundaryMode mode = boundary_mode_from_string(o.boundary());
  if (o.transform() == "2d") {
    if (rows < block || cols < block) return plan;
    plan.wavelet = plan.two_d = true;
    plan.dim = param.dim() - 1;
    plan.state_shape[param.dim() - 2] = approx_len(rows, wavelet, o.level(), mode);
    plan.state_shape[param.dim() - 1] = approx_len(cols, wavelet, o.level(), mode);
    return plan;
  }
  TORCH_CHECK(o.dim() >= -param.dim() && o.dim() < param.dim(), "gwt::WaveletAdam: dim ", o.dim(),
              " is out of range for a parameter of shape ", param.sizes(),
              " (valid: ", -param.dim(), " to ", param.dim() - 1, ")");
  const int64_t dim = o.dim() < 0 ? o.dim() + param.dim() : o.dim();
  if (param.size(dim) < block) return plan;
  plan.wavelet = true;
  plan.dim = dim;
  plan.state_shape[dim] = approx_len(param.size(dim), wavelet, o.level(), mode);
  return plan;
}

void check_state(const WaveletAdamParamState& state, const at::Tensor& param, const Plan& plan) {
  for (const at::Tensor* t : {&state.exp_avg(), &state.exp_avg_sq()}) {
    TORCH_CHECK(t->defined() && t->sizes().vec() == plan.state_shape,
                "gwt::WaveletAdam: the state of a parameter of shape ", param.sizes(),
                " has moments of shape ", t->defined() ? t->sizes() : c10::IntArrayRef{},
                " but its group's options need ", c10::IntArrayRef(plan.state_shape),
                " (were level, wavelet, boundary or dim changed after training started?)");
  }
  TORCH_CHECK(state.step() >= 0,
              "gwt::WaveletAdam: a saved step count is negative: ", state.step());
  TORCH_CHECK(!state.norm().defined() || state.norm().numel() == 1,
              "gwt::WaveletAdam: the limiter norm in the state must be a single value");
}

void check_options_fit(const at::Tensor& param, const WaveletAdamOptions& o, int64_t next_step) {
  const double step_size =
      optim_detail::adam_step_size(o.lr(), o.betas(), o.correct_bias(), next_step);
  optim_detail::check_options_fit("gwt::WaveletAdam", param,
                                  {{"eps", o.eps()},
                                   {"the step size (lr x bias correction)", step_size},
                                   {"the step size x scale", step_size * o.scale()},
                                   {"lr x weight_decay", o.lr() * o.weight_decay()},
                                   {"threshold", o.threshold()},
                                   {"norm_growth_limit", o.norm_growth_limit()}});
  // The fused kernels divide the step size x scale by a denominator of at least eps before they
  // multiply by the gradient's terms; where that quotient overflows, a zero gradient's update is
  // inf x 0 = NaN (lr 1e300 with eps 1e-10 on a float64 parameter, found by fuzz_step). Half the
  // math type's largest value leaves room for eps rounded to float32.
  const bool f64 = optim_detail::compute_dtype(param) == at::kDouble;
  const double max = f64 ? std::numeric_limits<double>::max() : std::numeric_limits<float>::max();
  const double factor = std::max(std::abs(step_size), std::abs(step_size * o.scale())) / o.eps();
  TORCH_CHECK(factor <= max / 2, "gwt::WaveletAdam: the step size (x scale) / eps = ", factor,
              " overflows ", f64 ? "float64" : "float32", ", the dtype the update of a ",
              param.scalar_type(), " parameter is computed in (the update divides the step size ",
              "by its denominator, at least eps, first); it must be at most ", max / 2,
              ": use a larger eps or a smaller lr or scale");
}

// Which implementation computes this parameter's step: the fused kernels where they reproduce the
// reference (transform along the last, contiguous dimension), the ATen reference elsewhere.
Path path_for(const at::Tensor& param, const WaveletAdamOptions& o, const Plan& plan) {
  if (!o.fused() || !plan.wavelet || plan.dim != param.dim() - 1 || !param.is_contiguous())
    return Path::reference;
  // A GPU the CUDA kernels have no image for (warned once): the reference. CPU tensors never ask.
  if (param.is_cuda() && !kernels::cuda_kernels_run_on(param.device().index()))
    return Path::reference;
  const bool haar = o.wavelet() == "haar" || o.wavelet() == "db1";
  // Haar's zero mode pads odd lengths with zeros, which keeps blocks local; the other modes agree
  // with it only when no padding is needed. Thresholded details break Haar's closed form: the
  // general kernels threshold them.
  const int64_t block = int64_t{1} << o.level();
  const bool haar_local =
      haar && o.threshold() == 0 &&
      (o.boundary() == "zero" ||
       (param.size(-1) % block == 0 && (!plan.two_d || param.size(-2) % block == 0)));
  // 2-D: Haar on the Haar kernels (CUDA: levels 1 to 3), everything else on the reference.
  if (plan.two_d) {
    if (!haar_local) return Path::reference;
    if (param.is_cuda())
      return kernels::built_with_cuda() && o.level() <= 3 ? Path::haar : Path::reference;
    return param.device().is_cpu() ? Path::haar : Path::reference;
  }
  if (param.is_cuda()) {
    if (!kernels::built_with_cuda()) return Path::reference;
    if (haar_local && o.level() <= 3) return Path::haar;
    // The general CUDA kernel keeps a row's scratch in shared memory (of the parameter's device).
    const c10::DeviceGuard device(param.device());
    const Wavelet& wavelet = wavelet_named(o.wavelet());
    const int64_t bytes = kernels::wavelet_row_scratch_bytes(
        param.size(-1), wavelet.length(), o.level(), boundary_mode_from_string(o.boundary()),
        compute_dtype(param) == at::kDouble);
    return bytes <= kernels::wavelet_adam_cuda_max_scratch_bytes() ? Path::general
                                                                   : Path::reference;
  }
  if (!param.device().is_cpu()) return Path::reference;
  return haar_local ? Path::haar : Path::general;
}

}  // namespace wavelet_adam_detail
}  // namespace gwt
