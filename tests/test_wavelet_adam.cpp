// gwt::WaveletAdam against the GWT authors' optimizer and against the rule of
// docs/algorithm.md#the-update (and the dense path) written out in plain ATen ops here. As
// torch::optim users see it: test_wavelet_adam_groups.cpp (groups, schedulers, closures) and
// test_wavelet_adam_state.cpp (save/load, memory report).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gwt/gwt.h"
#include "test_util.h"
#include "wavelet_adam_test_util.h"

namespace {

using gwt::WaveletAdam;
using gwt::WaveletAdamOptions;
using gwt::WaveletAdamParamState;
using gwt_test::max_abs_diff;
using namespace gwt_test::wavelet_adam;

// ---------------------------------------------------------------------------------------------
// The authors' WaveAdamW (tests/data/official_gwt_trajectories.txt)
// ---------------------------------------------------------------------------------------------

std::string header_value(const gwt_test::Record& rec, const std::string& key) {
  for (const auto& word : rec.header)
    if (word.rfind(key + "=", 0) == 0) return word.substr(key.size() + 1);
  ADD_FAILURE() << "no " << key << " in config";
  return "";
}

// (Built with append: GCC 12 warns falsely on `"g" + std::to_string(t)`, GCC bug 105329.)
std::string row_key(const char* prefix, int64_t t) {
  return std::string(prefix).append(std::to_string(t));
}

TEST(WaveletAdam, MatchesTheAuthorsOptimizerTrajectories) {
  const auto records = gwt_test::read_records("official_gwt_trajectories.txt", "config");
  ASSERT_GE(records.size(), 2u);
  for (const auto& rec : records) {
    SCOPED_TRACE(header_value(rec, "name"));
    std::vector<int64_t> shape;
    const std::string shape_text = header_value(rec, "shape");
    for (size_t pos = 0; pos < shape_text.size();) {
      const size_t comma = shape_text.find(',', pos);
      shape.push_back(std::stoll(shape_text.substr(pos, comma - pos)));
      pos = comma == std::string::npos ? shape_text.size() : comma + 1;
    }
    const int64_t steps = std::stoll(header_value(rec, "steps"));
    at::Tensor p = gwt_test::to_tensor(rec.rows.at("p0")).view(shape).clone().requires_grad_(true);
    WaveletAdam opt({p}, WaveletAdamOptions(std::stod(header_value(rec, "lr")))
                             .level(std::stoll(header_value(rec, "level")))
                             .scale(std::stod(header_value(rec, "scale")))
                             .weight_decay(std::stod(header_value(rec, "wd")))
                             .betas({0.9, 0.999})
                             .eps(1e-6)
                             .wavelet("haar")
                             .boundary("zero"));
    ASSERT_TRUE(opt.is_wavelet_param(p));
    ASSERT_TRUE(opt.is_fused_param(p));  // the default path: the fused Haar kernel
    for (int64_t t = 1; t <= steps; ++t) {
      set_grad(p, gwt_test::to_tensor(rec.rows.at(row_key("g", t))).view(shape));
      opt.step();
      const at::Tensor expected = gwt_test::to_tensor(rec.rows.at(row_key("p", t))).view(shape);
      // Relative to each element, with a floor so that a value crossing zero does not blow up.
      const double rel = gwt_test::max_rel_diff(p.detach(), expected, 1e-3);
      EXPECT_LE(rel, 1e-10) << "step " << t;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The rule of docs/algorithm.md#the-update and the dense path, written out independently of the
// optimizer's code
// ---------------------------------------------------------------------------------------------

struct SpecState {
  at::Tensor m, v, norm;
  int64_t t = 0;
};

// One step of docs/algorithm.md#the-update on p (float64), transform along `dim`.
void spec_wavelet_step(at::Tensor& p, const at::Tensor& g, SpecState& s,
                       const WaveletAdamOptions& o) {
  const auto [b1, b2] = o.betas();
  const gwt::Wavelet w(o.wavelet());
  const auto mode = gwt::boundary_mode_from_string(o.boundary());
  const int64_t dim = o.dim() < 0 ? o.dim() + p.dim() : o.dim();
  const int64_t n = p.size(dim);
  auto c = gwt::wavedec(g.movedim(dim, -1), w, o.level(), -1, mode);
  if (!s.m.defined()) {
    s.m = at::zeros_like(c.approx);
    s.v = at::zeros_like(c.approx);
  }
  s.t += 1;
  s.m = b1 * s.m + (1 - b1) * c.approx;
  s.v = b2 * s.v + (1 - b2) * c.approx * c.approx;
  const at::Tensor denom = at::sqrt(s.v) + o.eps();
  at::Tensor N = s.m / denom;
  const double step_size = o.lr() * std::sqrt(1 - std::pow(b2, s.t)) / (1 - std::pow(b1, s.t));
  double lim = 1.0;
  const double gamma = o.norm_growth_limit();
  if (gamma > 0) {
    const double norm = N.norm().item<double>();
    if (!s.norm.defined()) {
      s.norm = at::scalar_tensor(norm, at::kDouble);
    } else {
      lim = std::max(norm / (s.norm.item<double>() + 1e-8), gamma) / gamma;
      N = N / lim;
      s.norm = at::scalar_tensor(norm / lim, at::kDouble);
    }
  }
  at::Tensor d = denom;
  for (auto& D : c.details) {
    D = D / (d.slice(-1, 0, D.size(-1)) * lim);
    d = at::repeat_interleave(d, 2, -1);
  }
  c.approx = N;
  const at::Tensor U = gwt::waverec(c, w, -1, mode).slice(-1, 0, n) * o.scale();
  p = p - step_size * U.movedim(-1, dim);
  p = p - o.lr() * o.weight_decay() * p;
}

TEST(WaveletAdam, MatchesTheAuthorsOptimizerThroughTheReferenceToo) {
  const auto records = gwt_test::read_records("official_gwt_trajectories.txt", "config");
  const auto& rec = records.at(0);
  at::Tensor p = gwt_test::to_tensor(rec.rows.at("p0")).view({8, 16}).clone().requires_grad_(true);
  WaveletAdam opt({p}, WaveletAdamOptions(0.01).level(2).scale(0.25).fused(false));
  ASSERT_FALSE(opt.is_fused_param(p));
  for (int64_t t = 1; t <= 12; ++t) {
    set_grad(p, gwt_test::to_tensor(rec.rows.at(row_key("g", t))).view({8, 16}));
    opt.step();
    const at::Tensor expected = gwt_test::to_tensor(rec.rows.at(row_key("p", t))).view({8, 16});
    EXPECT_LE(gwt_test::max_rel_diff(p.detach(), expected, 1e-3), 1e-10) << "step " << t;
  }
}

TEST(WaveletAdam, FollowsTheSpecRuleForOtherWaveletsModesAndDims) {
  at::manual_seed(7);
  struct Case {
    std::string wavelet, boundary;
    int64_t level, dim;
    std::vector<int64_t> shape;
    double gamma;
  };
  const std::vector<Case> cases = {
      {"db2", "zero", 2, -1, {6, 37}, 1.01},
      {"db2", "periodization", 3, 0, {40, 3}, 1.01},
      {"sym3", "symmetric", 1, 1, {2, 21, 5}, 1.05},
      {"haar", "zero", 3, -1, {4, 3, 29}, 0.0},
      {"coif1", "periodization", 2, -1, {5, 64}, 1.01},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.wavelet + " " + c.boundary + " L=" + std::to_string(c.level));
    const auto o = WaveletAdamOptions(0.02)
                       .wavelet(c.wavelet)
                       .boundary(c.boundary)
                       .level(c.level)
                       .dim(c.dim)
                       .scale(0.5)
                       .weight_decay(0.05)
                       .norm_growth_limit(c.gamma);
    at::Tensor p = make_param(c.shape);
    at::Tensor expected = p.detach().clone();
    WaveletAdam opt({p}, o);
    SpecState spec;
    for (int t = 0; t < 6; ++t) {
      // Growing gradients make the limiter act. One sign per step: on random signs a filter sum
      // can nearly cancel, the step divides by it, and 1e-12 would rest on how the fused kernel
      // and the spec (ATen's wavedec, whose rounding differs between instruction sets) round it.
      const double sign = at::rand({}, at::kDouble).item<double>() < 0.5 ? -1.0 : 1.0;
      const at::Tensor g = sign * (at::rand(c.shape, at::kDouble) + 0.5) * (1 + 3 * t);
      set_grad(p, g);
      opt.step();
      spec_wavelet_step(expected, g, spec, o);
      EXPECT_LE(max_abs_diff(p.detach(), expected), 1e-12) << "step " << t;
    }
    EXPECT_TRUE(at::allclose(state_of(opt, p).exp_avg(),
                             spec.m.movedim(-1, o.dim() < 0 ? o.dim() + p.dim() : o.dim())));
  }
}

TEST(WaveletAdam, DensePathIsAdamWithFoldedBiasCorrection) {
  at::manual_seed(8);
  const auto o = WaveletAdamOptions(0.01).weight_decay(0.1).eps(1e-6);
  // A bias (1-D), a matrix shorter than 2^level along dim, and a level-0 group are all dense.
  at::Tensor bias = make_param({7});
  at::Tensor narrow = make_param({5, 3});
  at::Tensor level0 = make_param({4, 16});
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{bias, narrow},
                      std::make_unique<WaveletAdamOptions>(o));
  groups.emplace_back(std::vector<at::Tensor>{level0},
                      std::make_unique<WaveletAdamOptions>(WaveletAdamOptions(o).level(0)));
  WaveletAdam opt(std::move(groups), o);
  for (const auto& p : {bias, narrow, level0}) {
    EXPECT_FALSE(opt.is_wavelet_param(p));
    at::Tensor expected = p.detach().clone();
    at::Tensor m = at::zeros_like(expected), v = at::zeros_like(expected);
    for (int t = 1; t <= 3; ++t) {
      const at::Tensor g = at::randn(p.sizes(), at::kDouble);
      set_grad(p, g);
      opt.step();
      m = 0.9 * m + 0.1 * g;
      v = 0.999 * v + 0.001 * g * g;
      const double step_size = 0.01 * std::sqrt(1 - std::pow(0.999, t)) / (1 - std::pow(0.9, t));
      expected = expected - step_size * m / (at::sqrt(v) + 1e-6);
      expected = expected - 0.01 * 0.1 * expected;
      EXPECT_LE(max_abs_diff(p.detach(), expected), 1e-14);
      p.mutable_grad() = at::Tensor();  // only this parameter steps
    }
    EXPECT_EQ(state_of(opt, p).exp_avg().sizes(), p.sizes());
  }
}

// The dense parameters' one-pass loop (fused) against the reference's ATen ops, in float32 and
// float64, over 10 steps with weight decay. The gradients are fixed in advance (they do not depend
// on the parameters), so the two runs differ only in each operation's rounding: ATen's vectorised
// add may fuse a multiply-add where the loop rounds twice, which is a few ulps of each step's
// change, added up over 10 steps and never amplified. 1e-5 (float32) and 1e-13 (float64) of
// max |p| are far above 10 x 4 ulps, and far below a wrong rule (one step's change is 1e-2).
TEST(WaveletAdam, DenseLoopMatchesTheReference) {
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    SCOPED_TRACE(dtype == at::kFloat ? "float32" : "float64");
    at::manual_seed(21);
    const at::Tensor start = at::randn({300}, dtype);
    std::vector<at::Tensor> grads;
    for (int t = 0; t < 10; ++t) grads.push_back(at::randn({300}, dtype));
    std::vector<at::Tensor> params;
    for (const bool fused : {true, false}) {
      at::Tensor p = start.clone().requires_grad_(true);
      WaveletAdam opt({p}, WaveletAdamOptions(0.01).weight_decay(0.1).fused(fused));
      for (const auto& g : grads) {
        p.mutable_grad() = g.clone();
        opt.step();
      }
      params.push_back(p.detach());
    }
    const double scale = start.abs().max().item<double>();
    EXPECT_LE(max_abs_diff(params[0], params[1]), (dtype == at::kFloat ? 1e-5 : 1e-13) * scale);
    EXPECT_GT(max_abs_diff(params[0], start), 1e-2);  // they moved
  }
}

// The dense loop (gwt::kernels::dense_adam_update_cpu: 8 floats or 4 doubles per AVX2 register, or
// the baseline build's plain loop) against the rule written here one IEEE operation at a time,
// bit for bit. Exact by construction: each operation is rounded once to the nearest, whatever
// the build (volatile keeps the compiler from fusing a multiply and an add here; the kernel keeps
// them apart itself). 70001 values: more than two parallel chunks, and a last value that goes
// through the padded register; 13 values: a tail of 5 floats after one register. Weight decay on
// and off. The step size is the optimizer's expression (optim_detail::adam_step_size) in double.
template <typename T>
T rounded_once(T x) {
  volatile T y = x;
  return y;
}

TEST(WaveletAdam, DenseLoopIsTheRuleOperationByOperation) {
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    for (const int64_t n : {int64_t{70001}, int64_t{13}}) {
      for (const double wd : {0.1, 0.0}) {
        SCOPED_TRACE(std::string(dtype == at::kFloat ? "float32" : "float64") + " n " +
                     std::to_string(n) + " wd " + std::to_string(wd));
        at::manual_seed(23);
        at::Tensor p = at::randn({n}, dtype).requires_grad_(true);
        at::Tensor expected = p.detach().clone(), m = at::zeros_like(expected),
                   v = at::zeros_like(expected);
        const auto o = WaveletAdamOptions(0.01).weight_decay(wd).eps(1e-6);
        WaveletAdam opt({p}, o);
        ASSERT_FALSE(opt.is_wavelet_param(p));
        for (int t = 1; t <= 3; ++t) {
          const at::Tensor g = at::randn({n}, dtype);
          p.mutable_grad() = g.clone();
          opt.step();
          const double step_size =
              0.01 * std::sqrt(1 - std::pow(0.999, t)) / (1 - std::pow(0.9, t));
          AT_DISPATCH_FLOATING_TYPES(dtype, "rule", [&] {
            const scalar_t b1 = 0.9, b2 = 0.999, c1 = static_cast<scalar_t>(1 - 0.9),
                           c2 = static_cast<scalar_t>(1 - 0.999), eps = static_cast<scalar_t>(1e-6),
                           step = static_cast<scalar_t>(-step_size),
                           decay = static_cast<scalar_t>(-(0.01 * wd));
            scalar_t* e = expected.data_ptr<scalar_t>();
            scalar_t* mm = m.data_ptr<scalar_t>();
            scalar_t* vv = v.data_ptr<scalar_t>();
            const scalar_t* gg = g.data_ptr<scalar_t>();
            for (int64_t i = 0; i < n; ++i) {
              mm[i] = rounded_once(rounded_once(mm[i] * b1) + rounded_once(c1 * gg[i]));
              vv[i] = rounded_once(rounded_once(vv[i] * b2) +
                                   rounded_once(rounded_once(c2 * gg[i]) * gg[i]));
              const scalar_t denom = rounded_once(rounded_once(std::sqrt(vv[i])) + eps);
              e[i] = rounded_once(e[i] + rounded_once(rounded_once(step * mm[i]) / denom));
              if (wd != 0) e[i] = rounded_once(e[i] + rounded_once(decay * e[i]));
            }
          });
          ASSERT_TRUE(at::equal(p.detach(), expected)) << "step " << t;
          ASSERT_TRUE(at::equal(state_of(opt, p).exp_avg(), m));
          ASSERT_TRUE(at::equal(state_of(opt, p).exp_avg_sq(), v));
        }
      }
    }
  }
}

