// The fused kernels against the readable ATen reference (WaveletAdamOptions::fused(false)), on
// the CPU and on a CUDA device. What depends on the instruction set (the AVX2 bodies and their
// conversions): test_fused_simd.cpp; the CUDA kernels' bodies run on the host:
// test_fused_kernel_rows.cpp.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "bound_expect.h"
#include "float_bound.h"
#include "fused_test_util.h"
#include "gwt/gwt.h"
#include "test_util.h"

namespace {

using gwt::WaveletAdam;
using gwt::WaveletAdamOptions;
using gwt_test::expect_within_bound;
using gwt_test::max_abs_diff;
using gwt_test::rel_error;
using namespace gwt_test::fused;

// Growing gradients so the norm-growth limiter acts.
std::vector<at::Tensor> gradients(at::IntArrayRef shape, int steps, int64_t seed) {
  at::manual_seed(seed);
  std::vector<at::Tensor> out;
  for (int t = 0; t < steps; ++t) out.push_back(at::randn(shape, at::kDouble) * (1 + 2 * t));
  return out;
}

// Float64: two float64 runs of one rule (the fused kernel and the reference, or the device and
// the CPU) each lie within the data's rounding bound (tests/float_bound.h with u = 2^-53) of the
// exact result, so within twice it of each other, whatever order either sums in on any
// instruction set, BLAS or thread count: the rule cannot fail by chance (measured: the worst
// error is 0.04 of twice the bound). It is only worth something if the bound is small, so the
// bound is checked to be at most `max_relative` x max(1, kappa) of the parameters' largest
// magnitude: 1e-11 on one-sign rows (kappa <= 10); zero mode's edge coefficients take partial tap
// sums that nearly cancel even there (kappa up to 3.5e4 for coif3 at level 3), where float64
// itself is that sensitive and the bound rightly grows with kappa (6.5e-9 of the parameters
// there, against a guard of 3.5e-7); kappa itself must stay below 1e5, or a sum that cancels
// outright would excuse any result. Elsewhere the bound measured 1.5e-15 to 1.7e-12 of the
// parameters: the kernels' limiter off by a relative 1e-12 fails it (up to 14x).
void expect_float64_pair(const at::Tensor& run, const at::Tensor& other,
                         const gwt_test::RoundingBound& bound, double max_relative,
                         const std::string& what) {
  const at::Tensor err = (run.to(at::kDouble) - other).abs();
  EXPECT_TRUE(gwt_test::float64_pair_holds(run, other, bound, max_relative))
      << what << ": worst error / twice the bound "
      << (err / (2 * bound.bound())).max().item<double>() << ", worst error "
      << err.max().item<double>() << ", bound / largest |p| "
      << bound.bound().max().item<double>() / other.abs().max().item<double>() << ", kappa "
      << bound.kappa();
}

// The fused and the reference run of one float64 parameter, and their bound.
struct Float64Runs {
  OptRun fused, reference;
  gwt_test::RoundingBound bound;
  Float64Runs(const at::Tensor& init, const WaveletAdamOptions& o)
      : fused(make_run(init, at::kDouble, WaveletAdamOptions(o).fused(true))),
        reference(make_run(init, at::kDouble, WaveletAdamOptions(o).fused(false))),
        bound(init.sizes(), o, at::kDouble, at::kDouble) {}
  void step_and_check(const at::Tensor& g, double max_relative, const std::string& what) {
    step(fused, g), step(reference, g);
    bound.step(g, reference.param.detach());
    expect_float64_pair(fused.param, reference.param, bound, max_relative, what);
  }
};

TEST(Fused, HaarMatchesReferenceInFloat32AcrossShapesAndLevels) {
  // Levels 4 and 5 (the kernel's instance with a run-time block size) where the rows have 2^level
  // values.
  const std::vector<std::vector<int64_t>> shapes = {
      {8, 64}, {5, 37}, {3, 4, 33}, {2, 1031}, {16, 8}};
  for (const auto& shape : shapes)
    for (int64_t level : {1, 2, 3, 4, 5})
      for (double gamma : {1.01, 0.0}) {
        if (shape.back() < (int64_t{1} << level)) continue;  // dense: not this kernel's case
        const std::string what = "shape " + c10::str(at::IntArrayRef(shape)) + " level " +
                                 std::to_string(level) + " gamma " + std::to_string(gamma);
        const auto o = base_options().level(level).norm_growth_limit(gamma);
        BoundedRuns runs(at::randn(shape, at::kDouble), at::kFloat, o);
        ASSERT_TRUE(runs.fused.opt->is_fused_param(runs.fused.param));
        ASSERT_FALSE(runs.reference.opt->is_fused_param(runs.reference.param));
        // 1e-4 of |p|: the bound must be that tight to mean anything (an error of the size of
        // one update is ~1e-2 of |p| here).
        for (const auto& g : gwt_test::well_conditioned_gradients(shape, 6, 21, at::kFloat))
          runs.step_and_check(g, 1e-4, what);
        // The first moments, against the same analysis (they may cancel across steps: the bound
        // is relative to the sum of |terms|).
        const at::Tensor m_bound =
            runs.bound.exp_avg_bound().reshape(state_of(runs.fused).exp_avg().sizes());
        const at::Tensor m_exact = state_of(runs.exact).exp_avg();
        for (const OptRun* r : {&runs.fused, &runs.reference})
          EXPECT_TRUE(((state_of(*r).exp_avg().to(at::kDouble) - m_exact).abs() <= m_bound)
                          .all()
                          .item<bool>())
              << what;
      }
}

TEST(Fused, Haar2dMatchesReferenceInFloat32) {
  // transform("2d"): blocks of 2^L x 2^L; odd sizes pad with zeros (zero mode), batch dimensions.
  // The CPU kernel's tiles span a block row's whole width up to a budget (2048 coefficients,
  // 32768 values) and split wider rows: 12 x 2100 is one tile per block row at every level, more
  // than 512 coefficients wide at levels 1 and 2; 13 x 8201 splits its rows at every level, into
  // tiles of 2048 coefficients (levels 1 and 2) or 512 (level 3), with a short last one that ends
  // in a partial block, and its last block row is partial (13 rows).
  const std::vector<std::vector<int64_t>> shapes = {{64, 96}, {3, 17, 40}, {8, 8},
                                                    {37, 70}, {12, 2100},  {13, 8201}};
  for (const auto& shape : shapes)
    for (int64_t level : {1, 2, 3}) {
      const std::string what =
          "shape " + c10::str(at::IntArrayRef(shape)) + " level " + std::to_string(level);
      const auto o = base_options().transform("2d").level(level);
      BoundedRuns runs(at::randn(shape, at::kDouble), at::kFloat, o);
      ASSERT_TRUE(runs.fused.opt->is_fused_param(runs.fused.param));
      // The bound takes the norm's sum over all coefficients at its a priori worst (error
      // growing with their number), so the wide shapes' bound passes the fixed guard of 1e-4 of
      // the parameters' largest magnitude (it reaches about 9e-4 of it). What fails a wrong result
      // is the element-wise check; the guard only keeps the bound from being vacuous, and for them
      // it is half of each step's largest change (the bound measured at most 0.18 of it). Both
      // sides are float64 functions of the seeded data, so the margin is the same on every CPU
      // (unchanged under MKL_CBWR=COMPATIBLE/AVX2/AVX512 and ATEN_CPU_CAPABILITY=default).
      const bool wide = shape.back() > 1000;
      for (const auto& g : gwt_test::well_conditioned_gradients(shape, 5, 34, at::kFloat, true)) {
        if (wide)
          runs.step_and_check_below_step(g, 0.5, what);
        else
          runs.step_and_check(g, 1e-4, what);
      }
      EXPECT_EQ(runs.fused.opt->state_bytes(runs.fused.param),
                runs.reference.opt->state_bytes(runs.reference.param));
    }
}

TEST(Fused, HaarMatchesReferenceInFloat64) {
  struct Case {
    std::string transform;
    std::vector<int64_t> shape;
    std::vector<int64_t> levels;
  };
  // 2-D: the CPU kernel's tiles, whole block rows (12 x 2100) and split ones (13 x 8201), as in
  // Haar2dMatchesReferenceInFloat32. The gradients have one sign per row (per matrix for 2-D)
  // and step: with random signs a block's sum A can nearly cancel, the step divides by |A|, and
  // the difference of the runs then rests on the rounding of A, which differs between ATen's
  // instruction sets. With one sign no block sum cancels (kappa 1), and the bound is small.
  // Levels 4 and 5 take the kernel's instance with a run-time block size (1 to 3 have their own),
  // on shapes with 2^level elements along each transformed axis, and rows that end in a partial
  // block (200 = 6 x 32 + 8; 70 x 100 with blocks of 16 x 16 and 32 x 32).
  const std::vector<int64_t> low = {1, 2, 3}, high = {4, 5};
  for (const auto& c : std::vector<Case>{{"1d", {6, 45}, low},
                                         {"1d", {4, 2048}, low},
                                         {"2d", {12, 2100}, low},
                                         {"2d", {13, 8201}, low},
                                         {"1d", {5, 200}, high},
                                         {"2d", {70, 100}, high}})
    for (const int64_t level : c.levels) {
      const std::string what = c.transform + " shape " + c10::str(at::IntArrayRef(c.shape)) +
                               " level " + std::to_string(level);
      Float64Runs runs(at::randn(c.shape, at::kDouble),
                       base_options().level(level).transform(c.transform));
      ASSERT_TRUE(runs.fused.opt->is_fused_param(runs.fused.param));
      for (const auto& g :
           gwt_test::well_conditioned_gradients(c.shape, 6, 22, at::kDouble, c.transform == "2d"))
        runs.step_and_check(g, 1e-11, what);
    }
}

TEST(Fused, GeneralWaveletsMatchReferenceForEveryModeAndLevel) {
  for (const std::string wavelet : {"db2", "sym3", "coif1", "db4", "db5", "sym8", "coif3"})
    for (const std::string boundary : {"zero", "periodization", "symmetric"})
      for (int64_t level : {1, 2, 3}) {
        const std::string what = wavelet + " " + boundary + " level " + std::to_string(level);
        const auto o = base_options().wavelet(wavelet).boundary(boundary).level(level);
        const std::vector<int64_t> shape = {3, 5, 41};
        const at::Tensor init = at::randn(shape, at::kDouble);
        // float64: within twice the rounding bound of each other, on one-sign rows.
        Float64Runs runs64(init, o);
        ASSERT_TRUE(runs64.fused.opt->is_fused_param(runs64.fused.param));
        for (const auto& g : gwt_test::well_conditioned_gradients(shape, 5, 28, at::kDouble))
          runs64.step_and_check(g, 1e-11, what);
        // float32: within the rounding bound, on well-conditioned data.
        BoundedRuns runs(init, at::kFloat, o);
        for (const auto& g : gwt_test::well_conditioned_gradients(shape, 5, 28, at::kFloat))
          runs.step_and_check(g, 1e-3, what);
        // Periodization and symmetric extension keep one-sign rows well conditioned (kappa < 2
        // measured), so their float32 checks are tight; zero mode is for longer filters at deeper
        // levels (kappa 11 to 4e4: edge coefficients of few taps).
        if (boundary != "zero") {
          EXPECT_LE(runs.bound.kappa(), 10) << what;
        }
      }
}

// The AVX2 build steps float32 rows in groups of eight, one row per lane (wavelet_rows8_avx2.h),
// and the rows past the last full group one at a time: shapes with full groups only, groups and
// leftover rows, rows shorter and longer than the filter, odd lengths and lengths that are not a
// multiple of 8 (the transposes' tails), every filter length gwt has (2 to 18 taps: each has its
// own unrolled loops), every mode and levels 1 to 3. Each run within the rounding bound of the
// float64 run (tests/float_bound.h); elsewhere (baseline build, GWT_NO_ROWS8=1) the same shapes
// test the one-row body.
TEST(Fused, GeneralKernelRowGroupsMatchTheReferenceInFloat32) {
  const std::vector<std::vector<int64_t>> shapes = {
      {8, 37}, {17, 64}, {2, 8, 9}, {9, 130}, {24, 7}};
  for (const std::string wavelet :
       {"db2", "db3", "sym4", "db5", "coif2", "db7", "sym8", "coif3", "haar"})
    for (const std::string boundary : {"zero", "periodization", "symmetric"})
      for (int64_t level : {1, 2, 3})
        for (const auto& shape : shapes) {
          if (shape.back() < (int64_t{1} << level)) continue;  // dense: not this kernel's case
          // Haar takes the Haar kernel wherever it is block-local; symmetric mode on a length that
          // is not a multiple of the block is the general kernel's.
          if (wavelet == "haar" && boundary != "symmetric") continue;
          const std::string what = wavelet + " " + boundary + " level " + std::to_string(level) +
                                   " shape " + c10::str(at::IntArrayRef(shape));
          const auto o = base_options().wavelet(wavelet).boundary(boundary).level(level);
          BoundedRuns runs(at::randn(shape, at::kDouble), at::kFloat, o);
          ASSERT_TRUE(runs.fused.opt->is_fused_param(runs.fused.param)) << what;
          // 1e-3 of |p|, as GeneralWaveletsMatchReferenceForEveryModeAndLevel: an error of one
          // update's size is ~1e-2 of |p| here, so a wrong lane or tap fails it.
          for (const auto& g : gwt_test::well_conditioned_gradients(shape, 3, 31, at::kFloat))
            runs.step_and_check(g, 1e-3, what);
        }
}

TEST(Fused, ThresholdedDetailsMatchTheReference) {
  for (const std::string wavelet : {"haar", "db2"})
    for (const std::string mode : {"soft", "hard"}) {
      SCOPED_TRACE(wavelet + " " + mode);
      const auto o = base_options().wavelet(wavelet).level(2).threshold(0.7).threshold_mode(mode);
      const at::Tensor init = at::randn({5, 43}, at::kDouble);
      OptRun fused = make_run(init, at::kDouble, o);
      OptRun reference = make_run(init, at::kDouble, WaveletAdamOptions(o).fused(false));
      ASSERT_TRUE(fused.opt->is_fused_param(fused.param));
      // One-sign rows: no approximation cancels, so 1e-11 does not rest on how either run rounds
      // a nearly cancelled sum that the step then divides by (measured 1.6e-16; on random signs,
      // 2.2e-14).
      for (const auto& g : gwt_test::well_conditioned_gradients({5, 43}, 4, 30, at::kDouble)) {
        step(fused, g), step(reference, g);
        EXPECT_LE(rel_error(fused.param, reference.param), 1e-11);
        EXPECT_EQ(fused.opt->kept_details(), reference.opt->kept_details());
      }
      EXPECT_GT(fused.opt->kept_details().first, 0);
    }
}

TEST(Fused, GeneralWaveletsInHalfPrecision) {
  for (auto dtype : {at::kBFloat16, at::kHalf})
    for (const std::vector<int64_t>& shape : {std::vector<int64_t>{6, 77}, {64, 100}}) {
      const std::string what = c10::str(dtype, " ", at::IntArrayRef(shape));
      const auto o = base_options().wavelet("db2").level(2);
      const at::Tensor init = at::randn(shape, at::kDouble).to(dtype).to(at::kDouble);
      BoundedRuns runs(init, dtype, o);
      // The bound is dominated by storing p in dtype each step (u of bf16 is 2^-8).
      for (const auto& g : gwt_test::well_conditioned_gradients(shape, 5, 29, dtype))
        runs.step_and_check(g, dtype == at::kBFloat16 ? 0.05 : 0.01, what);
    }
}

TEST(Fused, NonContiguousGradient) {
  BoundedRuns runs(at::randn({8, 40}, at::kDouble), at::kFloat, base_options());
  for (const auto& g : gwt_test::well_conditioned_gradients({8, 40}, 4, 40, at::kFloat)) {
    const at::Tensor view = g.to(at::kFloat).t().contiguous().t();  // a transposed view
    ASSERT_FALSE(view.is_contiguous());
    runs.fused.param.mutable_grad() = view;
    runs.reference.param.mutable_grad() = view.clone();
    runs.exact.param.mutable_grad() = g;
    runs.fused.opt->step(), runs.reference.opt->step(), runs.exact.opt->step();
    runs.bound.step(g, runs.exact.param.detach());
    expect_within_bound(runs.fused.param, runs.exact.param, runs.bound, 1e-4, "fused");
    expect_within_bound(runs.reference.param, runs.exact.param, runs.bound, 1e-4, "reference");
  }
}

// bf16/fp16 parameters or bf16 state: both runs within the rounding bound of the float64 run
// (dominated by storing p, or the moments, in the low precision each step).
void check_low_precision(at::ScalarType dtype, const std::string& state_dtype) {
  const std::vector<int64_t> shape = {12, 70};
  const auto o = base_options().level(2).state_dtype(state_dtype);
  const at::Tensor init = at::randn(shape, at::kDouble).to(dtype).to(at::kDouble);
  BoundedRuns runs(init, dtype, o, state_dtype == "bfloat16" ? at::kBFloat16 : at::kFloat);
  ASSERT_TRUE(runs.fused.opt->is_fused_param(runs.fused.param));
  // bf16 moments: 2^-8 per stored moment and step, through the denominators and the limiter.
  const double max_relative = state_dtype == "bfloat16" ? 0.1
                              : dtype == at::kBFloat16  ? 0.05
                                                        : 0.01;
  for (const auto& g : gwt_test::well_conditioned_gradients(shape, 5, 23, dtype))
    runs.step_and_check(g, max_relative, c10::str(dtype, " state ", state_dtype));
  EXPECT_EQ(runs.fused.opt->state_bytes(runs.fused.param),
            runs.reference.opt->state_bytes(runs.reference.param));
}

TEST(Fused, BFloat16AndHalfParametersStayWithinTheRoundingBound) {
  check_low_precision(at::kBFloat16, "auto");
  check_low_precision(at::kHalf, "auto");
}

TEST(Fused, BFloat16StateHalvesTheStateAndStaysWithinTheRoundingBound) {
  check_low_precision(at::kFloat, "bfloat16");
  check_low_precision(at::kBFloat16, "bfloat16");
  at::Tensor p = at::randn({64, 64}).requires_grad_(true);
  WaveletAdam opt({p}, WaveletAdamOptions().state_dtype("bfloat16"));
  p.mutable_grad() = at::randn({64, 64});
  opt.step();
  EXPECT_EQ(opt.state_bytes(p), 2 * 64 * 16 * 2 + 4);  // bf16 moments + float limiter norm
}

TEST(Fused, ResultsDoNotDependOnTheThreadCount) {
  const int threads = at::get_num_threads();
  // 2-D at 16 x 8201: tiles of 2048 coefficients and a short one per block row, 8 tiles over the
  // threads.
  for (const std::string transform : {"1d", "2d"}) {
    const std::vector<int64_t> shape =
        transform == "1d" ? std::vector<int64_t>{64, 4096} : std::vector<int64_t>{16, 8201};
    const at::Tensor init = at::randn(shape, at::kDouble);
    std::vector<at::Tensor> results;
    for (int n : {1, 2}) {
      at::set_num_threads(n);
      OptRun r = make_run(init, at::kFloat, base_options().transform(transform));
      for (const auto& g : gradients(shape, 3, 24)) step(r, g);
      results.push_back(r.param.detach().clone());
    }
    at::set_num_threads(threads);
    EXPECT_TRUE(at::equal(results[0], results[1])) << transform;
  }
}

TEST(Fused, SaveLoadMidRunContinuesBitIdentically) {
  const at::Tensor init = at::randn({10, 52}, at::kDouble);
  const auto grads = gradients({10, 52}, 8, 25);
  for (const auto& [dtype, wavelet] : std::vector<std::pair<at::ScalarType, std::string>>{
           {at::kFloat, "haar"}, {at::kBFloat16, "haar"}, {at::kFloat, "db2"}}) {
    OptRun straight = make_run(init, dtype, base_options().level(3).wavelet(wavelet));
    for (const auto& g : grads) step(straight, g);

    OptRun first = make_run(init, dtype, base_options().level(3).wavelet(wavelet));
    for (int t = 0; t < 4; ++t) step(first, grads[t]);
    const std::string path =
        ::testing::TempDir() + "gwt_fused_" + std::to_string(::getpid()) + ".pt";
    torch::save(*first.opt, path);
    OptRun second = make_run(first.param.detach(), dtype, WaveletAdamOptions(0.5));
    torch::load(*second.opt, path);
    std::remove(path.c_str());
    ASSERT_TRUE(second.opt->is_fused_param(second.param));
    for (int t = 4; t < 8; ++t) step(second, grads[t]);
    EXPECT_TRUE(at::equal(second.param, straight.param)) << dtype << " " << wavelet;
  }
}

TEST(Fused, AppliesOnlyWhereItReproducesTheReference) {
  auto fused_for = [](at::IntArrayRef shape, const WaveletAdamOptions& o) {
    at::Tensor p = at::randn(shape).requires_grad_(true);
    return WaveletAdam({p}, o).is_fused_param(p);
  };
  EXPECT_TRUE(fused_for({4, 30}, WaveletAdamOptions().level(2)));  // zero mode pads
  EXPECT_TRUE(fused_for({4, 32}, WaveletAdamOptions().boundary("periodization")));  // no padding
  EXPECT_TRUE(
      fused_for({4, 30}, WaveletAdamOptions().boundary("periodization")));  // general kernel
  EXPECT_TRUE(fused_for({4, 30}, WaveletAdamOptions().wavelet("db2")));     // general kernel
  EXPECT_FALSE(fused_for({32, 4}, WaveletAdamOptions().dim(0)));            // not last
  EXPECT_FALSE(fused_for({4, 32}, WaveletAdamOptions().fused(false)));
  EXPECT_FALSE(fused_for({32}, WaveletAdamOptions()));  // dense
}

TEST(Fused, NonFiniteGradientIsCaughtByTheNormPass) {
  const at::Tensor init = at::randn({4, 64}, at::kDouble);
  OptRun r = make_run(init, at::kFloat, base_options());
  step(r, at::randn({4, 64}, at::kDouble));
  const at::Tensor before = r.param.detach().clone();
  at::Tensor g = at::randn({4, 64}, at::kDouble);
  g[2][17] = std::numeric_limits<double>::infinity();
  step(r, g);
  EXPECT_EQ(r.opt->skipped_steps(), 1);
  EXPECT_TRUE(at::equal(before, r.param));
}

// The CUDA kernels against the CPU reference. They run only where a GPU is present; elsewhere the
// CUDA sources are still compiled and linked (GWT_CUDA=AUTO), and these tests say why they skip.

TEST(FusedCuda, MatchesTheCpuReference) {
  if (!at::hasCUDA())
    GTEST_SKIP() << "no CUDA device on this machine: the CUDA kernels were only compiled";
  for (const std::string wavelet : {"haar", "db2"})
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble})
      for (int64_t level : {1, 2, 3})
        for (const auto& shape :
             std::vector<std::vector<int64_t>>{{64, 512}, {7, 37}, {3, 5, 66}}) {
          SCOPED_TRACE(
              c10::str(wavelet, " ", dtype, " level ", level, " shape ", at::IntArrayRef(shape)));
          const auto o = base_options().level(level).wavelet(wavelet);
          const at::Tensor init = at::randn(shape, at::kDouble);
          at::Tensor gpu = init.to(dtype).cuda().requires_grad_(true);
          WaveletAdam gpu_opt({gpu}, o);
          ASSERT_TRUE(gpu_opt.is_fused_param(gpu));
          OptRun exact = make_run(init, at::kDouble, WaveletAdamOptions(o).fused(false));
          gwt_test::RoundingBound bound(shape, o, dtype,
                                        dtype == at::kDouble ? at::kDouble : at::kFloat);
          const double max_relative = dtype == at::kDouble  ? 1e-11
                                      : dtype == at::kFloat ? 1e-4
                                      : dtype == at::kHalf  ? 0.01
                                                            : 0.05;
          // One-sign rows for every dtype; float64 math on the device too, held as Float64Runs.
          const auto grads = gwt_test::well_conditioned_gradients(shape, 5, 26, dtype);
          for (const auto& g : grads) {
            gpu.mutable_grad() = g.to(dtype).cuda();
            gpu_opt.step();
            step(exact, g);
            bound.step(g, exact.param.detach());
            if (dtype == at::kDouble)
              expect_float64_pair(gpu.cpu(), exact.param, bound, max_relative, "gpu");
            else
              expect_within_bound(gpu.cpu(), exact.param, bound, max_relative, "gpu");
          }
        }
}

