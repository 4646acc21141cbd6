// FoamAdam's fused CPU kernels (src/kernels/cpu/foam_adam_cpu_impl.h and its AVX2 loops) against
// the readable ATen reference (FoamAdamOptions::fused(false)): both held to the rounding bound of
// the float64 run (tests/foam_bound.h), in float32, float16 and bfloat16 parameters and float32
// and bfloat16 moments; in float64, to each other. The golden trajectories run through both
// paths in test_foam.cpp.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "float_bound.h"  // well_conditioned_gradients
#include "foam_bound.h"
#include "foam_test_util.h"
#include "gwt/gwt.h"
#include "kernels/shared/multi_tensor.h"
#include "kernels/shared/multi_tensor_emulate.h"
#include "optim/common.h"        // kind_of
#include "optim/device_steps.h"  // emulate_device_steps_on_cpu

namespace {

using namespace gwt_test::foam;
using gwt_test::FoamRoundingBound;

struct FoamRun {
  at::Tensor param;
  std::unique_ptr<FoamAdam> opt;
  at::ScalarType grad_dtype;
};

FoamRun make_run(const at::Tensor& init, at::ScalarType dtype, const FoamAdamOptions& o,
                 at::ScalarType grad_dtype) {
  FoamRun r;
  r.param = init.to(dtype).clone().requires_grad_(true);
  r.opt = std::make_unique<FoamAdam>(std::vector<at::Tensor>{r.param}, o);
  r.grad_dtype = grad_dtype;
  return r;
}

void step(FoamRun& r, const at::Tensor& g) {
  r.param.mutable_grad() = g.to(r.grad_dtype).reshape(r.param.sizes());
  r.opt->step();
}

// Gradients for `shape` (a 0-dim parameter: those of one value) whose rows have one sign per step
// and magnitudes in [0.5, 1.5) x (1 + 2t), rounded to `dtype`, in float64.
std::vector<at::Tensor> gradients(at::IntArrayRef shape, int steps, int64_t seed,
                                  at::ScalarType dtype) {
  if (!shape.empty()) return gwt_test::well_conditioned_gradients(shape, steps, seed, dtype);
  auto out = gwt_test::well_conditioned_gradients({1}, steps, seed, dtype);
  for (auto& g : out) g = g.reshape({});
  return out;
}

// The fused and the reference run of one parameter in `dtype`, the float64 run, and the bound.
struct FoamRuns {
  FoamRun fused, reference, exact;
  FoamRoundingBound bound;
  FoamRuns(const at::Tensor& init, at::ScalarType dtype, const FoamAdamOptions& o,
           at::ScalarType state = at::kFloat, at::ScalarType grad_dtype = at::ScalarType::Undefined)
      : fused(make_run(init, dtype, with_state(o, state).fused(true), grad_of(dtype, grad_dtype))),
        reference(
            make_run(init, dtype, with_state(o, state).fused(false), grad_of(dtype, grad_dtype))),
        exact(make_run(init, at::kDouble, FoamAdamOptions(o).state_dtype("auto").fused(false),
                       at::kDouble)),
        bound(init.sizes(), o, dtype, dtype == at::kDouble ? at::kDouble : state) {}

  // One step of the three runs; each reduced one within the bound of the float64 run, and the
  // bound at most max_relative of the parameters' largest magnitude.
  void step_and_check(const at::Tensor& g, double max_relative, const std::string& what) {
    step(fused, g), step(reference, g), step(exact, g);
    bound.step(g, exact.param.detach());
    const at::Tensor b = bound.bound();
    for (const FoamRun* run : {&fused, &reference}) {
      const at::Tensor err = (run->param.detach().to(at::kDouble) - exact.param.detach()).abs();
      EXPECT_TRUE((err <= b).all().item<bool>())
          << what << (run == &fused ? " fused" : " reference") << ": worst error / bound "
          << (err / b).max().item<double>();
    }
    EXPECT_LE(b.max().item<double>(),
              max_relative * exact.param.detach().abs().max().item<double>())
        << what << ": the bound is too loose to mean anything";
    if (std::getenv("GWT_PRINT_BOUNDS") != nullptr)
      std::printf("%s: bound / |p| %.3g, worst fused error / bound %.3g\n", what.c_str(),
                  b.max().item<double>() / exact.param.detach().abs().max().item<double>(),
                  ((fused.param.detach().to(at::kDouble) - exact.param.detach()).abs() / b)
                      .max()
                      .item<double>());
  }

