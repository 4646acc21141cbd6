// Every error a caller can cause names the problem and leaves parameters and state unchanged.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <cstdio>
#include <functional>
#include <limits>
#include <sstream>
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

WaveletAdamParamState& state_in(WaveletAdam& opt, const at::Tensor& p) {
  return static_cast<WaveletAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

std::string saved_bytes(WaveletAdam& opt) {
  std::ostringstream out;
  torch::save(opt, out);
  return out.str();
}

void load_bytes(WaveletAdam& opt, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::load(opt, in);
}

TEST(Errors, LoadRejectsOptionsThatDoNotFitTheModelsDtype) {
  // Found by fuzz_load (GaLoreAdam; WaveletAdam shares the check): options valid for the float64
  // model they were saved with (lr 1e300) loaded into a float32 model, whose step() then threw.
  // load() makes the step's checks for every parameter, with state or without.
  at::Tensor wide = at::randn({8, 32}, at::kDouble).requires_grad_(true);
  WaveletAdam saved({wide}, WaveletAdamOptions(1e300));
  wide.mutable_grad() = at::randn({8, 32}, at::kDouble);
  saved.step();
  const std::string bytes = saved_bytes(saved);
  for (bool stepped : {false, true}) {
    at::Tensor narrow = at::randn({8, 32}).requires_grad_(true);
    WaveletAdam opt({narrow}, WaveletAdamOptions(0.01));
    if (stepped) {
      narrow.mutable_grad() = at::randn({8, 32});
      opt.step();
    }
    const std::string before = saved_bytes(opt);
    expect_error([&] { load_bytes(opt, bytes); }, {"does not fit float32", "Float parameter"});
    EXPECT_EQ(saved_bytes(opt), before);
    EXPECT_DOUBLE_EQ(opt.group_options(0).lr(), 0.01);
  }
}

TEST(Errors, LoadChecksTheDimOfParametersWithoutState) {
  // Found by fuzz_load: a checkpoint whose options have a dim out of range for a parameter that
  // has no state loaded (only parameters with state were planned), and the next step threw. The
  // constructor and add_param_group refuse such a dim for every parameter; load() now does too.
  at::Tensor a = at::randn({2, 8, 16}).requires_grad_(true);
  at::Tensor b = at::randn({8, 16}).requires_grad_(true);
  WaveletAdam saved({a, b}, WaveletAdamOptions(0.01));
  a.mutable_grad() = at::randn({2, 8, 16});
  saved.step();  // b has no gradient: no state
  // dim 2 fits a (3-D), not b (2-D); step() plans only parameters with gradients.
  static_cast<WaveletAdamOptions&>(saved.param_groups()[0].options()).dim(2);
  const std::string bytes = saved_bytes(saved);
  at::Tensor c = at::randn({2, 8, 16}).requires_grad_(true);
  at::Tensor d = at::randn({8, 16}).requires_grad_(true);
  WaveletAdam target({c, d}, WaveletAdamOptions(0.01));
  const std::string before = saved_bytes(target);
  expect_error([&] { load_bytes(target, bytes); },
               {"dim 2 is out of range for a parameter of shape [8, 16]"});
  EXPECT_EQ(saved_bytes(target), before);
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

// A checkpoint in the gwt.WaveletAdam.v1 layout written here by hand, as WaveletAdam::save wrote
// it before the per-parameter dtype entries existed: one group, every parameter with state.
std::string handwritten_checkpoint(const WaveletAdamOptions& options,
                                   const std::vector<at::Tensor>& params,
                                   const std::vector<const WaveletAdamParamState*>& states,
                                   int64_t skipped_steps) {
  torch::serialize::OutputArchive archive;
  archive.write("format", c10::IValue(std::string("gwt.WaveletAdam.v1")));
  archive.write("num_groups", c10::IValue(int64_t{1}));
  archive.write("skipped_steps", c10::IValue(skipped_steps));
  torch::serialize::OutputArchive group(archive.compilation_unit());
  torch::serialize::OutputArchive options_archive(archive.compilation_unit());
  options.serialize(options_archive);
  group.write("options", options_archive);
  group.write("num_params", c10::IValue(static_cast<int64_t>(params.size())));
  for (size_t j = 0; j < params.size(); ++j) {
    // (Built with append: GCC 12 warns falsely on `"param_" + std::to_string(j)`, GCC bug 105329.)
    const std::string key = std::string("param_").append(std::to_string(j));
    group.write(std::string(key).append("_shape"), c10::IValue(params[j].sizes().vec()));
    torch::serialize::OutputArchive state(archive.compilation_unit());
    states[j]->serialize(state);
    group.write(key, state);
  }
  archive.write("group_0", group);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

TEST(Errors, CorruptCheckpointStateIsRejectedChangingNothing) {
  // Each checkpoint comes from a trained optimizer of the Fixture's shapes whose state was
  // corrupted before saving, and whose lr (0.5) differs from the target's, so that a load that
  // went part of the way would show in the options as well as in the state.
  using Corrupt = std::function<void(WaveletAdamParamState & w, WaveletAdamParamState & b)>;
  struct Case {
    const char* what;
    Corrupt corrupt;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"nothing", [](auto&, auto&) {}, {}},
      {"NaN in exp_avg",
       [](auto& w, auto&) { w.exp_avg()[0][1] = k_nan; },
       {"exp_avg ", "[8, 32]", "NaN or an infinity"}},
      {"inf in exp_avg_sq",
       [](auto&, auto& b) { b.exp_avg_sq()[3] = k_inf; },
       {"exp_avg_sq", "[8]", "NaN or an infinity"}},
      {"negative exp_avg_sq",
       [](auto& w, auto&) { w.exp_avg_sq()[2][0] = -1e-3; },
       {"exp_avg_sq", "negative value"}},
      {"NaN limiter norm",
       [](auto& w, auto&) { w.norm(at::scalar_tensor(k_nan, at::kDouble)); },
       {"limiter norm", "NaN or an infinity"}},
      {"negative limiter norm",
       [](auto& w, auto&) { w.norm(at::scalar_tensor(-2.0, at::kDouble)); },
       {"limiter norm", "negative value"}},
      {"negative step", [](auto&, auto& b) { b.step(-3); }, {"step count is negative", "-3"}},
      {"integer moments",
       [](auto& w, auto&) { w.exp_avg(w.exp_avg().to(at::kLong)); },
       {"Long", "floating point"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    Fixture source;
    static_cast<WaveletAdamOptions&>(source.opt.param_groups()[0].options()).lr(0.5);
    c.corrupt(state_in(source.opt, source.w), state_in(source.opt, source.b));
    const std::string bytes = saved_bytes(source.opt);
    Fixture f;
    if (c.words.empty()) {  // the uncorrupted checkpoint loads
      load_bytes(f.opt, bytes);
      EXPECT_EQ(f.opt.group_options(0).lr(), 0.5);
      EXPECT_TRUE(state_in(f.opt, f.w) == state_in(source.opt, source.w));
      continue;
    }
    expect_error([&] { load_bytes(f.opt, bytes); }, c.words);
    f.expect_unchanged();
    EXPECT_EQ(f.opt.group_options(0).lr(), 0.01);
  }

  // Checked in the dtype the state will have: 1e300 is finite in float64 and infinite once the
  // moments are converted for a model that became float32 as a whole.
  Fixture source;
  state_in(source.opt, source.w).exp_avg()[0][0] = 1e300;
  at::Tensor w = at::randn({8, 32}).requires_grad_(true), b = at::randn({8}).requires_grad_(true);
  WaveletAdam target({w, b}, WaveletAdamOptions(0.01));
  expect_error([&] { load_bytes(target, saved_bytes(source.opt)); },
               {"exp_avg ", "NaN or an infinity"});
  EXPECT_TRUE(target.state().empty());
}

TEST(Errors, CheckpointOfParametersReorderedAcrossDtypesIsRejected) {
  // Equal shapes, different dtypes: the saved shapes cannot tell the reorder, the dtypes can.
  at::Tensor a = at::randn({8, 32}, at::kFloat).requires_grad_(true);
  at::Tensor c = at::randn({8, 32}, at::kDouble).requires_grad_(true);
  WaveletAdam saved({a, c}, WaveletAdamOptions(0.01));
  a.mutable_grad() = at::randn({8, 32}, at::kFloat);
  c.mutable_grad() = at::randn({8, 32}, at::kDouble);
  saved.step();
  const std::string bytes = saved_bytes(saved);

  at::Tensor a2 = a.detach().clone().requires_grad_(true);
  at::Tensor c2 = c.detach().clone().requires_grad_(true);
  // With the model's weights loaded, the digests of the parameters' bytes tell the reorder.
  WaveletAdam reordered({c2, a2}, WaveletAdamOptions(0.02));
  expect_error([&] { load_bytes(reordered, bytes); },
               {"holds the values that parameter 1 of group 0 had", "reordered"});
  EXPECT_TRUE(reordered.state().empty());
  EXPECT_EQ(reordered.group_options(0).lr(), 0.02);
  // With fresh weights the digests cannot tell, the dtypes still do.
  WaveletAdam fresh({at::randn({8, 32}, at::kDouble).requires_grad_(true),
                     at::randn({8, 32}, at::kFloat).requires_grad_(true)},
                    WaveletAdamOptions(0.02));
  expect_error([&] { load_bytes(fresh, bytes); },
               {"parameter 0 of group 0 was Float when saved but is Double here", "reordered"});
  EXPECT_TRUE(fresh.state().empty());

  WaveletAdam in_order({a2, c2}, WaveletAdamOptions(0.02));
  load_bytes(in_order, bytes);
  EXPECT_TRUE(state_in(in_order, a2) == state_in(saved, a));
  EXPECT_TRUE(state_in(in_order, c2) == state_in(saved, c));

  // A model converted as a whole between save and load (Module::to(kDouble)) still loads, its
  // moments converted (docs/options.md: save, convert the model, load).
  at::Tensor a3 = a.detach().to(at::kDouble).requires_grad_(true);
  at::Tensor c3 = c.detach().clone().requires_grad_(true);
  WaveletAdam converted({a3, c3});
  load_bytes(converted, bytes);
  EXPECT_EQ(state_in(converted, a3).exp_avg().scalar_type(), at::kDouble);
  EXPECT_TRUE(
      at::equal(state_in(converted, a3).exp_avg(), state_in(saved, a).exp_avg().to(at::kDouble)));
}

TEST(Errors, CheckpointsWithoutFingerprintsLoadAndCountersAreChecked) {
  // Written as before the dtype entries: it loads into the same parameters, state and counters.
  Fixture source;
  static_cast<WaveletAdamOptions&>(source.opt.param_groups()[0].options()).lr(0.5);
  const std::vector<const WaveletAdamParamState*> states = {&state_in(source.opt, source.w),
                                                            &state_in(source.opt, source.b)};
  const auto& options = source.opt.group_options(0);
  Fixture f;
  load_bytes(f.opt, handwritten_checkpoint(options, {source.w, source.b}, states, 2));
  EXPECT_EQ(f.opt.skipped_steps(), 2);
  EXPECT_TRUE(f.opt.group_options(0) == options);
  EXPECT_TRUE(state_in(f.opt, f.w) == *states[0]);
  EXPECT_TRUE(state_in(f.opt, f.b) == *states[1]);

  // A negative counter is rejected before anything changes.
  Fixture g;
  expect_error(
      [&] {
        load_bytes(g.opt, handwritten_checkpoint(options, {source.w, source.b}, states, -1));
      },
      {"skipped_steps is negative", "-1"});
  g.expect_unchanged();
  EXPECT_EQ(g.opt.skipped_steps(), 0);
  EXPECT_EQ(g.opt.group_options(0).lr(), 0.01);
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
