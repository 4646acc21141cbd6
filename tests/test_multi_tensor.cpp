// The multi-tensor step (src/kernels/shared/multi_tensor.h, the CUDA kernels' bodies) run on the
// host over the same grid the GPU runs (multi_tensor_emulate.h), against the readable reference
// (WaveletAdamOptions::fused(false)): the device code tested on machines without a GPU.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "../src/optim/device_steps.h"
#include "bound_expect.h"
#include "float_bound.h"
#include "gwt/gwt.h"
#include "kernels/shared/multi_tensor.h"
#include "kernels/shared/multi_tensor_emulate.h"
#include "optim/common.h"  // kind_of
#include "test_util.h"

namespace {

namespace mt = gwt::kernels::mt;
using gwt::WaveletAdam;
using gwt::WaveletAdamOptions;

struct Spec {
  std::vector<int64_t> shape;
  int64_t level = 2;
  std::string transform = "1d";
  at::ScalarType param = at::kDouble;
  bool bf16_state = false;
  std::string nonfinite = "skip_step";
  std::string wavelet = "haar";  // any other: the general rows
  std::string boundary = "zero";
  double threshold = 0;
};

at::ScalarType math_of(at::ScalarType param) {
  return param == at::kDouble ? at::kDouble : at::kFloat;
}

using gwt::optim_detail::kind_of;

WaveletAdamOptions options_of(const Spec& s) {
  return WaveletAdamOptions(0.02)
      .weight_decay(0.1)
      .scale(0.5)
      .level(s.level)
      .transform(s.transform)
      .nonfinite(s.nonfinite)
      .wavelet(s.wavelet)
      .boundary(s.boundary)
      .threshold(s.threshold)
      .fused(false);
}

// One tensor of the emulated step, in memory of its own as a device would hold it: parameter,
// gradient, moments, the limiter's saved norm (-1: none yet) and the counters.
struct Emulated {
  at::Tensor p, g, m, v, norm, counts, kept;
  mt::TensorMeta meta;
  mt::GroupKey key;
  bool general = false;
  std::shared_ptr<gwt::Wavelet> wavelet;  // general: the filters args points to
  gwt::kernels::WaveletAdamArgs args;     // general: what Planner::add_general takes
};

Emulated make_emulated(const at::Tensor& init, const Spec& s, bool wavelet) {
  const WaveletAdamOptions o = options_of(s);
  Emulated e;
  e.p = init.to(s.param).contiguous();
  e.g = at::zeros_like(e.p);
  mt::TensorMeta& t = e.meta;
  std::vector<int64_t> state_shape = init.sizes().vec();
  e.general = wavelet && s.wavelet != "haar";
  if (e.general) {
    e.wavelet = std::make_shared<gwt::Wavelet>(s.wavelet);
    auto& a = e.args;
    a.n = t.n = init.size(-1);
    a.rows = t.rows = init.numel() / t.n;
    a.level = s.level;
    a.boundary = gwt::boundary_mode_from_string(s.boundary);
    a.approx_len = t.approx_len = gwt::approx_len(a.n, *e.wavelet, s.level, a.boundary);
    a.dec_lo = e.wavelet->dec_lo().data(), a.dec_hi = e.wavelet->dec_hi().data();
    a.filter_length = e.wavelet->length();
    a.coeff_len = gwt::kernels::wavelet_workspace_len(a.n, a.filter_length, a.level, a.boundary);
    a.threshold = s.threshold;
    std::tie(a.beta1, a.beta2) = o.betas();
    a.eps = o.eps(), a.decay = o.lr() * o.weight_decay();
    state_shape.back() = a.approx_len;
    e.kept = at::zeros({a.rows}, at::kLong);
    if (s.threshold > 0) t.kept_per_row = e.kept.data_ptr<int64_t>();
  } else if (wavelet) {
    t.n = init.size(-1);
    t.rows = init.numel() / t.n;
    t.two_d = s.transform == "2d";
    if (t.two_d) t.height = init.size(-2);
    mt::complete_haar_meta(t, s.level);
    state_shape.back() = t.approx_len;
    if (t.two_d) state_shape[state_shape.size() - 2] = t.block_rows;
  } else {
    t.kind = mt::Kind::dense;
    t.n = init.numel();
    t.rows = 1;
  }
  const at::ScalarType state = s.bf16_state ? at::kBFloat16 : math_of(s.param);
  e.m = at::zeros(state_shape, state);
  e.v = at::zeros(state_shape, state);
  e.norm = at::full({}, -1.0, math_of(s.param));
  e.counts = at::zeros({2}, at::kLong);
  t.param = e.p.data_ptr(), t.grad = e.g.data_ptr();
  t.exp_avg = e.m.data_ptr(), t.exp_avg_sq = e.v.data_ptr();
  t.norm = e.norm.data_ptr(), t.counts = e.counts.data_ptr<int64_t>();
  std::tie(t.beta1, t.beta2) = o.betas();
  t.eps = o.eps(), t.lr = o.lr(), t.weight_decay = o.weight_decay(), t.scale = o.scale();
  t.gamma = o.norm_growth_limit();
  t.correct_bias = o.correct_bias();
  t.skip_param = o.nonfinite() == "skip_param";
  e.key = {kind_of(s.param), kind_of(state), s.param == at::kDouble};
  return e;
}

// The tensors of `specs` stepped together through the emulated kernels and, unless told not to,
// by the float64 reference (one WaveletAdam, one group per tensor, so whole-step skips agree).
struct StepRun {
  std::vector<Spec> specs;
  std::vector<at::Tensor> exact;  // the reference's float64 parameters
  std::unique_ptr<WaveletAdam> reference;
  std::vector<Emulated> emulated;
  mt::StepFlags flags{};
  int64_t chunk_values;
  int64_t launches = 0;

