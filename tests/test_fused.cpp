// The fused kernels against the readable ATen reference (WaveletAdamOptions::fused(false)).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/shared/haar_block.h"
#include "kernels/shared/wavelet_row.h"
#include "bound_expect.h"
#include "float_bound.h"
#include "gwt/gwt.h"
#include "kernels/kernels.h"
#include "test_util.h"

#ifdef GWT_TEST_BF16_AVX2_PROBE
namespace gwt_test {
void bf16_round_avx2(const float* in, uint16_t* out, size_t n);  // tests/bf16_avx2_probe.cpp
void bf16_widen_avx2(const uint16_t* in, float* out, size_t n);
void f16_round_avx2(const float* in, uint16_t* out, size_t n);
void f16_widen_avx2(const uint16_t* in, float* out, size_t n);
}  // namespace gwt_test
#endif

namespace {

using gwt::WaveletAdam;
using gwt::WaveletAdamOptions;
using gwt_test::expect_within_bound;
using gwt_test::max_abs_diff;
using gwt_test::rel_error;

struct OptRun {
  at::Tensor param;
  std::unique_ptr<WaveletAdam> opt;
};

OptRun make_run(const at::Tensor& init, at::ScalarType dtype, const WaveletAdamOptions& options) {
  OptRun r;
  r.param = init.to(dtype).clone().requires_grad_(true);
  r.opt = std::make_unique<WaveletAdam>(std::vector<at::Tensor>{r.param}, options);
  return r;
}

void step(OptRun& r, const at::Tensor& grad) {
  r.param.mutable_grad() = grad.to(r.param.scalar_type());
  r.opt->step();
}

// Growing gradients so the norm-growth limiter acts.
std::vector<at::Tensor> gradients(at::IntArrayRef shape, int steps, int64_t seed) {
  at::manual_seed(seed);
  std::vector<at::Tensor> out;
  for (int t = 0; t < steps; ++t) out.push_back(at::randn(shape, at::kDouble) * (1 + 2 * t));
  return out;
}

WaveletAdamOptions base_options() {
  return WaveletAdamOptions(0.02).weight_decay(0.1).scale(0.5).wavelet("haar");
}

// The fused and the reference run of one parameter in a reduced precision, with the float64 run
// and the bound that both must keep to.
struct BoundedRuns {
  OptRun fused, reference, exact;
  gwt_test::RoundingBound bound;
  BoundedRuns(const at::Tensor& init, at::ScalarType dtype, const WaveletAdamOptions& o,
              at::ScalarType state = at::kFloat)
      : fused(make_run(init, dtype, WaveletAdamOptions(o).fused(true))),
        reference(make_run(init, dtype, WaveletAdamOptions(o).fused(false))),
        exact(make_run(init, at::kDouble, WaveletAdamOptions(o).state_dtype("auto").fused(false))),
        bound(init.sizes(), o, dtype, state) {}
  // One step of all three with gradient g (float64 values representable in dtype), then the rule.
  void step_and_check(const at::Tensor& g, double max_relative, const std::string& what) {
    step(fused, g), step(reference, g), step(exact, g);
    check(g, max_relative, what);
  }
  // As step_and_check, with the bound's guard at `fraction` of this step's largest change of the
  // float64 run's parameters (relative to their largest magnitude), for shapes whose a priori
  // bound grows with their coefficient count past a fixed guard. A bound under half a step's
  // change still fails a block left out or stepped twice.
  void step_and_check_below_step(const at::Tensor& g, double fraction, const std::string& what) {
    const at::Tensor before = exact.param.detach().clone();
    step(fused, g), step(reference, g), step(exact, g);
    const at::Tensor after = exact.param.detach();
    const double change = (after - before).abs().max().item<double>();
    check(g, fraction * change / after.abs().max().item<double>(), what);
  }

 private:
  void check(const at::Tensor& g, double max_relative, const std::string& what) {
    bound.step(g, exact.param.detach());
    expect_within_bound(fused.param, exact.param, bound, max_relative, what + " fused");
    expect_within_bound(reference.param, exact.param, bound, max_relative, what + " reference");
  }
};

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

const gwt::WaveletAdamParamState& state_of(const OptRun& r) {
  return static_cast<const gwt::WaveletAdamParamState&>(
      *r.opt->state().at(r.param.unsafeGetTensorImpl()));
}

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

// Whether environment variable `name` is set and not "0" (GWT_NO_AVX2, GWT_NO_ROWS8).
bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

#if defined(__x86_64__)
// Whether the CPU has F16C (CPUID leaf 1, ECX bit 29), which the kernels' float16 conversions use.
bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

// Whether the kernels run their AVX2 bodies here, as gwt::kernels decides (dispatch.h).
bool avx2_bodies_run() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c() &&
         !env_set("GWT_NO_AVX2");
#else
  return false;
#endif
}

