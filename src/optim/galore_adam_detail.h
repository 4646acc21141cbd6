#pragma once

// Internal to gwt::GaLoreAdam (not installed): how a parameter's step is planned and what its
// state must fit, shared by the step and load (galore_adam.cpp) and the Python package's
// load_state_dict, which checks a state_dict's tensors where they are.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gwt/optim/galore_adam.h"

namespace gwt {
namespace galore_adam_detail {

struct Plan {
  bool projected = false;
  bool right = true;  // the projector multiplies from the right (state [m, rank])
  int64_t rank = 0;
  std::vector<int64_t> state_shape;  // shape of exp_avg / exp_avg_sq
};

/// What a parameter's step does under `o`: projected or dense, from which side, the state's shape.
Plan plan_for(const at::Tensor& param, const GaLoreAdamOptions& o);

/// Throws unless `state` (its moments, and a projector it holds) fits `param` under `plan`.
void check_state(const GaLoreAdamParamState& state, const at::Tensor& param, const Plan& plan);

/// Throws unless every option value that enters `param`'s step number `next_step` fits its math
/// dtype (step() and load() check it).
void check_options_fit(const at::Tensor& param, const GaLoreAdamOptions& o, int64_t next_step);

/// Checks a saved state against its parameter and options (a step >= 0, the shapes the options
/// give, floating-point moments and projector that are finite in the parameter's math dtype,
/// second moment >= 0) and converts its tensors to that dtype and the parameter's device
/// (optim_detail::loaded_state_tensor). GaLoreAdam::load does this with a checkpoint's state and
/// the Python package's load_state_dict with a state_dict's; `who` and `where` name the caller
/// and the parameter in messages. Changes only `state`.
void prepare_loaded_state(GaLoreAdamParamState& state, const at::Tensor& param,
                          const GaLoreAdamOptions& options, const char* who,
                          const std::string& where, bool own_storage);

}  // namespace galore_adam_detail
}  // namespace gwt
