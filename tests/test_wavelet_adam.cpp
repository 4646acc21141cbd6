// gwt::WaveletAdam against the GWT authors' optimizer and against the rule of
// docs/algorithm.md#the-update (and the dense path) written out in plain ATen ops here.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/serialize.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "gwt/gwt.h"
#include "test_util.h"

namespace {

using gwt::WaveletAdam;
using gwt::WaveletAdamOptions;
using gwt::WaveletAdamParamState;
using gwt_test::max_abs_diff;

std::string temp_file(const std::string& name) {
  return ::testing::TempDir() + "gwt_" + name + "_" + std::to_string(::getpid()) + ".pt";
}

at::Tensor make_param(at::IntArrayRef shape, at::ScalarType dtype = at::kDouble) {
  return at::randn(shape, at::TensorOptions().dtype(dtype)).requires_grad_(true);
}

void set_grad(const at::Tensor& p, const at::Tensor& g) {
  p.mutable_grad() = g.to(p.scalar_type()).clone();
}

const WaveletAdamParamState& state_of(WaveletAdam& opt, const at::Tensor& p) {
  return static_cast<const WaveletAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

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

// ---------------------------------------------------------------------------------------------
// torch::optim behaviour: groups, schedulers, closures, save/load, memory report
// ---------------------------------------------------------------------------------------------

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

// Trains `steps` steps with seeded gradients on a two-group optimizer.
void train(WaveletAdam& opt, const std::vector<at::Tensor>& params, int steps, int64_t seed) {
  at::manual_seed(seed);
  for (int t = 0; t < steps; ++t) {
    for (const auto& p : params) set_grad(p, at::randn(p.sizes(), at::kDouble) * (1 + t));
    opt.step();
  }
}

std::vector<torch::optim::OptimizerParamGroup> two_groups(const std::vector<at::Tensor>& params) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0], params[1]},
                      std::make_unique<WaveletAdamOptions>(
                          WaveletAdamOptions(0.01).wavelet("db2").level(2).scale(0.25)));
  groups.emplace_back(
      std::vector<at::Tensor>{params[2]},
      std::make_unique<WaveletAdamOptions>(WaveletAdamOptions(0.003).level(0).weight_decay(0.1)));
  return groups;
}

std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

TEST(WaveletAdam, SaveLoadContinuesBitIdentically) {
  at::manual_seed(12);
  const std::vector<at::Tensor> params = {make_param({8, 40}), make_param({3, 6, 17}),
                                          make_param({9})};
  const std::vector<at::Tensor> copy = clone_params(params);
  WaveletAdam uninterrupted(two_groups(params));
  train(uninterrupted, params, 5, 100);
  train(uninterrupted, params, 5, 200);

  WaveletAdam first(two_groups(copy));
  train(first, copy, 5, 100);
  const std::string path = temp_file("saveload");
  torch::save(first, path);
  // A fresh optimizer, with different options that the checkpoint must replace.
  const std::vector<at::Tensor> resumed = clone_params(copy);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{resumed[0], resumed[1]});
  groups.emplace_back(std::vector<at::Tensor>{resumed[2]});
  WaveletAdam second(std::move(groups), WaveletAdamOptions(0.5));
  torch::load(second, path);
  std::remove(path.c_str());
  EXPECT_EQ(second.group_options(0), first.group_options(0));
  EXPECT_EQ(second.group_options(1), first.group_options(1));
  for (size_t i = 0; i < resumed.size(); ++i)
    EXPECT_TRUE(state_of(second, resumed[i]) == state_of(first, copy[i])) << "param " << i;
  train(second, resumed, 5, 200);
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(at::equal(resumed[i], params[i])) << "param " << i;
}

