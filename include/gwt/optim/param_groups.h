#pragma once

/// \file
/// The paper's parameter grouping, built from a torch::nn::Module.

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <vector>

#include "gwt/optim/foam_adam.h"
#include "gwt/optim/wavelet_adam.h"

namespace gwt {

/// How paper_param_groups() sorts parameters. The default rule (the GWT/GaLore recipe): the 2-D
/// `weight` of every torch::nn::Linear goes to the wavelet group (attention and MLP projections),
/// except linear layers whose own name is one of `head_names` (the output head); everything else
/// (embeddings, norms, biases, convolutions, other tensors) is dense. Overrides match substrings of
/// the full parameter name (as in Module::named_parameters()); force_dense wins over force_wavelet.
struct ParamGroupRules {
  /// Names of output-head linear layers kept dense (the last component of the module's name).
  std::vector<std::string> head_names = {"lm_head", "head", "output", "classifier"};
  /// Parameters whose name contains one of these are dense.
  std::vector<std::string> force_dense;
  /// Parameters whose name contains one of these go to the wavelet group (if not forced dense).
  std::vector<std::string> force_wavelet;
};

/// One parameter and the group the rules put it in.
struct ParamAssignment {
  std::string name;
  at::Tensor param;
  bool wavelet;
};

/// Sorts every parameter of `module` that requires grad, in named_parameters() order.
std::vector<ParamAssignment> assign_param_groups(const torch::nn::Module& module,
                                                 const ParamGroupRules& rules = {});

/// Up to two groups for gwt::WaveletAdam: first the wavelet group with `options`, then the dense
/// group with `options` and level 0. Empty groups are left out.
std::vector<torch::optim::OptimizerParamGroup> paper_param_groups(
    const torch::nn::Module& module, const WaveletAdamOptions& options = {},
    const ParamGroupRules& rules = {});

/// The same two groups for gwt::FoamAdam (the authors' FOAM groups the same way: linear layers'
/// weights folded, except the head; everything else dense): first the folded group with `options`,
/// then the dense group with `options` and level 0. Empty groups are left out.
std::vector<torch::optim::OptimizerParamGroup> foam_param_groups(
    const torch::nn::Module& module, const FoamAdamOptions& options = {},
    const ParamGroupRules& rules = {});

}  // namespace gwt
