// gwt::GaLoreAdam against the GaLore rule written out here in float64 ATen ops (also through its
// SVD fallback, with failures injected by a test-only hook), its errors and checkpoint checks; and
// gwt::nn::LowRankLinear against the Eckart-Young theorem.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/serialize.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "gwt/gwt.h"
#include "test_util.h"

namespace {

using gwt::GaLoreAdam;
using gwt::GaLoreAdamOptions;
using gwt::GaLoreAdamParamState;
using gwt_test::max_abs_diff;

const GaLoreAdamParamState& state_of(GaLoreAdam& opt, const at::Tensor& p) {
  return static_cast<const GaLoreAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}
GaLoreAdamParamState& mutable_state_of(GaLoreAdam& opt, const at::Tensor& p) {
  return static_cast<GaLoreAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

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

at::Tensor scalar(int64_t v) {
  return at::scalar_tensor(v, at::kLong);
}

// Parameters, every state tensor and step, and the counters: what must not change on an error.
std::vector<at::Tensor> snapshot(GaLoreAdam& opt, const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    out.push_back(p.detach().clone());
    auto it = opt.state().find(p.unsafeGetTensorImpl());
    out.push_back(scalar(it != opt.state().end()));
    if (it == opt.state().end()) continue;
    const auto& s = static_cast<const GaLoreAdamParamState&>(*it->second);
    out.push_back(scalar(s.step()));
    out.push_back(scalar(s.right()));
    out.push_back(s.exp_avg().clone());
    out.push_back(s.exp_avg_sq().clone());
    out.push_back(s.projector().defined() ? s.projector().clone() : scalar(-1));
  }
  out.push_back(scalar(opt.skipped_steps()));
  out.push_back(scalar(opt.svd_fallbacks()));
  out.push_back(scalar(static_cast<int64_t>(opt.param_groups().size())));
  return out;
}

void expect_same(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& expected) {
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(got[i].scalar_type() == expected[i].scalar_type() &&
                got[i].sizes() == expected[i].sizes() && at::equal(got[i], expected[i]))
        << "snapshot entry " << i << " changed";
}

std::string saved(const GaLoreAdam& opt) {
  std::ostringstream out;
  torch::save(opt, out);
  return out.str();
}
void load(GaLoreAdam& opt, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::load(opt, in);
}

// One GaLore step from zero state, in plain float64 ATen: SVD, project, Adam, project back.
at::Tensor expected_first_step(const at::Tensor& p0, const at::Tensor& g,
                               const std::string& proj_type, int64_t r, double lr, double scale,
                               double wd) {
  const int64_t m = g.size(0), n = g.size(1);
  const bool right = proj_type == "right" || (proj_type == "std" && m >= n) ||
                     (proj_type == "reverse_std" && m < n);
  const auto [u, s, vh] = at::linalg_svd(g, false);
  const at::Tensor P = right ? vh.narrow(0, 0, r) : u.narrow(1, 0, r);  // [r, n] or [m, r]
  const at::Tensor R = right ? at::matmul(g, P.t()) : at::matmul(P.t(), g);
  const at::Tensor m1 = 0.1 * R, v1 = 0.001 * R * R;
  const double step_size = lr * std::sqrt(1 - 0.999) / (1 - 0.9);
  const at::Tensor N = m1 / (at::sqrt(v1) + 1e-6);
  const at::Tensor back = (right ? at::matmul(N, P) : at::matmul(P, N)) * scale;
  at::Tensor p1 = p0 - step_size * back;
  return p1 - lr * wd * p1;
}

TEST(GaLoreAdam, OneStepEqualsTheFormulaForEveryProjType) {
  for (const std::string proj_type : {"std", "reverse_std", "left", "right"})
    for (const auto& shape : std::vector<std::vector<int64_t>>{{12, 7}, {6, 15}}) {
      SCOPED_TRACE(proj_type + " " + c10::str(at::IntArrayRef(shape)));
      at::manual_seed(3);
      at::Tensor p = at::randn(shape, at::kDouble).requires_grad_(true);
      const at::Tensor p0 = p.detach().clone();
      const at::Tensor g = at::randn(shape, at::kDouble);
      GaLoreAdam opt(
          {p}, GaLoreAdamOptions(0.01).rank(3).proj_type(proj_type).scale(0.5).weight_decay(0.1));
      ASSERT_TRUE(opt.is_projected_param(p));
      p.mutable_grad() = g.clone();
      opt.step();
      // Singular vectors are defined up to sign; the update (P^T P and P P^T products) is not.
      EXPECT_LE(max_abs_diff(p.detach(), expected_first_step(p0, g, proj_type, 3, 0.01, 0.5, 0.1)),
                1e-12);
      const bool right = state_of(opt, p).right();
      EXPECT_EQ(state_of(opt, p).exp_avg().sizes(),
                (right ? std::vector<int64_t>{shape[0], 3} : std::vector<int64_t>{3, shape[1]}));
    }
}

TEST(GaLoreAdam, ProjectorChangesOnlyEveryUpdateProjGapSteps) {
  at::manual_seed(4);
  at::Tensor p = at::randn({10, 8}, at::kDouble).requires_grad_(true);
  GaLoreAdam opt({p}, GaLoreAdamOptions(0.01).rank(2).update_proj_gap(3));
  std::vector<at::Tensor> projectors;
  for (int t = 0; t < 8; ++t) {
    p.mutable_grad() = at::randn({10, 8}, at::kDouble);
    opt.step();
    projectors.push_back(state_of(opt, p).projector().clone());
  }
  // Refreshed at steps 1, 4, 7 (iterations 0, 3, 6), kept in between.
  for (int t = 1; t < 8; ++t) {
    const bool refreshed = t % 3 == 0;
    EXPECT_EQ(!at::equal(projectors[t], projectors[t - 1]), refreshed) << "step " << t + 1;
  }
}

TEST(GaLoreAdam, SaveLoadContinuesBitIdentically) {
  for (const std::string svd : {"exact", "randomized"}) {
    at::manual_seed(5);
    const at::Tensor init_w = at::randn({16, 12}, at::kDouble),
                     init_b = at::randn({12}, at::kDouble);
    std::vector<at::Tensor> grads_w, grads_b;
    for (int t = 0; t < 10; ++t)
      grads_w.push_back(at::randn({16, 12}, at::kDouble)),
          grads_b.push_back(at::randn({12}, at::kDouble));
    const auto options = GaLoreAdamOptions(0.01).rank(4).update_proj_gap(3).svd(svd);
    auto run = [&](bool interrupt) {
      at::Tensor w = init_w.clone().requires_grad_(true), b = init_b.clone().requires_grad_(true);
      auto opt = std::make_unique<GaLoreAdam>(std::vector<at::Tensor>{w, b}, options);
      for (int t = 0; t < 10; ++t) {
        if (interrupt && t == 5) {
          const std::string path =
              ::testing::TempDir() + "gwt_galore_" + std::to_string(::getpid()) + ".pt";
          torch::save(*opt, path);
          opt = std::make_unique<GaLoreAdam>(std::vector<at::Tensor>{w, b}, GaLoreAdamOptions(0.5));
          torch::load(*opt, path);
          std::remove(path.c_str());
          EXPECT_EQ(opt->group_options(0), options);
        }
        w.mutable_grad() = grads_w[t].clone(), b.mutable_grad() = grads_b[t].clone();
        opt->step();
      }
      return std::make_pair(w.detach(), b.detach());
    };
    const auto straight = run(false), resumed = run(true);
    EXPECT_TRUE(at::equal(straight.first, resumed.first)) << svd;
    EXPECT_TRUE(at::equal(straight.second, resumed.second)) << svd;
  }
}

TEST(GaLoreAdam, IllConditionedGradientsDoNotProduceNaN) {
  at::manual_seed(6);
  at::Tensor p = at::randn({20, 10}).requires_grad_(true);
  GaLoreAdam opt({p}, GaLoreAdamOptions(0.01).rank(4).update_proj_gap(1));
  const at::Tensor u = at::randn({20, 1}), v = at::randn({1, 10});
  const std::vector<at::Tensor> grads = {
      at::zeros({20, 10}),                                      // no spectrum at all
      at::matmul(u, v),                                         // rank 1 < rank 4
      at::matmul(u, v) * 1e30f + at::randn({20, 10}) * 1e-30f,  // condition number ~1e60
      at::diag(at::logspace(-30, 30, 10)).repeat({2, 1}),       // singular values over 60 decades
  };
  for (const auto& g : grads) {
    p.mutable_grad() = g;
    opt.step();
    EXPECT_TRUE(at::isfinite(p).all().item<bool>());
    EXPECT_TRUE(at::isfinite(state_of(opt, p).projector()).all().item<bool>());
  }
  EXPECT_EQ(opt.skipped_steps(), 0);
}

TEST(GaLoreAdam, GradientThatProjectsToInfinitySkipsTheStep) {
  // Finite float32 values near the top of the range: the projection R = G Vr^T overflows. The step
  // is skipped like a non-finite gradient, with nothing changed (no new projector either).
  at::Tensor p = at::randn({12, 8}).requires_grad_(true);
  GaLoreAdam opt({p}, GaLoreAdamOptions(0.01).rank(3).update_proj_gap(1));
  p.mutable_grad() = at::randn({12, 8});
  opt.step();
  const at::Tensor before = p.detach().clone(), projector = state_of(opt, p).projector().clone();
  p.mutable_grad() = at::full({12, 8}, 3e38f);
  opt.step();
  EXPECT_EQ(opt.skipped_steps(), 1);
  EXPECT_TRUE(at::equal(p, before));
  EXPECT_TRUE(at::equal(state_of(opt, p).projector(), projector));
  EXPECT_EQ(state_of(opt, p).step(), 1);
  p.mutable_grad() = at::randn({12, 8});
  opt.step();
  EXPECT_TRUE(at::isfinite(p).all().item<bool>());
  EXPECT_EQ(state_of(opt, p).step(), 2);
}

TEST(GaLoreAdam, RandomizedSvdQualityAgainstTheExactOne) {
  // A rank-8 matrix plus noise: the randomized projector captures the same energy as the exact one.
  at::manual_seed(7);
  const at::Tensor g =
      at::matmul(at::randn({300, 8}), at::randn({8, 200})) + 0.01 * at::randn({300, 200});
  const auto [u, s, vh] = gwt::truncated_svd(g, 8, false);
  const auto [ur, sr, vhr] = gwt::truncated_svd(g, 8, true, 8, 2, 11);
  const double exact = at::matmul(g, vh.t()).norm().item<double>();
  const double randomized = at::matmul(g, vhr.t()).norm().item<double>();
  std::printf("randomized SVD, rank 8 of 300x200: captured energy %.6f of the exact SVD's\n",
              randomized / exact);
  EXPECT_GE(randomized / exact, 0.999);
  EXPECT_LE(max_abs_diff(sr, s) / s[0].item<double>(), 1e-3);
}

TEST(GaLoreAdam, DensePathGroupsAndScheduler) {
  at::Tensor w = at::randn({8, 6}, at::kDouble).requires_grad_(true),
             bias = at::randn({6}, at::kDouble).requires_grad_(true);
  at::Tensor thin =
      at::randn({8, 2}, at::kDouble).requires_grad_(true);  // rank 4 >= min dim: dense
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{w, thin},
                      std::make_unique<GaLoreAdamOptions>(GaLoreAdamOptions(0.02).rank(4)));
  groups.emplace_back(std::vector<at::Tensor>{bias},
                      std::make_unique<GaLoreAdamOptions>(GaLoreAdamOptions(0.005).rank(0)));
  GaLoreAdam opt(std::move(groups), GaLoreAdamOptions(0.5));
  EXPECT_EQ(opt.group_options(0).lr(), 0.02);
  EXPECT_EQ(opt.group_options(1).lr(), 0.005);
  EXPECT_TRUE(opt.is_projected_param(w));
  EXPECT_FALSE(opt.is_projected_param(thin));
  EXPECT_FALSE(opt.is_projected_param(bias));
  torch::optim::StepLR scheduler(opt, 1, 0.5);
  for (int t = 0; t < 2; ++t) {
    for (auto* p : {&w, &thin, &bias}) p->mutable_grad() = at::randn(p->sizes(), at::kDouble);
    opt.step();
    scheduler.step();
  }
  EXPECT_DOUBLE_EQ(opt.group_options(0).lr(), 0.01);
  EXPECT_EQ(state_of(opt, thin).exp_avg().sizes(), thin.sizes());
  EXPECT_EQ(opt.state_bytes(w), (8 * 4 * 2 + 4 * 6) * 8);  // moments [8, 4] and projector [4, 6]
}

