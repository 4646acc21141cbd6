// gwt::WaveletAdam's state as torch::optim users see it: save and load, the memory report, and the
// same steps whatever the thread count or the parameters' precision (the rule:
// test_wavelet_adam.cpp; groups, schedulers and closures: test_wavelet_adam_groups.cpp).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

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

}  // namespace
