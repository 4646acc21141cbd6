// WaveletAdam's compression options: the 2-D transform on the LL subband, thresholding of the
// details, and min_size, against the rules written out here in plain float64 ATen ops.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "float_bound.h"
#include "gwt/gwt.h"
#include "test_util.h"

namespace {

using gwt::WaveletAdam;
using gwt::WaveletAdamOptions;
using gwt::WaveletAdamParamState;
using gwt_test::max_abs_diff;

const WaveletAdamParamState& state_of(WaveletAdam& opt, const at::Tensor& p) {
  return static_cast<const WaveletAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

struct Spec {
  at::Tensor m, v, norm;
  int64_t t = 0;
};

// The limiter and step of docs/algorithm.md#the-update, shared by both rules below.
double limiter(at::Tensor& N, Spec& s, double gamma) {
  if (gamma <= 0) return 1.0;
  const double norm = N.norm().item<double>();
  if (!s.norm.defined()) {
    s.norm = at::scalar_tensor(norm, at::kDouble);
    return 1.0;
  }
  const double lim = std::max(norm / (s.norm.item<double>() + 1e-8), gamma) / gamma;
  N = N / lim;
  s.norm = at::scalar_tensor(norm / lim, at::kDouble);
  return lim;
}

// Adam's moments on the approximation; returns sqrt(v) + eps.
at::Tensor moments(const at::Tensor& approx, Spec& s, const WaveletAdamOptions& o) {
  const auto [b1, b2] = o.betas();
  if (!s.m.defined()) s.m = at::zeros_like(approx), s.v = at::zeros_like(approx);
  s.t += 1;
  s.m = b1 * s.m + (1 - b1) * approx;
  s.v = b2 * s.v + (1 - b2) * approx * approx;
  return at::sqrt(s.v) + o.eps();
}

// p -= step_size * scale * U with the folded bias correction, then the decoupled decay.
void apply(at::Tensor& p, const at::Tensor& U, const Spec& s, const WaveletAdamOptions& o) {
  const auto [b1, b2] = o.betas();
  const double step_size = o.lr() * std::sqrt(1 - std::pow(b2, s.t)) / (1 - std::pow(b1, s.t));
  p = p - step_size * o.scale() * U;
  p = p - o.lr() * o.weight_decay() * p;
}

// The 2-D rule of the compression issue: moments on LL; each detail subband at level k divided by
// the LL denominator repeated 2^(L-k) times along both axes and cropped.
void spec_2d_step(at::Tensor& p, const at::Tensor& g, Spec& s, const WaveletAdamOptions& o) {
  const auto mode = gwt::boundary_mode_from_string(o.boundary());
  auto c = gwt::wavedec2(g, o.wavelet(), o.level(), mode);
  const at::Tensor denom = moments(c.approx, s, o);
  at::Tensor N = s.m / denom;
  const double lim = limiter(N, s, o.norm_growth_limit());
  at::Tensor d = denom;
  for (auto& level : c.details) {
    for (auto& D : level) {
      if (o.threshold() > 0) D = gwt::threshold(D, o.threshold(), o.threshold_mode());
      D = D / (d.slice(-2, 0, D.size(-2)).slice(-1, 0, D.size(-1)) * lim);
    }
    d = at::repeat_interleave(at::repeat_interleave(d, 2, -2), 2, -1);
  }
  c.approx = N;
  const at::Tensor U =
      gwt::waverec2(c, o.wavelet(), mode).slice(-2, 0, p.size(-2)).slice(-1, 0, p.size(-1));
  apply(p, U, s, o);
}

// The rule of docs/algorithm.md#the-update along the last dimension, with the details thresholded
// before normalisation.
void spec_1d_step(at::Tensor& p, const at::Tensor& g, Spec& s, const WaveletAdamOptions& o) {
  const auto mode = gwt::boundary_mode_from_string(o.boundary());
  auto c = gwt::wavedec(g, o.wavelet(), o.level(), -1, mode);
  const at::Tensor denom = moments(c.approx, s, o);
  at::Tensor N = s.m / denom;
  const double lim = limiter(N, s, o.norm_growth_limit());
  at::Tensor d = denom;
  for (auto& D : c.details) {
    D = gwt::threshold(D, o.threshold(), o.threshold_mode());
    D = D / (d.slice(-1, 0, D.size(-1)) * lim);
    d = at::repeat_interleave(d, 2, -1);
  }
  c.approx = N;
  const at::Tensor U = gwt::waverec(c, o.wavelet(), -1, mode).slice(-1, 0, p.size(-1));
  apply(p, U, s, o);
}

TEST(Compression, TwoDimensionalPathFollowsTheRule) {
  struct Case {
    std::string wavelet, boundary;
    int64_t level;
    std::vector<int64_t> shape;
    double threshold;
  };
  // Haar without a threshold takes the fused CPU kernel (2^L x 2^L blocks), the rest the reference.
  const std::vector<Case> cases = {
      {"haar", "zero", 2, {12, 20}, 0.0},          {"haar", "zero", 2, {3, 13, 22}, 0.0},
      {"haar", "periodization", 1, {16, 24}, 0.0}, {"db2", "periodization", 2, {16, 24}, 0.0},
      {"sym3", "symmetric", 1, {2, 13, 11}, 0.0},  {"haar", "zero", 3, {17, 33}, 0.3}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.wavelet + " " + c.boundary + " L=" + std::to_string(c.level));
    const auto o = WaveletAdamOptions(0.02)
                       .transform("2d")
                       .wavelet(c.wavelet)
                       .boundary(c.boundary)
                       .level(c.level)
                       .scale(0.5)
                       .weight_decay(0.05)
                       .threshold(c.threshold);
    at::manual_seed(31);
    at::Tensor p = at::randn(c.shape, at::kDouble).requires_grad_(true);
    at::Tensor expected = p.detach().clone();
    WaveletAdam opt({p}, o);
    EXPECT_EQ(opt.is_fused_param(p), c.wavelet == "haar" && c.threshold == 0);
    Spec spec;
    // One sign per matrix and step: no block or filter sum cancels, so 1e-10 does not rest on how
    // the kernel and the spec round a nearly cancelled sum the step divides by.
    int t = 0;
    for (const auto& g : gwt_test::well_conditioned_gradients(c.shape, 5, 31, at::kDouble, true)) {
      p.mutable_grad() = g.clone();
      opt.step();
      spec_2d_step(expected, g, spec, o);
      EXPECT_LE(max_abs_diff(p.detach(), expected), 1e-10) << "step " << t++;
    }
  }
}

TEST(Compression, TwoDimensionalStateIsAQuarterToTheLevel) {
  for (int64_t level : {1, 2, 3}) {
    at::Tensor p = at::randn({64, 64}).requires_grad_(true);
    WaveletAdam opt({p}, WaveletAdamOptions().transform("2d").level(level));
    p.mutable_grad() = at::randn({64, 64});
    opt.step();
    const auto& s = state_of(opt, p);
    EXPECT_EQ(s.exp_avg().numel() * (int64_t{1} << (2 * level)), p.numel()) << "level " << level;
    EXPECT_EQ(opt.state_bytes(p), 2 * p.numel() * 4 / (int64_t{1} << (2 * level)) + 4);
  }
}

TEST(Compression, ThresholdingFollowsTheRuleAndReportsWhatIsKept) {
  for (const std::string mode : {"soft", "hard"}) {
    const auto o =
        WaveletAdamOptions(0.02).wavelet("db2").level(2).threshold(0.8).threshold_mode(mode);
    at::manual_seed(32);
    at::Tensor p = at::randn({6, 40}, at::kDouble).requires_grad_(true);
    at::Tensor expected = p.detach().clone();
    WaveletAdam opt({p}, o);
    Spec spec;
    // One sign per row and step: no filter sum cancels (zero mode's edges aside), so 1e-12 does
    // not rest on how the kernel and the spec round a nearly cancelled sum the step divides by.
    // The magnitudes grow ([0.5, 1.5) times 1, 3, 5, 7), so the details straddle the threshold in
    // the interior too, not only at zero mode's edges.
    int t = 0;
    for (const auto& g : gwt_test::well_conditioned_gradients({6, 40}, 4, 32, at::kDouble)) {
      p.mutable_grad() = g.clone();
      opt.step();
      spec_1d_step(expected, g, spec, o);
      EXPECT_LE(max_abs_diff(p.detach(), expected), 1e-12) << mode << " step " << t++;
    }
    const auto& s = state_of(opt, p);
    const auto c = gwt::wavedec(at::randn({6, 40}, at::kDouble), "db2", 2);
    EXPECT_EQ(s.total_details(), 6 * (c.details[0].size(-1) + c.details[1].size(-1)));
    EXPECT_GT(s.kept_details(), 0);
    EXPECT_LT(s.kept_details(), s.total_details());  // |d| < 0.8 is common for these gradients
    EXPECT_EQ(opt.kept_details(), std::make_pair(s.kept_details(), s.total_details()));
  }
}

TEST(Compression, ThresholdZeroIsBitIdenticalToNone) {
  at::manual_seed(33);
  const at::Tensor init = at::randn({8, 32});
  at::Tensor a = init.clone().requires_grad_(true), b = init.clone().requires_grad_(true);
  WaveletAdam with({a}, WaveletAdamOptions(0.01).threshold(0.0)),
      without({b}, WaveletAdamOptions(0.01));
  for (int t = 0; t < 4; ++t) {
    const at::Tensor g = at::randn({8, 32});
    a.mutable_grad() = g.clone(), b.mutable_grad() = g.clone();
    with.step(), without.step();
  }
  EXPECT_TRUE(at::equal(a, b));
}

TEST(Compression, MinSizeSendsSmallMatricesToTheDensePath) {
  at::Tensor small = at::randn({16, 64}).requires_grad_(true),
             large = at::randn({32, 64}).requires_grad_(true);
  WaveletAdam opt({small, large}, WaveletAdamOptions().min_size(32));
  EXPECT_FALSE(opt.is_wavelet_param(small));
  EXPECT_TRUE(opt.is_wavelet_param(large));
  small.mutable_grad() = at::randn({16, 64}), large.mutable_grad() = at::randn({32, 64});
  opt.step();
  EXPECT_EQ(state_of(opt, small).exp_avg().sizes(), small.sizes());
  EXPECT_EQ(state_of(opt, large).exp_avg().sizes(), (std::vector<int64_t>{32, 16}));
}

TEST(Compression, BadCompressionOptionsAreRejected) {
  const at::Tensor p = at::randn({8, 8}).requires_grad_(true);
  EXPECT_THROW(WaveletAdam({p}, WaveletAdamOptions().transform("3d")), c10::Error);
  EXPECT_THROW(WaveletAdam({p}, WaveletAdamOptions().threshold(-0.1)), c10::Error);
  EXPECT_THROW(WaveletAdam({p}, WaveletAdamOptions().threshold_mode("garrote")), c10::Error);
  EXPECT_THROW(WaveletAdam({p}, WaveletAdamOptions().min_size(-1)), c10::Error);
}

TEST(ThresholdScheduler, LinearRampWithFloorAndCeiling) {
  at::Tensor a = at::randn({8, 16}).requires_grad_(true),
             b = at::randn({8, 16}).requires_grad_(true);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{a});
  groups.emplace_back(std::vector<at::Tensor>{b});
  WaveletAdam opt(std::move(groups));
  auto scheduler = gwt::ThresholdScheduler::linear_ramp(opt, 0.0, 1.0, 4, 0.1, 0.6);
  const std::vector<double> expected = {0.1, 0.25, 0.5,
                                        0.6, 0.6,  0.6};  // 0, .25, .5, .75 -> clamped
  for (size_t t = 0; t < expected.size(); ++t) {
    EXPECT_DOUBLE_EQ(opt.group_options(0).threshold(), expected[t]) << "call " << t;
    EXPECT_DOUBLE_EQ(opt.group_options(1).threshold(), expected[t]) << "call " << t;
    scheduler.step();
  }
}