TEST(GaLoreAdam, BadOptionsAreRejected) {
  const at::Tensor p = at::randn({4, 8}).requires_grad_(true);
  EXPECT_THROW(GaLoreAdam({p}, GaLoreAdamOptions().rank(-1)), c10::Error);
  EXPECT_THROW(GaLoreAdam({p}, GaLoreAdamOptions().update_proj_gap(0)), c10::Error);
  EXPECT_THROW(GaLoreAdam({p}, GaLoreAdamOptions().proj_type("diagonal")), c10::Error);
  EXPECT_THROW(GaLoreAdam({p}, GaLoreAdamOptions().svd("lanczos")), c10::Error);
  EXPECT_THROW(GaLoreAdam({p}, GaLoreAdamOptions(std::numeric_limits<double>::quiet_NaN())),
               c10::Error);
}

// ---------------------------------------------------------------------------------------------
// Errors a caller can cause: clear, and nothing changed
// ---------------------------------------------------------------------------------------------

TEST(GaLoreAdam, StateOfAnotherDtypeIsAClearErrorWithNothingChanged) {
  // The model converted in place after the first step (as Module::to(kDouble) does, through
  // set_data): the float32 moments and projector no longer fit. The step must fail before it
  // changes anything, for the projected and the dense path.
  for (const bool dense_only : {false, true}) {
    SCOPED_TRACE(dense_only ? "dense parameter only" : "projected and dense");
    at::manual_seed(12);
    at::Tensor w = at::randn({12, 8}).requires_grad_(true), b = at::randn({8}).requires_grad_(true);
    GaLoreAdam opt({w, b}, GaLoreAdamOptions(0.01).rank(3).update_proj_gap(1));
    w.mutable_grad() = at::randn({12, 8});
    b.mutable_grad() = at::randn({8});
    opt.step();
    w.set_data(w.detach().to(at::kDouble));
    b.set_data(b.detach().to(at::kDouble));
    w.mutable_grad() = dense_only ? at::Tensor() : at::randn({12, 8}, at::kDouble);
    b.mutable_grad() = at::randn({8}, at::kDouble);
    const auto before = snapshot(opt, {w, b});
    expect_error([&] { opt.step(); },
                 {"Double parameter", "Float", "save the optimizer and load it again"});
    expect_same(snapshot(opt, {w, b}), before);
    // The way out the message names: saved and loaded again, the state follows the parameters.
    load(opt, saved(opt));
    opt.step();
    EXPECT_EQ(state_of(opt, b).exp_avg().scalar_type(), at::kDouble);
    EXPECT_EQ(state_of(opt, b).step(), 2);
  }
}

