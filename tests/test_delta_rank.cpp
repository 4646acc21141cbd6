// Rank changes of gwt::nn::DeltaLinear under an optimizer: gwt::nn::resize_rank, which carries or
// restarts the optimizer's state, and gwt::nn::RankSchedule. Exactness and tolerances as in
// test_delta.cpp.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "delta_test_util.h"
#include "gwt/gwt.h"
#include "test_util.h"

namespace {

using gwt::nn::DeltaLinear;
using gwt::nn::DeltaLinearOptions;
using gwt::nn::StateFollow;
using namespace gwt_test::delta;

// A regression that rank 8 cannot fit (the target differs from the base by a rank-16 map).
struct Regression {
  at::Tensor x, y;
  Regression(const torch::nn::Linear& base, int64_t rank) {
    const int64_t in = base->weight.size(1), out = base->weight.size(0);
    x = at::randn({64, in}, at::kDouble);
    const at::Tensor target =
        base->weight.detach() +
        0.3 * at::matmul(at::randn({out, rank}, at::kDouble), at::randn({rank, in}, at::kDouble)) /
            std::sqrt(static_cast<double>(in));
    y = at::matmul(x, target.t()) + base->bias.detach();
  }
  at::Tensor loss(DeltaLinear& layer) const { return (layer->forward(x) - y).pow(2).mean(); }
};

std::vector<at::Tensor> trainable(const DeltaLinear& layer) {
  std::vector<at::Tensor> out;
  for (const auto& p : layer->parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

double train_on(const Regression& data, DeltaLinear& layer, torch::optim::Optimizer& opt, int steps,
                std::vector<double>* losses = nullptr) {
  double last = 0;
  for (int t = 0; t < steps; ++t) {
    opt.zero_grad();
    const at::Tensor loss = data.loss(layer);
    last = loss.item<double>();
    if (losses) losses->push_back(last);
    loss.backward();
    opt.step();
  }
  return last;
}

TEST(RankAdaptation, GrowingCarriesTheMomentsAndTrainingContinuesWithoutASpike) {
  for (int which = 0; which < 2; ++which) {
    at::manual_seed(12);
    torch::nn::Linear base = make_base(32, 24);
    DeltaLinear layer(base, DeltaLinearOptions(32, 24).rank(8).orthogonal_core(which == 1));
    const Regression data(base, 16);
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (which == 0)
      opt = std::make_unique<torch::optim::AdamW>(trainable(layer),
                                                  torch::optim::AdamWOptions(3e-3).weight_decay(0));
    else
      opt = std::make_unique<gwt::WaveletAdam>(trainable(layer),
                                               gwt::WaveletAdamOptions(3e-3).min_size(0));
    train_on(data, layer, *opt, 60);
    at::Tensor m_before;
    {
      const auto& s = *opt->state().at(layer->U.unsafeGetTensorImpl());
      m_before = which == 0 ? static_cast<const torch::optim::AdamWParamState&>(s).exp_avg().clone()
                            : static_cast<const gwt::WaveletAdamParamState&>(s).exp_avg().clone();
    }
    const double at_growth = data.loss(layer).item<double>();
    const auto report = gwt::nn::resize_rank(layer, 16, *opt);
    EXPECT_EQ(report.to, 16);
    ASSERT_EQ(report.state.size(), which == 0 ? 2u : 3u);
    for (const auto& [name, follow] : report.state)
      EXPECT_EQ(follow, StateFollow::kept) << name << " optimizer " << which;
    // The function is unchanged (to the rounding of products of another size), and the kept
    // components' moments are exactly as they were.
    EXPECT_NEAR(data.loss(layer).item<double>(), at_growth, 1e-12 * at_growth);
    const auto& s = *opt->state().at(layer->U.unsafeGetTensorImpl());
    const at::Tensor m = which == 0 ? static_cast<const torch::optim::AdamWParamState&>(s).exp_avg()
                                    : static_cast<const gwt::WaveletAdamParamState&>(s).exp_avg();
    // AdamW keeps U's shape; WaveletAdam (haar, level 2) keeps a quarter of each row.
    EXPECT_EQ(m.size(1), which == 0 ? 16 : 4);
    EXPECT_TRUE(at::equal(m.narrow(1, 0, m_before.size(1)), m_before));
    EXPECT_EQ(
        m.narrow(1, m_before.size(1), m.size(1) - m_before.size(1)).abs().max().item<double>(), 0);
    // Training goes on without a spike: the new columns start at zero with zero moments, and
    // their first Adam steps (m / sqrt(v) = (1 - b1) / sqrt(1 - b2) ~ 3 at a late step count) are
    // lr-sized, so the loss may bump by a few percent (measured here: AdamW 0%, WaveletAdam
    // 5%) but not jump; 10% is the line. And the added rank is put to use.
    std::vector<double> losses;
    train_on(data, layer, *opt, 60, &losses);
    const double worst = *std::max_element(losses.begin(), losses.end());
    std::printf("growth %s: worst loss after / at growth = %.4f, final = %.4f\n",
                which == 0 ? "AdamW" : "WaveletAdam", worst / at_growth, losses.back() / at_growth);
    EXPECT_LE(worst, 1.10 * at_growth) << which;
    EXPECT_LT(losses.back(), 0.9 * at_growth) << which;
    EXPECT_GT(layer->U.detach().narrow(1, 8, 8).abs().max().item<double>(), 0);
  }
}

TEST(RankAdaptation, ShrinkingRestartsTheStateOfTheRotatedComponents) {
  at::manual_seed(13);
  torch::nn::Linear base = make_base(32, 24);
  DeltaLinear layer(base, DeltaLinearOptions(32, 24).rank(16));
  const Regression data(base, 16);
  torch::optim::AdamW opt(trainable(layer), torch::optim::AdamWOptions(3e-3));
  train_on(data, layer, opt, 20);
  const auto report = gwt::nn::resize_rank(layer, 8, opt);
  EXPECT_GT(report.error, 0);
  for (const auto& [name, follow] : report.state) EXPECT_EQ(follow, StateFollow::restarted) << name;
  EXPECT_EQ(opt.state().count(layer->U.unsafeGetTensorImpl()), 0u);
  train_on(data, layer, opt, 5);  // the optimizer starts fresh state for the new shapes
  EXPECT_EQ(static_cast<const torch::optim::AdamWParamState&>(
                *opt.state().at(layer->U.unsafeGetTensorImpl()))
                .step(),
            5);
  // A bad rank changes nothing.
  expect_error([&] { gwt::nn::resize_rank(layer, 99, opt); }, "invalid rank 99");
  EXPECT_EQ(layer->rank(), 8);
}

TEST(RankAdaptation, ScheduleGrowsAFullRankAndShrinksAnUnusedOne) {
  at::manual_seed(14);
  // Deltas with chosen singular values: U = P diag(s), V = R (orthonormal P, R).
  auto with_spectrum = [](const std::vector<double>& s) {
    torch::nn::Linear base = make_base(40, 32);
    const int64_t k = static_cast<int64_t>(s.size());
    DeltaLinear layer(base, DeltaLinearOptions(40, 32).rank(k));
    at::NoGradGuard no_grad;
    const at::Tensor p = std::get<0>(at::linalg_qr(at::randn({32, k}, at::kDouble)));
    const at::Tensor r = std::get<0>(at::linalg_qr(at::randn({40, k}, at::kDouble)));
    layer->U.copy_(p * gwt_test::to_tensor(s));
    layer->V.copy_(r);
    return layer;
  };
  DeltaLinear full = with_spectrum(std::vector<double>(16, 1.0));  // last 8 hold sqrt(1/2)
  std::vector<double> decaying(16, 1.0);
  for (int i = 8; i < 16; ++i) decaying[i] = 1e-4;  // last 8 hold ~1e-4
  DeltaLinear unused = with_spectrum(decaying);
  EXPECT_NEAR(gwt::nn::RankSchedule::tail_energy(full, 8), std::sqrt(0.5), 1e-12);
  EXPECT_NEAR(gwt::nn::RankSchedule::tail_energy(unused, 8), 1e-4, 1e-6);
  std::vector<at::Tensor> params = trainable(full);
  for (const auto& p : trainable(unused)) params.push_back(p);
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-3));
  gwt::nn::RankSchedule schedule({{"full", full}, {"unused", unused}}, opt,
                                 gwt::nn::RankScheduleOptions().every(3).min_rank(8).max_rank(24));
  EXPECT_TRUE(schedule.step().empty());
  EXPECT_TRUE(schedule.step().empty());
  const auto changes = schedule.step();  // the third call evaluates
  ASSERT_EQ(changes.size(), 2u);
  EXPECT_EQ(changes[0].name, "full");
  EXPECT_EQ(changes[0].to, 24);
  EXPECT_EQ(changes[1].name, "unused");
  EXPECT_EQ(changes[1].to, 8);
  EXPECT_NEAR(changes[1].error, 1e-4, 1e-6);  // sqrt(8e-8 / (8 + 8e-8))
  EXPECT_EQ(full->rank(), 24);
  EXPECT_EQ(unused->rank(), 8);
  // Bounds: max_rank 24 reached (the grown columns are zero: tail energy 0, so it would shrink
  // back only by the rule, not past min_rank).
  expect_error(
      [&] {
        gwt::nn::RankSchedule(std::vector<std::pair<std::string, DeltaLinear>>{}, opt,
                              gwt::nn::RankScheduleOptions().threshold(0));
      },
      "threshold must be in (0, 1)");
}

// ------------------------------------------------------------------------------------------------
// Issue 38: growth from rank 0.
// ------------------------------------------------------------------------------------------------

TEST(DeltaLinear, AGrownRankZeroLayerTrainsUnderTheOptimizerItWasBuiltWith) {
  // resize_rank registered U and V when the layer had none: an optimizer built before held
  // neither, so they never trained.
  for (int which = 0; which < 2; ++which)
    for (bool core : {false, true}) {
      SCOPED_TRACE(std::to_string(which) + (core ? " core" : ""));
      at::manual_seed(22);
      torch::nn::Linear base = make_base(16, 12);
      DeltaLinear layer(base, DeltaLinearOptions(16, 12).reflections(2).orthogonal_core(core));
      std::unique_ptr<torch::optim::Optimizer> opt;
      if (which == 0)
        opt = std::make_unique<torch::optim::AdamW>(layer->parameters(),
                                                    torch::optim::AdamWOptions(1e-2));
      else
        opt = std::make_unique<gwt::WaveletAdam>(layer->parameters(),
                                                 gwt::WaveletAdamOptions(1e-2).min_size(0));
      const at::Tensor x = at::randn({8, 16}, at::kDouble);
      const at::Tensor target = at::randn({8, 12}, at::kDouble);
      auto steps = [&](int n) {
        for (int t = 0; t < n; ++t) {
          opt->zero_grad();
          (layer->forward(x) - target).pow(2).mean().backward();
          opt->step();
        }
      };
      steps(2);  // the optimizer has state for the rank-0 parts before the growth
      ASSERT_TRUE(layer->U.defined());
      const auto* u = layer->U.unsafeGetTensorImpl();
      gwt::nn::resize_rank(layer, 4, *opt);
      EXPECT_EQ(layer->U.unsafeGetTensorImpl(), u);
      EXPECT_EQ(layer->U.sizes(), (c10::IntArrayRef{12, 4}));
      steps(3);
      EXPECT_GT(layer->U.detach().abs().max().item<double>(), 0);
    }
}

TEST(RankAdaptation, ScheduleRefusesMinRankZeroAndGrowsALayerBelowMinRank) {
  // With min_rank 0 a layer could shrink to rank 0, where its tail energy is 0: it never grew
  // again.
  at::manual_seed(28);
  DeltaLinear layer(make_base(16, 12), DeltaLinearOptions(16, 12));
  torch::optim::AdamW opt(layer->parameters(), torch::optim::AdamWOptions(1e-2));
  expect_error(
      [&] {
        gwt::nn::RankSchedule({{"l", layer}}, opt, gwt::nn::RankScheduleOptions().min_rank(0));
      },
      "min_rank must be >= 1");
  gwt::nn::RankSchedule schedule(
      {{"l", layer}}, opt, gwt::nn::RankScheduleOptions().every(1).step(2).min_rank(4).max_rank(8));
  const auto changes = schedule.step();
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].from, 0);
  EXPECT_EQ(changes[0].to, 4);
  EXPECT_EQ(layer->rank(), 4);
}

}  // namespace