// is_fused_param and is_wavelet_param of a tensor that is not one of the optimizer's parameters
// (here: one of the same shape) are errors that name the call.
TEST(WaveletAdam, AskingAboutATensorThatIsNotAParameterIsAnError) {
  at::Tensor p = make_param({8, 32});
  WaveletAdam opt({p}, WaveletAdamOptions(0.01));
  const at::Tensor other = at::zeros({8, 32}, at::kDouble);
  for (const std::string call : {"is_fused_param", "is_wavelet_param"}) {
    try {
      call == "is_fused_param" ? opt.is_fused_param(other) : opt.is_wavelet_param(other);
      ADD_FAILURE() << call << ": no error";
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find(call + ": the tensor is not a parameter of this optimizer"),
                std::string::npos)
          << msg;
    }
  }
  EXPECT_TRUE(opt.is_wavelet_param(p));
}

// nonfinite: "skip_step" leaves every parameter and its state bit-unchanged when one gradient is
// not finite; "skip_param" leaves only that parameter so, and steps the others exactly as an
// optimizer over them alone would (the same kernels on the same data: compared bit for bit).
TEST(WaveletAdam, NonFiniteSkipsTheStepOrOnlyTheParameter) {
  for (const bool fused : {true, false}) {
    for (const std::string mode : {"skip_step", "skip_param"}) {
      SCOPED_TRACE(mode + (fused ? " fused" : " reference"));
      at::manual_seed(5);
      std::vector<at::Tensor> params = {make_param({8, 32}, at::kFloat),
                                        make_param({8, 32}, at::kFloat),
                                        make_param({7}, at::kFloat)};
      std::vector<at::Tensor> alone = {params[0].detach().clone().requires_grad_(true),
                                       params[2].detach().clone().requires_grad_(true)};
      const auto o = WaveletAdamOptions(0.01).weight_decay(0.1).fused(fused).nonfinite(mode);
      WaveletAdam opt(params, o);
      WaveletAdam others(alone, o);  // params 0 and 2 only
      std::vector<at::Tensor> grads;
      for (int t = 0; t < 3; ++t)
        for (int i = 0; i < 3; ++i) grads.push_back(at::randn(params[i].sizes()));
      for (int t = 0; t < 3; ++t) {
        for (int i = 0; i < 3; ++i) set_grad(params[i], grads[3 * t + i]);
        set_grad(alone[0], grads[3 * t]), set_grad(alone[1], grads[3 * t + 2]);
        const bool poison = t == 2;
        if (poison) params[1].mutable_grad()[2][5] = std::numeric_limits<float>::quiet_NaN();
        std::vector<at::Tensor> values;
        std::vector<WaveletAdamParamState> states;
        for (const auto& p : params) {
          if (!poison) break;
          values.push_back(p.detach().clone());
          states.push_back(state_of(opt, p));  // a copy (tensors shared: compared by value below)
          states.back().exp_avg(states.back().exp_avg().clone());
          states.back().exp_avg_sq(states.back().exp_avg_sq().clone());
          if (states.back().norm().defined()) states.back().norm(states.back().norm().clone());
        }
        opt.step();
        if (!poison || mode == "skip_param") others.step();
        if (!poison) continue;
        EXPECT_EQ(opt.skipped_steps(), 1);
        for (int i = 0; i < 3; ++i) {
          const bool kept = mode == "skip_step" || i == 1;
          EXPECT_EQ(at::equal(params[i].detach(), values[i]), kept) << "parameter " << i;
          WaveletAdamParamState now = state_of(opt, params[i]);
          now.skipped(states[i].skipped());
          EXPECT_EQ(now == states[i], kept) << "state " << i;
        }
        EXPECT_EQ(opt.skipped_steps(params[1]), mode == "skip_param" ? 1 : 0);
        EXPECT_EQ(opt.skipped_steps(params[0]), 0);
        if (mode == "skip_param") {
          EXPECT_TRUE(at::equal(params[0].detach(), alone[0].detach()));
          EXPECT_TRUE(at::equal(params[2].detach(), alone[1].detach()));
          EXPECT_TRUE(state_of(opt, params[0]) == state_of(others, alone[0]));
        }
      }
      // The option and the count survive a checkpoint.
      const std::string path = temp_file("nonfinite");
      torch::save(opt, path);
      std::vector<at::Tensor> copies;
      for (const auto& p : params) copies.push_back(p.detach().clone().requires_grad_(true));
      WaveletAdam loaded(copies, WaveletAdamOptions(0.01));
      torch::load(loaded, path);
      std::remove(path.c_str());
      EXPECT_EQ(loaded.group_options(0).nonfinite(), mode);
      EXPECT_EQ(loaded.skipped_steps(copies[1]), mode == "skip_param" ? 1 : 0);
      EXPECT_EQ(loaded.skipped_steps(), 1);
    }
  }
}