  // Float64: the fused and the reference run each within the bound (u = 2^-53) of the exact
  // result, so within twice it of each other.
  void step_and_check_pair(const at::Tensor& g, double max_relative, const std::string& what) {
    step(fused, g), step(reference, g);
    bound.step(g, reference.param.detach());
    const at::Tensor b = bound.bound();
    const at::Tensor err = (fused.param.detach() - reference.param.detach()).abs();
    EXPECT_TRUE((err <= 2 * b).all().item<bool>())
        << what << ": worst error / twice the bound " << (err / (2 * b)).max().item<double>();
    EXPECT_LE(b.max().item<double>(),
              max_relative * reference.param.detach().abs().max().item<double>())
        << what;
  }

 private:
  static FoamAdamOptions with_state(const FoamAdamOptions& o, at::ScalarType state) {
    return FoamAdamOptions(o).state_dtype(state == at::kBFloat16 ? "bfloat16" : "auto");
  }
  static at::ScalarType grad_of(at::ScalarType dtype, at::ScalarType grad) {
    return grad == at::ScalarType::Undefined ? dtype : grad;
  }
};

// Shapes that reach every loop: whole rows of whole blocks (one long row for the kernel), rows
// with a partial last block after groups of 8 whole blocks (the AVX2 loop, then the plain one),
// rows shorter than a block, 3-D, 1-D and 0-dim parameters.
const std::vector<std::vector<int64_t>> k_shapes = {{4, 64},    {3, 77}, {3, 13}, {5, 3},
                                                    {2, 3, 37}, {1000},  {}};

std::string name_of(at::IntArrayRef shape, int64_t level) {
  std::string s = "shape [";
  for (int64_t d : shape) s += std::to_string(d) + ",";
  return s + "] level " + std::to_string(level);
}

// Float32: the bound measured 2e-7 to 2e-6 of the parameters' largest magnitude over these runs
// (6 steps, lr 0.02); 1e-5 leaves room and still fails a wrong rule: rho^2 replaced by rho in the
// register loop exceeds the bound by 100x and more, a partial block divided by its own length
// too.
TEST(FoamFused, MatchesTheReferenceWithinTheRoundingBoundInFloat32) {
  const auto base = FoamAdamOptions(0.02).weight_decay(0.1).scale(0.25).res_scale(0.5);
  int64_t seed = 0;
  for (const auto& shape : k_shapes)
    for (int64_t level = 1; level <= 4; ++level) {
      at::manual_seed(++seed);
      const at::Tensor init = at::randn(shape, at::kDouble);
      FoamRuns runs(init, at::kFloat, FoamAdamOptions(base).level(level));
      EXPECT_TRUE(runs.fused.opt->is_fused_param(runs.fused.param));
      for (const auto& g : gradients(shape, 6, seed, at::kFloat))
        runs.step_and_check(g, 1e-5, name_of(shape, level));
    }
}

TEST(FoamFused, EveryOptionMatchesTheReferenceInFloat32) {
  const std::vector<std::pair<std::string, FoamAdamOptions>> variants = {
      {"defaults", FoamAdamOptions(0.02)},
      {"res_scale 0", FoamAdamOptions(0.02).res_scale(0)},
      {"res_scale 2, beta2 0.95, eps 1e-6",
       FoamAdamOptions(0.02).res_scale(2).betas({0.9, 0.95}).eps(1e-6)},
      {"no bias correction, decay", FoamAdamOptions(0.01).correct_bias(false).weight_decay(0.05)},
      {"negative scale", FoamAdamOptions(0.02).scale(-0.5)},
  };
  int64_t seed = 100;
  for (const auto& [what, o] : variants)
    for (int64_t level : {1, 2, 3}) {
      at::manual_seed(++seed);
      const at::Tensor init = at::randn({3, 77}, at::kDouble);
      FoamRuns runs(init, at::kFloat, FoamAdamOptions(o).level(level));
      for (const auto& g : gradients({3, 77}, 6, seed, at::kFloat))
        runs.step_and_check(g, 1e-5, what + ", level " + std::to_string(level));
    }
}

// Float64: the bound measured below 1e-14 of the parameters here; 1e-12 leaves room.
TEST(FoamFused, Float64KernelAndReferenceAgreeWithinTwiceTheBound) {
  int64_t seed = 200;
  for (const auto& shape : k_shapes)
    for (int64_t level : {1, 2, 4}) {
      at::manual_seed(++seed);
      const at::Tensor init = at::randn(shape, at::kDouble);
      FoamRuns runs(init, at::kDouble,
                    FoamAdamOptions(0.02).level(level).weight_decay(0.1).res_scale(0.5));
      EXPECT_TRUE(runs.fused.opt->is_fused_param(runs.fused.param));
      for (const auto& g : gradients(shape, 6, seed, at::kDouble))
        runs.step_and_check_pair(g, 1e-12, name_of(shape, level));
    }
}

// Float16 and bfloat16 parameters (gradients of their own dtype, or float32) and bfloat16 moments:
// the math is float32, the parameter and the moments are rounded on every store. Storing p
// dominates the bound (u_param |p| per step: 2^-11 and 2^-8); lr 0.1 makes each step's change
// larger than that, so a wrong update still fails. Measured bound / largest |p|: at most 4e-3
// (float16) and 3e-2 (bfloat16) after 6 steps.
TEST(FoamFused, LowPrecisionParametersAndBFloat16MomentsStayWithinTheBound) {
  struct Case {
    at::ScalarType param, state, grad;
    double max_relative;
  };
  const std::vector<Case> cases = {
      {at::kHalf, at::kFloat, at::kHalf, 1e-2},
      {at::kHalf, at::kFloat, at::kFloat, 1e-2},
      {at::kBFloat16, at::kFloat, at::kBFloat16, 6e-2},
      {at::kBFloat16, at::kBFloat16, at::kFloat, 6e-2},
      {at::kFloat, at::kBFloat16, at::kFloat, 6e-2},
  };
  int64_t seed = 300;
  for (const Case& c : cases)
    for (const auto& shape : std::vector<std::vector<int64_t>>{{4, 64}, {3, 77}})
      for (int64_t level : {1, 2, 3}) {
        at::manual_seed(++seed);
        const at::Tensor init = at::randn(shape, at::kDouble).to(c.param).to(at::kDouble);
        const auto o = FoamAdamOptions(0.1).level(level).res_scale(0.5).weight_decay(0.01);
        FoamRuns runs(init, c.param, o, c.state, c.grad);
        EXPECT_TRUE(runs.fused.opt->is_fused_param(runs.fused.param));
        const std::string what = std::string(c10::toString(c.param)) + " params, " +
                                 c10::toString(c.state) + " state, " + c10::toString(c.grad) +
                                 " grads, " + name_of(shape, level);
        // Gradients representable in the narrower of the parameter's and the gradient's dtype.
        const at::ScalarType narrow = c.grad == at::kFloat ? c.param : c.grad;
        for (const auto& g : gradients(shape, 6, seed, narrow))
          runs.step_and_check(g, c.max_relative, what);
      }
}

// Dense groups (level 0) take the dense Adam loop for float32 and float64 parameters.
TEST(FoamFused, DenseGroupsTakeTheDenseLoopWithinTheBound) {
  at::manual_seed(400);
  const at::Tensor init = at::randn({5, 40}, at::kDouble);
  FoamRuns runs(init, at::kFloat, FoamAdamOptions(0.02).level(0).weight_decay(0.1));
  EXPECT_TRUE(runs.fused.opt->is_fused_param(runs.fused.param));
  EXPECT_FALSE(runs.fused.opt->is_folded_param(runs.fused.param));
  for (const auto& g : gradients({5, 40}, 6, 400, at::kFloat))
    runs.step_and_check(g, 1e-5, "dense float32");
  FoamRuns f64(init, at::kDouble, FoamAdamOptions(0.02).level(0).weight_decay(0.1));
  for (const auto& g : gradients({5, 40}, 6, 401, at::kDouble))
    f64.step_and_check_pair(g, 1e-12, "dense float64");
}

// Groups of 8 blocks are the unit of work, whatever the number of threads: the same bits with one
// thread and with two, over rows with partial blocks and rows of whole ones.
TEST(FoamFused, ResultsDoNotDependOnTheThreadCount) {
  const int threads = at::get_num_threads();
  for (const auto& shape : std::vector<std::vector<int64_t>>{{64, 2050}, {32, 4096}})
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      at::manual_seed(500);
      const at::Tensor init = at::randn(shape, at::kDouble);
      const auto o = FoamAdamOptions(0.02).weight_decay(0.1).res_scale(0.5);
      FoamRun one = make_run(init, dtype, o, dtype), two = make_run(init, dtype, o, dtype);
      for (const auto& g : gradients(shape, 3, 501, dtype)) {
        at::set_num_threads(1);
        step(one, g);
        at::set_num_threads(2);
        step(two, g);
      }
      EXPECT_TRUE(at::equal(one.param, two.param)) << c10::toString(dtype);
      EXPECT_TRUE(at::equal(state_of(*one.opt, one.param).exp_avg_sq(),
                            state_of(*two.opt, two.param).exp_avg_sq()));
    }
  at::set_num_threads(threads);
}

