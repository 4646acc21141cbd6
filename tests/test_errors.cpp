// Every error a caller can cause names the problem and leaves parameters and state unchanged.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gwt/gwt.h"

namespace {

using gwt::WaveletAdam;
using gwt::WaveletAdamOptions;
using gwt::WaveletAdamParamState;

constexpr double k_nan = std::numeric_limits<double>::quiet_NaN();
constexpr double k_inf = std::numeric_limits<double>::infinity();

// Expects `fn` to throw a c10::Error whose message contains every one of `words`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& words) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << words.front();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& w : words)
      EXPECT_NE(msg.find(w), std::string::npos) << "'" << w << "' not in: " << msg;
  }
}

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

TEST(Errors, BadOptionsAtConstructionNameTheProblem) {
  const at::Tensor p = at::randn({4, 8}).requires_grad_(true);
  auto make = [&](WaveletAdamOptions o) { return [p, o] { WaveletAdam opt({p}, o); }; };
  expect_error(make(WaveletAdamOptions().wavelet("db42")),
               {"unknown wavelet", "db42", "haar", "sym4"});
  expect_error(make(WaveletAdamOptions().boundary("reflect")),
               {"unknown boundary mode", "reflect", "zero", "periodization"});
  expect_error(make(WaveletAdamOptions().level(-1)), {"level", "-1"});
  expect_error(make(WaveletAdamOptions(k_nan)), {"learning rate"});
  expect_error(make(WaveletAdamOptions(-0.1)), {"learning rate", "-0.1"});
  expect_error(make(WaveletAdamOptions(k_inf)), {"learning rate"});
  expect_error(make(WaveletAdamOptions().betas({1.0, 0.999})), {"beta1", "[0, 1)"});
  expect_error(make(WaveletAdamOptions().betas({0.9, -0.5})), {"beta2"});
  expect_error(make(WaveletAdamOptions().betas({k_nan, 0.9})), {"beta1"});
  expect_error(make(WaveletAdamOptions().eps(-1e-8)), {"eps"});
  expect_error(make(WaveletAdamOptions().eps(k_nan)), {"eps"});
  expect_error(make(WaveletAdamOptions().weight_decay(-0.1)), {"weight_decay"});
  expect_error(make(WaveletAdamOptions().weight_decay(k_inf)), {"weight_decay"});
  expect_error(make(WaveletAdamOptions().norm_growth_limit(-1)), {"norm_growth_limit"});
  expect_error(make(WaveletAdamOptions().scale(k_nan)), {"scale"});
  expect_error(make(WaveletAdamOptions().dim(2)), {"dim", "out of range"});
}

TEST(Errors, IntegerBoolAndComplexParametersAreRejected) {
  for (auto dtype : {at::kLong, at::kInt, at::kBool, at::kComplexFloat}) {
    const at::Tensor p = at::zeros({4, 8}, dtype);
    expect_error([&] { WaveletAdam opt({p}); }, {"parameters must be", "float"});
  }
}

TEST(Errors, ParameterInTwoGroupsIsRejected) {
  const at::Tensor p = at::randn({4, 8}).requires_grad_(true);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{p});
  groups.emplace_back(std::vector<at::Tensor>{p});
  expect_error([&] { WaveletAdam opt(std::move(groups)); }, {"more than once"});
}

TEST(Errors, SparseGradientLeavesEverythingUnchanged) {
  Fixture f;
  f.w.mutable_grad() = at::randn({8, 32}, at::kDouble);
  f.b.mutable_grad() = at::randn({8}, at::kDouble).to_sparse();
  expect_error([&] { f.opt.step(); }, {"sparse"});
  f.expect_unchanged();
}

TEST(Errors, BadLrSetLaterIsCaughtAtStep) {
  Fixture f;
  f.w.mutable_grad() = at::randn({8, 32}, at::kDouble);
  f.b.mutable_grad() = at::randn({8}, at::kDouble);
  f.opt.param_groups()[0].options().set_lr(k_nan);
  expect_error([&] { f.opt.step(); }, {"learning rate"});
  f.expect_unchanged();
}

