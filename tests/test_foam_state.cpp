// gwt::FoamAdam's state: save and load continue bit-identically, non-finite gradients skip what
// they should, and every error a caller can cause (options, gradients, state, checkpoints) names
// the problem with parameters and state unchanged (the rule: test_foam.cpp).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "foam_test_util.h"
#include "gwt/gwt.h"

namespace {

using namespace gwt_test::foam;

// Three groups: a [8, 30] weight and a 1-D bias folded at level 2; a 3-D parameter folded along
// dim 1 at level 1, res_scale 0.5 and decay; a dense [5, 6].
std::vector<torch::optim::OptimizerParamGroup> two_groups(const std::vector<at::Tensor>& params,
                                                          const std::string& state_dtype) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0], params[1]},
                      std::make_unique<FoamAdamOptions>(
                          FoamAdamOptions(0.01).level(2).scale(0.25).state_dtype(state_dtype)));
  groups.emplace_back(std::vector<at::Tensor>{params[2]},
                      std::make_unique<FoamAdamOptions>(
                          FoamAdamOptions(0.02).level(1).dim(1).res_scale(0.5).weight_decay(0.1)));
  groups.emplace_back(std::vector<at::Tensor>{params[3]},
                      std::make_unique<FoamAdamOptions>(FoamAdamOptions(0.003).level(0)));
  return groups;
}

void train(FoamAdam& opt, const std::vector<at::Tensor>& params, int steps, uint64_t seed) {
  at::manual_seed(seed);
  for (int t = 0; t < steps; ++t) {
    for (const auto& p : params) set_grad(p, at::randn(p.sizes(), at::kDouble) * (1 + t));
    opt.step();
  }
}

std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

TEST(FoamAdam, SaveLoadContinuesBitIdentically) {
  for (const at::ScalarType dtype : {at::kDouble, at::kFloat})
    for (const std::string state_dtype : {"auto", "bfloat16"}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " moments " + state_dtype);
      at::manual_seed(11);
      const std::vector<at::Tensor> params = {make_param({8, 30}, dtype), make_param({7}, dtype),
                                              make_param({3, 9, 4}, dtype),
                                              make_param({5, 6}, dtype)};
      FoamAdam uninterrupted(two_groups(params, state_dtype));
      const std::vector<at::Tensor> copy = clone_params(params);
      FoamAdam first(two_groups(copy, state_dtype));
      train(uninterrupted, params, 4, 100);
      train(uninterrupted, params, 4, 200);
      train(first, copy, 4, 100);
      const std::string bytes = saved(first);
      // A fresh optimizer whose groups have other options, which the checkpoint replaces.
      const std::vector<at::Tensor> resumed = clone_params(copy);
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(std::vector<at::Tensor>{resumed[0], resumed[1]});
      groups.emplace_back(std::vector<at::Tensor>{resumed[2]});
      groups.emplace_back(std::vector<at::Tensor>{resumed[3]});
      FoamAdam second(std::move(groups), FoamAdamOptions(0.5).level(4));
      load(second, bytes);
      for (size_t i = 0; i < 3; ++i) EXPECT_EQ(second.group_options(i), first.group_options(i));
      for (size_t i = 0; i < resumed.size(); ++i)
        EXPECT_TRUE(state_of(second, resumed[i]) == state_of(first, copy[i])) << "param " << i;
      train(second, resumed, 4, 200);
      for (size_t i = 0; i < params.size(); ++i)
        EXPECT_TRUE(at::equal(resumed[i], params[i])) << "param " << i;
    }
}