// Which parameters a kernel takes (is_fused_param), and that the others step by the reference.
TEST(FoamFused, KernelsTakeContiguousCpuParametersFoldedAlongTheirLastDimension) {
  at::manual_seed(600);
  const at::Tensor matrix = make_param({6, 8}, at::kFloat), bias = make_param({7}, at::kFloat),
                   scalar_param = make_param({}, at::kFloat), half = make_param({4, 8}, at::kHalf),
                   transposed = at::randn({8, 6}).t().requires_grad_(true);
  FoamAdam opt({matrix, bias, scalar_param, half, transposed}, FoamAdamOptions(0.01));
  for (const auto& p : {matrix, bias, scalar_param, half}) EXPECT_TRUE(opt.is_fused_param(p));
  EXPECT_FALSE(opt.is_fused_param(transposed));  // not contiguous: the reference
  const at::Tensor m2 = make_param({6, 8}, at::kFloat);
  FoamAdam along0({m2}, FoamAdamOptions(0.01).dim(0));
  EXPECT_FALSE(along0.is_fused_param(m2));  // blocks along a dimension that is not the last
  FoamAdam off({m2}, FoamAdamOptions(0.01).fused(false));
  EXPECT_FALSE(off.is_fused_param(m2));
  const at::Tensor h2 = make_param({4, 8}, at::kHalf), m3 = make_param({4, 8}, at::kFloat);
  FoamAdam dense({h2, m3}, FoamAdamOptions(0.01).level(0).state_dtype("bfloat16"));
  EXPECT_FALSE(dense.is_fused_param(h2));  // dense float16: the reference
  EXPECT_FALSE(dense.is_fused_param(m3));  // dense with bfloat16 moments: the reference

  // A non-contiguous parameter steps by the reference, as one that is contiguous by the kernel:
  // the same result within the bound (float64: both exact to 1e-14 here).
  const at::Tensor init = at::randn({6, 8}, at::kDouble);
  const at::Tensor plain = init.clone().requires_grad_(true);
  const at::Tensor strided = init.t().contiguous().t().requires_grad_(true);
  ASSERT_FALSE(strided.is_contiguous());
  FoamAdam a({strided}, FoamAdamOptions(0.05)), b({plain}, FoamAdamOptions(0.05));
  EXPECT_FALSE(a.is_fused_param(strided));
  EXPECT_TRUE(b.is_fused_param(plain));
  for (int t = 0; t < 4; ++t) {
    const at::Tensor g = at::randn({6, 8}, at::kDouble);
    set_grad(strided, g), set_grad(plain, g);
    a.step(), b.step();
  }
  EXPECT_LE(gwt_test::max_abs_diff(strided, plain), 1e-14);
}

