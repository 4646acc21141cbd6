#pragma once

// The workloads of the step benchmarks (bench_step.cpp and gpu_check.cpp).

#include <ATen/ATen.h>

#include <vector>

namespace gwt_bench {

/// (0) the LLaMA-60M wavelet-eligible set: 8 layers of q, k, v, o 512x512, gate and up 1376x512,
/// down 512x1376 (25.3M values); (1) one 4096x4096 matrix; (2) many small tensors: 500 of 64x64
/// and 500 biases of 64 (2.08M values), where per-tensor host work shows; (3) a 1B-parameter
/// LLaMA-shaped set for GPUs: 20 layers of q, k, v, o 2048x2048, gate and up 5632x2048, down
/// 2048x5632 (1.03B values, 4 GB of fp32 parameters and 4 GB of gradients); (4) the parameters of
/// the main job's model (examples/train_lm, preset "tiny": byte embedding and head 256x128, 4
/// layers of q, k, v, o 128x128, gate and up 344x128, down 128x344 and two norms of 128, a final
/// norm; 0.86M values); (5) the set of (0) in bfloat16; (6) the set of (0) in float16. fp32
/// parameters (bfloat16 for 5, float16 for 6) with fixed gradients of their type; (7) one
/// 4096x11008 matrix (LLaMA-7B's down projection: rows wider than a 2-D tile's budget at L=2).
/// Workloads not listed here (2 and anything else) are (2).
/// Whether parameter i of workload 4 is a linear layer's weight inside a block: the tensors
/// gwt::paper_param_groups puts in the wavelet group (embedding, head and norms stay dense).
inline bool tiny_lm_wavelet_param(const std::vector<at::Tensor>& params, size_t i) {
  return params[i].dim() == 2 && i != 0 && i + 1 != params.size();
}

inline std::vector<at::Tensor> make_workload(int which, const at::Device& device = at::kCPU) {
  at::manual_seed(0);
  std::vector<std::vector<int64_t>> shapes;
  if (which == 0 || which == 5 || which == 6) {
    for (int layer = 0; layer < 8; ++layer) {
      for (int i = 0; i < 4; ++i) shapes.push_back({512, 512});
      shapes.push_back({1376, 512});
      shapes.push_back({1376, 512});
      shapes.push_back({512, 1376});
    }
  } else if (which == 1) {
    shapes.push_back({4096, 4096});
  } else if (which == 7) {
    shapes.push_back({4096, 11008});
  } else if (which == 3) {
    for (int layer = 0; layer < 20; ++layer) {
      for (int i = 0; i < 4; ++i) shapes.push_back({2048, 2048});
      shapes.push_back({5632, 2048});
      shapes.push_back({5632, 2048});
      shapes.push_back({2048, 5632});
    }
  } else if (which == 4) {
    shapes.push_back({256, 128});  // embedding
    for (int layer = 0; layer < 4; ++layer) {
      shapes.push_back({128});  // attention norm
      for (int i = 0; i < 4; ++i) shapes.push_back({128, 128});
      shapes.push_back({128});  // MLP norm
      shapes.push_back({344, 128});
      shapes.push_back({344, 128});
      shapes.push_back({128, 344});
    }
    shapes.push_back({128});       // final norm
    shapes.push_back({256, 128});  // head
  } else {
    for (int i = 0; i < 500; ++i) shapes.push_back({64, 64});
    for (int i = 0; i < 500; ++i) shapes.push_back({64});
  }
  std::vector<at::Tensor> params;
  for (const auto& s : shapes) {
    const at::ScalarType dtype = which == 5   ? at::kBFloat16
                                 : which == 6 ? at::kHalf
                                              : at::kFloat;
    at::Tensor p = (at::randn(s) * 0.02).to(device, dtype).requires_grad_(true);
    p.mutable_grad() = (at::randn(s) * 1e-3).to(device, dtype);
    params.push_back(p);
  }
  return params;
}

}  // namespace gwt_bench