// A checkpoint saved before a parameter's first step (it had no gradient yet) loads: that parameter
// stays without state and the others get theirs, and training then goes on bit-identically to an
// optimizer that was never saved. A parameter with no elements is saved and loaded too (its
// digest covers only its shape).
TEST(WaveletAdam, SaveLoadBeforeAParametersFirstStep) {
  at::manual_seed(31);
  const std::vector<at::Tensor> params = {make_param({8, 40}), make_param({6, 16}),
                                          make_param({0, 16})};
  const std::vector<at::Tensor> copy = clone_params(params);
  WaveletAdam uninterrupted(params, WaveletAdamOptions(0.01));
  WaveletAdam first(copy, WaveletAdamOptions(0.01));
  train(uninterrupted, {params[0]}, 2, 300);
  train(first, {copy[0]}, 2, 300);
  ASSERT_EQ(first.state_bytes(copy[1]), 0);
  const std::string path = temp_file("before_first_step");
  torch::save(first, path);
  const std::vector<at::Tensor> resumed = clone_params(copy);
  WaveletAdam second(resumed, WaveletAdamOptions(0.5));
  torch::load(second, path);
  std::remove(path.c_str());
  EXPECT_TRUE(state_of(second, resumed[0]) == state_of(first, copy[0]));
  EXPECT_EQ(second.state_bytes(resumed[1]), 0);
  EXPECT_EQ(second.state_bytes(resumed[2]), 0);
  train(uninterrupted, {params[0], params[1]}, 3, 400);
  train(second, {resumed[0], resumed[1]}, 3, 400);
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(at::equal(resumed[i], params[i])) << "param " << i;
}

// Parameters without elements step, in every path and both nonfinite modes: nothing to update,
// their step counts advance, and the others step as they would alone. A [0, n] parameter whose
// rows hold whole Haar blocks was given to the CPU kernel as one row of 0 elements, which it
// refused with an internal assert (found by fuzz_step once it drew "skip_param", 2026-12-06).
TEST(WaveletAdam, ParametersWithoutElementsStep) {
  for (const std::string mode : {"skip_step", "skip_param"})
    for (const bool fused : {true, false})
      for (const at::ScalarType dtype : {at::kFloat, at::kHalf})
        for (const std::string transform : {"1d", "2d"}) {
          SCOPED_TRACE(mode + (fused ? " fused " : " reference ") + c10::toString(dtype) + " " +
                       transform);
          at::manual_seed(37);
          const std::vector<at::Tensor> empty = {make_param({0, 16}, dtype),
                                                 make_param({2, 0, 8}, dtype),
                                                 make_param({5, 0}, dtype), make_param({0}, dtype)};
          at::Tensor full = make_param({4, 32}, dtype);
          at::Tensor alone = full.detach().clone().requires_grad_(true);
          std::vector<at::Tensor> params = empty;
          params.push_back(full);
          const auto o =
              WaveletAdamOptions(0.01).level(2).fused(fused).nonfinite(mode).transform(transform);
          WaveletAdam opt(params, o);
          WaveletAdam single({alone}, o);
          for (int t = 0; t < 2; ++t) {
            for (const at::Tensor& p : empty) set_grad(p, at::zeros_like(p));
            const at::Tensor g = at::randn({4, 32}).to(dtype);
            set_grad(full, g), set_grad(alone, g);
            ASSERT_NO_THROW(opt.step());
            single.step();
          }
          for (const at::Tensor& p : empty) EXPECT_EQ(state_of(opt, p).step(), 2);
          EXPECT_TRUE(at::equal(full, alone));
          EXPECT_EQ(opt.skipped_steps(), 0);
        }
}

// `in` reads what `out` wrote, as a checkpoint file would give it back.
void reopen(torch::serialize::OutputArchive& out, torch::serialize::InputArchive& in) {
  std::ostringstream bytes;
  out.save_to(bytes);
  std::istringstream stream(bytes.str());
  in.load_from(stream);
}