TEST(GaLoreAdam, StateOnAnotherDeviceOrNotContiguousIsAClearErrorWithNothingChanged) {
  // No second device is needed for the device check: a moment on the meta device stands for one
  // left on the CPU by model->to(cuda) (the check compares devices, whatever they are).
  at::manual_seed(13);
  at::Tensor w = at::randn({12, 8}, at::kDouble).requires_grad_(true);
  GaLoreAdam opt({w}, GaLoreAdamOptions(0.01).rank(3).update_proj_gap(2));
  w.mutable_grad() = at::randn({12, 8}, at::kDouble);
  opt.step();
  w.mutable_grad() = at::randn({12, 8}, at::kDouble);
  auto& state = mutable_state_of(opt, w);
  const at::Tensor exp_avg = state.exp_avg();
  const auto before = snapshot(opt, {w});

  state.exp_avg(at::zeros_like(exp_avg, at::TensorOptions().device(at::kMeta)));
  expect_error([&] { opt.step(); }, {"exp_avg", "meta", "cpu"});
  state.exp_avg(exp_avg);
  expect_same(snapshot(opt, {w}), before);

  const at::Tensor projector = state.projector();
  state.projector(projector.t().contiguous().t());  // same values, column-major
  expect_error([&] { opt.step(); }, {"projector", "not contiguous"});
  state.projector(projector);
  expect_same(snapshot(opt, {w}), before);

  opt.step();
  EXPECT_EQ(state_of(opt, w).step(), 2);
}