// HaarAdamArgs::carry: the norm pass leaves each coefficient's approximation and denominator, and
// the update pass takes them instead of computing them again. Both are the same computation, so
// the step must be the same bits with and without it: float32, bfloat16 and float16 parameters
// (bfloat16 state for one), levels 1 to 3, 1-D and 2-D, shapes whose tiles end in the plain
// loops' tail. Where the AVX2 bodies run, a carry changed between the passes must change the
// step, or the update would not be reading it and the comparison would prove nothing.
TEST(Fused, CarriedApproximationsGiveTheSameBits) {
  namespace k = gwt::kernels;
  struct Case {
    at::ScalarType param, state;
  };
  auto kind_of = [](at::ScalarType t) {
    return t == at::kFloat  ? k::ScalarKind::f32
           : t == at::kHalf ? k::ScalarKind::f16
                            : k::ScalarKind::bf16;
  };
  int changed = 0, cases = 0;
  for (const Case c : {Case{at::kFloat, at::kFloat}, Case{at::kBFloat16, at::kFloat},
                       Case{at::kHalf, at::kFloat}, Case{at::kFloat, at::kBFloat16}})
    for (const int64_t level : {1, 2, 3})
      for (const bool two_d : {false, true})
        for (const std::vector<int64_t>& shape :
             {std::vector<int64_t>{16, 512}, {13, 1000}, {3, 4100}}) {
          const int64_t block = int64_t{1} << level, rows = shape[0], n = shape[1];
          const int64_t approx_len = (n + block - 1) / block;
          const int64_t state_rows = two_d ? (rows + block - 1) / block : rows;
          const at::Tensor g = at::randn(shape).to(c.param);
          // Three runs: no carry, a carry, a carry changed between the passes.
          std::vector<at::Tensor> p, m, v;
          std::vector<std::vector<float>> carry(3);
          std::vector<k::HaarAdamArgs> args(3);
          const at::Tensor p0 = at::randn(shape).to(c.param);
          const at::Tensor m0 = (at::randn({state_rows, approx_len}) * 0.1).to(c.state);
          const at::Tensor v0 = at::rand({state_rows, approx_len}).to(c.state);
          for (size_t r = 0; r < 3; ++r) {
            p.push_back(p0.clone()), m.push_back(m0.clone()), v.push_back(v0.clone());
            k::HaarAdamArgs& a = args[r];
            a.param = p[r].data_ptr(), a.grad = g.data_ptr();
            a.exp_avg = m[r].data_ptr(), a.exp_avg_sq = v[r].data_ptr();
            a.param_kind = kind_of(c.param), a.state_kind = kind_of(c.state);
            a.rows = rows, a.n = n, a.approx_len = approx_len, a.level = level;
            a.step_size = 1e-3, a.decay = 1e-4, a.two_d = two_d, a.height = two_d ? rows : 1;
            if (r > 0) {
              carry[r].assign(static_cast<size_t>(2 * state_rows * approx_len), 0.0f);
              a.carry = carry[r].data();
            }
          }
          const std::string what = c10::str(c.param, " params, ", c.state, " state, level ", level,
                                            two_d ? " 2-D " : " 1-D ", at::IntArrayRef(shape));
          for (int step = 0; step < 3; ++step) {
            double norms[3];
            for (size_t r = 0; r < 3; ++r) norms[r] = k::haar_adam_norm_sq_cpu(args[r]);
            EXPECT_EQ(norms[0], norms[1]) << what;
            for (float& x : carry[2]) x *= 1.5f;
            for (size_t r = 0; r < 3; ++r) k::haar_adam_update_cpu(args[r], 1.25);
          }
          EXPECT_TRUE(at::equal(p[0], p[1])) << what;
          EXPECT_TRUE(at::equal(m[0], m[1])) << what;
          EXPECT_TRUE(at::equal(v[0], v[1])) << what;
          changed += !at::equal(p[0], p[2]);
          ++cases;
        }
  // Every case has whole vector groups of coefficients, so the AVX2 bodies use the carry in all.
  if (avx2_bodies_run()) {
    EXPECT_EQ(changed, cases);
  } else {
    EXPECT_EQ(changed, 0);
  }
}

