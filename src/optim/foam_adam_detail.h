#pragma once

// Internal to gwt::FoamAdam (not installed): what a parameter's step does under its group's
// options and what its state must fit (foam_adam_options.cpp), shared by the step and the
// checkpoints (foam_adam.cpp).

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

#include "device_steps.h"
#include "gwt/optim/foam_adam.h"

namespace gwt {
namespace foam_adam_detail {

inline const FoamAdamOptions& options_of(const torch::optim::OptimizerParamGroup& group) {
  return static_cast<const FoamAdamOptions&>(group.options());
}

/// The dtype the moments are kept in.
at::ScalarType state_dtype(const at::Tensor& param, const FoamAdamOptions& o);

struct Plan {
  bool folded = false;
  /// The normalised dimension the blocks run along (folded only); -1 for a 0-dim parameter, which
  /// is folded as one row of one element.
  int64_t dim = 0;
  std::vector<int64_t> state_shape;  // shape of exp_avg / exp_avg_sq
};

/// What a parameter's step does under `o` (throws if `dim` is out of range for a parameter it
/// would fold).
Plan plan_for(const at::Tensor& param, const FoamAdamOptions& o);

/// Throws unless `state` fits `param` under `plan`: moments of the plan's shape, a step and a skip
/// count >= 0.
void check_state(const FoamAdamParamState& state, const at::Tensor& param, const Plan& plan);

/// Throws unless every option value that enters `param`'s step number `next_step` fits its math
/// dtype (optim_detail::check_options_fit); step() and load() check it.
void check_options_fit(const at::Tensor& param, const FoamAdamOptions& o, int64_t next_step);

/// Checks a saved state against its parameter and options (check_state; floating-point moments,
/// finite in the dtype the steps keep them in, second moment >= 0) and converts its tensors to that
/// dtype and the parameter's device (optim_detail::loaded_state_tensor). `who` and `where` name
/// the caller and the parameter in messages. Changes only `state`.
void prepare_loaded_state(FoamAdamParamState& state, const at::Tensor& param,
                          const FoamAdamOptions& options, const char* who, const std::string& where,
                          bool own_storage);

/// Which computation takes a parameter's step (foam_adam_fused.cpp).
enum class Path { reference, folded, dense };

/// The fused kernel that takes `param`'s step under `o` with moments of dtype `moments`, or
/// Path::reference: a CPU parameter of float32, float64, float16 or bfloat16, contiguous, with
/// fused(true); folded along its last dimension, or dense with float32/float64 moments of its own
/// dtype. Everything else (another `dim`, another device) takes the readable reference.
Path path_for(const at::Tensor& param, const FoamAdamOptions& o, const Plan& plan,
              at::ScalarType moments);

/// Whether the multi-tensor kernels (device_steps.h) take `param`'s step on its device: a CUDA
/// parameter (or a CPU one while they are emulated), fused(true), folded along its last dimension
/// or dense, contiguous, with moments of its math dtype or bfloat16.
bool device_kernel_takes(const at::Tensor& param, const FoamAdamOptions& o, const Plan& plan,
                         at::ScalarType moments);

/// device_kernel_takes, and a contiguous gradient of the parameter's dtype on its device: the step
/// can run there.
bool device_eligible(const at::Tensor& param, const FoamAdamOptions& o, const Plan& plan,
                     at::ScalarType moments);

/// The multi-tensor kernels' description of `param`'s step (device_eligible).
optim_detail::DeviceItem device_item(const at::Tensor& param, FoamAdamParamState& state,
                                     const FoamAdamOptions& o, const Plan& plan);

/// One parameter's step in the kernel `path` names (not Path::reference), `step_size` this step's
/// lr times bias correction: the reference's rule, with its order of operations, in one pass.
void fused_update(const at::Tensor& param, FoamAdamParamState& state, const FoamAdamOptions& o,
                  Path path, double step_size);

}  // namespace foam_adam_detail
}  // namespace gwt