  StepRun(std::vector<Spec> s, const std::vector<at::Tensor>& inits, int64_t chunk,
          bool with_reference)
      : specs(std::move(s)), chunk_values(chunk) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (size_t i = 0; i < specs.size(); ++i) {
      exact.push_back(inits[i].clone().requires_grad_(true));
      auto o = std::make_unique<WaveletAdamOptions>(options_of(specs[i]));
      groups.emplace_back(std::vector<at::Tensor>{exact.back()}, std::move(o));
    }
    reference = std::make_unique<WaveletAdam>(groups, WaveletAdamOptions(0.02));
    for (size_t i = 0; i < specs.size(); ++i)
      emulated.push_back(make_emulated(inits[i], specs[i], reference->is_wavelet_param(exact[i])));
    if (!with_reference) reference.reset();
  }

  void step(const std::vector<at::Tensor>& grads) {
    if (reference) {
      for (size_t i = 0; i < specs.size(); ++i) exact[i].mutable_grad() = grads[i];
      reference->step();
    }
    mt::Planner planner(chunk_values);
    for (size_t i = 0; i < specs.size(); ++i) {
      emulated[i].g.copy_(grads[i]);
      if (emulated[i].general)
        planner.add_general(emulated[i].key, emulated[i].meta, emulated[i].args);
      else
        planner.add(emulated[i].key, emulated[i].meta);
    }
    launches = planner.launches();
    mt::emulate_step(planner.groups(), &flags);
  }
};

// Shapes, levels and transforms of the mixed sets, cycled through: Haar 1-D at levels 1 to 4 with
// rows that are and are not whole blocks, 3-D, 2-D at levels 1 to 3 with partial blocks at the
// edges, and dense parameters (1-D, and level 0).
std::vector<Spec> mixed_specs(size_t count, const std::vector<at::ScalarType>& dtypes,
                              bool with_dense, bool with_general = false) {
  // General wavelets, every mode, levels 1 to 3 (a row per block on the GPU).
  const std::vector<Spec> general = {
      {{6, 45}, 2, "1d", at::kDouble, false, "skip_step", "db2"},
      {{4, 50}, 3, "1d", at::kDouble, false, "skip_step", "sym3", "periodization"},
      {{3, 2, 41}, 1, "1d", at::kDouble, false, "skip_step", "coif1", "symmetric"}};
  std::vector<Spec> kinds = {
      {{16, 64}, 2},     {{5, 37}, 1},        {{3, 11, 33}, 3},       {{7, 130}, 4},
      {{8, 8}, 2, "2d"}, {{24, 40}, 3, "2d"}, {{2, 13, 21}, 1, "2d"}, {{6, 40}, 2},
      {{33}, 2},         {{9, 10}, 0}};
  if (with_general) kinds.insert(kinds.end(), general.begin(), general.end());
  std::vector<Spec> out;
  for (size_t i = 0; out.size() < count; ++i) {
    Spec s = kinds[i % kinds.size()];
    if (!with_dense && (s.shape.size() == 1 || s.level == 0)) continue;
    s.param = dtypes[i % dtypes.size()];
    s.bf16_state = s.param != at::kDouble && (i / dtypes.size()) % 2 == 1;
    out.push_back(s);
  }
  return out;
}