// ------------------------------------------------------------------------------------------------
// The multi-tensor step's FOAM blocks (src/kernels/shared/multi_tensor.h, Kind::foam: the CUDA
// kernels' bodies) run on the host over the grid the GPU runs (multi_tensor_emulate.h), against
// the readable reference: the device code tested on machines without a GPU.
// ------------------------------------------------------------------------------------------------

namespace mt = gwt::kernels::mt;

using gwt::optim_detail::kind_of;

// One tensor of the emulated step in memory of its own, as a device would hold it.
struct FoamEmulated {
  at::Tensor p, g, m, v, norm, counts;
  mt::TensorMeta meta;
  mt::GroupKey key;
};

FoamEmulated make_emulated(const at::Tensor& init, at::ScalarType dtype, at::ScalarType state,
                           const FoamAdamOptions& o) {
  FoamEmulated e;
  e.p = init.to(dtype).contiguous();
  e.g = at::zeros_like(e.p);
  mt::TensorMeta& t = e.meta;
  std::vector<int64_t> state_shape = init.sizes().vec();
  if (o.level() > 0) {
    t.n = init.dim() == 0 ? 1 : init.size(-1);
    t.rows = init.numel() / t.n;
    mt::complete_foam_meta(t, o.level());
    if (!state_shape.empty()) state_shape.back() = t.approx_len;
  } else {
    t.kind = mt::Kind::dense;
    t.n = init.numel();
    t.rows = 1;
  }
  e.m = at::zeros(state_shape, state);
  e.v = at::zeros(state_shape, state);
  e.norm = at::full({}, -1.0, dtype == at::kDouble ? at::kDouble : at::kFloat);
  e.counts = at::zeros({2}, at::kLong);
  t.param = e.p.data_ptr(), t.grad = e.g.data_ptr();
  t.exp_avg = e.m.data_ptr(), t.exp_avg_sq = e.v.data_ptr();
  t.norm = e.norm.data_ptr(), t.counts = e.counts.data_ptr<int64_t>();
  std::tie(t.beta1, t.beta2) = o.betas();
  t.eps = o.eps(), t.lr = o.lr(), t.weight_decay = o.weight_decay();
  t.scale = o.scale(), t.res_scale = o.res_scale(), t.gamma = 0;
  t.correct_bias = o.correct_bias();
  t.skip_param = o.nonfinite() == "skip_param";
  e.key = {kind_of(dtype), kind_of(state), dtype == at::kDouble};
  return e;
}