// Options saved before `nonfinite` existed (every key but that one) load with the behaviour those
// checkpoints had, "skip_step", and every other option as saved.
TEST(WaveletAdam, OptionsSavedBeforeNonfiniteExistedLoadAsSkipStep) {
  const auto saved = WaveletAdamOptions(0.02)
                         .betas({0.8, 0.99})
                         .eps(1e-7)
                         .weight_decay(0.1)
                         .wavelet("db2")
                         .level(3)
                         .boundary("periodization")
                         .scale(0.5)
                         .norm_growth_limit(1.05)
                         .correct_bias(false)
                         .dim(0)
                         .fused(false)
                         .state_dtype("bfloat16")
                         .threshold(0.25)
                         .threshold_mode("hard")
                         .min_size(16);
  torch::serialize::OutputArchive out;
  out.write("lr", c10::IValue(saved.lr()));
  out.write("beta1", c10::IValue(std::get<0>(saved.betas())));
  out.write("beta2", c10::IValue(std::get<1>(saved.betas())));
  out.write("eps", c10::IValue(saved.eps()));
  out.write("weight_decay", c10::IValue(saved.weight_decay()));
  out.write("wavelet", c10::IValue(saved.wavelet()));
  out.write("level", c10::IValue(saved.level()));
  out.write("boundary", c10::IValue(saved.boundary()));
  out.write("scale", c10::IValue(saved.scale()));
  out.write("norm_growth_limit", c10::IValue(saved.norm_growth_limit()));
  out.write("correct_bias", c10::IValue(saved.correct_bias()));
  out.write("dim", c10::IValue(saved.dim()));
  out.write("fused", c10::IValue(saved.fused()));
  out.write("state_dtype", c10::IValue(saved.state_dtype()));
  out.write("transform", c10::IValue(saved.transform()));
  out.write("threshold", c10::IValue(saved.threshold()));
  out.write("threshold_mode", c10::IValue(saved.threshold_mode()));
  out.write("min_size", c10::IValue(saved.min_size()));
  torch::serialize::InputArchive in;
  reopen(out, in);
  WaveletAdamOptions loaded = WaveletAdamOptions(1.0).nonfinite("skip_param");
  loaded.serialize(in);
  EXPECT_EQ(loaded.nonfinite(), "skip_step");
  EXPECT_EQ(loaded, WaveletAdamOptions(saved).nonfinite("skip_step"));
  EXPECT_FALSE(loaded == WaveletAdamOptions(saved).nonfinite("skip_param"));  // == sees nonfinite
}

// A saved parameter state without one of its tensors is an error that names the tensor.
TEST(WaveletAdam, SavedStateWithoutATensorNamesIt) {
  for (const std::string drop : {"exp_avg", "exp_avg_sq", "norm"}) {
    SCOPED_TRACE(drop);
    torch::serialize::OutputArchive out;
    out.write("step", c10::IValue(int64_t{3}));
    if (drop != "exp_avg") out.write("exp_avg", at::zeros({2}));
    if (drop != "exp_avg_sq") out.write("exp_avg_sq", at::zeros({2}));
    out.write("has_norm", c10::IValue(true));
    if (drop != "norm") out.write("norm", at::ones({}));
    torch::serialize::InputArchive in;
    reopen(out, in);
    WaveletAdamParamState state;
    try {
      state.serialize(in);
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("has no " + drop), std::string::npos) << msg;
    }
  }
}

