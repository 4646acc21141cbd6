// gwt::WaveletAdam as torch::optim users see it: parameter groups, schedulers, closures, and the
// groups gwt makes for a module (the rule: test_wavelet_adam.cpp; save/load and the memory report:
// test_wavelet_adam_state.cpp).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>
#include <torch/optim/schedulers/step_lr.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "gwt/gwt.h"
#include "wavelet_adam_test_util.h"

namespace {

using gwt::WaveletAdam;
using gwt::WaveletAdamOptions;
using gwt::WaveletAdamParamState;
using namespace gwt_test::wavelet_adam;

TEST(WaveletAdam, GroupsKeepTheirOwnLevelAndLr) {
  at::manual_seed(9);
  at::Tensor a = make_param({4, 32}), b = make_param({4, 32});
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{a},
                      std::make_unique<WaveletAdamOptions>(WaveletAdamOptions(0.01).level(1)));
  groups.emplace_back(std::vector<at::Tensor>{b},
                      std::make_unique<WaveletAdamOptions>(WaveletAdamOptions(0.001).level(3)));
  WaveletAdam opt(std::move(groups), WaveletAdamOptions(0.5).level(2));
  EXPECT_EQ(opt.group_options(0).level(), 1);
  EXPECT_EQ(opt.group_options(0).lr(), 0.01);
  EXPECT_EQ(opt.group_options(1).level(), 3);
  EXPECT_EQ(opt.group_options(1).lr(), 0.001);

  // Each group steps exactly like an optimizer built with that group's options alone.
  at::Tensor a2 = a.detach().clone().requires_grad_(true),
             b2 = b.detach().clone().requires_grad_(true);
  WaveletAdam alone_a({a2}, WaveletAdamOptions(0.01).level(1));
  WaveletAdam alone_b({b2}, WaveletAdamOptions(0.001).level(3));
  for (int t = 0; t < 3; ++t) {
    const at::Tensor ga = at::randn({4, 32}, at::kDouble), gb = at::randn({4, 32}, at::kDouble);
    set_grad(a, ga), set_grad(a2, ga), set_grad(b, gb), set_grad(b2, gb);
    opt.step(), alone_a.step(), alone_b.step();
  }
  EXPECT_TRUE(at::equal(a, a2));
  EXPECT_TRUE(at::equal(b, b2));
  EXPECT_EQ(state_of(opt, a).exp_avg().size(1), 16);
  EXPECT_EQ(state_of(opt, b).exp_avg().size(1), 4);
}

// The bias correction's powers are kept per thread for the last betas and step asked
// (optim_detail::adam_step_size): groups with other betas, and a parameter added later (its own
// step count), must each get their own, so every tensor steps as it would alone.
TEST(WaveletAdam, GroupsWithOtherBetasAndStepCountsStepAsAlone) {
  at::manual_seed(19);
  const WaveletAdamOptions first = WaveletAdamOptions(0.01).betas({0.9, 0.999}).level(2);
  const WaveletAdamOptions second = WaveletAdamOptions(0.01).betas({0.8, 0.99}).level(2);
  const std::vector<at::Tensor> params = {make_param({4, 32}), make_param({4, 32}),
                                          make_param({4, 32})};
  std::vector<at::Tensor> alone;
  for (const at::Tensor& x : params) alone.push_back(x.detach().clone().requires_grad_(true));
  std::vector<std::vector<at::Tensor>> grads(3);  // grads[i]: parameter i's, step after step
  for (int t = 0; t < 5; ++t)
    for (size_t i = 0; i < 3; ++i)
      if (i < 2 || t >= 2) grads[i].push_back(at::randn({4, 32}, at::kDouble));

  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0]},
                      std::make_unique<WaveletAdamOptions>(first));
  groups.emplace_back(std::vector<at::Tensor>{params[1]},
                      std::make_unique<WaveletAdamOptions>(second));
  WaveletAdam opt(std::move(groups), first);
  for (int t = 0; t < 5; ++t) {
    // The third parameter joins at t = 2: from then on one step asks for the step sizes of
    // (first betas, step t + 1), (second betas, t + 1) and (first betas, t - 1) in turn.
    if (t == 2) opt.add_param_group(torch::optim::OptimizerParamGroup({params[2]}));
    for (size_t i = 0; i < 3; ++i)
      if (i < 2 || t >= 2) set_grad(params[i], grads[i][static_cast<size_t>(i < 2 ? t : t - 2)]);
    opt.step();
  }
  EXPECT_EQ(state_of(opt, params[2]).step(), 3);
  // Each alone, one after the other: every step asks with new values, as a cache keyed on the
  // step alone would also get right, so these are a reference for the interleaved asks above.
  for (size_t i = 0; i < 3; ++i) {
    WaveletAdam single({alone[i]}, i == 1 ? second : first);
    for (const at::Tensor& g : grads[i]) set_grad(alone[i], g), single.step();
    EXPECT_TRUE(at::equal(params[i], alone[i])) << "parameter " << i;
  }
}

