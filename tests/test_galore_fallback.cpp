// gwt::GaLoreAdam's SVD fallback, with failures injected by a test-only hook, and the gradients
// and options it refuses or skips (the rule: test_galore.cpp).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "galore_test_util.h"
#include "gwt/gwt.h"
#include "test_util.h"

namespace {

using gwt_test::max_abs_diff;
using namespace gwt_test::galore;

// ---------------------------------------------------------------------------------------------
// The SVD fallback (failures injected through gwt::detail::inject_svd_fault, a test-only hook)
// ---------------------------------------------------------------------------------------------

// GaLore's rule for given projectors, in plain float64 ATen (betas 0.9/0.999, eps 1e-6, bias
// correction, no weight decay): the moments live in the projected space and are kept when the
// projector changes.
at::Tensor galore_reference(at::Tensor p, const std::vector<at::Tensor>& grads,
                            const std::vector<at::Tensor>& projectors, bool right, double lr,
                            double scale) {
  at::Tensor m, v;
  for (size_t t = 0; t < grads.size(); ++t) {
    const at::Tensor& P = projectors[t];
    const at::Tensor R = right ? at::matmul(grads[t], P.t()) : at::matmul(P.t(), grads[t]);
    m = t == 0 ? 0.1 * R : 0.9 * m + 0.1 * R;
    v = t == 0 ? 0.001 * R * R : 0.999 * v + 0.001 * R * R;
    const double n = static_cast<double>(t + 1);
    const double step_size = lr * std::sqrt(1 - std::pow(0.999, n)) / (1 - std::pow(0.9, n));
    const at::Tensor N = m / (at::sqrt(v) + 1e-6);
    p = p - step_size * scale * (right ? at::matmul(N, P) : at::matmul(P, N));
  }
  return p;
}

TEST(GaLoreAdam, SvdConvergenceFailureOrNonFiniteResultKeepsThePreviousProjector) {
  // Documented fallback: the previous projector is kept; at the first refresh (none yet) the
  // leading coordinate vectors, I[:r] on the projected side; svd_fallbacks() counts each.
  using gwt::detail::SvdFault;
  for (const SvdFault fault : {SvdFault::linalg_error, SvdFault::non_finite})
    for (const std::string proj_type : {"std", "left"}) {  // [10, 6]: std projects from the right
      SCOPED_TRACE(std::string(fault == SvdFault::linalg_error ? "LinAlgError " : "NaN result ") +
                   proj_type);
      at::manual_seed(30);
      const bool right = proj_type == "std";
      const at::Tensor p0 = at::randn({10, 6}, at::kDouble);
      at::Tensor p = p0.clone().requires_grad_(true);
      GaLoreAdam opt({p}, GaLoreAdamOptions(0.01).rank(2).update_proj_gap(2).proj_type(proj_type));
      std::vector<at::Tensor> grads, projectors;
      for (int t = 0; t < 5; ++t) {  // refreshes at steps 1, 3, 5; the SVD fails at 1 and 5
        if (t == 0 || t == 4) gwt::detail::inject_svd_fault(fault);
        grads.push_back(at::randn({10, 6}, at::kDouble));
        p.mutable_grad() = grads.back().clone();
        opt.step();
        projectors.push_back(state_of(opt, p).projector().clone());
        EXPECT_EQ(opt.svd_fallbacks(), t < 4 ? 1 : 2) << "step " << t + 1;
      }
      EXPECT_TRUE(at::equal(projectors[0],
                            right ? at::eye(2, 6, at::kDouble) : at::eye(10, 2, at::kDouble)));
      EXPECT_TRUE(at::equal(projectors[1], projectors[0]));  // no refresh at step 2
      // Step 3 refreshed from the SVD of its gradient: the same subspace as the top-2 singular
      // vectors (P^T P, or P P^T, is sign-free), and kept through the failure at step 5.
      const auto [u, s, vh] = at::linalg_svd(grads[2], false);
      const at::Tensor top = right ? vh.narrow(0, 0, 2) : u.narrow(1, 0, 2);
      const at::Tensor gram = right ? at::matmul(projectors[2].t(), projectors[2])
                                    : at::matmul(projectors[2], projectors[2].t());
      const at::Tensor top_gram = right ? at::matmul(top.t(), top) : at::matmul(top, top.t());
      EXPECT_LE(max_abs_diff(gram, top_gram), 1e-10);
      EXPECT_TRUE(at::equal(projectors[4], projectors[2]));
      EXPECT_EQ(state_of(opt, p).step(), 5);
      EXPECT_EQ(opt.skipped_steps(), 0);
      // The parameter followed the rule with those projectors (float64: 1e-12).
      EXPECT_LE(
          max_abs_diff(p.detach(), galore_reference(p0, grads, projectors, right, 0.01, 0.25)),
          1e-12);
    }
}

TEST(GaLoreAdam, OtherSvdErrorsPropagateWithNothingChanged) {
  // Out of memory (or a CUDA error, or a bug) is not a property of the gradient: it reaches the
  // caller, at the first refresh and at later ones, and the step changes nothing.
  using gwt::detail::SvdFault;
  for (const SvdFault fault : {SvdFault::out_of_memory, SvdFault::other_error})
    for (const bool first_step : {true, false}) {
      SCOPED_TRACE(std::string(fault == SvdFault::out_of_memory ? "OutOfMemoryError" : "Error") +
                   (first_step ? " at the first step" : " at a later refresh"));
      at::manual_seed(31);
      at::Tensor w = at::randn({10, 6}).requires_grad_(true),
                 b = at::randn({6}).requires_grad_(true);
      GaLoreAdam opt({w, b}, GaLoreAdamOptions(0.01).rank(2).update_proj_gap(1));
      auto set_grads = [&] {
        w.mutable_grad() = at::randn({10, 6});
        b.mutable_grad() = at::randn({6});
      };
      if (!first_step) {
        set_grads();
        opt.step();
      }
      set_grads();
      const auto before = snapshot(opt, {w, b});
      gwt::detail::inject_svd_fault(fault);
      if (fault == SvdFault::out_of_memory)
        EXPECT_THROW(opt.step(), c10::OutOfMemoryError);
      else
        expect_error([&] { opt.step(); }, {"injected SVD error"});
      expect_same(snapshot(opt, {w, b}), before);
      opt.step();  // the fault is used up: the same step now goes through
      EXPECT_EQ(state_of(opt, w).step(), first_step ? 1 : 2);
      EXPECT_EQ(opt.svd_fallbacks(), 0);
    }
}

TEST(GaLoreAdam, GradientThatOverflowsTheComputeDtypeSkipsTheStep) {
  // A finite float64 gradient of a float32 parameter that overflows in the conversion: no SVD of
  // infinities (which LAPACK may answer with an error that is not a convergence failure); the
  // step is skipped with nothing changed, at the first refresh and later.
  at::manual_seed(32);
  at::Tensor w = at::randn({10, 6}).requires_grad_(true);
  GaLoreAdam opt({w}, GaLoreAdamOptions(0.01).rank(2).update_proj_gap(1));
  for (int t = 0; t < 2; ++t) {
    w.mutable_grad() = at::full({10, 6}, 1e300, at::kDouble);
    const auto before = snapshot(opt, {w});
    opt.step();
    EXPECT_EQ(opt.skipped_steps(), t + 1);
    auto after = snapshot(opt, {w});
    after[after.size() - 3] = before[before.size() - 3];  // all but skipped_steps
    expect_same(after, before);
    w.mutable_grad() = at::randn({10, 6});
    opt.step();  // a normal step in between
  }
  EXPECT_EQ(state_of(opt, w).step(), 2);
  EXPECT_EQ(opt.svd_fallbacks(), 0);
}

TEST(GaLoreAdam, EpsZeroIsRejectedLikeWaveletAdams) {
  // eps = 0 made 0 / 0 = NaN in the parameter where a coordinate's gradients were all zero.
  const at::Tensor p = at::randn({4, 8}).requires_grad_(true);
  for (double bad : {0.0, 1e-300, -1e-8, k_nan})
    expect_error([&] { GaLoreAdam opt({p}, GaLoreAdamOptions().eps(bad)); },
                 {"gwt::GaLoreAdam: invalid eps", "smallest normal float32"});
  // The smallest accepted eps keeps all-zero coordinates at zero update, dense and projected.
  at::Tensor d = at::ones({6}).requires_grad_(true);
  at::Tensor w = at::ones({8, 6}).requires_grad_(true);
  GaLoreAdam opt({d, w}, GaLoreAdamOptions(1e-3).rank(2).eps(std::numeric_limits<float>::min()));
  d.mutable_grad() = at::zeros({6});
  w.mutable_grad() = at::zeros({8, 6});
  opt.step();
  EXPECT_TRUE(at::equal(d, at::ones({6})));
  EXPECT_TRUE(at::isfinite(w).all().item<bool>());
}

TEST(GaLoreAdam, OptionsThatOverflowFloat32AreRejectedAtStepWithNothingChanged) {
  // lr = 1e300 is a finite double: valid for a float64 parameter, but a float32 parameter's update
  // runs in float32, where ATen's scalar conversion threw a std::runtime_error half-way through the
  // step (found by fuzz_step for WaveletAdam; GaLore shares the check).
  at::manual_seed(33);
  at::Tensor d = at::randn({6}).requires_grad_(true);
  at::Tensor w = at::randn({8, 6}).requires_grad_(true);
  GaLoreAdam opt({d, w}, GaLoreAdamOptions(0.01).rank(2));
  d.mutable_grad() = at::randn({6});
  w.mutable_grad() = at::randn({8, 6});
  opt.step();
  auto& o = static_cast<GaLoreAdamOptions&>(opt.param_groups()[0].options());
  for (auto set : std::vector<std::function<void()>>{[&] { o.lr(1e300); },
                                                     [&] { o.lr(1e20).weight_decay(1e20); },
                                                     [&] { o.lr(1e30).scale(1e30); }}) {
    o = GaLoreAdamOptions(0.01).rank(2);
    set();
    const auto before = snapshot(opt, {d, w});
    expect_error([&] { opt.step(); }, {"does not fit float32", "Float parameter"});
    expect_same(snapshot(opt, {d, w}), before);
  }
  // The same lr for a float64 parameter is representable: the step runs.
  at::Tensor q = at::randn({6}, at::kDouble).requires_grad_(true);
  GaLoreAdam wide({q}, GaLoreAdamOptions(1e300));
  q.mutable_grad() = at::randn({6}, at::kDouble);
  EXPECT_NO_THROW(wide.step());
}

TEST(GaLoreAdam, WideGradientThatOverflowsADenseParametersDtypeSkipsTheStep) {
  // A float64 gradient of 1e300 is finite, but the float32 update converts it to infinity: the
  // finite check runs on the converted gradient, so the step is skipped instead of writing NaN.
  at::Tensor d = at::randn({6}).requires_grad_(true);
  GaLoreAdam opt({d}, GaLoreAdamOptions(0.01));
  d.mutable_grad() = at::full({6}, 1e300, at::kDouble);
  const auto before = snapshot(opt, {d});
  opt.step();
  EXPECT_EQ(opt.skipped_steps(), 1);
  auto after = snapshot(opt, {d});
  after[after.size() - 3] = before[before.size() - 3];  // all but skipped_steps
  expect_same(after, before);
}

TEST(GaLoreAdam, NonFiniteGradientAnywhereSkipsTheWholeStep) {
  // A NaN or an infinity in one element of any gradient, projected or dense, in either group and
  // in float32 or float64: no parameter, moment, projector or step count changes, in any group,
  // and skipped_steps() grows by one. Bit-exact by construction: nothing may be written.
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    at::manual_seed(34);
    const auto f = at::TensorOptions().dtype(dtype);
    at::Tensor w = at::randn({10, 6}, f).requires_grad_(true);  // projected
    at::Tensor d = at::randn({6}, f).requires_grad_(true);      // dense
    at::Tensor v = at::randn({5, 9}, f).requires_grad_(true);   // projected, second group
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{w, d});
    GaLoreAdam opt(std::move(groups), GaLoreAdamOptions(0.01).rank(2).update_proj_gap(1));
    opt.add_param_group(torch::optim::OptimizerParamGroup(
        {v}, std::make_unique<GaLoreAdamOptions>(GaLoreAdamOptions(0.02).rank(3))));
    const std::vector<at::Tensor> params = {w, d, v};
    auto fresh_grads = [&] {
      for (const auto& p : params) p.mutable_grad() = at::randn(p.sizes(), f);
    };
    fresh_grads();
    opt.step();  // state, moments and projectors exist
    int64_t skipped = 0;
    for (size_t which = 0; which < params.size(); ++which) {
      for (double bad : {k_nan, k_inf, -k_inf}) {
        fresh_grads();
        params[which].mutable_grad().view({-1})[3] = bad;
        const auto before = snapshot(opt, params);
        opt.step();
        EXPECT_EQ(opt.skipped_steps(), ++skipped) << "parameter " << which << ", value " << bad;
        auto after = snapshot(opt, params);
        after[after.size() - 3] = before[before.size() - 3];  // all but skipped_steps
        expect_same(after, before);
      }
    }
    fresh_grads();
    opt.step();  // finite again: the step is taken
    for (const auto& p : params) EXPECT_EQ(state_of(opt, p).step(), 2);
  }
}