TEST(WaveletAdam, LoadRejectsParametersReorderedSinceTheSave) {
  // Two weights of one shape and dtype: shapes and positions alone cannot tell them apart; the
  // checkpoint's digest of each parameter's bytes does, when the model's weights are loaded first.
  at::manual_seed(14);
  const std::vector<at::Tensor> params = {make_param({8, 40}), make_param({8, 40})};
  WaveletAdam first(params);
  train(first, params, 2, 300);
  const std::string path = temp_file("reorder");
  torch::save(first, path);
  const std::vector<at::Tensor> same = clone_params(params);
  WaveletAdam swapped(std::vector<at::Tensor>{same[1], same[0]}, WaveletAdamOptions(0.5));
  try {
    torch::load(swapped, path);
    ADD_FAILURE() << "a checkpoint of reordered parameters loaded";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("reordered"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(swapped.state().empty());  // nothing loaded
  EXPECT_EQ(swapped.group_options(0).lr(), 0.5);
  WaveletAdam in_order(std::vector<at::Tensor>{same[0], same[1]}, WaveletAdamOptions(0.5));
  torch::load(in_order, path);  // the same model in its own order loads
  std::remove(path.c_str());
  EXPECT_TRUE(state_of(in_order, same[1]) == state_of(first, params[1]));
}

TEST(WaveletAdam, ReferenceLimiterDoesNotDependOnTheThreadCount) {
  // 64 x 4096 at level 2: the limiter's norm runs over 64 x 1024 approximation coefficients, more
  // than ATen's grain size (32768), so ATen's own reduction was split between the threads and
  // summed in another order with 1 and 2 threads. The rest of the reference step is elementwise
  // or a product of 2-tap windows, computed the same way whatever the split.
  const int threads = at::get_num_threads();
  std::vector<std::vector<at::Tensor>> runs;
  for (int n : {1, 2}) {
    at::set_num_threads(n);
    at::manual_seed(15);
    at::Tensor p = make_param({64, 4096});
    WaveletAdam opt({p}, WaveletAdamOptions(0.01).fused(false));
    std::vector<at::Tensor> run;
    for (int t = 0; t < 3; ++t) {
      set_grad(p, at::randn({64, 4096}, at::kDouble) * (1 + 4 * t));
      opt.step();
      run.push_back(state_of(opt, p).norm().clone());
    }
    run.push_back(p.detach().clone());
    runs.push_back(std::move(run));
  }
  at::set_num_threads(threads);
  for (size_t i = 0; i < runs[0].size(); ++i)
    EXPECT_TRUE(at::equal(runs[0][i], runs[1][i])) << "tensor " << i;
}

TEST(WaveletAdam, StateBytesReportsAQuarterAtTwoLevels) {
  at::Tensor w = make_param({512, 512}, at::kFloat), b = make_param({512}, at::kFloat);
  WaveletAdam opt({w, b}, WaveletAdamOptions().level(2));
  EXPECT_EQ(opt.state_bytes(), 0);
  set_grad(w, at::randn({512, 512})), set_grad(b, at::randn({512}));
  opt.step();
  const int64_t wavelet_bytes = 2 * 512 * 128 * 4 + 4;  // two quarter-size moments + limiter norm
  EXPECT_EQ(opt.state_bytes(w), wavelet_bytes);
  EXPECT_EQ(opt.state_bytes(b), 2 * 512 * 4);
  EXPECT_EQ(opt.state_bytes(), wavelet_bytes + 2 * 512 * 4);
}

TEST(WaveletAdam, HalfPrecisionParamsKeepFloatMoments) {
  at::manual_seed(13);
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    at::Tensor p = make_param({8, 64}, at::kFloat);
    at::Tensor low = p.detach().to(dtype).requires_grad_(true);
    at::Tensor full = low.detach().to(at::kFloat).requires_grad_(true);
    WaveletAdam opt_low({low}, WaveletAdamOptions(0.01)),
        opt_full({full}, WaveletAdamOptions(0.01));
    const at::Tensor g = at::randn({8, 64});
    set_grad(low, g), set_grad(full, g.to(dtype).to(at::kFloat));
    opt_low.step(), opt_full.step();
    EXPECT_EQ(low.scalar_type(), dtype);
    EXPECT_EQ(state_of(opt_low, low).exp_avg().scalar_type(), at::kFloat);
    // Bit for bit: both run the same float32 operations on the same float32 values (the low
    // parameter and gradient widen exactly). Every coefficient of [8, 64] at level 2 takes the
    // AVX2 body where the CPU has it (one instruction sequence for every type), else the plain
    // loops of the baseline build, which has no FMA to contract into.
    EXPECT_TRUE(at::equal(low, full.detach().to(dtype)));
  }
}

TEST(WaveletAdam, FusedReadsTheFloat32GradientOfALowPrecisionParamAsTheReferenceDoes) {
  // Each gradient is 1 + k/128 + 2^-12 (k in [0, 128)): 1 + k/128 is exact in bfloat16 and float16,
  // and 2^-12 is below half their ulp in [1, 2), so rounding the gradient to the parameter's type
  // (what the fused path did) lowers every value by exactly 2^-12, and the approximation
  // coefficients by a relative 2^-12 * sum(h) / (2 * sum|h|) >= 1e-4 (haar: 1.2e-4, db2: 1e-4).
  // Both paths read it as float32 now, and differ only by float32 rounding: every gradient is
  // positive in [1, 2), so each approximation coefficient is a sum of same-sign terms (haar) or
  // one with condition number below 2.6 (db2: one small negative tap, -0.13 against 1.54), a few
  // float32 roundings (u = 6e-8) apart: relative differences below 40u = 2.4e-6 in m and twice
  // that in v = A^2. The bounds 1e-5 (m) and 2e-5 (v) hold by construction and are 10x below the
  // rounding defect. The parameters are roundings to the low-precision type of float32 results
  // 1e-6 * lr apart, so they differ by at most one ulp of the parameter (<= 2^-7 |p| in bfloat16,
  // 2^-10 |p| in float16).
  at::manual_seed(16);
  struct Case {
    const char* wavelet;
    const char* boundary;
    int64_t level;
  };
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    for (const Case& c : {Case{"haar", "zero", 2}, Case{"db2", "periodization", 1}}) {
      SCOPED_TRACE(std::string(c.wavelet) + (dtype == at::kHalf ? " float16" : " bfloat16"));
      const at::Tensor start = 1 + at::randint(0, 128, {8, 64}, at::kFloat) / 128;  // exact
      const at::Tensor g =
          1 + at::randint(0, 128, {8, 64}, at::kFloat) / 128 + std::ldexp(1.0, -12);
      ASSERT_FALSE(at::equal(g.to(dtype).to(at::kFloat), g));
      std::vector<at::Tensor> params;
      std::vector<std::unique_ptr<WaveletAdam>> opts;
      for (bool fused : {true, false}) {
        params.push_back(start.to(dtype).requires_grad_(true));
        params.back().mutable_grad() = g.clone();  // float32, as autocast or a user may leave it
        opts.push_back(std::make_unique<WaveletAdam>(std::vector<at::Tensor>{params.back()},
                                                     WaveletAdamOptions(0.01)
                                                         .wavelet(c.wavelet)
                                                         .boundary(c.boundary)
                                                         .level(c.level)
                                                         .fused(fused)));
        EXPECT_EQ(opts.back()->is_fused_param(params.back()), fused);
        opts.back()->step();
      }
      const auto& fused = state_of(*opts[0], params[0]);
      const auto& reference = state_of(*opts[1], params[1]);
      auto max_rel = [](const at::Tensor& a, const at::Tensor& b) {
        return ((a - b).abs() / b.abs()).max().item<double>();
      };
      EXPECT_LE(max_rel(fused.exp_avg(), reference.exp_avg()), 1e-5);
      EXPECT_LE(max_rel(fused.exp_avg_sq(), reference.exp_avg_sq()), 2e-5);
      EXPECT_LE(max_rel(fused.norm(), reference.norm()), 1e-5);
      const double ulp = dtype == at::kBFloat16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
      const at::Tensor pf = params[0].detach().to(at::kFloat),
                       pr = params[1].detach().to(at::kFloat);
      EXPECT_TRUE(((pf - pr).abs() <= ulp * pr.abs()).all().item<bool>());
      EXPECT_FALSE(at::equal(pr, start.to(dtype).to(at::kFloat)));  // the step moved them
    }
  }
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