std::vector<at::Tensor> inits_of(const std::vector<Spec>& specs, int64_t seed) {
  at::manual_seed(seed);
  std::vector<at::Tensor> out;
  for (const Spec& s : specs)
    out.push_back(at::randn(s.shape, at::kDouble).to(s.param).to(at::kDouble));
  return out;
}

// Step t's gradients (one-sign rows, growing so that the limiter binds: float_bound.h), rounded
// to each tensor's dtype.
std::vector<std::vector<at::Tensor>> gradients_of(const std::vector<Spec>& specs, int steps,
                                                  int64_t seed) {
  std::vector<std::vector<at::Tensor>> by_step(static_cast<size_t>(steps));
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto g =
        gwt_test::well_conditioned_gradients(specs[i].shape, steps, seed + static_cast<int64_t>(i),
                                             specs[i].param, specs[i].transform == "2d");
    for (int t = 0; t < steps; ++t)
      by_step[static_cast<size_t>(t)].push_back(g[static_cast<size_t>(t)]);
  }
  return by_step;
}

// Float64: each wavelet tensor's emulated step and the reference lie within the data's rounding
// bound of the exact result (float_bound.h with u = 2^-53), so within twice it of each other
// whatever order either sums in; the bound is held to 1e-11 of the parameters (one-sign rows),
// so a wrong term fails it. Dense tensors round the reference's operations one by one in the same
// order: a few units in the last place of |p| and of the step per step, far below 1e-12 of |p|.
TEST(MultiTensor, StepsOf1To500TensorsMatchTheReferenceInFloat64) {
  for (size_t count : {1, 7, 56, 500}) {
    SCOPED_TRACE(std::to_string(count) + " tensors");
    std::vector<Spec> specs = mixed_specs(count, {at::kDouble}, true, true);
    if (count >= 7) specs[3].shape = {300, 512};  // 300 chunks of 512 values: more than a block
    const auto inits = inits_of(specs, 40);
    StepRun run(specs, inits, 512, true);
    std::vector<gwt_test::RoundingBound> bounds;
    for (size_t i = 0; i < specs.size(); ++i)
      bounds.emplace_back(specs[i].shape, options_of(specs[i]), at::kDouble, at::kDouble);
    int t = 0;
    for (const auto& grads : gradients_of(specs, 4, 41)) {
      run.step(grads);
      ++t;
      for (size_t i = 0; i < specs.size(); ++i) {
        SCOPED_TRACE("tensor " + std::to_string(i) + " step " + std::to_string(t));
        const at::Tensor exact = run.exact[i].detach();
        EXPECT_EQ(run.emulated[i].counts[mt::k_steps].item<int64_t>(), t);
        if (run.emulated[i].meta.kind == mt::Kind::dense) {
          EXPECT_LE(gwt_test::rel_error(run.emulated[i].p, exact), 1e-12);
          continue;
        }
        bounds[i].step(grads[i], exact);
        EXPECT_TRUE(gwt_test::float64_pair_holds(run.emulated[i].p, exact, bounds[i], 1e-11))
            << "worst error " << gwt_test::max_abs_diff(run.emulated[i].p, exact);
      }
    }
    EXPECT_EQ(run.flags.skipped_steps, 0);
  }
}

// Float32, bfloat16 and float16 parameters with float32 or bfloat16 moments, in one step of four
// groups: each within its rounding bound of the float64 reference (the bounds of
// tests/test_fused.cpp's CUDA check: 1e-4 of |p| in float32, 0.01 float16, 0.05 bfloat16, 0.1
// with bfloat16 moments).
TEST(MultiTensor, ReducedPrecisionStaysWithinTheRoundingBound) {
  const std::vector<Spec> specs =
      mixed_specs(56, {at::kFloat, at::kBFloat16, at::kHalf}, false, true);
  const auto inits = inits_of(specs, 42);
  StepRun run(specs, inits, 2048, true);
  std::vector<gwt_test::RoundingBound> bounds;
  for (const Spec& s : specs)
    bounds.emplace_back(s.shape, options_of(s), s.param, s.bf16_state ? at::kBFloat16 : at::kFloat);
  for (const auto& grads : gradients_of(specs, 4, 43)) {
    run.step(grads);
    // Three per group: (f32|bf16|f16 parameters) x (f32|bf16 moments), Haar and general apart.
    std::set<std::tuple<int, int, bool>> groups;
    for (const Emulated& e : run.emulated)
      groups.insert(
          {static_cast<int>(e.key.param_kind), static_cast<int>(e.key.state_kind), e.general});
    EXPECT_EQ(groups.size(), 12u);
    EXPECT_EQ(run.launches, 3 * static_cast<int64_t>(groups.size()));
    for (size_t i = 0; i < specs.size(); ++i) {
      const Spec& s = specs[i];
      bounds[i].step(grads[i], run.exact[i].detach());
      const double max_relative = s.bf16_state            ? 0.1
                                  : s.param == at::kFloat ? 1e-4
                                  : s.param == at::kHalf  ? 0.01
                                                          : 0.05;
      gwt_test::expect_within_bound(run.emulated[i].p, run.exact[i].detach(), bounds[i],
                                    max_relative, c10::str("tensor ", i, " ", s.param));
    }
  }
}