// With finite gradients "skip_param" steps exactly as "skip_step": it only orders the passes
// differently, and its Haar CPU tensors take the norm pass's approximations and denominators from
// a carry (HaarAdamArgs::carry) instead of computing them again, the same bits by construction.
TEST(WaveletAdam, SkipParamStepsAsSkipStepWithFiniteGradients) {
  for (const std::string transform : {"1d", "2d"}) {
    SCOPED_TRACE(transform);
    at::manual_seed(23);
    const std::vector<std::vector<int64_t>> shapes = {{64, 96}, {8, 32}, {13, 100}, {7}};
    std::vector<at::Tensor> a, b;
    for (const auto& shape : shapes) {
      a.push_back(make_param(shape, at::kFloat));
      b.push_back(a.back().detach().clone().requires_grad_(true));
    }
    const auto o = WaveletAdamOptions(0.01).weight_decay(0.1).level(2).transform(transform);
    WaveletAdam step_wise(a, WaveletAdamOptions(o).nonfinite("skip_step"));
    WaveletAdam param_wise(b, WaveletAdamOptions(o).nonfinite("skip_param"));
    for (int t = 0; t < 4; ++t) {
      for (size_t i = 0; i < a.size(); ++i) {
        const at::Tensor g = at::randn(a[i].sizes());
        set_grad(a[i], g), set_grad(b[i], g);
      }
      step_wise.step(), param_wise.step();
    }
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(at::equal(a[i].detach(), b[i].detach())) << "parameter " << i;
      EXPECT_TRUE(state_of(step_wise, a[i]) == state_of(param_wise, b[i])) << "state " << i;
    }
  }
}