struct EmulatedSpec {
  std::vector<int64_t> shape;
  int64_t level;
  at::ScalarType param = at::kDouble, state = at::kDouble;
};

FoamAdamOptions emulated_options(const EmulatedSpec& s) {
  return FoamAdamOptions(0.02).level(s.level).weight_decay(0.1).scale(0.25).res_scale(0.5);
}

// The tensors of `specs` stepped together through the emulated kernels (chunks of
// `chunk_values` gradient values), each beside its own fused(false) reference run in its dtype
// and its float64 run.
struct EmulatedRuns {
  std::vector<EmulatedSpec> specs;
  std::vector<FoamEmulated> emulated;
  std::vector<FoamRuns> runs;  // .reference (the dtype's), .exact (float64), .bound
  mt::StepFlags flags{};
  int64_t chunk_values;
  int64_t launches = 0;
  EmulatedRuns(std::vector<EmulatedSpec> s, int64_t seed, int64_t chunk)
      : specs(std::move(s)), chunk_values(chunk) {
    at::manual_seed(seed);
    for (const EmulatedSpec& spec : specs) {
      const at::Tensor init = at::randn(spec.shape, at::kDouble).to(spec.param).to(at::kDouble);
      emulated.push_back(make_emulated(init, spec.param, spec.state, emulated_options(spec)));
      runs.emplace_back(init, spec.param, emulated_options(spec), spec.state);
    }
  }
  void step(const std::vector<at::Tensor>& grads, bool with_runs = true) {
    mt::Planner planner(chunk_values);
    for (size_t i = 0; i < specs.size(); ++i) {
      emulated[i].g.copy_(grads[i].reshape(emulated[i].g.sizes()));
      planner.add(emulated[i].key, emulated[i].meta);
      if (with_runs) {
        step(runs[i].reference, grads[i]), step(runs[i].exact, grads[i]);
        runs[i].bound.step(grads[i], runs[i].exact.param.detach());
      }
    }
    launches = planner.launches();
    mt::emulate_step(planner.groups(), &flags);
  }
  static void step(FoamRun& r, const at::Tensor& g) { ::step(r, g); }
};

