#pragma once

// The models the checkpoint-loading target loads into, shared with the seed generator
// (gwt_fuzz_seed) so that the seed archives fit them: a WaveletAdam over a float32 matrix, a
// float32 vector (group 0) and a float64 matrix (group 1), and a GaLoreAdam over the same kinds of
// parameters, with gradients that depend only on the step number.

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "gwt/optim/galore_adam.h"
#include "gwt/optim/wavelet_adam.h"

namespace gwt_fuzz {

struct WaveletAdamModel {
  std::vector<at::Tensor> params = {at::zeros({8, 16}, at::kFloat), at::zeros({16}, at::kFloat),
                                    at::zeros({6, 12}, at::kDouble)};
  std::unique_ptr<gwt::WaveletAdam> opt;

  static gwt::WaveletAdamOptions default_options(size_t group) {
    return group == 0 ? gwt::WaveletAdamOptions(1e-2)
                      : gwt::WaveletAdamOptions(1e-2).wavelet("db2").level(1);
  }

  explicit WaveletAdamModel(const gwt::WaveletAdamOptions& group0 = default_options(0),
                            const gwt::WaveletAdamOptions& group1 = default_options(1)) {
    for (size_t i = 0; i < params.size(); ++i)
      params[i].copy_(at::linspace(-1, 1, params[i].numel(), at::kDouble)
                          .view(params[i].sizes())
                          .to(params[i].scalar_type()));
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{params[0], params[1]},
                        std::make_unique<gwt::WaveletAdamOptions>(group0));
    groups.emplace_back(std::vector<at::Tensor>{params[2]},
                        std::make_unique<gwt::WaveletAdamOptions>(group1));
    opt = std::make_unique<gwt::WaveletAdam>(std::move(groups), group0);
  }
};

struct GaLoreAdamModel {
  std::vector<at::Tensor> params = {at::zeros({12, 8}, at::kFloat), at::zeros({8}, at::kFloat),
                                    at::zeros({6, 10}, at::kDouble)};
  std::unique_ptr<gwt::GaLoreAdam> opt;

  static gwt::GaLoreAdamOptions default_options(size_t group) {
    return group == 0 ? gwt::GaLoreAdamOptions(1e-2).rank(2).update_proj_gap(2)
                      : gwt::GaLoreAdamOptions(1e-2).rank(3).proj_type("left");
  }

  explicit GaLoreAdamModel(const gwt::GaLoreAdamOptions& group0 = default_options(0),
                           const gwt::GaLoreAdamOptions& group1 = default_options(1)) {
    for (size_t i = 0; i < params.size(); ++i)
      params[i].copy_(at::linspace(-1, 1, params[i].numel(), at::kDouble)
                          .view(params[i].sizes())
                          .to(params[i].scalar_type()));
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{params[0], params[1]},
                        std::make_unique<gwt::GaLoreAdamOptions>(group0));
    groups.emplace_back(std::vector<at::Tensor>{params[2]},
                        std::make_unique<gwt::GaLoreAdamOptions>(group1));
    opt = std::make_unique<gwt::GaLoreAdam>(std::move(groups), group0);
  }
};

/// Gives every parameter (those with with_grad[i], or all) a gradient that depends on i and `step`
/// only: a smooth pattern plus a step-dependent ripple, never zero.
inline void set_grads(std::vector<at::Tensor>& params, int step,
                      const std::vector<bool>& with_grad = {}) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (!with_grad.empty() && !with_grad[i]) {
      params[i].mutable_grad() = at::Tensor();
      continue;
    }
    const auto n = params[i].numel();
    const at::Tensor k = at::arange(n, at::kDouble);
    const at::Tensor g = at::sin(k * (0.37 + 0.11 * static_cast<double>(i)) +
                                 0.5 * static_cast<double>(step)) +
                         0.1 * static_cast<double>(step + 1);
    params[i].mutable_grad() = g.view(params[i].sizes()).to(params[i].scalar_type());
  }
}

}  // namespace gwt_fuzz