// A tensor's chunks, their sums and the finalize's sum depend on the tensor alone: stepped with 55
// others of mixed types, or alone in its launch, it ends with the same bits.
TEST(MultiTensor, ATensorsBitsDoNotDependOnTheTensorsBesideIt) {
  const std::vector<Spec> specs =
      mixed_specs(56, {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}, true, true);
  const auto inits = inits_of(specs, 44);
  const auto grads = gradients_of(specs, 3, 45);
  StepRun together(specs, inits, 256, false);
  for (const auto& g : grads) together.step(g);
  for (size_t i = 0; i < specs.size(); ++i) {
    StepRun alone({specs[i]}, {inits[i]}, 256, false);
    for (const auto& g : grads) alone.step({g[i]});
    const Emulated &a = alone.emulated[0], &b = together.emulated[i];
    EXPECT_TRUE(at::equal(a.p, b.p) && at::equal(a.m, b.m) && at::equal(a.v, b.v) &&
                at::equal(a.norm, b.norm) && at::equal(a.counts, b.counts))
        << "tensor " << i;
  }
}

// Three launches per group of types, whatever the number of tensors.
TEST(MultiTensor, LaunchesDoNotGrowWithTheTensorCount) {
  for (size_t count : {7, 56, 500, 5000}) {
    const std::vector<Spec> specs =
        mixed_specs(count, {at::kFloat, at::kBFloat16, at::kDouble}, true);
    mt::Planner planner;
    std::vector<Emulated> tensors;
    for (const Spec& s : specs) {
      tensors.push_back(
          make_emulated(at::zeros(s.shape, at::kDouble), s, s.shape.size() > 1 && s.level > 0));
      planner.add(tensors.back().key, tensors.back().meta);
    }
    // float32 and bfloat16 parameters with float32 or bfloat16 moments, and float64.
    EXPECT_EQ(planner.groups().size(), 5u) << count << " tensors";
    EXPECT_EQ(planner.launches(), 15) << count << " tensors";
  }
}

// A non-finite gradient in a "skip_step" tensor skips the whole step on every tensor; one in a
// "skip_param" tensor skips that tensor alone (its skip count, and the optimizer's, advance); the
// counts and every value equal the reference's, and later steps go on as the reference's do.
TEST(MultiTensor, NonFiniteGradientsSkipAsTheReferenceDoes) {
  std::vector<Spec> specs = mixed_specs(7, {at::kDouble}, true);
  for (size_t i = 0; i < specs.size(); i += 2) specs[i].nonfinite = "skip_param";
  const auto inits = inits_of(specs, 46);
  StepRun run(specs, inits, 512, true);
  auto grads = gradients_of(specs, 5, 47);
  grads[1][2] = grads[1][2].clone();
  grads[1][2].view(-1)[3] = NAN;  // step 2: tensor 2 ("skip_param") alone is skipped
  grads[2][3] = grads[2][3].clone();
  grads[2][3].view(-1)[0] = INFINITY;  // step 3: tensor 3 ("skip_step"): nothing steps
  for (size_t step = 0; step < grads.size(); ++step) {
    run.step(grads[step]);
    for (size_t i = 0; i < specs.size(); ++i) {
      SCOPED_TRACE(c10::str("step ", step + 1, " tensor ", i));
      EXPECT_EQ(run.emulated[i].counts[mt::k_skipped].item<int64_t>(),
                run.reference->skipped_steps(run.exact[i]));
      EXPECT_LE(gwt_test::rel_error(run.emulated[i].p, run.exact[i].detach()), 1e-10);
    }
    EXPECT_EQ(run.flags.skipped_steps, run.reference->skipped_steps());
  }
  EXPECT_EQ(run.flags.skipped_steps, 2);
  EXPECT_EQ(run.emulated[2].counts[mt::k_steps].item<int64_t>(), 3);
  EXPECT_EQ(run.emulated[0].counts[mt::k_steps].item<int64_t>(), 4);
}