TEST(GaLoreAdam, AddParamGroupKeepsAndChecksTheGroupsOptions) {
  // LibTorch's add_param_group merges a group's options with the defaults field by field only for
  // its own optimizers; a group of GaLoreAdamOptions added after construction kept the defaults.
  at::Tensor w = at::randn({8, 6}, at::kDouble).requires_grad_(true),
             v = at::randn({8, 6}, at::kDouble).requires_grad_(true),
             b = at::randn({6}, at::kDouble).requires_grad_(true);
  const auto defaults = GaLoreAdamOptions(0.5).rank(3);
  GaLoreAdam opt({w}, defaults);
  auto add = [&](std::vector<at::Tensor> params,
                 std::unique_ptr<torch::optim::OptimizerOptions> o) {
    opt.add_param_group(torch::optim::OptimizerParamGroup(std::move(params), std::move(o)));
  };
  const auto own = GaLoreAdamOptions(0.02).rank(2).weight_decay(0.1).proj_type("left");
  add({v}, std::make_unique<GaLoreAdamOptions>(own));
  add({b}, nullptr);  // no options: the defaults
  ASSERT_EQ(opt.param_groups().size(), 3u);
  EXPECT_EQ(opt.group_options(0), defaults);
  EXPECT_EQ(opt.group_options(1), own);
  EXPECT_EQ(opt.group_options(2), defaults);
  for (auto* p : {&w, &v, &b}) p->mutable_grad() = at::randn(p->sizes(), at::kDouble);
  opt.step();  // the group's options act: rank 2 from the left, moments [2, 6]
  EXPECT_EQ(state_of(opt, v).exp_avg().sizes(), (std::vector<int64_t>{2, 6}));
  EXPECT_FALSE(state_of(opt, v).right());

  // Rejected, with nothing changed.
  const at::Tensor x = at::randn({4}, at::kDouble).requires_grad_(true);
  const auto before = snapshot(opt, {w, v, b});
  expect_error([&] { add({x, v}, nullptr); }, {"already in parameter group 1"});
  expect_error([&] { add({x, x}, nullptr); }, {"more than once"});
  expect_error([&] { add({x}, std::make_unique<GaLoreAdamOptions>(GaLoreAdamOptions().rank(-1))); },
               {"invalid rank -1"});
  expect_error([&] { add({x}, std::make_unique<torch::optim::AdamOptions>(0.1)); },
               {"options of another optimizer", "gwt::GaLoreAdamOptions"});
  expect_error([&] { add({at::zeros({4}, at::kLong)}, nullptr); }, {"Long"});
  expect_same(snapshot(opt, {w, v, b}), before);
  EXPECT_EQ(opt.param_groups().size(), 3u);
}

