// gwt::FoamAdam against the FOAM authors' optimizer and against the rule of docs/algorithm.md#foam
// written out in NumPy (tests/gen_foam_golden.py); which parameters it folds, its groups, its
// memory and its low-precision steps. Checkpoints, non-finite gradients and bad input:
// test_foam_state.cpp.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "foam_test_util.h"
#include "gwt/gwt.h"
#include "test_util.h"

namespace {

using namespace gwt_test::foam;

// (Built with append: GCC 12 warns falsely on `"g" + std::to_string(t)`, GCC bug 105329.)
std::string row_key(const char* prefix, int64_t t) {
  return std::string(prefix).append(std::to_string(t));
}

// Replays every record of a golden file (format: tests/data/README of the shared golden set, and
// tests/gen_foam_golden.py) in float64 and compares each step's parameter.
void expect_trajectories(const std::string& file, size_t min_records) {
  const auto records = gwt_test::read_records(file, "config");
  ASSERT_GE(records.size(), min_records);
  for (const auto& rec : records) {
    SCOPED_TRACE(config_value(rec, "name"));
    const std::vector<int64_t> shape = config_shape(rec);
    // The fused kernels (where one takes the parameter: dim -1) and the readable reference.
    for (bool fused : {true, false}) {
      SCOPED_TRACE(fused ? "fused" : "reference");
      const FoamAdamOptions options = config_options(rec).fused(fused);
      at::Tensor p =
          gwt_test::to_tensor(rec.rows.at("p0")).view(shape).clone().requires_grad_(true);
      FoamAdam opt({p}, options);
      EXPECT_EQ(opt.is_folded_param(p), options.level() > 0);
      EXPECT_EQ(
          opt.is_fused_param(p),
          fused && (options.dim() == -1 || options.dim() == p.dim() - 1 || options.level() == 0));
      const int64_t steps = std::stoll(config_value(rec, "steps"));
      ASSERT_GE(steps, 8);
      for (int64_t t = 1; t <= steps; ++t) {
        set_grad(p, gwt_test::to_tensor(rec.rows.at(row_key("g", t))).view(shape));
        opt.step();
        const at::Tensor expected = gwt_test::to_tensor(rec.rows.at(row_key("p", t))).view(shape);
        // Relative to each element, with a floor of 1e-3 so that a value near zero does not blow
        // up. Both sides compute in float64 with a few roundings per element and step (block sums,
        // moment updates, one square root, one division, two updates of p), each within 1.1e-16
        // relative, on update terms of order one (|m| / sqrt(v) is bounded for these betas): over
        // 8 to 12 steps p differs by a few 1e-15 (at most 4e-15 here), 1e-12 against the floor at
        // the worst, so 1e-9 cannot fail by rounding. A change of the rule moves p far more: rho^2
        // dropped from V, 7e-2 at step 1; a padded block divided by its real length, every config
        // with a partial block fails at step 1.
        EXPECT_LE(gwt_test::max_rel_diff(p.detach(), expected, 1e-3), 1e-9) << "step " << t;
      }
    }
  }
}

TEST(FoamAdam, MatchesTheAuthorsOptimizerTrajectories) {
  // tests/data/foam_trajectories.txt: the authors' FOAM (foam_torch/foam_adam.py), float64.
  expect_trajectories("foam_trajectories.txt", 2);
}

TEST(FoamAdam, FollowsTheRuleOnOddLengthsLevelsDimsAndOptions) {
  // tests/data/foam_rule_golden.txt: the rule in NumPy (tests/gen_foam_golden.py) on odd lengths,
  // levels 1 to 4, a block longer than the row, 3-D parameters, dim 0 and 1, a 1-D parameter,
  // res_scale 0, 0.5 and 2, beta2 0.95, eps 1e-6, no bias correction, decay, a dense group.
  expect_trajectories("foam_rule_golden.txt", 12);
}

TEST(FoamAdam, MomentsHoldOneValuePerBlockAlongDim) {
  at::manual_seed(3);
  const at::Tensor odd = make_param({3, 13}), along0 = make_param({11, 5}),
                   cube = make_param({2, 9, 3}), bias = make_param({7}), one = make_param({});
  FoamAdam opt({odd, along0, cube, bias, one}, FoamAdamOptions(0.01).level(2));
  FoamAdam dim0({along0.detach().clone().requires_grad_(true)}, FoamAdamOptions(0.01).dim(0));
  for (const auto& p : {odd, along0, cube, bias, one}) set_grad(p, at::randn(p.sizes()));
  opt.step();
  EXPECT_EQ(state_of(opt, odd).exp_avg().sizes(), at::IntArrayRef({3, 4}));  // ceil(13 / 4)
  EXPECT_EQ(state_of(opt, along0).exp_avg().sizes(), at::IntArrayRef({11, 2}));
  EXPECT_EQ(state_of(opt, cube).exp_avg_sq().sizes(), at::IntArrayRef({2, 9, 1}));
  EXPECT_EQ(state_of(opt, bias).exp_avg().sizes(), at::IntArrayRef({2}));
  EXPECT_EQ(state_of(opt, one).exp_avg().dim(), 0);
  const at::Tensor p0 = dim0.param_groups()[0].params()[0];
  set_grad(p0, at::randn({11, 5}));
  dim0.step();
  EXPECT_EQ(state_of(dim0, p0).exp_avg().sizes(), at::IntArrayRef({3, 5}));  // ceil(11 / 4) rows
}

TEST(FoamAdam, AZeroDimParameterStepsAsARowOfOneElement) {
  at::manual_seed(4);
  const at::Tensor scalar_param = make_param({});
  const at::Tensor row = scalar_param.detach().reshape({1}).clone().requires_grad_(true);
  const auto o = FoamAdamOptions(0.05).level(2).scale(0.25).res_scale(0.5).weight_decay(0.1);
  FoamAdam a({scalar_param}, o), b({row}, o);
  for (int t = 0; t < 4; ++t) {
    const at::Tensor g = at::randn({}, at::kDouble);
    set_grad(scalar_param, g), set_grad(row, g.reshape({1}));
    a.step(), b.step();
    EXPECT_TRUE(at::equal(scalar_param.reshape({1}), row)) << "step " << t;
  }
}

TEST(FoamAdam, EveryParameterOfAFoldedGroupIsFoldedAndFused) {
  const at::Tensor small = make_param({5, 3}), bias = make_param({7}), cube = make_param({2, 3, 9}),
                   one = make_param({}), big = make_param({8, 8});
  // As the authors: every parameter of a group with a level, whatever its shape.
  FoamAdam all({small, bias, cube, one, big}, FoamAdamOptions().level(3));
  for (const auto& p : {small, bias, cube, one, big}) {
    EXPECT_TRUE(all.is_folded_param(p)) << p.sizes();
    EXPECT_TRUE(all.is_fused_param(p)) << p.sizes();  // contiguous, on the CPU, along dim -1
  }
  // min_size keeps what has fewer than two dimensions, or fewer than min_size along either of the
  // last two, dense (WaveletAdam's meaning).
  FoamAdam sized({small, bias, cube, one, big}, FoamAdamOptions().min_size(4));
  EXPECT_FALSE(sized.is_folded_param(small));
  EXPECT_FALSE(sized.is_folded_param(bias));
  EXPECT_FALSE(sized.is_folded_param(cube));  // its last two: 3 x 9
  EXPECT_FALSE(sized.is_folded_param(one));
  EXPECT_TRUE(sized.is_folded_param(big));
  FoamAdam dense({small, big}, FoamAdamOptions().level(0));
  EXPECT_FALSE(dense.is_folded_param(big));
  const at::Tensor stranger = make_param({4});
  expect_error([&] { (void)all.is_folded_param(stranger); }, {"not a parameter"});
  expect_error([&] { (void)all.is_fused_param(stranger); }, {"is_fused_param", "not a parameter"});
}

TEST(FoamAdam, StateAtLevelTwoIsAQuarterOfAdamsRoundedUpPerRow) {
  at::manual_seed(5);
  const at::Tensor even = make_param({8, 32}, at::kFloat), odd = make_param({6, 30}, at::kFloat);
  const at::Tensor bias = make_param({30}, at::kFloat);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{even, odd},
                      std::make_unique<FoamAdamOptions>(FoamAdamOptions(0.01).level(2)));
  groups.emplace_back(std::vector<at::Tensor>{bias},
                      std::make_unique<FoamAdamOptions>(FoamAdamOptions(0.01).level(0)));
  FoamAdam opt(std::move(groups));
  EXPECT_EQ(opt.state_bytes(), 0);
  for (const auto& p : {even, odd, bias}) set_grad(p, at::randn(p.sizes()));
  opt.step();
  const int64_t f32 = 4, moments = 2;
  const int64_t adam_even = moments * 8 * 32 * f32;
  EXPECT_EQ(opt.state_bytes(even) * 4, adam_even);         // exactly a quarter
  EXPECT_EQ(opt.state_bytes(odd), moments * 6 * 8 * f32);  // ceil(30 / 4) = 8 per row
  EXPECT_EQ(opt.state_bytes(bias), moments * 30 * f32);    // dense: Adam's
  EXPECT_EQ(opt.state_bytes(),
            opt.state_bytes(even) + opt.state_bytes(odd) + opt.state_bytes(bias));
  // bfloat16 moments halve it again.
  const at::Tensor narrow = make_param({8, 32}, at::kFloat);
  FoamAdam half({narrow}, FoamAdamOptions(0.01).state_dtype("bfloat16"));
  set_grad(narrow, at::randn({8, 32}));
  half.step();
  EXPECT_EQ(half.state_bytes(narrow) * 8, adam_even);
  EXPECT_EQ(state_of(half, narrow).exp_avg().scalar_type(), at::kBFloat16);
}

