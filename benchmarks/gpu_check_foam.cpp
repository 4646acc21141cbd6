// The GPU check's FoamAdam case (gpu_check.cpp runs it): FoamAdam's step on the device under test
// (its multi-tensor kernels on a GPU, or emulated on the host with --emulate) against the
// readable reference on the CPU, over tensors of mixed shapes, levels and groups in one step,
// with a parameter skipped alone and a whole step skipped.

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "gpu_check_steps.h"
#include "gwt/gwt.h"

bool check_foam(const at::Device& device) {
  const std::vector<std::vector<int64_t>> shapes = {{16, 64}, {5, 37}, {3, 11, 33}, {7, 130},
                                                    {33},     {},      {9, 10}};
  std::vector<at::Tensor> dev, ref;
  std::vector<torch::optim::OptimizerParamGroup> dev_groups, ref_groups;
  at::manual_seed(6);
  for (int i = 0; i < 28; ++i) {
    const auto& shape = shapes[static_cast<size_t>(i) % shapes.size()];
    const at::Tensor init = at::randn(shape, at::kDouble);
    dev.push_back(init.to(device).clone().requires_grad_(true));
    ref.push_back(init.clone().requires_grad_(true));
    // Levels 1 to 3, a dense group every seventh tensor; "skip_param" in every other group.
    const auto o = gwt::FoamAdamOptions(0.02)
                       .weight_decay(0.1)
                       .scale(0.25)
                       .res_scale(0.5)
                       .level(i % 7 == 6 ? 0 : 1 + i % 3)
                       .nonfinite(i % 2 == 0 ? "skip_param" : "skip_step");
    dev_groups.emplace_back(std::vector<at::Tensor>{dev.back()},
                            std::make_unique<gwt::FoamAdamOptions>(o));
    ref_groups.emplace_back(
        std::vector<at::Tensor>{ref.back()},
        std::make_unique<gwt::FoamAdamOptions>(gwt::FoamAdamOptions(o).fused(false)));
  }
  gwt::FoamAdam dev_opt(dev_groups), ref_opt(ref_groups);
  double worst = 0;
  const bool ok = gwt_gpu_check::compare_steps(
      dev_opt, ref_opt, dev, ref,
      [&dev](int t, size_t i) {
        at::manual_seed(100 * t + static_cast<int64_t>(i));
        return at::randn(dev[i].sizes(), at::kDouble) * (1 + t);
      },
      worst);
  std::printf(
      "%s check FoamAdam, 28 tensors of mixed shapes, levels and groups in one step (2 skips): "
      "worst relative error %.3g, skipped steps %lld\n",
      ok ? "PASS" : "FAIL", worst, static_cast<long long>(dev_opt.skipped_steps()));
  return ok;
}