TEST(ThresholdScheduler, PerGroupRuleAndSaveLoadKeepTheCurrentValues) {
  at::Tensor a = at::randn({8, 16}).requires_grad_(true),
             b = at::randn({8, 16}).requires_grad_(true);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{a},
                      std::make_unique<WaveletAdamOptions>(WaveletAdamOptions().threshold(0.2)));
  groups.emplace_back(std::vector<at::Tensor>{b},
                      std::make_unique<WaveletAdamOptions>(WaveletAdamOptions().threshold(0.4)));
  WaveletAdam opt(std::move(groups));
  gwt::ThresholdScheduler scheduler(opt,
                                    [](int64_t step, double base) { return base * (1 + step); });
  for (int t = 0; t < 3; ++t) {
    a.mutable_grad() = at::randn({8, 16}), b.mutable_grad() = at::randn({8, 16});
    opt.step();
    scheduler.step();
  }
  EXPECT_DOUBLE_EQ(opt.group_options(0).threshold(), 0.8);
  EXPECT_NEAR(opt.group_options(1).threshold(), 1.6, 1e-15);
  const std::string path = ::testing::TempDir() + "gwt_sched_" + std::to_string(::getpid()) + ".pt";
  torch::save(opt, path);
  std::vector<torch::optim::OptimizerParamGroup> fresh;
  fresh.emplace_back(std::vector<at::Tensor>{a});
  fresh.emplace_back(std::vector<at::Tensor>{b});
  WaveletAdam loaded(std::move(fresh));
  torch::load(loaded, path);
  std::remove(path.c_str());
  EXPECT_DOUBLE_EQ(loaded.group_options(0).threshold(), 0.8);
  EXPECT_NEAR(loaded.group_options(1).threshold(), 1.6, 1e-15);
}