// Every option away from its default, so that a group that fell back to the defaults shows.
WaveletAdamOptions custom_options() {
  return WaveletAdamOptions(0.02)
      .betas({0.8, 0.99})
      .eps(1e-8)
      .weight_decay(0.05)
      .wavelet("db2")
      .level(1)
      .boundary("periodization")
      .scale(0.25)
      .norm_growth_limit(1.1)
      .correct_bias(false)
      .dim(-1)
      .fused(false)
      .state_dtype("bfloat16")
      .transform("1d")
      .threshold(1e-3)
      .threshold_mode("hard")
      .min_size(2);
}

TEST(WaveletAdam, GroupOptionsStickAtConstructionAndThroughAddParamGroup) {
  // LibTorch's add_param_group (not virtual) merges a group's options into the defaults only for
  // its own optimizers: a WaveletAdamOptions group came out as a copy of the defaults.
  at::manual_seed(14);
  at::Tensor a = make_param({4, 32}), b = make_param({4, 32}), c = make_param({4, 32});
  const WaveletAdamOptions defaults = WaveletAdamOptions(0.5).level(2);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{a},
                      std::make_unique<WaveletAdamOptions>(custom_options().lr(0.03)));
  WaveletAdam opt(std::move(groups), defaults);
  EXPECT_TRUE(opt.group_options(0) == custom_options().lr(0.03));

  opt.add_param_group(torch::optim::OptimizerParamGroup(
      {b}, std::make_unique<WaveletAdamOptions>(custom_options())));
  opt.add_param_group(torch::optim::OptimizerParamGroup({c}));  // no options: the defaults
  ASSERT_EQ(opt.param_groups().size(), 3u);
  EXPECT_TRUE(opt.group_options(0) == custom_options().lr(0.03));
  EXPECT_TRUE(opt.group_options(1) == custom_options());
  EXPECT_TRUE(opt.group_options(2) == defaults);
  // The group holds its own copy: changing the defaults later does not reach it.
  static_cast<WaveletAdamOptions&>(opt.defaults()).level(3);
  EXPECT_EQ(opt.group_options(2).level(), 2);

  // The added group steps exactly like an optimizer built with its options alone.
  at::Tensor b2 = b.detach().clone().requires_grad_(true);
  WaveletAdam alone({b2}, custom_options());
  for (int t = 0; t < 3; ++t) {
    const at::Tensor g = at::randn({4, 32}, at::kDouble);
    set_grad(b, g), set_grad(b2, g);
    opt.step(), alone.step();
  }
  EXPECT_TRUE(at::equal(b, b2));
  EXPECT_EQ(state_of(opt, b).exp_avg().scalar_type(), at::kBFloat16);
}

TEST(WaveletAdam, GroupWithoutOptionsTakesTheDefaults) {
  at::Tensor a = make_param({4, 32});
  WaveletAdam opt(
      std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup({a})},
      WaveletAdamOptions(0.03).level(3));
  EXPECT_EQ(opt.group_options(0).lr(), 0.03);
  EXPECT_EQ(opt.group_options(0).level(), 3);
}