// The eight-lane body reads bfloat16 parameters, gradients and moments by widening them exactly and
// stores them by rounding the float it computed: its float operations are those of a float32 step
// on the same values, instruction for instruction. So one step from bfloat16 values (moments zero)
// must give the float32 step's result rounded, bit for bit: the parameters for bfloat16
// parameters, the moments for bfloat16 state (whose parameters must equal the float32 run's, the
// update using the moments before they are stored). Row counts are multiples of 8, so every row
// takes that body; a machine without it (no AVX2, or GWT_NO_AVX2 / GWT_NO_ROWS8 set) skips.
TEST(Fused, GeneralKernelRowGroupsInBFloat16AreTheFloat32StepRounded) {
  if (!avx2_bodies_run() || env_set("GWT_NO_ROWS8"))
    GTEST_SKIP() << "the eight-lane body does not run";
  for (const std::string wavelet : {"db2", "sym5"})
    for (const std::string boundary : {"zero", "symmetric", "periodization"})
      for (const std::vector<int64_t>& shape :
           {std::vector<int64_t>{8, 37}, {16, 100}, {24, 130}}) {
        const std::string what = wavelet + " " + boundary + " " + c10::str(at::IntArrayRef(shape));
        const auto o = base_options().wavelet(wavelet).boundary(boundary).level(2);
        // Values a bfloat16 holds exactly, of one magnitude (no flush to zero anywhere).
        const at::Tensor init = at::randn(shape, at::kDouble).to(at::kBFloat16).to(at::kDouble);
        const at::Tensor g = at::randn(shape, at::kDouble).to(at::kBFloat16).to(at::kDouble);
        OptRun f32 = make_run(init, at::kFloat, WaveletAdamOptions(o).fused(true));
        OptRun bf16 = make_run(init, at::kBFloat16, WaveletAdamOptions(o).fused(true));
        OptRun bf16_state =
            make_run(init, at::kFloat, WaveletAdamOptions(o).fused(true).state_dtype("bfloat16"));
        step(f32, g), step(bf16, g), step(bf16_state, g);
        EXPECT_TRUE(at::equal(bf16.param.detach(), f32.param.detach().to(at::kBFloat16))) << what;
        EXPECT_TRUE(at::equal(state_of(bf16).exp_avg(), state_of(f32).exp_avg())) << what;
        EXPECT_TRUE(at::equal(bf16_state.param.detach(), f32.param.detach())) << what;
        EXPECT_TRUE(
            at::equal(state_of(bf16_state).exp_avg(), state_of(f32).exp_avg().to(at::kBFloat16)))
            << what;
        EXPECT_TRUE(at::equal(state_of(bf16_state).exp_avg_sq(),
                              state_of(f32).exp_avg_sq().to(at::kBFloat16)))
            << what;
      }
}

