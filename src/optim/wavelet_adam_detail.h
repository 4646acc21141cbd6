#pragma once

// Internal to gwt::WaveletAdam (not installed): how a parameter's step is planned
// (wavelet_adam_plan.cpp), shared by the step (wavelet_adam.cpp) and load
// (wavelet_adam_serialize.cpp).

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gwt/optim/wavelet_adam.h"
#include "gwt/wavelet.h"

namespace gwt {
namespace wavelet_adam_detail {

inline const WaveletAdamOptions& options_of(const torch::optim::OptimizerParamGroup& group) {
  return static_cast<const WaveletAdamOptions&>(group.options());
}

/// The dtype the moments are kept in.
at::ScalarType state_dtype(const at::Tensor& param, const WaveletAdamOptions& o);

struct Plan {
  bool wavelet = false;
  bool two_d = false;                // transform "2d": over the last two dimensions
  int64_t dim = 0;                   // normalised transform dimension (wavelet only)
  std::vector<int64_t> state_shape;  // shape of exp_avg / exp_avg_sq
};

/// The wavelet of that name, built once (plan_for runs for each parameter at every step, and a
/// Wavelet built by name copies its filters into four vectors). An unknown name throws Wavelet's
/// own error.
const Wavelet& wavelet_named(const std::string& name);

/// What a parameter's step does under `o` (throws if dim is out of range for it).
Plan plan_for(const at::Tensor& param, const WaveletAdamOptions& o);

/// Throws unless `state` fits `param` under `plan`.
void check_state(const WaveletAdamParamState& state, const at::Tensor& param, const Plan& plan);

/// Throws unless every option value that enters `param`'s step number `next_step` fits its math
/// dtype (optim_detail::check_options_fit); step() and load() check it.
void check_options_fit(const at::Tensor& param, const WaveletAdamOptions& o, int64_t next_step);

/// Checks a saved state against its parameter and options (the shapes the options give, a step
/// and a skip count >= 0, floating-point moments and limiter norm that are finite in the dtype the
/// steps use, second moment and norm >= 0) and converts its tensors to that dtype and the
/// parameter's device (optim_detail::loaded_state_tensor). WaveletAdam::load does this with a
/// checkpoint's state and the Python package's load_state_dict with a state_dict's; `who` and
/// `where` name the caller and the parameter in messages. Changes only `state`.
void prepare_loaded_state(WaveletAdamParamState& state, const at::Tensor& param,
                          const WaveletAdamOptions& options, const char* who,
                          const std::string& where, bool own_storage);

}  // namespace wavelet_adam_detail
}  // namespace gwt