// A first step skipped under "skip_param": the fresh state kept (step 0, zero moments) counts it
// and the next step is an ordinary first step.
TEST(WaveletAdam, SkipParamOnAFirstStepKeepsAZeroState) {
  at::manual_seed(6);
  at::Tensor p = make_param({8, 32});
  at::Tensor q = p.detach().clone().requires_grad_(true);
  WaveletAdam opt({p}, WaveletAdamOptions(0.01).nonfinite("skip_param"));
  WaveletAdam fresh({q}, WaveletAdamOptions(0.01));
  const at::Tensor start = p.detach().clone();
  p.mutable_grad() = at::full({8, 32}, std::numeric_limits<double>::infinity(), at::kDouble);
  opt.step();
  EXPECT_TRUE(at::equal(p.detach(), start));
  EXPECT_EQ(state_of(opt, p).step(), 0);
  EXPECT_EQ(opt.skipped_steps(p), 1);
  const at::Tensor g = at::randn({8, 32}, at::kDouble);
  set_grad(p, g), set_grad(q, g);
  opt.step(), fresh.step();
  EXPECT_TRUE(at::equal(p.detach(), q.detach()));
  EXPECT_EQ(state_of(opt, p).step(), 1);
}

TEST(WaveletAdam, NonFiniteOptionIsChecked) {
  at::Tensor p = make_param({8, 32});
  try {
    WaveletAdam opt({p}, WaveletAdamOptions(0.01).nonfinite("skip"));
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("invalid nonfinite 'skip'; valid values are skip_step"),
              std::string::npos)
        << e.what();
  }
}

TEST(WaveletAdam, CorrectBiasOffUsesThePlainLearningRate) {
  at::Tensor p = make_param({3});
  at::Tensor expected = p.detach().clone();
  WaveletAdam opt({p}, WaveletAdamOptions(0.1).correct_bias(false));
  const at::Tensor g = at::randn({3}, at::kDouble);
  set_grad(p, g);
  opt.step();
  expected -= 0.1 * (0.1 * g) / (at::sqrt(0.001 * g * g) + 1e-6);
  EXPECT_LE(max_abs_diff(p.detach(), expected), 1e-15);
}

}  // namespace
