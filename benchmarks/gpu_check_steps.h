#pragma once

// The GPU check's comparison of one optimizer on the device under test with another on the CPU
// (gpu_check.cpp's 56 WaveletAdam tensors, gpu_check_foam.cpp's FoamAdam set): five steps of both
// on the same float64 gradients, tensor 4's gradient with a NaN at step 2 (a "skip_param" tensor:
// skipped alone) and tensor 7's at step 3 (a "skip_step" one: the whole step).

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

namespace gwt_gpu_check {

/// Steps both and compares after each step: every parameter within 1e-10 of |p| of the reference
/// (float64 on both sides: far above either's rounding), the same skip counts. `grad_of(t, i)`:
/// step t's gradient of tensor i (float64, on the CPU). Sets `worst` to the largest relative error.
template <typename Optimizer>
bool compare_steps(Optimizer& dev_opt, Optimizer& ref_opt, std::vector<at::Tensor>& dev,
                   std::vector<at::Tensor>& ref,
                   const std::function<at::Tensor(int, size_t)>& grad_of, double& worst) {
  bool ok = true;
  worst = 0;
  for (int t = 0; t < 5; ++t) {
    for (size_t i = 0; i < dev.size(); ++i) {
      at::Tensor g = grad_of(t, i);
      if (t == 2 && i == 4) g.view(-1)[0] = NAN;  // "skip_param": tensor 4 alone
      if (t == 3 && i == 7) g.view(-1)[1] = NAN;  // "skip_step": the whole step
      dev[i].mutable_grad() = g.to(dev[i].device());
      ref[i].mutable_grad() = g;
    }
    dev_opt.step(), ref_opt.step();
    for (size_t i = 0; i < dev.size(); ++i) {
      const at::Tensor d = dev[i].detach().cpu(), r = ref[i].detach();
      const double err = (d - r).abs().max().item<double>() / r.abs().max().item<double>();
      worst = std::max(worst, err);
      ok = ok && err <= 1e-10 && dev_opt.skipped_steps(dev[i]) == ref_opt.skipped_steps(ref[i]);
    }
    ok = ok && dev_opt.skipped_steps() == ref_opt.skipped_steps();
  }
  return ok;
}

}  // namespace gwt_gpu_check
