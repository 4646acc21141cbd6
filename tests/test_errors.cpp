// Every error a caller can cause names the problem and leaves parameters and state unchanged
// (the errors in a checkpoint it loads: test_errors_checkpoint.cpp).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "errors_test_util.h"
#include "gwt/gwt.h"

namespace {

using namespace gwt_test::errors;

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

TEST(Errors, StateDtypeMustBeAValidName) {
  // "bf16" and the like used to mean float32 moments silently.
  const at::Tensor p = at::randn({4, 8}).requires_grad_(true);
  for (const char* bad : {"bf16", "float32", "BFloat16", "", "float16"})
    expect_error([&] { WaveletAdam opt({p}, WaveletAdamOptions().state_dtype(bad)); },
                 {"invalid state_dtype", "valid values are auto, bfloat16"});
  for (const char* good : {"auto", "bfloat16"})
    EXPECT_NO_THROW(WaveletAdam({p}, WaveletAdamOptions().state_dtype(good))) << good;

  // Changed mid-run: caught at step, before any state changes.
  Fixture f;
  f.w.mutable_grad() = at::randn({8, 32}, at::kDouble);
  f.b.mutable_grad() = at::randn({8}, at::kDouble);
  static_cast<WaveletAdamOptions&>(f.opt.param_groups()[0].options()).state_dtype("bf16");
  expect_error([&] { f.opt.step(); }, {"invalid state_dtype 'bf16'"});
  f.expect_unchanged();
}

TEST(Errors, OptionsThatOverflowFloat32AreRejectedAtStepWithNothingChanged) {
  // Found by fuzz_step: lr = 1e300 (a finite double) for a float32 parameter threw ATen's
  // std::runtime_error "value cannot be converted to type float without overflow" from the middle
  // of the reference path's step. Every option that enters the float32 math is checked first.
  for (bool fused : {true, false}) {
    at::manual_seed(34);
    at::Tensor w = at::randn({8, 32}).requires_grad_(true);
    at::Tensor b = at::randn({8}).requires_grad_(true);
    WaveletAdam opt({w, b}, WaveletAdamOptions(0.01).fused(fused));
    w.mutable_grad() = at::randn({8, 32});
    b.mutable_grad() = at::randn({8});
    opt.step();
    auto& o = static_cast<WaveletAdamOptions&>(opt.param_groups()[0].options());
    const auto state_of = [&](const at::Tensor& p) -> const WaveletAdamParamState& {
      return static_cast<const WaveletAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
    };
    for (auto set : std::vector<std::function<void()>>{
             [&] { o.lr(1e300); }, [&] { o.lr(1e20).weight_decay(1e20); },
             [&] { o.lr(1e30).scale(1e30); }, [&] { o.threshold(1e39); },
             [&] { o.norm_growth_limit(1e39); }}) {
      o = WaveletAdamOptions(0.01).fused(fused);
      set();
      const at::Tensor w0 = w.detach().clone(), m0 = state_of(w).exp_avg().clone();
      expect_error([&] { opt.step(); }, {"does not fit float32", "Float parameter"});
      EXPECT_TRUE(at::equal(w, w0));
      EXPECT_TRUE(at::equal(state_of(w).exp_avg(), m0));
      EXPECT_EQ(state_of(w).step(), 1);
      EXPECT_EQ(state_of(b).step(), 1);
    }
  }
  // A float64 parameter's math is float64: the same lr is representable and the step runs.
  Fixture f;
  static_cast<WaveletAdamOptions&>(f.opt.param_groups()[0].options()).lr(1e300);
  f.w.mutable_grad() = at::randn({8, 32}, at::kDouble);
  EXPECT_NO_THROW(f.opt.step());
}

TEST(Errors, OptionProductsThatOverflowFloat64AreRejectedAtStepWithNothingChanged) {
  // Found by fuzz_step: lr 1e300 and scale 1e300, each a finite double, on a float64 parameter
  // with a zero gradient: the step size x scale overflowed to inf, and inf x 0 wrote NaN into every
  // value (sym7, fused). Each product that enters the float64 math is checked first.
  for (bool fused : {true, false}) {
    at::Tensor w = at::full({5, 10}, -0.8, at::kDouble).requires_grad_(true);
    WaveletAdam opt({w}, WaveletAdamOptions(0.01).wavelet("sym7").level(2).fused(fused));
    w.mutable_grad() = at::zeros({5, 10}, at::kDouble);
    opt.step();
    auto& o = static_cast<WaveletAdamOptions&>(opt.param_groups()[0].options());
    for (auto set : std::vector<std::function<void()>>{[&] { o.lr(1e300).scale(1e300); },
                                                       [&] { o.lr(1e300).weight_decay(1e300); }}) {
      o = WaveletAdamOptions(0.01).wavelet("sym7").level(2).fused(fused);
      set();
      const at::Tensor w0 = w.detach().clone();
      expect_error([&] { opt.step(); }, {"overflows float64", "Double parameter"});
      EXPECT_TRUE(at::equal(w, w0));
      EXPECT_EQ(static_cast<const WaveletAdamParamState&>(*opt.state().at(w.unsafeGetTensorImpl()))
                    .step(),
                1);
    }
  }
}

TEST(Errors, StepSizeOverEpsThatOverflowsTheMathIsRejectedAtStepWithNothingChanged) {
  // Found by fuzz_step: lr 1e300 with eps 1e-10 on a float64 parameter (bfloat16 state, Haar) and a
  // zero gradient: the fused step divides the step size by the denominator first, 3e309 overflowed
  // to inf, and inf x 0 wrote NaN. The same for float32: lr 1e5 with eps 1e-35.
  struct Case {
    at::ScalarType dtype;
    double lr, eps;
    std::string math;
  };
  for (const Case& c : {Case{at::kDouble, 1e300, 1e-10, "overflows float64"},
                        Case{at::kFloat, 1e5, 1e-35, "overflows float32"},
                        Case{at::kBFloat16, 1e5, 1e-35, "overflows float32"}})
    for (bool fused : {true, false})
      for (const std::string wavelet : {"haar", "db2"}) {
        at::Tensor w = at::full({5, 12}, -0.8, c.dtype).requires_grad_(true);
        // bfloat16 state from the first step, as in the fuzz case (set later it would not apply:
        // existing moments keep their dtype).
        WaveletAdam opt(
            {w}, WaveletAdamOptions(0.01).wavelet(wavelet).fused(fused).state_dtype("bfloat16"));
        w.mutable_grad() = at::zeros({5, 12}, c.dtype);
        opt.step();
        auto& o = static_cast<WaveletAdamOptions&>(opt.param_groups()[0].options());
        o.lr(c.lr).eps(c.eps);
        const at::Tensor w0 = w.detach().clone();
        expect_error([&] { opt.step(); }, {c.math, "/ eps", "use a larger eps"});
        EXPECT_TRUE(at::equal(w, w0));
        EXPECT_EQ(
            static_cast<const WaveletAdamParamState&>(*opt.state().at(w.unsafeGetTensorImpl()))
                .step(),
            1);
        o.lr(0.01).eps(1e-6);  // a sound step still runs
        opt.step();
        EXPECT_TRUE(at::isfinite(w).all().item<bool>());
      }
}

TEST(Errors, WideGradientThatOverflowsTheMathDtypeSkipsTheStepOnEveryPath) {
  // A float64 gradient of 1e300 for a float32 parameter is finite as given but infinite in the
  // float32 math. The reference path and dense parameters checked the gradient as given and
  // wrote NaN; now every path checks it in the math dtype, and the step is skipped.
  for (bool fused : {true, false}) {
    at::Tensor w = at::randn({8, 32}).requires_grad_(true);
    at::Tensor b = at::randn({8}).requires_grad_(true);  // dense (below 2^level)
    WaveletAdam opt({w, b}, WaveletAdamOptions(0.01).level(3).fused(fused));
    const at::Tensor w0 = w.detach().clone(), b0 = b.detach().clone();
    w.mutable_grad() = at::full({8, 32}, 1e300, at::kDouble);
    b.mutable_grad() = at::full({8}, 1e300, at::kDouble);
    opt.step();
    EXPECT_EQ(opt.skipped_steps(), 1) << "fused " << fused;
    EXPECT_TRUE(at::equal(w, w0));
    EXPECT_TRUE(at::equal(b, b0));
    EXPECT_TRUE(opt.state().empty());
    // Only the dense parameter's gradient overflows: still skipped.
    w.mutable_grad() = at::randn({8, 32}, at::kDouble);
    opt.step();
    EXPECT_EQ(opt.skipped_steps(), 2);
    EXPECT_TRUE(at::equal(w, w0));
  }
}

TEST(Errors, EpsMustBePositiveInFloat32) {
  // eps = 0 made 0 / 0 on a block of zero gradients: the fused path skipped every step as
  // non-finite, the reference wrote NaN. 1e-300 is 0 once cast to the float32 math.
  const at::Tensor p = at::randn({4, 8}).requires_grad_(true);
  for (double bad : {0.0, -0.0, 1e-300, 1e-39})
    expect_error([&] { WaveletAdam opt({p}, WaveletAdamOptions().eps(bad)); },
                 {"invalid eps", "smallest normal float32"});

  // Changed mid-run: caught at step, before anything changes.
  Fixture f;
  f.w.mutable_grad() = at::randn({8, 32}, at::kDouble);
  f.b.mutable_grad() = at::randn({8}, at::kDouble);
  static_cast<WaveletAdamOptions&>(f.opt.param_groups()[0].options()).eps(0);
  expect_error([&] { f.opt.step(); }, {"invalid eps 0"});
  f.expect_unchanged();

  // The smallest accepted eps keeps a block of zero gradients finite (0 / eps = 0) on the fused
  // and the reference path, in float32 (where eps is exactly FLT_MIN) and float64. Rows 0-1 are
  // zero: their blocks have m = v = 0 at every step.
  for (auto dtype : {at::kFloat, at::kDouble}) {
    for (bool fused : {true, false}) {
      at::Tensor q = at::ones({4, 16}, dtype).requires_grad_(true);
      WaveletAdam opt({q},
                      WaveletAdamOptions(1e-3).eps(std::numeric_limits<float>::min()).fused(fused));
      for (int t = 0; t < 3; ++t) {
        at::Tensor g = at::randn({4, 16}, dtype);
        g.narrow(0, 0, 2).zero_();
        q.mutable_grad() = g;
        opt.step();
      }
      EXPECT_EQ(opt.skipped_steps(), 0) << dtype << " fused " << fused;
      EXPECT_TRUE(at::isfinite(q).all().item<bool>()) << dtype << " fused " << fused;
      // Zero gradients and zero moments: rows 0-1 did not move.
      EXPECT_TRUE(at::equal(q.detach().narrow(0, 0, 2), at::ones({2, 16}, dtype)));
    }
  }
}

TEST(Errors, IntegerBoolAndComplexParametersAreRejected) {
  for (auto dtype : {at::kLong, at::kInt, at::kBool, at::kComplexFloat}) {
    const at::Tensor p = at::zeros({4, 8}, dtype);
    expect_error([&] { WaveletAdam opt({p}); }, {"parameters must be", "float"});
  }
}

TEST(Errors, Float8ParametersAreRejectedNamingTheSupportedDtypes) {
  // float8 passes is_floating_point() but no kernel or reference path computes in it.
  for (auto dtype :
       {at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kFloat8_e4m3fnuz, at::kFloat8_e5m2fnuz}) {
    const at::Tensor p = at::zeros({4, 8}, at::kFloat).to(dtype);
    expect_error([&] { WaveletAdam opt({p}); },
                 {"parameters must be float64, float32, float16 or bfloat16", "Float8"});
  }
  // A parameter converted in place after construction is caught at step, before anything changes.
  Fixture f;
  f.w.mutable_grad() = at::randn({8, 32}, at::kDouble);
  f.b.mutable_grad() = at::randn({8}, at::kDouble);
  const at::Tensor b_data = f.b.detach().clone();
  {
    at::NoGradGuard no_grad;
    f.b.set_data(b_data.to(at::kFloat8_e4m3fn));
  }
  expect_error([&] { f.opt.step(); }, {"float8", "Float8_e4m3fn"});
  {
    at::NoGradGuard no_grad;
    f.b.set_data(b_data);
  }
  f.expect_unchanged();
}

TEST(Errors, ParameterInTwoGroupsIsRejected) {
  const at::Tensor p = at::randn({4, 8}).requires_grad_(true);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{p});
  groups.emplace_back(std::vector<at::Tensor>{p});
  expect_error([&] { WaveletAdam opt(std::move(groups)); }, {"more than once"});
}