// float16 as bfloat16 above: the AVX2 bodies widen float16 values exactly and round on store as
// c10::Half does (KernelSimd.HalfConversionsAreC10s), with float math, so one step from float16
// values (moments float32, zero) gives the float32 step's parameters rounded and the same moments,
// bit for bit, and so does the same gradient given in float32 (read as float32, exactly the same
// values): the Haar body (levels 1-3, 1-D and 2-D; lengths and heights multiples of 8 blocks,
// so no element takes the plain loops' tail) and the eight-row body (rows a multiple of 8). ATen's
// float-to-half cast rounds to nearest, ties to even, subnormals included, on every instruction
// set.
TEST(Fused, AvxBodiesInFloat16GiveTheFloat32StepRounded) {
  if (!avx2_bodies_run()) GTEST_SKIP() << "the AVX2 bodies do not run";
  struct Case {
    WaveletAdamOptions options;
    std::vector<int64_t> shape;
  };
  std::vector<Case> cases;
  for (int64_t level : {1, 2, 3}) {
    const int64_t span = 8 << level;  // 8 blocks of 2^level
    cases.push_back({base_options().level(level), {5, 2 * span}});
    cases.push_back({base_options().level(level).transform("2d"), {span, 2 * span}});
  }
  if (!env_set("GWT_NO_ROWS8"))
    for (const std::string wavelet : {"db2", "sym5"})
      for (const std::string boundary : {"zero", "symmetric", "periodization"})
        cases.push_back({base_options().wavelet(wavelet).boundary(boundary).level(2), {16, 100}});
  for (const auto& c : cases) {
    const std::string what = c.options.wavelet() + " L=" + std::to_string(c.options.level()) + " " +
                             c.options.transform() + " " + c.options.boundary();
    const at::Tensor init = at::randn(c.shape, at::kDouble).to(at::kHalf).to(at::kDouble);
    const at::Tensor g = at::randn(c.shape, at::kDouble).to(at::kHalf).to(at::kDouble);
    OptRun f32 = make_run(init, at::kFloat, WaveletAdamOptions(c.options).fused(true));
    OptRun f16 = make_run(init, at::kHalf, WaveletAdamOptions(c.options).fused(true));
    // The same float16 parameter with the same gradient in float32 (read as it is: grad_f32).
    OptRun f16_g32 = make_run(init, at::kHalf, WaveletAdamOptions(c.options).fused(true));
    ASSERT_TRUE(f16.opt->is_fused_param(f16.param)) << what;
    step(f32, g), step(f16, g);
    f16_g32.param.mutable_grad() = g.to(at::kFloat);
    f16_g32.opt->step();
    EXPECT_TRUE(at::equal(f16.param.detach(), f32.param.detach().to(at::kHalf))) << what;
    EXPECT_TRUE(at::equal(state_of(f16).exp_avg(), state_of(f32).exp_avg())) << what;
    EXPECT_TRUE(at::equal(state_of(f16).exp_avg_sq(), state_of(f32).exp_avg_sq())) << what;
    EXPECT_TRUE(at::equal(f16_g32.param.detach(), f16.param.detach())) << what << " grad_f32";
    EXPECT_TRUE(at::equal(state_of(f16_g32).exp_avg(), state_of(f16).exp_avg())) << what;
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

#ifdef GWT_TEST_BF16_AVX2_PROBE
// Every 16-bit pattern, 0 to 0xFFFF: every bfloat16 or float16.
std::vector<uint16_t> every_16_bit_pattern() {
  std::vector<uint16_t> every(65536);
  for (uint32_t u = 0; u < 65536; ++u) every[u] = static_cast<uint16_t>(u);
  return every;
}

// The floats the conversion tests round: every upper half of a float's bits, each with the given
// lower halves and `random` pseudo-random ones (a fixed linear congruential sequence from seed).
std::vector<float> floats_by_upper_half(const std::vector<uint32_t>& lows, int random,
                                        uint32_t seed) {
  std::vector<float> floats;
  floats.reserve(65536 * (lows.size() + static_cast<size_t>(random)));
  auto push = [&floats](uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    floats.push_back(f);
  };
  for (uint32_t high = 0; high < 65536; ++high) {
    for (uint32_t low : lows) push(high << 16 | low);
    for (int k = 0; k < random; ++k) {
      seed = seed * 1664525u + 1013904223u;
      push(high << 16 | seed >> 16);
    }
  }
  return floats;
}
#endif

// The AVX2 Haar loops store bfloat16 parameters and moments through bf16_avx2.h's rounding, the
// plain loops (and the reference) through c10::BFloat16(float): the two must agree bit for bit on
// every float, or the same step would round differently by CPU. Every bfloat16 widens; every upper
// half of a float rounds with the lower halves that decide it (0, 1, just below the tie, the tie,
// just above, the largest) and 58 pseudo-random ones: 4.2M floats, every NaN and infinity pattern's
// upper half included.
TEST(KernelSimd, BFloat16ConversionsAreC10s) {
#ifndef GWT_TEST_BF16_AVX2_PROBE
  GTEST_SKIP() << "not an x86-64 build: no AVX2 conversions to check";
#else
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "this CPU has no AVX2";
  const std::vector<uint16_t> every = every_16_bit_pattern();
  std::vector<float> widened(every.size());
  gwt_test::bf16_widen_avx2(every.data(), widened.data(), every.size());
  int64_t widen_mismatches = 0;
  for (uint32_t u = 0; u < 65536; ++u) {
    const float expected = c10::BFloat16(every[u], c10::BFloat16::from_bits());
    widen_mismatches += std::memcmp(&expected, &widened[u], sizeof(float)) != 0;
  }
  EXPECT_EQ(widen_mismatches, 0);

  const std::vector<float> floats =
      floats_by_upper_half({0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF}, 58, 20261205);
  std::vector<uint16_t> rounded(floats.size());
  gwt_test::bf16_round_avx2(floats.data(), rounded.data(), floats.size());
  int64_t round_mismatches = 0;
  uint32_t first_mismatch = 0;
  for (size_t i = 0; i < floats.size(); ++i) {
    if (c10::BFloat16(floats[i]).x == rounded[i]) continue;
    if (round_mismatches++ == 0) std::memcpy(&first_mismatch, &floats[i], sizeof first_mismatch);
  }
  EXPECT_EQ(round_mismatches, 0) << "first at float bits 0x" << std::hex << first_mismatch;
#endif
}

// The same for float16 (f16_avx2.h: F16C's instructions, with c10's NaN), against c10::Half's
// conversions, which are software in this file's build. Every float16 widens. Floats:
// every upper half, each with the lower halves around every multiple of 0x1000 (below, at, above)
// and 16 pseudo-random ones. The rounding points (and ties) of normal-range results are multiples
// of 0x2000 in the lower half; those of subnormal results are multiples of 0x4000 or 0x8000 there,
// or lie in the upper half, which is enumerated with the lower halves 0, 1 and 0xFFFF among them.
// 4.2M floats. Where this file is compiled with F16C (-mf16c, -march=native), c10 converts with
// it, and a NaN keeps its payload there and becomes 0x7E00 in the kernels: NaNs then compare by
// being NaN with the same sign. Both round in the default rounding mode (to nearest), which
// nothing in torch or gwt changes.
TEST(KernelSimd, HalfConversionsAreC10s) {
#ifndef GWT_TEST_BF16_AVX2_PROBE
  GTEST_SKIP() << "not an x86-64 build: no AVX2 conversions to check";
#else
  if (!__builtin_cpu_supports("avx2") || !cpu_has_f16c())
    GTEST_SKIP() << "this CPU has no AVX2 or no F16C";
#ifdef __F16C__  // (c10's own C10_X86_F16 is undefined again at the end of its Half.h)
  constexpr bool c10_keeps_nan_payloads = true;
#else
  constexpr bool c10_keeps_nan_payloads = false;
#endif
  auto same_nan = [](uint32_t a, uint32_t b, uint32_t sign_bit, bool a_nan, bool b_nan) {
    return a_nan && b_nan && (a & sign_bit) == (b & sign_bit);
  };
  const std::vector<uint16_t> every = every_16_bit_pattern();
  std::vector<float> widened(every.size());
  gwt_test::f16_widen_avx2(every.data(), widened.data(), every.size());
  int64_t widen_mismatches = 0;
  for (uint32_t u = 0; u < 65536; ++u) {
    const float expected = c10::Half(every[u], c10::Half::from_bits());
    uint32_t e, w;
    std::memcpy(&e, &expected, sizeof e), std::memcpy(&w, &widened[u], sizeof w);
    if (e == w) continue;
    widen_mismatches +=
        !(c10_keeps_nan_payloads &&
          same_nan(e, w, 0x80000000u, std::isnan(expected), std::isnan(widened[u])));
  }
  EXPECT_EQ(widen_mismatches, 0);

  std::vector<uint32_t> around_points;  // below, at and above every multiple of 0x1000
  for (uint32_t point = 0; point < 0x10000; point += 0x1000)
    for (uint32_t low : {point - 1, point, point + 1}) around_points.push_back(low & 0xFFFF);
  const std::vector<float> floats = floats_by_upper_half(around_points, 16, 20261206);
  std::vector<uint16_t> rounded(floats.size());
  gwt_test::f16_round_avx2(floats.data(), rounded.data(), floats.size());
  int64_t round_mismatches = 0;
  uint32_t first_mismatch = 0;
  for (size_t i = 0; i < floats.size(); ++i) {
    const c10::Half expected(floats[i]);
    if (expected.x == rounded[i]) continue;
    const bool result_nan = (rounded[i] & 0x7C00) == 0x7C00 && (rounded[i] & 0x03FF) != 0;
    if (c10_keeps_nan_payloads && same_nan(expected.x, rounded[i], 0x8000u,
                                           std::isnan(static_cast<float>(expected)), result_nan))
      continue;
    if (round_mismatches++ == 0) std::memcpy(&first_mismatch, &floats[i], sizeof first_mismatch);
  }
  EXPECT_EQ(round_mismatches, 0) << "first at float bits 0x" << std::hex << first_mismatch;
#endif
}

// The finiteness check of the CPU kernels (gwt::kernels::all_finite_cpu: the step's check of the
// reference path's gradients and of GaLore's) against ATen's isfinite, in every dtype it reads:
// all finite (the most negative finite value, the smallest subnormal and -0 among them), then
// NaN of either sign, +Inf and -Inf alone at the first and last element, on both sides of the
// first chunk boundary and inside the third chunk (chunks of 65536 values are checked in
// parallel), in lengths with and without a partial chunk or vector tail.
TEST(WaveletAdamKernels, AllFiniteFindsEveryNonFiniteValueInEveryDtype) {
  for (const auto dtype : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16}) {
    const auto kind = dtype == at::kDouble  ? gwt::kernels::ScalarKind::f64
                      : dtype == at::kFloat ? gwt::kernels::ScalarKind::f32
                      : dtype == at::kHalf  ? gwt::kernels::ScalarKind::f16
                                            : gwt::kernels::ScalarKind::bf16;
    // The dtype's largest finite value and its smallest subnormal.
    const std::pair<double, double> extremes =
        dtype == at::kDouble  ? std::make_pair(std::numeric_limits<double>::max(),
                                               std::numeric_limits<double>::denorm_min())
        : dtype == at::kFloat ? std::make_pair(double{std::numeric_limits<float>::max()},
                                               double{std::numeric_limits<float>::denorm_min()})
        : dtype == at::kHalf
            ? std::make_pair(static_cast<double>(std::numeric_limits<c10::Half>::max()),
                             static_cast<double>(std::numeric_limits<c10::Half>::denorm_min()))
            : std::make_pair(static_cast<double>(std::numeric_limits<c10::BFloat16>::max()),
                             static_cast<double>(std::numeric_limits<c10::BFloat16>::denorm_min()));
    for (const int64_t n :
         {int64_t{1}, int64_t{7}, int64_t{65536}, int64_t{65537}, int64_t{200003}}) {
      at::Tensor x = at::randn({n}, at::kDouble).to(dtype);
      x[0] = -extremes.first;
      if (n > 2) x[1] = -0.0, x[2] = extremes.second;
      ASSERT_TRUE(at::isfinite(x).all().item<bool>());
      EXPECT_TRUE(gwt::kernels::all_finite_cpu(x.data_ptr(), n, kind)) << dtype << " n " << n;
      for (const double bad :
           {std::numeric_limits<double>::quiet_NaN(), -std::numeric_limits<double>::quiet_NaN(),
            std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()})
        for (const int64_t pos :
             {int64_t{0}, n - 1, int64_t{65535}, int64_t{65536}, int64_t{150001}}) {
          if (pos >= n) continue;
          at::Tensor y = x.clone();
          y[pos] = bad;
          ASSERT_FALSE(at::isfinite(y).all().item<bool>());
          EXPECT_FALSE(gwt::kernels::all_finite_cpu(y.data_ptr(), n, kind))
              << dtype << " n " << n << " " << bad << " at " << pos;
        }
    }
  }
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

}  // namespace

namespace {

// The CUDA kernels against the CPU reference. They run only where a GPU is present; elsewhere the
// CUDA sources are still compiled and linked (GWT_CUDA=AUTO), and these tests say why they skip.
// The CUDA kernels' bodies run on the host: the general kernel's row bodies
// (src/kernels/shared/wavelet_row.h) with one lane, the Haar kernel's block bodies
// (src/kernels/shared/haar_block.h) block after block. This is the arithmetic and control flow the GPU
// runs, checked here against the ATen reference.
struct EmulatedKernel {
  at::Tensor m, v, norm;  // the optimizer state of one parameter
  int64_t kept = 0;

  template <typename S>
  void init_state(int64_t rows, int64_t approx_len) {
    if (m.defined()) return;
    const auto state = std::is_same_v<S, double>  ? at::kDouble
                       : std::is_same_v<S, float> ? at::kFloat
                                                  : at::kBFloat16;
    m = at::zeros({rows, approx_len}, state), v = at::zeros({rows, approx_len}, state);
  }

  // The kernel arguments of step t that do not depend on the wavelet.
  static void fill_args(gwt::kernels::HaarAdamArgs& a, int64_t rows, int64_t n, int64_t approx_len,
                        const WaveletAdamOptions& o, int64_t t) {
    a.n = n, a.rows = rows, a.approx_len = approx_len, a.level = o.level();
    std::tie(a.beta1, a.beta2) = o.betas();
    a.eps = o.eps();
    a.step_size =
        o.lr() * std::sqrt(1 - std::pow(a.beta2, t)) / (1 - std::pow(a.beta1, t)) * o.scale();
    a.decay = o.lr() * o.weight_decay();
  }

  // The limiter (docs/algorithm.md#the-norm-growth-limiter) from this step's norm pass.
  template <typename Acc>
  double limiter(Acc norm_sq, const WaveletAdamOptions& o) {
    const auto acc = std::is_same_v<Acc, double> ? at::kDouble : at::kFloat;
    const double now = std::sqrt(static_cast<double>(norm_sq)), gamma = o.norm_growth_limit();
    if (!norm.defined()) {
      norm = at::scalar_tensor(now, acc);
      return 1;
    }
    const double lim = std::max(now / (norm.item<double>() + 1e-8), gamma) / gamma;
    norm = at::scalar_tensor(now / lim, acc);
    return lim;
  }

  // One step of parameter p (rows x n, contiguous) with gradient g through the general kernel's
  // row bodies, as WaveletAdam does it: norm pass, limiter, update pass.
  template <typename P, typename S, typename Acc>
  void general_step(at::Tensor& p, const at::Tensor& g, const WaveletAdamOptions& o, int64_t t) {
    namespace k = gwt::kernels;
    const gwt::Wavelet wavelet(o.wavelet());
    const auto mode = gwt::boundary_mode_from_string(o.boundary());
    const int64_t n = p.size(-1), rows = p.numel() / n;
    const int64_t approx_len = gwt::approx_len(n, wavelet, o.level(), mode);
    init_state<S>(rows, approx_len);
    k::WaveletAdamArgs a;
    fill_args(a, rows, n, approx_len, o, t);
    a.dec_lo = wavelet.dec_lo().data(), a.dec_hi = wavelet.dec_hi().data();
    a.filter_length = wavelet.length(), a.boundary = mode;
    a.coeff_len = k::wavelet_workspace_len(n, wavelet.length(), o.level(), mode);
    a.threshold = o.threshold(), a.threshold_soft = o.threshold_mode() == "soft";
    const auto f = k::row::make_row_plan<Acc>(a);
    // What one CUDA block keeps in shared memory: the row's coefficients, two scratch rows and the
    // denominators (cuda/wavelet_adam.cu), reused row after row.
    std::vector<Acc> w(a.coeff_len), buf0(f.buffer_len), buf1(f.buffer_len), den(approx_len);
    EXPECT_EQ(static_cast<int64_t>((w.size() + 2 * buf0.size() + den.size()) * sizeof(Acc)),
              k::wavelet_row_scratch_bytes(n, a.filter_length, a.level, mode, sizeof(Acc) == 8));
    const k::row::HostLanes lanes;
    const P* gp = g.data_ptr<P>();
    P* pp = p.data_ptr<P>();
    S *mp = m.data_ptr<S>(), *vp = v.data_ptr<S>();
    Acc norm_sq = 0;
    for (int64_t r = 0; r < rows; ++r)
      norm_sq +=
          k::row::row_norm_sq<P, S, Acc>(lanes, f, gp + r * n, mp + r * approx_len,
                                         vp + r * approx_len, w.data(), buf0.data(), buf1.data());
    const double lim = limiter(norm_sq, o);
    kept = 0;
    for (int64_t r = 0; r < rows; ++r) {  // the update pass computes the coefficients again
      k::row::row_dwt<P, Acc>(lanes, f, gp + r * n, w.data(), buf0.data(), buf1.data());
      kept += k::row::row_update<P, S, Acc>(lanes, f, static_cast<Acc>(lim), pp + r * n,
                                            mp + r * approx_len, vp + r * approx_len, w.data(),
                                            buf0.data(), buf1.data(), den.data());
    }
  }

  // The same step through the Haar kernel's block bodies (blocks of B = 2^level elements).
  template <typename P, typename S, typename Acc, int B>
  void haar_step(at::Tensor& p, const at::Tensor& g, const WaveletAdamOptions& o, int64_t t) {
    namespace hb = gwt::kernels::haar_block;
    const int64_t n = p.size(-1), rows = p.numel() / n, approx_len = (n + B - 1) / B;
    ASSERT_EQ(int64_t{1} << o.level(), B);
    gwt::kernels::HaarAdamArgs a;
    fill_args(a, rows, n, approx_len, o, t);
    a.two_d = o.transform() == "2d";
    if (a.two_d) a.height = p.size(-2);
    const hb::Scalars s = hb::scalars_of(a);
    init_state<S>(s.state_rows, approx_len);
    const P* gp = g.data_ptr<P>();
    P* pp = p.data_ptr<P>();
    S *mp = m.data_ptr<S>(), *vp = v.data_ptr<S>();
    Acc norm_sq = 0;
    for (int64_t k = 0; k < hb::coefficients(s); ++k)
      norm_sq += hb::norm_term<P, S, Acc, B>(gp, mp, vp, s, k, false);
    const Acc lim = static_cast<Acc>(limiter(norm_sq, o));
    for (int64_t k = 0; k < hb::coefficients(s); ++k)
      hb::update<P, S, Acc, B>(pp, gp, mp, vp, s, lim, k, false);
  }
};

TEST(KernelRows, CudaHaarBlockBodiesMatchTheReferenceOnTheHost) {
  for (const std::string transform : {"1d", "2d"})
    for (const auto& shape : std::vector<std::vector<int64_t>>{{5, 37}, {3, 11, 33}, {16, 64}})
      for (int64_t level : {1, 2, 3}) {
        SCOPED_TRACE(transform + " shape " + c10::str(at::IntArrayRef(shape)) + " level " +
                     std::to_string(level));
        const auto o = base_options().level(level).transform(transform);
        const at::Tensor init = at::randn(shape, at::kDouble);
        OptRun reference = make_run(init, at::kDouble, WaveletAdamOptions(o).fused(false));
        if (!reference.opt->is_wavelet_param(reference.param)) continue;  // 2-D, 5 rows < 2^3
        at::Tensor p = init.clone(), p32 = init.to(at::kFloat);
        gwt_test::RoundingBound bound(shape, o, at::kFloat, at::kFloat);
        EmulatedKernel emulated, emulated32;
        int64_t t = 0;
        for (const auto& g :
             gwt_test::well_conditioned_gradients(shape, 5, 36, at::kFloat, transform == "2d")) {
          const at::Tensor g32 = g.to(at::kFloat);
          step(reference, g);
          bound.step(g, reference.param.detach());
          ++t;
          switch (level) {
            case 1:
              emulated.haar_step<double, double, double, 2>(p, g, o, t);
              emulated32.haar_step<float, float, float, 2>(p32, g32, o, t);
              break;
            case 2:
              emulated.haar_step<double, double, double, 4>(p, g, o, t);
              emulated32.haar_step<float, float, float, 4>(p32, g32, o, t);
              break;
            default:
              emulated.haar_step<double, double, double, 8>(p, g, o, t);
              emulated32.haar_step<float, float, float, 8>(p32, g32, o, t);
          }
          // float64 exactly as the reference (the GPU body once read float64 through float);
          // float32 within the rounding bound of the float64 reference.
          EXPECT_LE(rel_error(p, reference.param), 1e-10) << "step " << t;
          expect_within_bound(p32, reference.param, bound, 1e-4, "float32 body");
        }
      }
}

TEST(KernelRows, CudaRowBodiesMatchTheReferenceOnTheHostInFloat64) {
  for (const std::string wavelet : {"db2", "sym3", "coif1", "haar"})
    for (const std::string boundary : {"zero", "periodization", "symmetric"})
      for (int64_t level : {1, 2, 3})
        for (double threshold : {0.0, 0.4}) {
          SCOPED_TRACE(wavelet + " " + boundary + " level " + std::to_string(level) +
                       " threshold " + std::to_string(threshold));
          const auto o = base_options()
                             .wavelet(wavelet)
                             .boundary(boundary)
                             .level(level)
                             .threshold(threshold)
                             .threshold_mode(level == 2 ? "hard" : "soft");
          const std::vector<int64_t> shape = {3, 41};
          const at::Tensor init = at::randn(shape, at::kDouble);
          OptRun reference = make_run(init, at::kDouble, WaveletAdamOptions(o).fused(false));
          at::Tensor p = init.clone();
          EmulatedKernel emulated;
          int64_t t = 0;
          // One-sign rows, as in ThresholdedDetailsMatchTheReference (measured 5.8e-16).
          for (const auto& g : gwt_test::well_conditioned_gradients(shape, 5, 31, at::kDouble)) {
            step(reference, g);
            emulated.general_step<double, double, double>(p, g, o, ++t);
            EXPECT_LE(rel_error(p, reference.param), 1e-10) << "step " << t;
            if (threshold > 0) {
              EXPECT_EQ(emulated.kept, reference.opt->kept_details().first);
            }
          }
        }
}

TEST(KernelRows, CudaRowBodiesInHalfPrecisionWithBFloat16State) {
  // Half parameters and bfloat16 moments, math in float: the types the GPU body converts. The
  // body and the CPU kernel each within the rounding bound of the float64 run.
  const auto o = base_options().wavelet("db2").level(2).state_dtype("bfloat16");
  const std::vector<int64_t> shape = {4, 70};
  const at::Tensor init = at::randn(shape, at::kDouble).to(at::kHalf);
  BoundedRuns runs(init.to(at::kDouble), at::kHalf, o, at::kBFloat16);
  ASSERT_TRUE(runs.fused.opt->is_fused_param(runs.fused.param));
  at::Tensor p = init.clone();
  EmulatedKernel emulated;
  int64_t t = 0;
  for (const auto& g : gwt_test::well_conditioned_gradients(shape, 5, 32, at::kHalf)) {
    runs.step_and_check(g, 0.1, "half/bf16");  // 0.1: bf16 moments (see check_low_precision)
    emulated.general_step<c10::Half, c10::BFloat16, float>(p, g.to(at::kHalf), o, ++t);
    expect_within_bound(p, runs.exact.param, runs.bound, 0.1, "half/bf16 row body");
  }
}

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
