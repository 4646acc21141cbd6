#pragma once

// The fixture and the expectations of the tests of WaveletAdam's errors (test_errors.cpp,
// test_errors_checkpoint.cpp).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "error_expect.h"
#include "gwt/gwt.h"

// What the tests of errors use, for `using namespace gwt_test::errors`.
namespace gwt_test::errors {

using gwt::WaveletAdam;
using gwt::WaveletAdamOptions;
using gwt::WaveletAdamParamState;
using gwt_test::expect_error;
using gwt_test::k_inf;
using gwt_test::k_nan;

// A trained optimizer and snapshots of its parameters and state, to show nothing changed.
struct Fixture {
  at::Tensor w = at::randn({8, 32}, at::kDouble).requires_grad_(true);
  at::Tensor b = at::randn({8}, at::kDouble).requires_grad_(true);
  WaveletAdam opt{std::vector<at::Tensor>{w, b}, WaveletAdamOptions(0.01)};
  std::vector<at::Tensor> snapshot;

  Fixture() {
    for (int t = 0; t < 2; ++t) {
      w.mutable_grad() = at::randn({8, 32}, at::kDouble);
      b.mutable_grad() = at::randn({8}, at::kDouble);
      opt.step();
    }
    snapshot = current();
  }
  std::vector<at::Tensor> current() {
    std::vector<at::Tensor> out = {w.detach().clone(), b.detach().clone()};
    for (const auto& p : {w, b}) {
      const auto& s =
          static_cast<const WaveletAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
      out.push_back(s.exp_avg().clone());
      out.push_back(s.exp_avg_sq().clone());
      out.push_back(at::scalar_tensor(static_cast<double>(s.step()), at::kDouble));
      if (s.norm().defined()) out.push_back(s.norm().clone());
    }
    return out;
  }
  void expect_unchanged() {
    const auto now = current();
    ASSERT_EQ(now.size(), snapshot.size());
    for (size_t i = 0; i < now.size(); ++i)
      EXPECT_TRUE(at::equal(now[i], snapshot[i])) << "tensor " << i;
  }
};

}  // namespace gwt_test::errors