TEST(Errors, AddParamGroupRejectsDuplicatesAndBadOptionsChangingNothing) {
  Fixture f;
  const at::Tensor fresh = at::randn({4, 8}, at::kDouble).requires_grad_(true);
  const auto before = f.opt.group_options(0);
  auto group = [](std::vector<at::Tensor> params, WaveletAdamOptions o = {}) {
    return torch::optim::OptimizerParamGroup(std::move(params),
                                             std::make_unique<WaveletAdamOptions>(o));
  };
  // A parameter already in a group (with state, and without: LibTorch checked only the state).
  WaveletAdam without_state({fresh});
  expect_error([&] { without_state.add_param_group(group({fresh})); }, {"more than once"});
  EXPECT_EQ(without_state.param_groups().size(), 1u);
  expect_error([&] { f.opt.add_param_group(group({fresh, f.b})); }, {"more than once", "[8]"});
  // The same tensor twice in the new group.
  expect_error([&] { f.opt.add_param_group(group({fresh, fresh})); }, {"more than once"});
  // Invalid options, options of another optimizer, a non-leaf tensor, an integer tensor.
  expect_error([&] { f.opt.add_param_group(group({fresh}, WaveletAdamOptions().level(-1))); },
               {"invalid level"});
  expect_error([&] { f.opt.add_param_group(group({fresh}, WaveletAdamOptions().dim(2))); },
               {"dim", "out of range"});
  expect_error(
      [&] {
        f.opt.add_param_group(torch::optim::OptimizerParamGroup(
            {fresh}, std::make_unique<torch::optim::AdamWOptions>(0.1)));
      },
      {"options of another optimizer"});
  expect_error([&] { f.opt.add_param_group(group({fresh * 2})); }, {"non-leaf"});
  expect_error([&] { f.opt.add_param_group(group({at::zeros({4}, at::kLong)})); },
               {"parameters must be"});
  EXPECT_EQ(f.opt.param_groups().size(), 1u);
  EXPECT_EQ(f.opt.param_groups()[0].params().size(), 2u);
  EXPECT_TRUE(f.opt.group_options(0) == before);
  f.expect_unchanged();
  // A valid group is then accepted.
  f.opt.add_param_group(group({fresh}, WaveletAdamOptions(0.2)));
  EXPECT_EQ(f.opt.group_options(1).lr(), 0.2);
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

TEST(Errors, NormGrowthLimitBelowTheSmallestNormalFloatIsRejected) {
  // Found by fuzz_step: 1e-300 > 0 enables the limiter, but is 0 in the float32 math, where the
  // limit max(ratio, 0) / 0 made the stored norm NaN.
  const at::Tensor p = at::randn({4, 8}).requires_grad_(true);
  for (double bad : {1e-300, 1e-39})
    expect_error([&] { WaveletAdam opt({p}, WaveletAdamOptions().norm_growth_limit(bad)); },
                 {"invalid norm_growth_limit", "smallest normal float32"});
  EXPECT_NO_THROW(WaveletAdam({p}, WaveletAdamOptions().norm_growth_limit(0)));
  EXPECT_NO_THROW(WaveletAdam({p}, WaveletAdamOptions().norm_growth_limit(1.01)));
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

// A tensor whose elements the kernels cannot address (issue 38: FSDP2's DTensor parameters made
// the step write through a wrapper's data_ptr() and crash): a wrapper subclass without storage, a
// tensor without storage, a meta tensor. Each is an error naming it at every entry point, before
// anything changes.
at::Tensor without_storage(bool subclass) {
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      c10::DispatchKeySet(c10::DispatchKey::CPU), caffe2::TypeMeta::Make<float>(),
      c10::Device(c10::kCPU));
  t.unsafeGetTensorImpl()->set_sizes_contiguous({8, 32});
  // What a Python __torch_dispatch__ subclass (DTensor) carries.
  if (subclass) t.unsafeGetTensorImpl()->set_python_dispatch(true);
  return t;
}

TEST(Errors, TensorsWithoutStorageOrOnMetaAreRejectedEverywhere) {
  const std::vector<std::pair<at::Tensor, std::string>> bad = {
      {without_storage(true), "tensor subclass"},
      {without_storage(false), "no storage"},
      {at::empty({8, 32}, at::TensorOptions(at::kFloat).device(at::kMeta)), "is on meta"}};
  for (const auto& [t, words] : bad) {
    SCOPED_TRACE(words);
    expect_error([&] { WaveletAdam(std::vector<at::Tensor>{t}); }, {"gwt::WaveletAdam", words});
    expect_error([&] { gwt::GaLoreAdam(std::vector<at::Tensor>{t}); }, {"GaLoreAdam", words});
    expect_error([&] { gwt::wavedec(t, gwt::Wavelet("haar"), 1); }, {"transform", words});
    expect_error([&] { gwt::dwt(t, gwt::Wavelet("db2")); }, {"transform", words});
    expect_error([&] { gwt::wavedec2(t, gwt::Wavelet("haar"), 1); }, {"transform", words});
    // As a gradient of a good parameter: caught at step, nothing changed.
    Fixture f;
    f.b.mutable_grad() = at::randn({8}, at::kDouble);
    f.w.mutable_grad() = t;
    expect_error([&] { f.opt.step(); }, {"gradient", words});
    f.expect_unchanged();
  }
}

TEST(Errors, CheckStepThrowsWhatStepWouldAndChangesNothing) {
  Fixture f;
  f.w.mutable_grad() = at::randn({8, 32}, at::kDouble);
  f.b.mutable_grad() = at::randn({8}, at::kDouble);
  f.opt.check_step();  // good gradients: no error
  f.expect_unchanged();
  f.b.mutable_grad().set_(at::randn({9}, at::kDouble));
  expect_error([&] { f.opt.check_step(); }, {"gradient shape"});
  f.expect_unchanged();
  expect_error([&] { f.opt.step(); }, {"gradient shape"});
  f.expect_unchanged();
}

}  // namespace
