#pragma once

// Helpers shared by the tests of gwt::nn::DeltaLinear and its whole-model functions
// (test_delta.cpp, test_delta_adapters.cpp, test_delta_rank.cpp).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "error_expect.h"
#include "gwt/gwt.h"

namespace gwt_test::delta {

// Linear layers "0", "1", ... called by name (gwt::nn::child_forward), so that adapters put in by
// add_delta_adapters take part in the forward (a torch::nn::Sequential runs its own list).
struct StackImpl : torch::nn::Module {
  explicit StackImpl(const std::vector<std::pair<int64_t, int64_t>>& sizes) {
    for (size_t i = 0; i < sizes.size(); ++i)
      register_module(std::to_string(i), torch::nn::Linear(sizes[i].first, sizes[i].second));
    layers = static_cast<int64_t>(sizes.size());
    to(at::kDouble);
  }
  at::Tensor forward(at::Tensor x) {
    for (int64_t i = 0; i < layers; ++i) x = gwt::nn::child_forward(*this, std::to_string(i), x);
    return x;
  }
  std::shared_ptr<torch::nn::Module> layer(int64_t i) {
    return named_children()[std::to_string(i)];
  }
  int64_t layers = 0;
};
TORCH_MODULE(Stack);

// Expects `fn` to throw a c10::Error whose message contains `words`.
inline void expect_error(const std::function<void()>& fn, const std::string& words) {
  gwt_test::expect_error(fn, std::vector<std::string>{words});
}

// Every child of `model` still a plain Linear and every parameter trainable: nothing was replaced
// or frozen.
inline void expect_untouched(const torch::nn::Module& model) {
  for (const auto& child : model.children())
    EXPECT_TRUE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(child) != nullptr);
  for (const auto& p : model.parameters()) EXPECT_TRUE(p.requires_grad());
}

inline torch::nn::Linear make_base(int64_t in, int64_t out, at::ScalarType dtype = at::kDouble) {
  torch::nn::Linear base(torch::nn::LinearOptions(in, out));
  base->to(dtype);
  return base;
}

// H_1 ... H_r multiplied out densely from the columns of u [in, r].
inline at::Tensor dense_reflections(const at::Tensor& u) {
  const int64_t n = u.size(0);
  at::Tensor h = at::eye(n, u.options());
  for (int64_t i = 0; i < u.size(1); ++i) {
    const at::Tensor v = u.narrow(1, i, 1);
    h = at::matmul(h, at::eye(n, u.options()) - 2 * at::matmul(v, v.t()) / at::matmul(v.t(), v));
  }
  return h;
}

inline void randomize_impl(gwt::nn::DeltaLinearImpl& layer) {
  at::NoGradGuard no_grad;
  for (auto& p : layer.parameters())
    if (p.requires_grad()) p.copy_(at::randn(p.sizes(), p.options()));
}

inline Stack three_layers(int64_t hidden = 16) {
  return Stack(std::vector<std::pair<int64_t, int64_t>>{{12, 16}, {16, hidden}, {hidden, 3}});
}

}  // namespace gwt_test::delta