TEST(FoamAdam, NonFiniteGradientSkipsTheWholeStep) {
  at::manual_seed(12);
  const std::vector<at::Tensor> params = {make_param({8, 30}), make_param({7}),
                                          make_param({3, 9, 4}), make_param({5, 6})};
  FoamAdam opt(two_groups(params, "auto"));
  train(opt, params, 2, 300);
  for (const double bad : {k_nan, k_inf, -k_inf}) {
    for (const auto& p : params) set_grad(p, at::randn(p.sizes(), at::kDouble));
    params[2].mutable_grad().view({-1})[5] = bad;  // one value, in another group
    const auto before = snapshot(opt, params);
    opt.step();
    auto after = snapshot(opt, params);
    // Nothing changed but the skip count.
    EXPECT_EQ(after.back().item<int64_t>(), before.back().item<int64_t>() + 1);  // skipped_steps
    after.back() = before.back();
    expect_same_tensors(after, before);
  }
  EXPECT_EQ(opt.skipped_steps(), 3);
  for (const auto& p : params) EXPECT_EQ(opt.skipped_steps(p), 0);
}

TEST(FoamAdam, NonFiniteGradientSkipsOnlyItsParameterWithSkipParam) {
  at::manual_seed(13);
  const at::Tensor a = make_param({4, 12}), b = make_param({6}), fresh = make_param({4, 12});
  const auto o = FoamAdamOptions(0.01).nonfinite("skip_param");
  FoamAdam opt({a, b, fresh}, o);
  const at::Tensor b_alone = b.detach().clone().requires_grad_(true);
  FoamAdam alone({b_alone}, o);
  set_grad(a, at::randn({4, 12}, at::kDouble)), set_grad(b, at::randn({6}, at::kDouble));
  set_grad(b_alone, b.grad());
  opt.step(), alone.step();
  // `a` and `fresh` (its first step) have NaN gradients: they keep value and state; b steps.
  const at::Tensor a_before = a.detach().clone(), m_before = state_of(opt, a).exp_avg().clone();
  const at::Tensor fresh_before = fresh.detach().clone();
  set_grad(a, at::full({4, 12}, k_nan, at::kDouble));
  set_grad(fresh, at::full({4, 12}, k_inf, at::kDouble));
  set_grad(b, at::randn({6}, at::kDouble)), set_grad(b_alone, b.grad());
  opt.step(), alone.step();
  EXPECT_TRUE(at::equal(a, a_before));
  EXPECT_TRUE(at::equal(state_of(opt, a).exp_avg(), m_before));
  EXPECT_EQ(state_of(opt, a).step(), 1);
  EXPECT_TRUE(at::equal(fresh, fresh_before));
  EXPECT_EQ(state_of(opt, fresh).step(), 0);  // a first step skipped: zero state, no step
  EXPECT_EQ(at::count_nonzero(state_of(opt, fresh).exp_avg_sq()).item<int64_t>(), 0);
  EXPECT_TRUE(at::equal(b, b_alone));
  EXPECT_EQ(state_of(opt, b).step(), 2);
  EXPECT_EQ(opt.skipped_steps(), 1);  // steps in which a parameter was skipped
  EXPECT_EQ(opt.skipped_steps(a), 1);
  EXPECT_EQ(opt.skipped_steps(fresh), 1);
  EXPECT_EQ(opt.skipped_steps(b), 0);
}

// A trained optimizer (a folded [8, 32] weight and a 1-D bias in one group, a dense [4, 4] in
// another) and a snapshot of everything an error must leave as it was.
struct Trained {
  at::Tensor w = make_param({8, 32}), b = make_param({8}), d = make_param({4, 4});
  std::unique_ptr<FoamAdam> opt;
  explicit Trained(double lr = 0.01, int steps = 2) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{w, b},
                        std::make_unique<FoamAdamOptions>(FoamAdamOptions(lr).scale(0.25)));
    groups.emplace_back(std::vector<at::Tensor>{d},
                        std::make_unique<FoamAdamOptions>(FoamAdamOptions(lr).level(0)));
    opt = std::make_unique<FoamAdam>(std::move(groups));
    train(*opt, {w, b, d}, steps, 400);
    for (const auto& p : {w, b, d}) set_grad(p, at::randn(p.sizes(), at::kDouble));
  }
  std::vector<at::Tensor> snap() { return snapshot(*opt, {w, b, d}); }
  FoamAdamOptions& options(size_t group) {
    return static_cast<FoamAdamOptions&>(opt->param_groups()[group].options());
  }
};

