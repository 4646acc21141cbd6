#pragma once

// The workloads of the step benchmarks (bench_step.cpp and gpu_check.cpp).

#include <ATen/ATen.h>

#include <vector>

namespace gwt_bench {

/// (0) the LLaMA-60M wavelet-eligible set: 8 layers of q, k, v, o 512x512, gate and up 1376x512,
/// down 512x1376 (25.3M values); (1) one 4096x4096 matrix; (2) many small tensors: 500 of 64x64
/// and 500 biases of 64 (2.08M values), where per-tensor host work shows; (3) a 1B-parameter
/// LLaMA-shaped set for GPUs: 20 layers of q, k, v, o 2048x2048, gate and up 5632x2048, down
/// 2048x5632 (1.03B values, 4 GB of fp32 parameters and 4 GB of gradients). fp32 parameters with
/// fixed gradients.
inline std::vector<at::Tensor> make_workload(int which, const at::Device& device = at::kCPU) {
  at::manual_seed(0);
  std::vector<std::vector<int64_t>> shapes;
  if (which == 0) {
    for (int layer = 0; layer < 8; ++layer) {
      for (int i = 0; i < 4; ++i) shapes.push_back({512, 512});
      shapes.push_back({1376, 512});
      shapes.push_back({1376, 512});
      shapes.push_back({512, 1376});
    }
  } else if (which == 1) {
    shapes.push_back({4096, 4096});
  } else if (which == 3) {
    for (int layer = 0; layer < 20; ++layer) {
      for (int i = 0; i < 4; ++i) shapes.push_back({2048, 2048});
      shapes.push_back({5632, 2048});
      shapes.push_back({5632, 2048});
      shapes.push_back({2048, 5632});
    }
  } else {
    for (int i = 0; i < 500; ++i) shapes.push_back({64, 64});
    for (int i = 0; i < 500; ++i) shapes.push_back({64});
  }
  std::vector<at::Tensor> params;
  for (const auto& s : shapes) {
    at::Tensor p = (at::randn(s) * 0.02).to(device).requires_grad_(true);
    p.mutable_grad() = (at::randn(s) * 1e-3).to(device);
    params.push_back(p);
  }
  return params;
}

}  // namespace gwt_bench