TEST(GaLoreAdam, BadGradientsAreRejectedWithNothingChangedAndMissingOnesAreLeftOut) {
  at::manual_seed(35);
  at::Tensor w = at::randn({10, 6}).requires_grad_(true);
  at::Tensor d = at::randn({6}).requires_grad_(true);
  GaLoreAdam opt({w, d}, GaLoreAdamOptions(0.01).rank(2));
  w.mutable_grad() = at::randn({10, 6});
  d.mutable_grad() = at::randn({6});
  opt.step();
  const std::vector<std::pair<at::Tensor, std::string>> bad = {
      {at::randn({10, 7}), "gradient shape [10, 7] does not match its parameter's shape [10, 6]"},
      {at::randn({10, 6}).to_sparse(), "does not support sparse gradients"},
      {at::ones({10, 6}, at::kInt), "gradient dtype Int is not floating point"}};
  for (const auto& [grad, words] : bad) {
    w.mutable_grad() = grad;
    d.mutable_grad() = at::randn({6});  // a good gradient beside it: it does not step either
    const auto before = snapshot(opt, {w, d});
    expect_error([&] { opt.step(); }, {"gwt::GaLoreAdam", words});
    expect_same(snapshot(opt, {w, d}), before);
  }
  // A missing gradient leaves that parameter out: no state is made for a new one, the step count
  // of one with state stays, and the others step.
  at::Tensor u = at::randn({4, 8}).requires_grad_(true);
  opt.add_param_group(torch::optim::OptimizerParamGroup({u}));
  w.mutable_grad() = at::Tensor();
  d.mutable_grad() = at::randn({6});
  const at::Tensor w_before = w.detach().clone(), u_before = u.detach().clone();
  const auto w_state = snapshot(opt, {w});
  opt.step();
  EXPECT_TRUE(at::equal(w, w_before));
  EXPECT_TRUE(at::equal(u, u_before));
  EXPECT_EQ(opt.state().count(u.unsafeGetTensorImpl()), 0u);
  EXPECT_EQ(state_of(opt, w).step(), 1);
  auto w_after = snapshot(opt, {w});
  expect_same(std::vector<at::Tensor>(w_after.begin(), w_after.end() - 3),
              std::vector<at::Tensor>(w_state.begin(), w_state.end() - 3));
  EXPECT_EQ(state_of(opt, d).step(), 2);
  EXPECT_EQ(opt.skipped_steps(), 0);
}

}  // namespace