// Float64 (folded at levels 1 to 4 with whole and partial blocks, 3-D, 1-D and 0-dim, and a dense
// tensor): each emulated tensor and its reference lie within the bound (u = 2^-53) of the exact
// result, so within twice it of each other; the bound measured below 1e-14 of the parameters,
// held to 1e-12. Chunks of 64 values, so that tensors span many chunks.
TEST(FoamMultiTensor, EmulatedStepsMatchTheReferenceInFloat64) {
  EmulatedRuns r({{{4, 64}, 2},
                  {{3, 77}, 2},
                  {{3, 13}, 3},
                  {{5, 3}, 3},
                  {{2, 3, 37}, 1},
                  {{1000}, 2},
                  {{7, 130}, 4},
                  {{}, 2},
                  {{9, 10}, 0}},
                 700, 64);
  for (int t = 0; t < 6; ++t) {
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < r.specs.size(); ++i)
      grads.push_back(gradients(r.specs[i].shape, 6, 701 + i, at::kDouble)[t]);
    r.step(grads);
    for (size_t i = 0; i < r.specs.size(); ++i) {
      const at::Tensor b = r.runs[i].bound.bound();
      const at::Tensor ref = r.runs[i].reference.param.detach();
      const at::Tensor err = (r.emulated[i].p - ref).abs();
      EXPECT_TRUE((err <= 2 * b).all().item<bool>())
          << "tensor " << i << " step " << t << ": worst error / twice the bound "
          << (err / (2 * b)).max().item<double>();
      EXPECT_LE(b.max().item<double>(), 1e-12 * ref.abs().max().item<double>()) << i;
      EXPECT_EQ(r.emulated[i].counts[mt::k_steps].item<int64_t>(), t + 1);
    }
  }
  EXPECT_EQ(r.launches, 3);  // one group: three launches for nine tensors
}

// float32, float16 and bfloat16 parameters, float32 and bfloat16 moments, in one step (a group per
// type pair): each within the rounding bound of its float64 run (the CPU tests' limits: 1e-5 of
// |p| for float32, 1e-2 and 6e-2 with float16 and bfloat16 parameters or moments).
TEST(FoamMultiTensor, ReducedPrecisionStaysWithinTheRoundingBound) {
  std::vector<EmulatedSpec> specs = {
      {{4, 64}, 2, at::kFloat, at::kFloat},       {{3, 77}, 3, at::kFloat, at::kBFloat16},
      {{3, 77}, 1, at::kHalf, at::kFloat},        {{6, 40}, 2, at::kBFloat16, at::kFloat},
      {{6, 40}, 2, at::kBFloat16, at::kBFloat16}, {{5, 12}, 0, at::kFloat, at::kFloat}};
  EmulatedRuns r(specs, 710, 96);
  for (int t = 0; t < 6; ++t) {
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < specs.size(); ++i)
      grads.push_back(gradients(specs[i].shape, 6, 711 + i, specs[i].param)[t]);
    r.step(grads);
    for (size_t i = 0; i < specs.size(); ++i) {
      const double limit = specs[i].param == at::kBFloat16 || specs[i].state == at::kBFloat16 ? 6e-2
                           : specs[i].param == at::kHalf                                      ? 1e-2
                                                         : 1e-5;
      const at::Tensor b = r.runs[i].bound.bound();
      const at::Tensor exact = r.runs[i].exact.param.detach();
      EXPECT_TRUE(((r.emulated[i].p.to(at::kDouble) - exact).abs() <= b).all().item<bool>())
          << "tensor " << i << " step " << t;
      EXPECT_LE(b.max().item<double>(), limit * exact.abs().max().item<double>()) << i;
    }
  }
}