TEST(FoamAdam, LowPrecisionParametersStepInFloat32AndRoundOnce) {
  // A bfloat16 parameter's step is the float32 step of its values, rounded to bfloat16 once: the
  // same as a float32 parameter that starts from those values, exactly (the same float32 ops).
  at::manual_seed(6);
  const at::Tensor low = make_param({6, 13}, at::kBFloat16);
  const at::Tensor wide = low.detach().to(at::kFloat).requires_grad_(true);
  const auto o = FoamAdamOptions(0.01).level(2).scale(0.25).weight_decay(0.01);
  FoamAdam a({low}, o), b({wide}, o);
  for (int t = 0; t < 3; ++t) {
    const at::Tensor g = at::randn({6, 13});
    low.mutable_grad() = g.to(at::kBFloat16);
    wide.mutable_grad() = g.to(at::kBFloat16).to(at::kFloat);
    a.step(), b.step();
    EXPECT_TRUE(at::equal(low, wide.to(at::kBFloat16))) << "step " << t;
    EXPECT_TRUE(at::equal(state_of(a, low).exp_avg(), state_of(b, wide).exp_avg()));
    EXPECT_TRUE(at::equal(state_of(a, low).exp_avg_sq(), state_of(b, wide).exp_avg_sq()));
    EXPECT_EQ(state_of(a, low).exp_avg().scalar_type(), at::kFloat);
    at::NoGradGuard no_grad;
    wide.copy_(low);  // the next step starts from the rounded values, as the bfloat16 one does
  }
}

