#pragma once

// Checks of parameter groups and their options that are the same for gwt's torch::optim
// optimizers (internal: not installed): what add_param_group checks before it commits a group, the
// first pass of a step (every parameter with a gradient checked before anything changes), and the
// string options that several optimizers share. gwt::FoamAdam uses them; WaveletAdam and
// GaLoreAdam make the same checks in their own files.

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.h"

namespace gwt {
namespace optim_detail {

/// The options a group added to `optimizer` at position `index` is stepped with: its own when it
/// has some (which must be `Options`, named `options_name` in the message), else a copy of the
/// defaults; validated (validate_options(const Options&), found by argument-dependent lookup).
template <typename Options>
std::unique_ptr<Options> options_to_add(const torch::optim::Optimizer& optimizer,
                                        const torch::optim::OptimizerParamGroup& group,
                                        size_t index, const char* who, const char* options_name) {
  std::unique_ptr<Options> options;
  if (group.has_options()) {
    const auto* given = dynamic_cast<const Options*>(&group.options());
    TORCH_CHECK(given != nullptr, who, ": parameter group ", index,
                " has options of another optimizer; give it ", options_name);
    options = std::make_unique<Options>(*given);
  } else {
    options = std::make_unique<Options>(static_cast<const Options&>(optimizer.defaults()));
  }
  validate_options(*options);
  return options;
}

/// Throws unless every tensor of `params`, to be group `index` of `groups`, is a supported leaf
/// parameter that is in no group yet and appears once.
inline void check_params_to_add(const char* who,
                                const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                const std::vector<at::Tensor>& params, size_t index) {
  std::unordered_map<const void*, size_t> group_of;
  for (const auto i : c10::irange(groups.size()))
    for (const auto& param : groups[i].params()) group_of[param.unsafeGetTensorImpl()] = i;
  for (const auto& param : params) {
    check_param(who, param);
    TORCH_CHECK(param.is_leaf(), who, ": a parameter of shape ", param.sizes(),
                " in parameter group ", index,
                " is not a leaf tensor; optimize the tensors that require grad, not results of "
                "operations on them (e.g. detach().requires_grad_())");
    const auto [it, added] = group_of.emplace(param.unsafeGetTensorImpl(), index);
    if (added) continue;
    TORCH_CHECK(it->second != index, who, ": a parameter of shape ", param.sizes(),
                " appears more than once in parameter group ", index,
                " (each parameter may be in one group once)");
    TORCH_CHECK(false, who, ": a parameter of shape ", param.sizes(), " given for parameter group ",
                index, " is already in parameter group ", it->second,
                " (each parameter may be in one group once)");
  }
}

/// The first pass of a step: every group's options validated, and every parameter with a gradient
/// and its gradient checked (check_param, check_grad); then `visit(param, options, state)` with
/// the parameter's state (`State`, or nullptr before its first step) makes the optimizer's own
/// checks. Reads only.
template <typename Options, typename State, typename StateMap, typename Visit>
void for_each_param_to_step(const char* who,
                            const std::vector<torch::optim::OptimizerParamGroup>& groups,
                            const StateMap& states, Visit&& visit) {
  for (const auto& group : groups) {
    const auto& options = static_cast<const Options&>(group.options());
    validate_options(options);
    for (const auto& param : group.params()) {
      check_param(who, param);
      if (!param.grad().defined()) continue;
      check_grad(who, param, param.grad());
      const auto it = states.find(param.unsafeGetTensorImpl());
      visit(param, options, it == states.end() ? nullptr : static_cast<State*>(it->second.get()));
    }
  }
}

/// The state_dtype and nonfinite options (WaveletAdam's and FoamAdam's): one of the names they
/// know, as any other name ("bf16", "float32", "ignore", ...) would silently mean the default.
inline void check_state_dtype_and_nonfinite(const char* who, const std::string& state_dtype,
                                            const std::string& nonfinite) {
  TORCH_CHECK(state_dtype == "auto" || state_dtype == "bfloat16", who, ": invalid state_dtype '",
              state_dtype, "'; valid values are auto, bfloat16");
  TORCH_CHECK(nonfinite == "skip_step" || nonfinite == "skip_param", who, ": invalid nonfinite '",
              nonfinite,
              "'; valid values are skip_step (the whole step), skip_param (that parameter only)");
}

/// The dtype the moments are kept in under a state_dtype option that was validated: bfloat16, or
/// the math dtype (compute_dtype) for "auto".
inline at::ScalarType moment_dtype(const at::Tensor& param, const std::string& state_dtype) {
  TORCH_INTERNAL_ASSERT(state_dtype == "auto" || state_dtype == "bfloat16", "state_dtype '",
                        state_dtype, "' was not validated");
  return state_dtype == "bfloat16" ? at::kBFloat16 : compute_dtype(param);
}

}  // namespace optim_detail
}  // namespace gwt