TEST(FoamAdam, BadOptionsAreErrorsThatNameTheProblemWithNothingChanged) {
  struct Bad {
    std::function<void(FoamAdamOptions&)> set;
    std::vector<std::string> words;
  };
  const std::vector<Bad> bad = {
      {[](auto& o) { o.lr(-0.1); }, {"invalid learning rate -0.1", "finite and >= 0"}},
      {[](auto& o) { o.lr(k_nan); }, {"invalid learning rate"}},
      {[](auto& o) {
         o.betas({1.0, 0.999});
       },
       {"invalid beta1 1", "[0, 1)"}},
      {[](auto& o) {
         o.betas({0.9, -0.5});
       },
       {"invalid beta2 -0.5", "[0, 1)"}},
      {[](auto& o) { o.eps(0); }, {"invalid eps 0", "0 / 0"}},
      {[](auto& o) { o.weight_decay(-1); }, {"invalid weight_decay -1", ">= 0"}},
      {[](auto& o) { o.level(-1); }, {"invalid level -1", "[0, 30]", "0 = dense"}},
      {[](auto& o) { o.level(31); }, {"invalid level 31", "[0, 30]"}},
      {[](auto& o) { o.scale(k_nan); }, {"invalid scale", "finite"}},
      {[](auto& o) { o.res_scale(k_inf); }, {"invalid res_scale", "finite"}},
      {[](auto& o) { o.min_size(-2); }, {"invalid min_size -2", ">= 0"}},
      {[](auto& o) { o.state_dtype("bf16"); },
       {"invalid state_dtype 'bf16'", "valid values are auto, bfloat16"}},
      {[](auto& o) { o.nonfinite("ignore"); },
       {"invalid nonfinite 'ignore'", "skip_step", "skip_param"}},
      {[](auto& o) { o.dim(2); },
       {"dim 2 is out of range for a parameter of shape [8, 32]", "-2 to 1"}},
      {[](auto& o) { o.lr(1e40); }, {"does not fit float32", "Float parameter"}},
      {[](auto& o) { o.res_scale(1e20); }, {"res_scale^2", "does not fit float32"}},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    const bool float32_only = i + 2 >= bad.size();  // the last two fit float64
    const at::Tensor p = make_param({8, 32}, float32_only ? at::kFloat : at::kDouble);
    FoamAdamOptions options(0.01);
    bad[i].set(options);
    if (!float32_only) {  // at construction, and in add_param_group
      expect_error([&] { FoamAdam opt({p}, options); }, bad[i].words);
      FoamAdam opt({make_param({2, 2})}, FoamAdamOptions(0.01));
      expect_error(
          [&] {
            opt.add_param_group(
                torch::optim::OptimizerParamGroup({p}, std::make_unique<FoamAdamOptions>(options)));
          },
          bad[i].words);
      EXPECT_EQ(opt.param_groups().size(), 1u);
    }
    // Set on a trained optimizer's group: step() throws before anything changes.
    Trained f;
    if (float32_only) {
      f.w = make_param({8, 32}, at::kFloat);
      f.opt = std::make_unique<FoamAdam>(std::vector<at::Tensor>{f.w}, FoamAdamOptions(0.01));
      set_grad(f.w, at::randn({8, 32})), f.opt->step(), set_grad(f.w, at::randn({8, 32}));
      f.b = f.d = make_param({1});
    }
    const auto before = f.snap();
    bad[i].set(f.options(0));
    expect_error([&] { f.opt->step(); }, bad[i].words);
    expect_same_tensors(f.snap(), before);
  }
}

// Something done to a trained optimizer (or its gradients) that an error must name in `words`.
struct Damage {
  const char* name;
  std::function<void(Trained&)> apply;
  std::vector<std::string> words;
};