TEST(FoamAdam, BFloat16MomentsAreTheMathDtypesMomentsRounded) {
  // state_dtype("bfloat16"): each step updates the moments in float32 from their stored values and
  // stores them rounded; a float32 run given the same stored moments and gradient keeps them
  // unrounded.
  at::manual_seed(7);
  const at::Tensor p = make_param({4, 10}, at::kFloat);
  const at::Tensor q = p.detach().clone().requires_grad_(true);
  FoamAdam narrow({p}, FoamAdamOptions(0.01).level(1).state_dtype("bfloat16"));
  FoamAdam wide({q}, FoamAdamOptions(0.01).level(1));
  for (int t = 0; t < 3; ++t) {
    const at::Tensor g = at::randn({4, 10});
    set_grad(p, g), set_grad(q, g);
    if (t > 0) {
      auto& s = state_of(wide, q);
      s.exp_avg().copy_(state_of(narrow, p).exp_avg());
      s.exp_avg_sq().copy_(state_of(narrow, p).exp_avg_sq());
    }
    narrow.step();
    wide.step();
    const auto& s = state_of(wide, q);
    EXPECT_TRUE(at::equal(state_of(narrow, p).exp_avg(), s.exp_avg().to(at::kBFloat16)));
    EXPECT_TRUE(at::equal(state_of(narrow, p).exp_avg_sq(), s.exp_avg_sq().to(at::kBFloat16)));
    EXPECT_FALSE(at::equal(p, q)) << "the update reads the rounded moments";
    at::NoGradGuard no_grad;
    q.copy_(p);
  }
}