// Expects `fn` to throw a c10::Error whose message contains `words`.
void expect_words(const std::function<void()>& fn, const std::string& words) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << words;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(words), std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST(ThresholdScheduler, ABadRuleValueChangesNoGroupAndDoesNotAdvance) {
  // apply() set the groups in order: a rule failing for group 1 had already changed group 0, and
  // step() had advanced step_count(). Now every value is checked before any is set.
  at::Tensor a = at::randn({8, 16}).requires_grad_(true),
             b = at::randn({8, 16}).requires_grad_(true);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{a},
                      std::make_unique<WaveletAdamOptions>(WaveletAdamOptions().threshold(0.2)));
  groups.emplace_back(std::vector<at::Tensor>{b},
                      std::make_unique<WaveletAdamOptions>(WaveletAdamOptions().threshold(0.4)));
  WaveletAdam opt(std::move(groups));
  gwt::ThresholdScheduler scheduler(opt, [](int64_t step, double base) {
    return step == 2 && base > 0.3 ? -1.0 : base + static_cast<double>(step);
  });
  scheduler.step();
  EXPECT_EQ(scheduler.step_count(), 1);
  EXPECT_DOUBLE_EQ(opt.group_options(0).threshold(), 1.2);
  try {
    scheduler.step();
    ADD_FAILURE() << "no error for a negative threshold";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("for group 1 at step 2"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_EQ(scheduler.step_count(), 1);
  EXPECT_DOUBLE_EQ(opt.group_options(0).threshold(), 1.2);
  EXPECT_DOUBLE_EQ(opt.group_options(1).threshold(), 1.4);
  // A rule that rejects the construction-time values: the constructor throws, nothing set.
  EXPECT_THROW(gwt::ThresholdScheduler(opt, [](int64_t, double) { return std::nan(""); }),
               c10::Error);
  EXPECT_DOUBLE_EQ(opt.group_options(0).threshold(), 1.2);
}

TEST(ThresholdScheduler, AGroupAddedLaterTakesItsThresholdAsItsBase) {
  // base_.at(i) threw std::out_of_range for a group added after the scheduler was made.
  at::Tensor a = at::randn({8, 16}).requires_grad_(true),
             b = at::randn({8, 16}).requires_grad_(true);
  WaveletAdam opt(std::vector<at::Tensor>{a}, WaveletAdamOptions().threshold(0.1));
  gwt::ThresholdScheduler scheduler(opt,
                                    [](int64_t step, double base) { return base * (1 + step); });
  opt.add_param_group(torch::optim::OptimizerParamGroup(
      {b}, std::make_unique<WaveletAdamOptions>(WaveletAdamOptions().threshold(0.5))));
  scheduler.step();
  EXPECT_DOUBLE_EQ(opt.group_options(0).threshold(), 0.2);
  EXPECT_DOUBLE_EQ(opt.group_options(1).threshold(), 1.0);
  scheduler.step();
  EXPECT_DOUBLE_EQ(opt.group_options(1).threshold(), 1.5);  // base 0.5 kept, not 1.0
}

TEST(CompressedGradient, BadThresholdAndOutOfRangeDimAreCleanErrors) {
  const at::Tensor g = at::randn({4, 32}, at::kDouble);
  // A NaN threshold meant "keep everything" (NaN > 0 is false); a negative one likewise.
  for (double bad : {-0.5, std::nan(""), std::numeric_limits<double>::infinity()}) {
    try {
      gwt::compress_gradient(g, "haar", 2, bad);
      ADD_FAILURE() << "no error for threshold " << bad;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("invalid threshold"),
                std::string::npos);
    }
  }
  // A CompressedGradient whose recorded dim does not fit its shape (hand-made or loaded from a
  // damaged archive): std::out_of_range escaped from shape.at(dim).
  auto c = gwt::compress_gradient(g, "haar", 2, 0.0);
  for (int64_t dim : {2, -3}) {
    auto bad = c;
    bad.dim = dim;
    try {
      gwt::decompress_gradient(bad);
      ADD_FAILURE() << "no error for dim " << dim;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("out of range for the recorded shape"),
                std::string::npos)
          << e.what_without_backtrace();
    }
  }
  auto empty = c;
  empty.shape.clear();
  EXPECT_THROW(gwt::decompress_gradient(empty), c10::Error);
  // Subbands that do not belong to the recorded shape (found by fuzz_compression: waverec then
  // returned a gradient of another shape than the one recorded).
  auto short_approx = c;
  short_approx.approx = c.approx.narrow(0, 0, 3).contiguous();
  expect_words([&] { gwt::decompress_gradient(short_approx); },
               "the approximation has shape [3, 8]");
  auto wrong_level = c;
  wrong_level.level = 3;
  expect_words([&] { gwt::decompress_gradient(wrong_level); }, "level 3 but 2 detail subbands");
  auto wrong_detail =
      gwt::compress_gradient(g, "haar", 2, 1.0, "hard", -1, gwt::BoundaryMode::zero, "bitmask");
  wrong_detail.detail_shapes[1] = {4, 8};
  expect_words([&] { gwt::decompress_gradient(wrong_detail); },
               "detail subband 1 has shape [4, 8]");
}