TEST(FusedCuda, GeneralKernelModesAndThresholdsMatchTheCpuKernel) {
  if (!at::hasCUDA())
    GTEST_SKIP() << "no CUDA device on this machine: the CUDA kernels were only compiled";
  for (const std::string boundary : {"zero", "periodization", "symmetric"})
    for (double threshold : {0.0, 0.4}) {
      SCOPED_TRACE(boundary + " threshold " + std::to_string(threshold));
      const auto o =
          base_options().wavelet("sym3").boundary(boundary).level(2).threshold(threshold);
      const std::vector<int64_t> shape = {9, 300};
      const at::Tensor init = at::randn(shape, at::kDouble);
      at::Tensor gpu = init.cuda().requires_grad_(true);
      WaveletAdam gpu_opt({gpu}, o);
      ASSERT_TRUE(gpu_opt.is_fused_param(gpu));
      OptRun cpu = make_run(init, at::kDouble, o);
      for (const auto& g : gwt_test::well_conditioned_gradients(shape, 4, 33, at::kDouble)) {
        gpu.mutable_grad() = g.cuda();
        gpu_opt.step();
        step(cpu, g);
        EXPECT_LE(rel_error(gpu.cpu(), cpu.param), 1e-10);
        EXPECT_EQ(gpu_opt.kept_details(), cpu.opt->kept_details());
      }
    }
}