// ---------------------------------------------------------------------------------------------
// Checkpoints: integrity, parameter order, the layout without digests
// ---------------------------------------------------------------------------------------------

// A trained optimizer over a projected [10, 6] weight and a dense [6] bias.
struct Trained {
  at::Tensor w, b;
  std::unique_ptr<GaLoreAdam> opt;
  Trained(uint64_t seed, double lr, int steps) {
    at::manual_seed(seed);
    w = at::randn({10, 6}, at::kDouble).requires_grad_(true);
    b = at::randn({6}, at::kDouble).requires_grad_(true);
    opt = std::make_unique<GaLoreAdam>(std::vector<at::Tensor>{w, b},
                                       GaLoreAdamOptions(lr).rank(2).update_proj_gap(2));
    for (int t = 0; t < steps; ++t) {
      w.mutable_grad() = at::randn({10, 6}, at::kDouble);
      b.mutable_grad() = at::randn({6}, at::kDouble);
      opt->step();
    }
  }
  std::vector<at::Tensor> snap() { return snapshot(*opt, {w, b}); }
};

TEST(GaLoreAdam, LoadRejectsCorruptStateWithNothingChanged) {
  struct Corruption {
    const char* name;
    bool on_weight;
    std::function<void(GaLoreAdamParamState&)> apply;
    std::vector<std::string> words;
  };
  auto set_first = [](const at::Tensor& t, double v) { t.view({-1})[0].fill_(v); };
  const std::vector<Corruption> corruptions = {
      {"NaN first moment",
       true,
       [&](auto& s) { set_first(s.exp_avg(), k_nan); },
       {"exp_avg", "NaN or an infinity"}},
      {"infinite first moment (dense)",
       false,
       [&](auto& s) { set_first(s.exp_avg(), -k_inf); },
       {"exp_avg", "NaN or an infinity"}},
      {"NaN second moment",
       true,
       [&](auto& s) { set_first(s.exp_avg_sq(), k_nan); },
       {"exp_avg_sq", "NaN or an infinity"}},
      {"negative second moment",
       true,
       [&](auto& s) { set_first(s.exp_avg_sq(), -1e-3); },
       {"exp_avg_sq", "negative"}},
      {"negative second moment (dense)",
       false,
       [&](auto& s) { set_first(s.exp_avg_sq(), -1); },
       {"exp_avg_sq", "negative"}},
      {"negative step", true, [&](auto& s) { s.step(-3); }, {"step for parameter 0 of group 0", "is -3", ">= 0"}},
      {"NaN projector",
       true,
       [&](auto& s) { set_first(s.projector(), k_nan); },
       {"projector", "NaN or an infinity"}},
      {"infinite projector",
       true,
       [&](auto& s) { set_first(s.projector(), k_inf); },
       {"projector", "NaN or an infinity"}},
  };
  for (const auto& c : corruptions) {
    SCOPED_TRACE(c.name);
    Trained source(20, 0.01, 3);
    c.apply(mutable_state_of(*source.opt, c.on_weight ? source.w : source.b));
    const std::string bytes = saved(*source.opt);
    // The same model (its weights loaded), but an optimizer in another state: lr 0.3, 1 step.
    Trained target(20, 0.3, 0);
    target.w.mutable_grad() = at::randn({10, 6}, at::kDouble);
    target.b.mutable_grad() = at::randn({6}, at::kDouble);
    target.opt->step();
    {
      at::NoGradGuard no_grad;
      target.w.copy_(source.w), target.b.copy_(source.b);
    }
    const auto before = target.snap();
    auto words = c.words;
    words.push_back(c.on_weight ? "parameter 0 of group 0" : "parameter 1 of group 0");
    expect_error([&] { load(*target.opt, bytes); }, words);
    expect_same(target.snap(), before);
    EXPECT_EQ(target.opt->group_options(0).lr(), 0.3);
  }
}