struct StackImpl : torch::nn::Module {
  StackImpl()
      : layers(register_module("layers", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(16, 4))) {
    for (int i = 0; i < 4; ++i) layers->push_back(torch::nn::Linear(16, 16));
  }
  torch::nn::ModuleList layers;
  torch::nn::Linear head;
};
TORCH_MODULE(Stack);

TEST(DepthGroups, LowerLayersLighterUpperLayersStronger) {
  Stack model;
  const auto groups = gwt::depth_param_groups(
      *model, WaveletAdamOptions(0.01), [](int64_t layer, int64_t layers, WaveletAdamOptions o) {
        return o.level(layer < layers / 2 ? 1 : 2).threshold(0.1 * layer);
      });
  WaveletAdam opt(groups);
  ASSERT_EQ(opt.param_groups().size(), 5u);  // four layers and the dense group
  for (int64_t layer = 0; layer < 4; ++layer) {
    const auto& weight = model->layers[layer]->as<torch::nn::LinearImpl>()->weight;
    for (size_t g = 0; g < 4; ++g)
      if (opt.param_groups()[g].params().front().is_same(weight)) {
        EXPECT_EQ(opt.group_options(g).level(), layer < 2 ? 1 : 2);
        EXPECT_DOUBLE_EQ(opt.group_options(g).threshold(), 0.1 * static_cast<double>(layer));
      }
  }
  EXPECT_EQ(opt.group_options(4).level(), 0);
  EXPECT_FALSE(opt.is_wavelet_param(model->head->weight));
}