TEST(FusedCuda, Haar2dMatchesTheCpuReference) {
  if (!at::hasCUDA())
    GTEST_SKIP() << "no CUDA device on this machine: the CUDA kernels were only compiled";
  for (int64_t level : {1, 2, 3})
    for (const auto& shape : std::vector<std::vector<int64_t>>{{64, 96}, {3, 17, 40}}) {
      SCOPED_TRACE(c10::str("level ", level, " shape ", at::IntArrayRef(shape)));
      const auto o = base_options().level(level).transform("2d");
      const at::Tensor init = at::randn(shape, at::kDouble);
      at::Tensor gpu = init.cuda().requires_grad_(true);
      WaveletAdam gpu_opt({gpu}, o);
      ASSERT_TRUE(gpu_opt.is_fused_param(gpu));
      OptRun reference = make_run(init, at::kDouble, WaveletAdamOptions(o).fused(false));
      for (const auto& g : gwt_test::well_conditioned_gradients(shape, 4, 37, at::kDouble, true)) {
        gpu.mutable_grad() = g.cuda();
        gpu_opt.step();
        step(reference, g);
        EXPECT_LE(rel_error(gpu.cpu(), reference.param), 1e-10);
      }
    }
}

TEST(FusedCuda, NonContiguousGradientAndSaveLoad) {
  if (!at::hasCUDA())
    GTEST_SKIP() << "no CUDA device on this machine: the CUDA kernels were only compiled";
  const at::Tensor init = at::randn({16, 96}, at::kDouble);
  const auto grads = gwt_test::well_conditioned_gradients({16, 96}, 6, 27, at::kFloat);
  auto run = [&](bool interrupt) {
    at::Tensor p = init.to(at::kFloat).cuda().requires_grad_(true);
    auto opt = std::make_unique<WaveletAdam>(std::vector<at::Tensor>{p}, base_options());
    for (int t = 0; t < 6; ++t) {
      if (interrupt && t == 3) {
        const std::string path =
            ::testing::TempDir() + "gwt_cuda_" + std::to_string(::getpid()) + ".pt";
        torch::save(*opt, path);
        opt = std::make_unique<WaveletAdam>(std::vector<at::Tensor>{p}, WaveletAdamOptions(0.5));
        torch::load(*opt, path);
        std::remove(path.c_str());
      }
      p.mutable_grad() = grads[t].to(at::kFloat).t().contiguous().cuda().t();  // non-contiguous
      opt->step();
    }
    return p.detach().cpu();
  };
  OptRun exact = make_run(init, at::kDouble, base_options().fused(false));
  gwt_test::RoundingBound bound(init.sizes(), base_options(), at::kFloat, at::kFloat);
  for (const auto& g : grads) {
    step(exact, g);
    bound.step(g, exact.param.detach());
  }
  const at::Tensor straight = run(false);
  EXPECT_TRUE(at::equal(straight, run(true)));
  expect_within_bound(straight, exact.param, bound, 1e-4, "gpu");
}

}  // namespace