// The checkpoint layout of gwt.GaLoreAdam.v1 before parameter digests were added, written key by
// key: counters, then per group its options, its parameters' shapes and their states by position.
std::string digestless_checkpoint(const std::vector<at::Tensor>& params,
                                  const GaLoreAdamOptions& options,
                                  const std::vector<const GaLoreAdamParamState*>& states,
                                  int64_t skipped_steps, int64_t svd_fallbacks,
                                  const std::string& drop = "") {
  torch::serialize::OutputArchive archive;
  archive.write("format", c10::IValue(std::string("gwt.GaLoreAdam.v1")));
  archive.write("num_groups", c10::IValue(int64_t{1}));
  archive.write("skipped_steps", c10::IValue(skipped_steps));
  archive.write("svd_fallbacks", c10::IValue(svd_fallbacks));
  torch::serialize::OutputArchive group(archive.compilation_unit()),
      options_archive(archive.compilation_unit());
  options.serialize(options_archive);
  group.write("options", options_archive);
  group.write("num_params", c10::IValue(static_cast<int64_t>(params.size())));
  for (size_t j = 0; j < params.size(); ++j) {
    group.write("param_" + std::to_string(j) + "_shape", c10::IValue(params[j].sizes().vec()));
    torch::serialize::OutputArchive state(archive.compilation_unit());
    if (j == 0 && !drop.empty()) {  // the state key by key, as serialize writes it, less `drop`
      const GaLoreAdamParamState& s = *states[0];
      auto put = [&](const std::string& key, const c10::IValue& value) {
        if (key != drop) state.write(key, value);
      };
      put("step", s.step());
      put("exp_avg", s.exp_avg());
      put("exp_avg_sq", s.exp_avg_sq());
      put("has_projector", s.projector().defined());
      if (s.projector().defined()) put("projector", s.projector());
      put("right", s.right());
    } else {
      states[j]->serialize(state);
    }
    group.write("param_" + std::to_string(j), state);
  }
  archive.write("group_0", group);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

TEST(GaLoreAdam, CheckpointWithoutDigestsLoadsAndNegativeCountersAreRejected) {
  Trained source(21, 0.01, 3);
  const auto options = source.opt->group_options(0);
  const std::vector<const GaLoreAdamParamState*> states = {&state_of(*source.opt, source.w),
                                                           &state_of(*source.opt, source.b)};
  Trained target(22, 0.3, 1);  // other values: nothing identifies the parameters
  const auto before = target.snap();
  expect_error(
      [&] {
        load(*target.opt, digestless_checkpoint({source.w, source.b}, options, states, -1, 0));
      },
      {"skipped_steps -1", ">= 0"});
  expect_error(
      [&] {
        load(*target.opt, digestless_checkpoint({source.w, source.b}, options, states, 0, -2));
      },
      {"svd_fallbacks -2", ">= 0"});
  expect_same(target.snap(), before);

  // The old layout loads, and then steps exactly like the optimizer it was written from.
  load(*target.opt, digestless_checkpoint({source.w, source.b}, options, states, 4, 1));
  EXPECT_EQ(target.opt->skipped_steps(), 4);
  EXPECT_EQ(target.opt->svd_fallbacks(), 1);
  EXPECT_EQ(target.opt->group_options(0), options);
  {
    at::NoGradGuard no_grad;
    target.w.copy_(source.w), target.b.copy_(source.b);
  }
  for (int t = 0; t < 3; ++t) {
    const at::Tensor gw = at::randn({10, 6}, at::kDouble), gb = at::randn({6}, at::kDouble);
    source.w.mutable_grad() = gw.clone(), target.w.mutable_grad() = gw.clone();
    source.b.mutable_grad() = gb.clone(), target.b.mutable_grad() = gb.clone();
    source.opt->step();
    target.opt->step();
  }
  EXPECT_TRUE(at::equal(source.w, target.w));
  EXPECT_TRUE(at::equal(source.b, target.b));
}

// A checkpoint whose parameter state lacks one of its tensors names it, and changes nothing.
TEST(GaLoreAdam, CheckpointStateWithoutATensorIsAClearErrorWithNothingChanged) {
  Trained source(23, 0.01, 3);
  const std::vector<const GaLoreAdamParamState*> states = {&state_of(*source.opt, source.w),
                                                           &state_of(*source.opt, source.b)};
  ASSERT_TRUE(states[0]->projector().defined());
  for (const std::string key : {"exp_avg", "exp_avg_sq", "projector"}) {
    SCOPED_TRACE(key);
    Trained target(24, 0.3, 1);
    const auto before = target.snap();
    expect_error(
        [&] {
          load(*target.opt, digestless_checkpoint({source.w, source.b},
                                                  source.opt->group_options(0), states, 0, 0, key));
        },
        {"has no " + key});
    expect_same(target.snap(), before);
    EXPECT_EQ(target.opt->group_options(0).lr(), 0.3);
  }
}

// step(closure) runs the closure with gradients enabled and returns its loss; state_bytes() is the
// sum over the parameters; asking whether a tensor that is not a parameter is projected is an
// error naming the call.
TEST(GaLoreAdam, ClosureTotalAndATensorThatIsNotAParameter) {
  Trained t(25, 0.01, 0);
  bool grad_mode = false;
  const at::Tensor loss = t.opt->step([&] {
    grad_mode = at::GradMode::is_enabled();
    t.w.mutable_grad() = at::randn({10, 6}, at::kDouble);
    t.b.mutable_grad() = at::randn({6}, at::kDouble);
    return at::scalar_tensor(2.5, at::kDouble);
  });
  EXPECT_TRUE(grad_mode);
  EXPECT_EQ(loss.item<double>(), 2.5);
  EXPECT_EQ(state_of(*t.opt, t.w).step(), 1);
  EXPECT_GT(t.opt->state_bytes(t.w), 0);
  EXPECT_GT(t.opt->state_bytes(t.b), 0);
  EXPECT_EQ(t.opt->state_bytes(), t.opt->state_bytes(t.w) + t.opt->state_bytes(t.b));
  expect_error(
      [&] {
        t.opt->is_projected_param(at::zeros({10, 6}, at::kDouble));
      },
      {"is_projected_param", "not a parameter of this optimizer"});
}

TEST(GaLoreAdam, LoadDetectsParametersReorderedSinceTheSave) {
  // Two weights of one shape: positions and shapes alone cannot tell them apart. The checkpoint
  // holds a digest of each parameter's bytes; loaded into the same model (its weights loaded, so
  // the values are as saved) with the parameters in another order or group, it is an error.
  at::manual_seed(23);
  const auto options = GaLoreAdamOptions(0.01).rank(2);
  auto leaf = [](const at::Tensor& t) { return t.detach().clone().requires_grad_(true); };
  const at::Tensor a = leaf(at::randn({10, 6}, at::kDouble)),
                   b = leaf(at::randn({10, 6}, at::kDouble)), c = leaf(at::randn({6}, at::kDouble));
  auto make = [&](const std::vector<std::vector<at::Tensor>>& lists) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (const auto& l : lists)
      groups.emplace_back(l, std::make_unique<GaLoreAdamOptions>(options));
    return std::make_unique<GaLoreAdam>(std::move(groups), options);
  };
  auto train = [](GaLoreAdam& opt) {
    for (int t = 0; t < 2; ++t) {
      for (auto& group : opt.param_groups())
        for (auto& p : group.params()) p.mutable_grad() = at::randn(p.sizes(), at::kDouble);
      opt.step();
    }
  };
  for (const bool two_groups : {false, true}) {
    SCOPED_TRACE(two_groups ? "groups {a}, {b, c}" : "group {a, b, c}");
    const auto layout = two_groups ? std::vector<std::vector<at::Tensor>>{{a}, {b, c}}
                                   : std::vector<std::vector<at::Tensor>>{{a, b, c}};
    const auto swapped = two_groups ? std::vector<std::vector<at::Tensor>>{{b}, {a, c}}
                                    : std::vector<std::vector<at::Tensor>>{{b, a, c}};
    auto source = make(layout);
    train(*source);
    const std::string bytes = saved(*source);
    // Copies of the model's parameters, listed as in `lists` (which names a, b and c).
    auto copies = [&](const std::vector<std::vector<at::Tensor>>& lists, const at::Tensor& a2,
                      const at::Tensor& b2, const at::Tensor& c2) {
      std::vector<std::vector<at::Tensor>> out;
      for (const auto& l : lists) {
        out.emplace_back();
        for (const auto& t : l) out.back().push_back(t.is_same(a) ? a2 : t.is_same(b) ? b2 : c2);
      }
      return out;
    };
    // The model as saved (its weights loaded), its parameters listed in another order.
    const at::Tensor a2 = leaf(a), b2 = leaf(b), c2 = leaf(c);
    auto target = make(copies(swapped, a2, b2, c2));
    train(*target);
    {
      at::NoGradGuard no_grad;
      a2.copy_(a), b2.copy_(b), c2.copy_(c);
    }
    const auto before = snapshot(*target, {a2, b2, c2});
    expect_error([&] { load(*target, bytes); },
                 {"reordered", "parameter 0 of group 0",
                  two_groups ? "parameter 0 of group 1" : "parameter 1 of group 0"});
    expect_same(snapshot(*target, {a2, b2, c2}), before);

    // In the saved order it loads.
    const at::Tensor a3 = leaf(a), b3 = leaf(b), c3 = leaf(c);
    auto right_order = make(copies(layout, a3, b3, c3));
    load(*right_order, bytes);
    EXPECT_TRUE(at::equal(state_of(*right_order, a3).exp_avg(), state_of(*source, a).exp_avg()));
    EXPECT_TRUE(at::equal(state_of(*right_order, b3).exp_avg(), state_of(*source, b).exp_avg()));
    // A model whose values differ from the saved ones (freshly initialised, its weights not
    // loaded yet) cannot be checked: it loads, whatever the order (the documented limit).
    auto fresh = make(copies(swapped, leaf(a + 1), leaf(b + 1), leaf(c + 1)));
    load(*fresh, bytes);
  }
}

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