// c written with torch::save and read back with torch::load.
gwt::CompressedGradient saved_and_loaded(const gwt::CompressedGradient& c) {
  const std::string path =
      ::testing::TempDir() + "gwt_compressed_" + std::to_string(::getpid()) + ".pt";
  torch::save(c, path);
  gwt::CompressedGradient loaded;
  torch::load(loaded, path);
  std::remove(path.c_str());
  return loaded;
}

TEST(CompressedGradient, RoundTripIsExactWithoutThresholdAndReportsItsError) {
  at::manual_seed(34);
  const at::Tensor g = at::randn({24, 40}, at::kDouble);
  const auto exact = gwt::compress_gradient(g, "db2", 2, 0.0);
  EXPECT_LE(max_abs_diff(gwt::decompress_gradient(exact), g), 1e-12);
  EXPECT_LE(exact.relative_error, 1e-14);
  EXPECT_EQ(exact.dense_bytes(), 24 * 40 * 8);

  const auto lossy = gwt::compress_gradient(g, "db2", 2, 1.0, "hard");
  const at::Tensor back = gwt::decompress_gradient(lossy);
  EXPECT_NEAR(lossy.relative_error, (back - g).norm().item<double>() / g.norm().item<double>(),
              1e-15);
  EXPECT_GT(lossy.relative_error, 0.0);
  EXPECT_LT(lossy.bytes(), exact.bytes());
  // Kept coefficients are exactly those with |d| >= 1 (PyWavelets' hard rule).
  const auto c = gwt::wavedec(g, "db2", 2);
  int64_t kept = 0;
  for (const auto& d : c.details) kept += (d.abs() >= 1.0).sum().item<int64_t>();
  EXPECT_EQ(lossy.detail_values[0].numel() + lossy.detail_values[1].numel(), kept);

  const gwt::CompressedGradient loaded = saved_and_loaded(lossy);
  EXPECT_TRUE(at::equal(gwt::decompress_gradient(loaded), back));
  EXPECT_EQ(loaded.bytes(), lossy.bytes());
  EXPECT_DOUBLE_EQ(loaded.relative_error, lossy.relative_error);
}