TEST(FoamAdam, BadGradientsAndStateAreErrorsWithNothingChanged) {
  const std::vector<Damage> bad = {
      {"gradient of another shape",
       [](Trained& f) { f.b.mutable_grad() = at::randn({9}, at::kDouble); },
       {"gradient shape [9]", "parameter's shape [8]"}},
      {"sparse gradient",
       [](Trained& f) {
         f.d.mutable_grad() = at::randn({4, 4}, at::kDouble).to_sparse();
       },
       {"does not support sparse gradients"}},
      {"integer gradient",
       [](Trained& f) {
         f.w.mutable_grad() = at::ones({8, 32}, at::kLong);
       },
       {"gradient dtype Long", "not floating point"}},
      {"level changed after training started",
       [](Trained& f) { f.options(0).level(3); },
       {"moments of shape [8, 8]", "need [8, 4]", "level, dim or min_size changed"}},
      {"moments converted to another dtype",
       [](Trained& f) {
         auto& s = state_of(*f.opt, f.w);
         s.exp_avg(s.exp_avg().to(at::kFloat));
       },
       {"moments of a Double parameter", "are Float", "must be Double or BFloat16"}},
      {"moments of the wrong shape",
       [](Trained& f) {
         state_of(*f.opt, f.d).exp_avg_sq(at::zeros({4, 1}, at::kDouble));
       },
       {"moments of shape [4, 1]", "need [4, 4]"}},
  };
  for (const auto& c : bad) {
    SCOPED_TRACE(c.name);
    Trained f;
    c.apply(f);
    const auto before = f.snap();
    expect_error([&] { f.opt->step(); }, c.words);
    expect_same_tensors(f.snap(), before);
  }
}

TEST(FoamAdam, CorruptCheckpointsAreErrorsWithNothingChanged) {
  auto set_first = [](const at::Tensor& t, double v) { t.view({-1})[0].fill_(v); };
  const std::vector<Damage> corruptions = {
      {"moments of the wrong shape",
       [](Trained& f) {
         state_of(*f.opt, f.w).exp_avg(at::zeros({8, 9}, at::kDouble));
       },
       {"moments of shape [8, 9]", "need [8, 8]"}},
      {"negative second moment",
       [&](Trained& f) { set_first(state_of(*f.opt, f.b).exp_avg_sq(), -1e-3); },
       {"exp_avg_sq for parameter 1 of group 0", "negative value", "corrupt"}},
      {"NaN first moment",
       [&](Trained& f) { set_first(state_of(*f.opt, f.d).exp_avg(), k_nan); },
       {"exp_avg for parameter 0 of group 1", "NaN or an infinity"}},
      {"integer moments",
       [](Trained& f) {
         auto& s = state_of(*f.opt, f.w);
         s.exp_avg_sq(s.exp_avg_sq().to(at::kLong));
       },
       {"exp_avg_sq for parameter 0 of group 0", "is a Long tensor"}},
      {"negative step",
       [](Trained& f) { state_of(*f.opt, f.w).step(-2); },
       {"step count is negative: -2"}},
      {"negative skip count",
       [](Trained& f) { state_of(*f.opt, f.b).skipped(-1); },
       {"skipped count is negative: -1"}},
      {"invalid options",
       [](Trained& f) {
         f.options(1).betas({0.9, 1.5});
       },
       {"invalid beta2 1.5"}},
  };
  for (const auto& c : corruptions) {
    SCOPED_TRACE(c.name);
    Trained source(0.01, 3);
    c.apply(source);
    const std::string bytes = saved(*source.opt);
    // The same model (its weights loaded), but an optimizer in another state: lr 0.3, 1 step.
    Trained target(0.3, 1);
    {
      at::NoGradGuard no_grad;
      target.w.copy_(source.w), target.b.copy_(source.b), target.d.copy_(source.d);
    }
    const auto before = target.snap();
    expect_error([&] { load(*target.opt, bytes); }, c.words);
    expect_same_tensors(target.snap(), before);
  }
  // A checkpoint of another optimizer.
  Trained target;
  const auto before = target.snap();
  gwt::WaveletAdam other({target.w}, gwt::WaveletAdamOptions(0.01));
  std::ostringstream out;
  torch::save(other, out);
  expect_error([&] { load(*target.opt, out.str()); },
               {"not a gwt.FoamAdam.v1 checkpoint", "another optimizer"});
  expect_same_tensors(target.snap(), before);
}

}  // namespace