// ---------------------------------------------------------------------------------------------
// LowRankLinear
// ---------------------------------------------------------------------------------------------

TEST(LowRankLinear, FullRankReproducesTheDenseLayer) {
  at::manual_seed(8);
  torch::nn::Linear dense(24, 16);
  auto low = gwt::nn::factorize(dense, {16});
  const at::Tensor x = at::randn({5, 24});
  const at::Tensor expected = dense->forward(x), got = low->forward(x);
  // Both sides are float32 against the same exact product, not one run's luck against another's:
  // A B equals W up to the SVD's backward error (~16 float32 ulps of ||W||, i.e. ~1e-6 relative
  // for this 16 x 24 matrix), and each forward adds a sum of 24 rounded products (< 24 ulps of the
  // output's scale, ~3e-6 relative). 1e-5 of the output's scale is above the sum of both bounds
  // on any BLAS, thread count or instruction set.
  EXPECT_LE(max_abs_diff(got, expected) / expected.abs().max().item<double>(), 1e-5);
  EXPECT_EQ(low->dense_parameter_count(), 24 * 16 + 16);
  EXPECT_EQ(low->parameter_count(), 16 * 16 + 16 * 24 + 16);
}

TEST(LowRankLinear, SpectralErrorIsTheNextSingularValue) {
  at::manual_seed(9);
  torch::nn::Linear dense(40, 30);
  const at::Tensor s = at::linalg_svdvals(dense->weight.detach().to(at::kDouble));
  for (int64_t r : {1, 5, 12, 29}) {
    const auto low = gwt::nn::factorize(dense, {r});
    // s is the float64 spectrum; the error gwt reports comes from an SVD of the same float32
    // weight, so it differs from s[r] only by that SVD's backward error, a few float32 ulps of
    // ||W||_2 = s[0] (Weyl's inequality: singular values move by at most the perturbation's norm):
    // ~1e-7 s[0], ten times below the tolerance whatever LAPACK build runs.
    EXPECT_NEAR(low->reconstruction_error(), s[r].item<double>(), 1e-6 * s[0].item<double>())
        << "rank " << r;
    // The stored float32 factors reproduce it too (measured independently here): storing A and B
    // rounds each entry (relative 6e-8) and forming A B adds r products (< r ulps of s[0]), so
    // ||W - A B||_2 is within ~30 ulps of s[0] (~2e-6 s[0]) of s[r]; the tolerance is 1e-5 s[0].
    const double measured =
        at::linalg_matrix_norm(
            dense->weight.detach().to(at::kDouble) - low->weight().to(at::kDouble), 2)
            .item<double>();
    EXPECT_NEAR(measured, s[r].item<double>(), 1e-5 * s[0].item<double>()) << "rank " << r;
    EXPECT_EQ(low->rank(), r);
  }
  const auto randomized = gwt::nn::factorize(dense, {12, 0.0, true, 10, 3});
  // Randomized SVD with 10 extra columns and 3 power iterations: its error exceeds the best
  // rank-12 error s[12] by a factor that shrinks with each power iteration (Halko et al. 2011); the
  // 5% margin is a statement about the algorithm on this fixed seed's matrix, compared in float64
  // terms, not two float32 runs against each other.
  EXPECT_LE(randomized->reconstruction_error(), 1.05 * s[12].item<double>());
}