TEST(CompressedGradient, BitmaskAndIndexPositionsAgreeAndAutoPicksTheSmaller) {
  at::manual_seed(35);
  const at::Tensor g = at::randn({3, 20, 37}, at::kFloat);
  for (double threshold : {0.0, 0.5, 1.5, 3.5}) {
    SCOPED_TRACE("threshold " + std::to_string(threshold));
    const auto by_index = gwt::compress_gradient(g, "haar", 2, threshold, "soft", -1,
                                                 gwt::BoundaryMode::zero, "indices");
    const auto by_mask = gwt::compress_gradient(g, "haar", 2, threshold, "soft", -1,
                                                gwt::BoundaryMode::zero, "bitmask");
    const auto chosen = gwt::compress_gradient(g, "haar", 2, threshold, "soft");
    const at::Tensor back = gwt::decompress_gradient(by_index);
    EXPECT_TRUE(at::equal(gwt::decompress_gradient(by_mask), back));
    EXPECT_TRUE(at::equal(gwt::decompress_gradient(chosen), back));
    // Sizes from first principles: 4-byte values, plus 4-byte indices or 1 bit per coefficient.
    const int64_t approx_bytes = by_index.approx.numel() * 4;
    int64_t index_bytes = approx_bytes, mask_bytes = approx_bytes, best = approx_bytes;
    for (size_t k = 0; k < by_index.detail_shapes.size(); ++k) {
      int64_t coefficients = 1;
      for (int64_t s : by_index.detail_shapes[k]) coefficients *= s;
      const int64_t kept = by_index.detail_values[k].numel();
      index_bytes += 8 * kept;
      mask_bytes += 4 * kept + (coefficients + 7) / 8;
      best += 4 * kept + std::min(4 * kept, (coefficients + 7) / 8);
    }
    EXPECT_EQ(by_index.bytes(), index_bytes);
    EXPECT_EQ(by_mask.bytes(), mask_bytes);
    EXPECT_EQ(chosen.bytes(), best);

    const gwt::CompressedGradient loaded = saved_and_loaded(by_mask);
    EXPECT_TRUE(at::equal(gwt::decompress_gradient(loaded), back));
    EXPECT_EQ(loaded.bytes(), by_mask.bytes());
  }
  EXPECT_THROW(
      gwt::compress_gradient(g, "haar", 2, 0.0, "hard", -1, gwt::BoundaryMode::zero, "bits"),
      c10::Error);
  // A level with neither indices nor mask is refused, not written.
  auto broken =
      gwt::compress_gradient(g, "haar", 2, 3.5, "hard", -1, gwt::BoundaryMode::zero, "indices");
  broken.detail_indices[0] = at::Tensor();
  torch::serialize::OutputArchive archive;
  EXPECT_THROW(archive << broken, c10::Error);
  EXPECT_THROW(gwt::decompress_gradient(broken), c10::Error);
}

}  // namespace