TEST(FoamAdam, GroupsKeepTheirOwnOptions) {
  const at::Tensor a = make_param({4, 8}), b = make_param({4, 8}), c = make_param({3});
  FoamAdam opt({a}, FoamAdamOptions(0.01).level(3));
  opt.add_param_group(torch::optim::OptimizerParamGroup(
      {b}, std::make_unique<FoamAdamOptions>(FoamAdamOptions(0.2).level(1).res_scale(0.5))));
  opt.add_param_group(torch::optim::OptimizerParamGroup({c}));  // no options: the defaults
  EXPECT_EQ(opt.group_options(1), FoamAdamOptions(0.2).level(1).res_scale(0.5));
  EXPECT_EQ(opt.group_options(2), FoamAdamOptions(0.01).level(3));
  opt.param_groups()[1].options().set_lr(0.05);  // as LibTorch's schedulers do
  EXPECT_EQ(opt.group_options(1).lr(), 0.05);
  expect_error([&] { (void)opt.group_options(3); }, {"group 3 does not exist"});
  // Refused with nothing added: options of another optimizer, a parameter already in a group, or
  // twice in the new one.
  const at::Tensor d = make_param({2});
  expect_error(
      [&] {
        opt.add_param_group(torch::optim::OptimizerParamGroup(
            {d}, std::make_unique<gwt::WaveletAdamOptions>(gwt::WaveletAdamOptions())));
      },
      {"options of another optimizer", "gwt::FoamAdamOptions"});
  expect_error(
      [&] {
        opt.add_param_group(torch::optim::OptimizerParamGroup({d, a}));
      },
      {"already in parameter group 0"});
  expect_error(
      [&] {
        opt.add_param_group(torch::optim::OptimizerParamGroup({d, d}));
      },
      {"more than once in parameter group 3"});
  EXPECT_EQ(opt.param_groups().size(), 3u);
}

TEST(FoamAdam, FoamParamGroupsFoldLinearWeightsExceptTheHead) {
  torch::nn::Sequential model;
  model->push_back("fc", torch::nn::Linear(8, 16));
  model->push_back("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
  model->push_back("head", torch::nn::Linear(16, 4));
  const auto groups = gwt::foam_param_groups(*model, FoamAdamOptions(0.02).scale(0.25));
  ASSERT_EQ(groups.size(), 2u);
  ASSERT_EQ(groups[0].params().size(), 1u);
  EXPECT_TRUE(groups[0].params()[0].is_same(model->named_parameters()["fc.weight"]));
  EXPECT_EQ(groups[1].params().size(), 5u);  // fc.bias, norm's two, head's two
  const auto& folded = static_cast<const FoamAdamOptions&>(groups[0].options());
  const auto& dense = static_cast<const FoamAdamOptions&>(groups[1].options());
  EXPECT_EQ(folded, FoamAdamOptions(0.02).scale(0.25));
  EXPECT_EQ(dense, FoamAdamOptions(0.02).scale(0.25).level(0));
  FoamAdam opt(groups);
  EXPECT_TRUE(opt.is_folded_param(model->named_parameters()["fc.weight"]));
  EXPECT_FALSE(opt.is_folded_param(model->named_parameters()["head.weight"]));
}

}  // namespace
