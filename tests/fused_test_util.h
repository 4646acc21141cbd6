#pragma once

// Helpers shared by the tests of the fused kernels (test_fused*.cpp): an optimizer over one
// parameter, and the fused and reference runs held to the rounding bound of the float64 run.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "bound_expect.h"
#include "float_bound.h"
#include "gwt/gwt.h"

namespace gwt_test::fused {

using gwt::WaveletAdam;
using gwt::WaveletAdamOptions;

struct OptRun {
  at::Tensor param;
  std::unique_ptr<WaveletAdam> opt;
};

inline OptRun make_run(const at::Tensor& init, at::ScalarType dtype,
                       const WaveletAdamOptions& options) {
  OptRun r;
  r.param = init.to(dtype).clone().requires_grad_(true);
  r.opt = std::make_unique<WaveletAdam>(std::vector<at::Tensor>{r.param}, options);
  return r;
}

inline void step(OptRun& r, const at::Tensor& grad) {
  r.param.mutable_grad() = grad.to(r.param.scalar_type());
  r.opt->step();
}

inline WaveletAdamOptions base_options() {
  return WaveletAdamOptions(0.02).weight_decay(0.1).scale(0.5).wavelet("haar");
}

// The fused and the reference run of one parameter in a reduced precision, with the float64 run
// and the bound that both must keep to.
struct BoundedRuns {
  OptRun fused, reference, exact;
  gwt_test::RoundingBound bound;
  BoundedRuns(const at::Tensor& init, at::ScalarType dtype, const WaveletAdamOptions& o,
              at::ScalarType state = at::kFloat)
      : fused(make_run(init, dtype, WaveletAdamOptions(o).fused(true))),
        reference(make_run(init, dtype, WaveletAdamOptions(o).fused(false))),
        exact(make_run(init, at::kDouble, WaveletAdamOptions(o).state_dtype("auto").fused(false))),
        bound(init.sizes(), o, dtype, state) {}
  // One step of all three with gradient g (float64 values representable in dtype), then the rule.
  void step_and_check(const at::Tensor& g, double max_relative, const std::string& what) {
    step(fused, g), step(reference, g), step(exact, g);
    check(g, max_relative, what);
  }
  // As step_and_check, with the bound's guard at `fraction` of this step's largest change of the
  // float64 run's parameters (relative to their largest magnitude), for shapes whose a priori
  // bound grows with their coefficient count past a fixed guard. A bound under half a step's
  // change still fails a block left out or stepped twice.
  void step_and_check_below_step(const at::Tensor& g, double fraction, const std::string& what) {
    const at::Tensor before = exact.param.detach().clone();
    step(fused, g), step(reference, g), step(exact, g);
    const at::Tensor after = exact.param.detach();
    const double change = (after - before).abs().max().item<double>();
    check(g, fraction * change / after.abs().max().item<double>(), what);
  }

 private:
  void check(const at::Tensor& g, double max_relative, const std::string& what) {
    bound.step(g, exact.param.detach());
    expect_within_bound(fused.param, exact.param, bound, max_relative, what + " fused");
    expect_within_bound(reference.param, exact.param, bound, max_relative, what + " reference");
  }
};

inline const gwt::WaveletAdamParamState& state_of(const OptRun& r) {
  return static_cast<const gwt::WaveletAdamParamState&>(
      *r.opt->state().at(r.param.unsafeGetTensorImpl()));
}

}  // namespace gwt_test::fused