TEST(Errors, ChangedLevelAfterTrainingIsCaughtAtStep) {
  Fixture f;
  f.w.mutable_grad() = at::randn({8, 32}, at::kDouble);
  static_cast<WaveletAdamOptions&>(f.opt.param_groups()[0].options()).level(3);
  expect_error([&] { f.opt.step(); }, {"moments of shape", "level"});
  f.expect_unchanged();
}

TEST(Errors, MomentsThatAreNotWhereTheKernelsCanReadThemAreCaughtAtStep) {
  // The fused kernels take raw pointers: moments replaced by a non-contiguous view, of another
  // type (or, on a machine with a GPU, left on the CPU after the model moved) must not reach them.
  Fixture f;
  auto& s = static_cast<WaveletAdamParamState&>(*f.opt.state().at(f.w.unsafeGetTensorImpl()));
  const at::Tensor m = s.exp_avg();
  s.exp_avg(m.t().contiguous().t());  // same values and shape, transposed strides
  f.snapshot = f.current();
  f.w.mutable_grad() = at::randn({8, 32}, at::kDouble);
  expect_error([&] { f.opt.step(); }, {"moments of a parameter", "not contiguous"});
  f.expect_unchanged();

  // A model converted in place after training started (Module::to(dtype) keeps each parameter's
  // identity): float moments for a double parameter would be read as doubles.
  s.exp_avg(m.to(at::kFloat));
  f.snapshot = f.current();
  expect_error([&] { f.opt.step(); }, {"moments of a Double parameter are Float", "BFloat16"});
  f.expect_unchanged();
}

TEST(Errors, NonFiniteGradientSkipsTheStepAndCountsIt) {
  for (double bad : {k_nan, k_inf, -k_inf}) {
    Fixture f;
    f.w.mutable_grad() = at::randn({8, 32}, at::kDouble);
    f.b.mutable_grad() = at::randn({8}, at::kDouble);
    f.b.mutable_grad()[3] = bad;
    EXPECT_EQ(f.opt.skipped_steps(), 0);
    f.opt.step();
    EXPECT_EQ(f.opt.skipped_steps(), 1);
    f.expect_unchanged();
    // The next finite step proceeds normally.
    f.b.mutable_grad() = at::randn({8}, at::kDouble);
    f.opt.step();
    EXPECT_FALSE(at::equal(f.w.detach(), f.snapshot[0]));
  }
}

TEST(Errors, LoadingMismatchedGroupsOrShapesLeavesEverythingUnchanged) {
  const std::string path =
      ::testing::TempDir() + "gwt_errors_" + std::to_string(::getpid()) + ".pt";
  {
    at::Tensor a = at::randn({8, 32}, at::kDouble).requires_grad_(true);
    at::Tensor c = at::randn({8}, at::kDouble).requires_grad_(true);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{a});
    groups.emplace_back(std::vector<at::Tensor>{c});
    WaveletAdam saved(std::move(groups));
    a.mutable_grad() = at::randn({8, 32}, at::kDouble);
    c.mutable_grad() = at::randn({8}, at::kDouble);
    saved.step();
    torch::save(saved, path);
  }
  {
    Fixture f;  // one group: the checkpoint has two
    expect_error([&] { torch::load(f.opt, path); }, {"2 parameter groups", "has 1"});
    f.expect_unchanged();
  }
  {
    at::Tensor a = at::randn({8, 16}, at::kDouble).requires_grad_(true);  // was [8, 32]
    at::Tensor c = at::randn({8}, at::kDouble).requires_grad_(true);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{a});
    groups.emplace_back(std::vector<at::Tensor>{c});
    WaveletAdam opt(std::move(groups));
    expect_error([&] { torch::load(opt, path); }, {"shape", "[8, 32]", "[8, 16]"});
    EXPECT_TRUE(opt.state().empty());
  }
  std::remove(path.c_str());
}

TEST(Errors, MismatchedGradientShapeIsRejected) {
  Fixture f;
  f.w.mutable_grad() = at::randn({8, 32}, at::kDouble);
  f.b.mutable_grad() = at::randn({8}, at::kDouble);
  // Bypass autograd's own check by swapping the gradient tensor's data.
  f.b.mutable_grad().set_(at::randn({9}, at::kDouble));
  expect_error([&] { f.opt.step(); }, {"gradient shape"});
  f.expect_unchanged();
}

}  // namespace
