#include "gwt/optim/param_groups.h"

#include <torch/nn/modules/linear.h>

#include <memory>
#include <unordered_set>

namespace gwt {
namespace {

bool contains_any(const std::string& name, const std::vector<std::string>& patterns) {
  for (const auto& p : patterns)
    if (!p.empty() && name.find(p) != std::string::npos) return true;
  return false;
}

std::string last_component(const std::string& name) {
  const auto pos = name.rfind('.');
  return pos == std::string::npos ? name : name.substr(pos + 1);
}

}  // namespace

std::vector<ParamAssignment> assign_param_groups(const torch::nn::Module& module,
                                                 const ParamGroupRules& rules) {
  // Weights of non-head linear layers, by tensor identity.
  std::unordered_set<const void*> linear_weights;
  for (const auto& item : module.named_modules("", /*include_self=*/true)) {
    const auto* linear = item.value()->as<torch::nn::LinearImpl>();
    if (linear == nullptr || !linear->weight.defined()) continue;
    bool is_head = false;
    for (const auto& head : rules.head_names)
      is_head = is_head || last_component(item.key()) == head;
    if (!is_head) linear_weights.insert(linear->weight.unsafeGetTensorImpl());
  }
  std::vector<ParamAssignment> out;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& param = item.value();
    if (!param.requires_grad()) continue;
    bool wavelet = param.dim() == 2 && linear_weights.count(param.unsafeGetTensorImpl()) > 0;
    if (contains_any(item.key(), rules.force_wavelet)) wavelet = true;
    if (contains_any(item.key(), rules.force_dense)) wavelet = false;
    out.push_back({item.key(), param, wavelet});
  }
  return out;
}

namespace {

// The wavelet (or folded) group with `options`, then the dense group with level 0; empty groups
// left out.
template <typename Options>
std::vector<torch::optim::OptimizerParamGroup> two_groups(const torch::nn::Module& module,
                                                          const Options& options,
                                                          const ParamGroupRules& rules) {
  std::vector<at::Tensor> wavelet, dense;
  for (const auto& a : assign_param_groups(module, rules))
    (a.wavelet ? wavelet : dense).push_back(a.param);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!wavelet.empty()) groups.emplace_back(std::move(wavelet), std::make_unique<Options>(options));
  if (!dense.empty()) {
    auto dense_options = std::make_unique<Options>(options);
    dense_options->level(0);
    groups.emplace_back(std::move(dense), std::move(dense_options));
  }
  return groups;
}

}  // namespace

std::vector<torch::optim::OptimizerParamGroup> paper_param_groups(const torch::nn::Module& module,
                                                                  const WaveletAdamOptions& options,
                                                                  const ParamGroupRules& rules) {
  return two_groups(module, options, rules);
}

std::vector<torch::optim::OptimizerParamGroup> foam_param_groups(const torch::nn::Module& module,
                                                                 const FoamAdamOptions& options,
                                                                 const ParamGroupRules& rules) {
  return two_groups(module, options, rules);
}

}  // namespace gwt