// WaveletAdam's own step through the device path (device_steps.h: counts, skip counts and
// norms kept with the kernels, read back when asked), here with the kernels emulated on the host,
// against the same optimizer on the CPU path: the same parameters (float64: within the rounding
// bound's 1e-10 of |p| on one-sign rows, as above), the same skip counts and step counts, and a
// checkpoint of the device run that a CPU run resumes from. A step on the other path between
// device steps (the counts go back to the host and return) changes nothing either.
TEST(MultiTensor, WaveletAdamOnTheDevicePathMatchesTheHostPath) {
  struct Emulation {
    explicit Emulation(bool on) { gwt::optim_detail::emulate_device_steps_on_cpu(on); }
    ~Emulation() { gwt::optim_detail::emulate_device_steps_on_cpu(false); }
  };
  std::vector<Spec> specs = mixed_specs(7, {at::kDouble}, true);
  // A general wavelet with a threshold: its kept-detail counts come back from the device too.
  specs.push_back({{6, 45}, 2, "1d", at::kDouble, false, "skip_step", "db2", "zero", 0.4});
  const auto inits = inits_of(specs, 48);
  auto make = [&](std::vector<at::Tensor>& params) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (size_t i = 0; i < specs.size(); ++i) {
      params.push_back(inits[i].clone().requires_grad_(true));
      auto o = options_of(specs[i]).fused(true).nonfinite(i % 2 == 0 ? "skip_param" : "skip_step");
      groups.emplace_back(std::vector<at::Tensor>{params.back()},
                          std::make_unique<WaveletAdamOptions>(o));
    }
    return std::make_unique<WaveletAdam>(groups, WaveletAdamOptions(0.02));
  };
  std::vector<at::Tensor> dev_params, host_params;
  auto device = make(dev_params), host = make(host_params);
  auto grads = gradients_of(specs, 8, 49);
  grads[1][2].view(-1)[1] = NAN;       // step 2: tensor 2 ("skip_param") alone
  grads[0][4].view(-1)[2] = NAN;       // step 1: tensor 4 ("skip_param") skips its first step
  grads[3][1].view(-1)[0] = INFINITY;  // step 4: tensor 1 ("skip_step"): the whole step
  auto expect_same = [&](const std::vector<at::Tensor>& a, const WaveletAdam& a_opt,
                         const std::string& what) {
    for (size_t i = 0; i < specs.size(); ++i) {
      EXPECT_LE(gwt_test::rel_error(a[i].detach(), host_params[i].detach()), 1e-10)
          << what << " tensor " << i;
      EXPECT_EQ(a_opt.skipped_steps(a[i]), host->skipped_steps(host_params[i])) << what << i;
    }
    EXPECT_EQ(a_opt.skipped_steps(), host->skipped_steps()) << what;
    EXPECT_EQ(a_opt.kept_details(), host->kept_details()) << what;
    EXPECT_GT(a_opt.kept_details().first, 0) << what;
  };
  for (size_t t = 0; t < 6; ++t) {
    for (size_t i = 0; i < specs.size(); ++i) {
      dev_params[i].mutable_grad() = grads[t][i].clone();
      host_params[i].mutable_grad() = grads[t][i].clone();
    }
    host->step();
    const Emulation on(t != 2);  // step 3 on the host path
    device->step();
  }
  expect_same(dev_params, *device, "after 6 steps");
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& a = static_cast<const gwt::WaveletAdamParamState&>(
        *device->state().at(dev_params[i].unsafeGetTensorImpl()));
    const auto& b = static_cast<const gwt::WaveletAdamParamState&>(
        *host->state().at(host_params[i].unsafeGetTensorImpl()));
    EXPECT_EQ(a.step(), b.step()) << "tensor " << i;
    EXPECT_EQ(a.norm().defined(), b.norm().defined()) << "tensor " << i;
  }
  // The device run's checkpoint, resumed on the CPU path.
  std::stringstream saved;
  {
    torch::serialize::OutputArchive archive;
    device->save(archive);
    archive.save_to(saved);
  }
  std::vector<at::Tensor> resumed_params;
  auto resumed = make(resumed_params);
  for (size_t i = 0; i < specs.size(); ++i)
    resumed_params[i].detach().copy_(dev_params[i].detach());
  {
    torch::serialize::InputArchive archive;
    archive.load_from(saved);
    resumed->load(archive);
  }
  for (size_t t = 6; t < 8; ++t) {
    for (size_t i = 0; i < specs.size(); ++i) {
      resumed_params[i].mutable_grad() = grads[t][i].clone();
      host_params[i].mutable_grad() = grads[t][i].clone();
    }
    host->step();
    resumed->step();
  }
  expect_same(resumed_params, *resumed, "resumed");
}

}  // namespace
