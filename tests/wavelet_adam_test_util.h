#pragma once

// Helpers shared by the tests of gwt::WaveletAdam (test_wavelet_adam*.cpp): parameters, their
// gradients and state, and checkpoint files.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

#include "gwt/gwt.h"

namespace gwt_test::wavelet_adam {

using gwt::WaveletAdam;
using gwt::WaveletAdamParamState;

inline std::string temp_file(const std::string& name) {
  return ::testing::TempDir() + "gwt_" + name + "_" + std::to_string(::getpid()) + ".pt";
}

inline at::Tensor make_param(at::IntArrayRef shape, at::ScalarType dtype = at::kDouble) {
  return at::randn(shape, at::TensorOptions().dtype(dtype)).requires_grad_(true);
}

inline void set_grad(const at::Tensor& p, const at::Tensor& g) {
  p.mutable_grad() = g.to(p.scalar_type()).clone();
}

inline const WaveletAdamParamState& state_of(WaveletAdam& opt, const at::Tensor& p) {
  return static_cast<const WaveletAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

}  // namespace gwt_test::wavelet_adam