TEST(WaveletAdam, StepLRChangesTheLrItShould) {
  at::manual_seed(10);
  at::Tensor p = make_param({4, 16});
  at::Tensor q = p.detach().clone().requires_grad_(true);
  WaveletAdam opt({p}, WaveletAdamOptions(0.1));
  WaveletAdam manual({q}, WaveletAdamOptions(0.1));
  // The same schedule on LibTorch's own AdamW gives the lr sequence to expect.
  at::Tensor r = at::zeros({1}, at::kDouble).requires_grad_(true);
  torch::optim::AdamW adamw({r}, torch::optim::AdamWOptions(0.1));
  torch::optim::StepLR scheduler(opt, /*step_size=*/2, /*gamma=*/0.5);
  torch::optim::StepLR adamw_scheduler(adamw, /*step_size=*/2, /*gamma=*/0.5);
  for (int t = 0; t < 7; ++t) {
    const double expected_lr = adamw.param_groups()[0].options().get_lr();
    EXPECT_EQ(opt.group_options(0).lr(), expected_lr) << "epoch " << t;
    manual.param_groups()[0].options().set_lr(expected_lr);
    const at::Tensor g = at::randn({4, 16}, at::kDouble);
    set_grad(p, g), set_grad(q, g);
    opt.step(), manual.step();
    scheduler.step(), adamw_scheduler.step();
    EXPECT_TRUE(at::equal(p, q)) << "epoch " << t;
  }
  // Seven scheduler steps with step_size 2 halve the lr three times (LibTorch's count).
  EXPECT_DOUBLE_EQ(opt.group_options(0).lr(), 0.1 / 8);
}

TEST(WaveletAdam, ClosureIsEvaluatedWithGradEnabled) {
  at::manual_seed(11);
  at::Tensor w = make_param({4, 8});
  const at::Tensor x = at::randn({8, 3}, at::kDouble);
  WaveletAdam opt({w}, WaveletAdamOptions(0.01));
  const at::Tensor before = w.detach().clone();
  const at::Tensor loss = opt.step([&] {
    opt.zero_grad();
    at::Tensor l = at::mm(w, x).pow(2).sum();
    l.backward();
    return l;
  });
  EXPECT_NEAR(loss.item<double>(), at::mm(before, x).pow(2).sum().item<double>(), 1e-12);
  EXPECT_FALSE(at::equal(before, w.detach()));
}

// ---------------------------------------------------------------------------------------------
// Module helper
// ---------------------------------------------------------------------------------------------

struct TinyBlockImpl : torch::nn::Module {
  TinyBlockImpl()
      : q_proj(register_module("q_proj", torch::nn::Linear(16, 16))),
        up_proj(register_module("up_proj", torch::nn::Linear(16, 32))) {}
  torch::nn::Linear q_proj, up_proj;
};
TORCH_MODULE(TinyBlock);

struct TinyModelImpl : torch::nn::Module {
  TinyModelImpl()
      : embed(register_module("embed", torch::nn::Embedding(50, 16))),
        block(register_module("block", TinyBlock())),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})))),
        lm_head(register_module("lm_head", torch::nn::Linear(16, 50))) {}
  torch::nn::Embedding embed;
  TinyBlock block;
  torch::nn::LayerNorm norm;
  torch::nn::Linear lm_head;
};
TORCH_MODULE(TinyModel);

TEST(ParamGroups, PaperGroupingPutsLinearWeightsInTheWaveletGroup) {
  TinyModel model;
  std::vector<std::string> wavelet, dense;
  for (const auto& a : gwt::assign_param_groups(*model))
    (a.wavelet ? wavelet : dense).push_back(a.name);
  EXPECT_EQ(wavelet, (std::vector<std::string>{"block.q_proj.weight", "block.up_proj.weight"}));
  EXPECT_EQ(dense, (std::vector<std::string>{"embed.weight", "block.q_proj.bias",
                                             "block.up_proj.bias", "norm.weight", "norm.bias",
                                             "lm_head.weight", "lm_head.bias"}));

  const auto groups = gwt::paper_param_groups(*model, WaveletAdamOptions(0.01).level(3));
  WaveletAdam opt(groups);
  ASSERT_EQ(opt.param_groups().size(), 2u);
  EXPECT_EQ(opt.group_options(0).level(), 3);
  EXPECT_EQ(opt.group_options(1).level(), 0);
  EXPECT_EQ(opt.group_options(1).lr(), 0.01);
  EXPECT_TRUE(opt.is_wavelet_param(model->block->q_proj->weight));
  EXPECT_FALSE(opt.is_wavelet_param(model->lm_head->weight));
}

TEST(ParamGroups, OverridesByName) {
  TinyModel model;
  gwt::ParamGroupRules rules;
  rules.force_dense = {"up_proj"};
  rules.force_wavelet = {"lm_head.weight"};
  std::vector<std::string> wavelet;
  for (const auto& a : gwt::assign_param_groups(*model, rules))
    if (a.wavelet) wavelet.push_back(a.name);
  EXPECT_EQ(wavelet, (std::vector<std::string>{"block.q_proj.weight", "lm_head.weight"}));
}

}  // namespace