// A tensor's bits do not depend on the tensors beside it in a launch or on the chunk size.
TEST(FoamMultiTensor, ATensorsBitsDoNotDependOnTheTensorsBesideItOrTheChunks) {
  const std::vector<EmulatedSpec> specs = {{{3, 77}, 2, at::kFloat, at::kFloat},
                                           {{16, 64}, 2, at::kFloat, at::kFloat},
                                           {{7, 130}, 3, at::kFloat, at::kFloat}};
  EmulatedRuns all(specs, 720, 64), alone({specs[1]}, 721, 32768);
  alone.emulated[0].p.copy_(all.emulated[1].p);
  for (int t = 0; t < 4; ++t) {
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < specs.size(); ++i)
      grads.push_back(gradients(specs[i].shape, 4, 722 + i, at::kFloat)[t]);
    all.step(grads, false);
    alone.step({grads[1]}, false);
  }
  EXPECT_TRUE(at::equal(all.emulated[1].p, alone.emulated[0].p));
  EXPECT_TRUE(at::equal(all.emulated[1].v, alone.emulated[0].v));
}

// A non-finite gradient: "skip_step" tensors skip the whole step (nothing changes, the step is
// counted as skipped), a "skip_param" tensor only itself.
TEST(FoamMultiTensor, NonFiniteGradientsSkipAsTheOptimizerDoes) {
  for (const char* nonfinite : {"skip_step", "skip_param"}) {
    const std::vector<EmulatedSpec> specs = {{{4, 64}, 2, at::kFloat, at::kFloat},
                                             {{3, 77}, 2, at::kFloat, at::kFloat}};
    EmulatedRuns r(specs, 730, 64);
    for (auto& e : r.emulated) e.meta.skip_param = std::string(nonfinite) == "skip_param";
    std::vector<at::Tensor> grads = {gradients({4, 64}, 1, 731, at::kFloat)[0],
                                     gradients({3, 77}, 1, 732, at::kFloat)[0]};
    r.step(grads, false);
    const at::Tensor p0 = r.emulated[0].p.clone(), p1 = r.emulated[1].p.clone();
    grads[1][2][5] = std::nan("");
    r.step(grads, false);
    EXPECT_TRUE(at::equal(r.emulated[1].p, p1)) << nonfinite;  // skipped either way
    EXPECT_EQ(r.emulated[1].counts[mt::k_steps].item<int64_t>(), 1) << nonfinite;
    EXPECT_EQ(r.flags.skipped_steps, 1) << nonfinite;
    if (std::string(nonfinite) == "skip_step") {
      EXPECT_TRUE(at::equal(r.emulated[0].p, p0));
      EXPECT_EQ(r.emulated[0].counts[mt::k_steps].item<int64_t>(), 1);
    } else {
      EXPECT_FALSE(at::equal(r.emulated[0].p, p0));
      EXPECT_EQ(r.emulated[0].counts[mt::k_steps].item<int64_t>(), 2);
      EXPECT_EQ(r.emulated[1].counts[mt::k_skipped].item<int64_t>(), 1);
    }
  }
}