TEST(LowRankLinear, EnergyRulePicksTheSmallestSufficientRank) {
  // W = U diag(s) V^T with known singular values: energies 100, 25, 4, 1, 0.01 (sum 130.01).
  at::manual_seed(10);
  const at::Tensor s = at::tensor({10.0, 5.0, 2.0, 1.0, 0.1}, at::kDouble);
  const at::Tensor u = std::get<0>(at::linalg_qr(at::randn({8, 5}, at::kDouble)));
  const at::Tensor v = std::get<0>(at::linalg_qr(at::randn({6, 5}, at::kDouble)));
  torch::nn::Linear dense(6, 8);
  {
    at::NoGradGuard no_grad;
    dense->weight.copy_(at::matmul(u * s, v.t()));
  }
  EXPECT_EQ(gwt::nn::rank_for_energy(s, 100.0 / 130.01), 1);
  EXPECT_EQ(gwt::nn::rank_for_energy(s, 0.9), 2);    // 125 / 130.01 = 0.961
  EXPECT_EQ(gwt::nn::rank_for_energy(s, 0.97), 3);   // 129 / 130.01 = 0.992
  EXPECT_EQ(gwt::nn::rank_for_energy(s, 0.995), 4);  // 130 / 130.01 = 0.99992
  EXPECT_EQ(gwt::nn::rank_for_energy(s, 1.0), 5);
  EXPECT_EQ(gwt::nn::factorize(dense, {0, 0.97})->rank(), 3);
  EXPECT_THROW(gwt::nn::rank_for_energy(s, 1.5), c10::Error);
}

}  // namespace
