#pragma once

// gtest expectations over tests/float_bound.h's bounds, shared by the kernel tests.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "float_bound.h"
#include "test_util.h"

namespace gwt_test {

// max |a - b| / max |b|: the error relative to the parameter's magnitude.
inline double rel_error(const at::Tensor& a, const at::Tensor& b) {
  return max_abs_diff(a, b) / b.to(at::kDouble).abs().max().item<double>();
}

// Reduced precision: each run (fused and reference) lies within the rounding bound of the float64
// run, a bound computed from the data (tests/float_bound.h). Neither run is compared with the
// other's luck, so the rule holds for any BLAS, instruction set and thread count. The bound is
// checked to be small (at most `max_relative` of the parameters' largest magnitude), so a real
// error still fails it.
inline void expect_within_bound(const at::Tensor& run, const at::Tensor& exact,
                                const gwt_test::RoundingBound& bound, double max_relative,
                                const std::string& what) {
  const at::Tensor err = (run.to(at::kDouble) - exact.to(at::kDouble)).abs();
  const at::Tensor& b = bound.bound();
  EXPECT_TRUE((err <= b).all().item<bool>())
      << what << ": worst error / bound " << (err / b).max().item<double>() << ", worst error "
      << err.max().item<double>() << ", kappa " << bound.kappa();
  // Where the data cannot be made well conditioned (kappa > 10: zero mode with filters of 8 taps
  // or more at levels 2-3, whose edge coefficients take partial tap sums that nearly cancel even
  // on one-sign rows), float32 itself is sensitive and the bound is rightly large; the float64
  // tests are the exactness check there.
  if (bound.kappa() > 10) return;
  const double scale = exact.to(at::kDouble).abs().max().item<double>();
  EXPECT_LE(b.max().item<double>(), max_relative * scale)
      << what << ": the bound is too loose to mean anything (kappa " << bound.kappa() << ")";
}

}  // namespace gwt_test