// FoamAdam's own step through the device path (src/optim/device_steps.h), its kernels emulated on
// the host: the same parameters as the host path (both float64, the same rule with a few
// roundings per value and step: they differ by ~1e-15 relative, held to 1e-12), step and skip
// counts kept on the device and brought back when asked (skipped_steps, save), a non-finite
// gradient skipping as on the host, and a checkpoint of the device run resuming on the host.
TEST(FoamMultiTensor, FoamAdamOnTheDevicePathMatchesTheHostPath) {
  struct Emulation {
    explicit Emulation(bool on) { gwt::optim_detail::emulate_device_steps_on_cpu(on); }
    ~Emulation() { gwt::optim_detail::emulate_device_steps_on_cpu(false); }
  };
  for (const char* nonfinite : {"skip_step", "skip_param"}) {
    SCOPED_TRACE(nonfinite);
    at::manual_seed(740);
    const std::vector<std::vector<int64_t>> shapes = {{4, 64}, {3, 77}, {7}, {}, {5, 6}};
    std::vector<at::Tensor> host, device;
    for (const auto& shape : shapes) {
      host.push_back(at::randn(shape, at::kDouble).requires_grad_(true));
      device.push_back(host.back().detach().clone().requires_grad_(true));
    }
    const auto folded = FoamAdamOptions(0.02).weight_decay(0.1).res_scale(0.5).nonfinite(nonfinite);
    auto groups = [&](const std::vector<at::Tensor>& p) {
      std::vector<torch::optim::OptimizerParamGroup> g;
      g.emplace_back(std::vector<at::Tensor>{p[0], p[1], p[2], p[3]},
                     std::make_unique<FoamAdamOptions>(folded));
      g.emplace_back(std::vector<at::Tensor>{p[4]},
                     std::make_unique<FoamAdamOptions>(FoamAdamOptions(folded).level(0)));
      return g;
    };
    FoamAdam on_host(groups(host), folded), on_device(groups(device), folded);
    std::string checkpoint;
    for (int t = 0; t < 6; ++t) {
      for (size_t i = 0; i < shapes.size(); ++i) {
        at::Tensor g = at::randn(shapes[i], at::kDouble);
        if (t == 2 && i == 1) g.view({-1})[5] = std::nan("");
        set_grad(host[i], g), set_grad(device[i], g);
      }
      on_host.step();
      {
        const Emulation emulated(true);
        on_device.step();
      }
      for (size_t i = 0; i < shapes.size(); ++i)
        EXPECT_LE(gwt_test::max_rel_diff(device[i].detach(), host[i].detach(), 1e-3), 1e-12)
            << "tensor " << i << " step " << t;
      // The device path was taken: its counts stay on the device until asked for (the host's
      // state still says 0), where the host path's say 1.
      if (t == 0) {
        EXPECT_EQ(state_of(on_device, device[0]).step(), 0);
        EXPECT_EQ(state_of(on_host, host[0]).step(), 1);
      }
      if (t == 3) checkpoint = saved(on_device);  // syncs the device's counts first
    }
    EXPECT_EQ(on_device.skipped_steps(), on_host.skipped_steps());
    EXPECT_EQ(on_device.skipped_steps(), 1);
    for (size_t i = 0; i < shapes.size(); ++i) {
      EXPECT_EQ(on_device.skipped_steps(device[i]), on_host.skipped_steps(host[i])) << i;
      EXPECT_EQ(state_of(on_device, device[i]).step(), state_of(on_host, host[i]).step()) << i;
    }
    // The checkpoint of step 4 holds the device's counts (save syncs them first).
    std::vector<at::Tensor> resumed;
    for (const auto& p : device) resumed.push_back(p.detach().clone().requires_grad_(true));
    FoamAdam again(groups(resumed), folded);
    load(again, checkpoint);
    EXPECT_EQ(again.skipped_steps(), 1);
    EXPECT_EQ(state_of(again, resumed[0]).step(), std::string(nonfinite) == "skip_step" ? 3 : 4);
    EXPECT_EQ(state_of(again, resumed[1]).step(), 3);
  }
}

}  // namespace
