// The fused kernels against the readable ATen reference (WaveletAdamOptions::fused(false)).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "../src/kernels/haar_block.h"
#include "../src/kernels/wavelet_row.h"
#include "gwt/gwt.h"
#include "gwt/kernels.h"
#include "test_util.h"

namespace {

using gwt::WaveletAdam;
using gwt::WaveletAdamOptions;
using gwt_test::max_abs_diff;

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

// max |a - b| / max |b|: the error relative to the parameter's magnitude.
double rel_error(const at::Tensor& a, const at::Tensor& b) {
  return max_abs_diff(a, b) / b.to(at::kDouble).abs().max().item<double>();
}

// fp32: within 1e-5 relative of the reference, element by element (relative to |p| plus the mean
// |p|, so values crossing zero do not demand more than float32 holds). Where a block's gradients
// nearly cancel, its approximation coefficient and denominator are tiny and float32 rounding of
// that sum shows in the update of either implementation, by chance more in one or the other; there
// the rule is the one for bf16: the fused result is at most twice as far from float64 as the
// reference is (worst element against worst element, plus the same 1e-5 relative slack).
void expect_close_to_reference(const at::Tensor& fused, const at::Tensor& reference,
                               const at::Tensor& exact) {
  const at::Tensor f = fused.to(at::kDouble), r = reference.to(at::kDouble),
                   e = exact.to(at::kDouble);
  const bool elementwise = ((f - r).abs() <= 1e-5 * (r.abs() + r.abs().mean())).all().item<bool>();
  const double fused_error = (f - e).abs().max().item<double>();
  const double reference_error = (r - e).abs().max().item<double>();
  EXPECT_TRUE(elementwise ||
              fused_error <= 2 * reference_error + 1e-5 * r.abs().max().item<double>())
      << "worst |fused - reference| " << (f - r).abs().max().item<double>() << ", fused error "
      << fused_error << " against reference error " << reference_error;
}

// One unit in the last place, in dtype (bf16 or fp16), of the largest value of x. Parameters can
// grow far from their initial values (a block whose approximation cancels gets a large update), so
// the slack is taken at the current magnitude.
double ulp_of(at::ScalarType dtype, const at::Tensor& x) {
  const double largest = x.to(at::kDouble).abs().max().item<double>();
  return std::ldexp(1.0, std::ilogb(largest) - (dtype == at::kBFloat16 ? 7 : 10));
}

TEST(Fused, HaarMatchesReferenceInFloat32AcrossShapesAndLevels) {
  const std::vector<std::vector<int64_t>> shapes = {
      {8, 64}, {5, 37}, {3, 4, 33}, {2, 1031}, {16, 8}};
  for (const auto& shape : shapes)
    for (int64_t level : {1, 2, 3})
      for (double gamma : {1.01, 0.0}) {
        SCOPED_TRACE("shape " + c10::str(at::IntArrayRef(shape)) + " level " +
                     std::to_string(level) + " gamma " + std::to_string(gamma));
        const auto o = base_options().level(level).norm_growth_limit(gamma);
        const at::Tensor init = at::randn(shape, at::kDouble);
        OptRun fused = make_run(init, at::kFloat, WaveletAdamOptions(o).fused(true));
        OptRun reference = make_run(init, at::kFloat, WaveletAdamOptions(o).fused(false));
        OptRun exact = make_run(init, at::kDouble, WaveletAdamOptions(o).fused(false));
        ASSERT_TRUE(fused.opt->is_fused_param(fused.param));
        ASSERT_FALSE(reference.opt->is_fused_param(reference.param));
        for (const auto& g : gradients(shape, 6, 21)) {
          const at::Tensor g32 = g.to(at::kFloat).to(at::kDouble);
          step(fused, g32), step(reference, g32), step(exact, g32);
          expect_close_to_reference(fused.param, reference.param, exact.param);
        }
        // Where nothing is ill-conditioned the plain rule holds: the moments.
        const auto& sf = static_cast<const gwt::WaveletAdamParamState&>(
            *fused.opt->state().at(fused.param.unsafeGetTensorImpl()));
        const auto& sr = static_cast<const gwt::WaveletAdamParamState&>(
            *reference.opt->state().at(reference.param.unsafeGetTensorImpl()));
        EXPECT_LE(rel_error(sf.exp_avg(), sr.exp_avg()), 1e-5);
      }
}

TEST(Fused, Haar2dMatchesReferenceInFloat32) {
  // transform("2d"): blocks of 2^L x 2^L; odd sizes pad with zeros (zero mode), batch dimensions.
  const std::vector<std::vector<int64_t>> shapes = {{64, 96}, {3, 17, 40}, {8, 8}, {37, 70}};
  for (const auto& shape : shapes)
    for (int64_t level : {1, 2, 3}) {
      SCOPED_TRACE("shape " + c10::str(at::IntArrayRef(shape)) + " level " + std::to_string(level));
      const auto o = base_options().transform("2d").level(level);
      const at::Tensor init = at::randn(shape, at::kDouble);
      OptRun fused = make_run(init, at::kFloat, o);
      ASSERT_TRUE(fused.opt->is_fused_param(fused.param));
      OptRun reference = make_run(init, at::kFloat, WaveletAdamOptions(o).fused(false));
      OptRun exact = make_run(init, at::kDouble, WaveletAdamOptions(o).fused(false));
      for (const auto& g : gradients(shape, 5, 34)) {
        const at::Tensor g32 = g.to(at::kFloat).to(at::kDouble);
        step(fused, g32), step(reference, g32), step(exact, g32);
        expect_close_to_reference(fused.param, reference.param, exact.param);
      }
      EXPECT_EQ(fused.opt->state_bytes(fused.param), reference.opt->state_bytes(reference.param));
    }
}

TEST(Fused, HaarMatchesReferenceInFloat64) {
  for (const auto& shape : std::vector<std::vector<int64_t>>{{6, 45}, {4, 2048}})
    for (int64_t level : {1, 2, 3}) {
      const auto o = base_options().level(level);
      const at::Tensor init = at::randn(shape, at::kDouble);
      OptRun fused = make_run(init, at::kDouble, o);
      OptRun reference = make_run(init, at::kDouble, WaveletAdamOptions(o).fused(false));
      ASSERT_TRUE(fused.opt->is_fused_param(fused.param));
      for (const auto& g : gradients(shape, 6, 22)) {
        step(fused, g), step(reference, g);
        EXPECT_LE(rel_error(fused.param, reference.param), 1e-11) << "level " << level;
      }
    }
}

TEST(Fused, GeneralWaveletsMatchReferenceForEveryModeAndLevel) {
  for (const std::string wavelet : {"db2", "sym3", "coif1", "db4", "db5", "sym8", "coif3"})
    for (const std::string boundary : {"zero", "periodization", "symmetric"})
      for (int64_t level : {1, 2, 3}) {
        SCOPED_TRACE(wavelet + " " + boundary + " level " + std::to_string(level));
        const auto o = base_options().wavelet(wavelet).boundary(boundary).level(level);
        const std::vector<int64_t> shape = {3, 5, 41};
        const at::Tensor init = at::randn(shape, at::kDouble);
        OptRun fused64 = make_run(init, at::kDouble, o);
        OptRun reference64 = make_run(init, at::kDouble, WaveletAdamOptions(o).fused(false));
        OptRun fused32 = make_run(init, at::kFloat, o);
        OptRun reference32 = make_run(init, at::kFloat, WaveletAdamOptions(o).fused(false));
        ASSERT_TRUE(fused64.opt->is_fused_param(fused64.param));
        for (const auto& g : gradients(shape, 5, 28)) {
          const at::Tensor g32 = g.to(at::kFloat).to(at::kDouble);
          step(fused64, g32), step(reference64, g32), step(fused32, g32), step(reference32, g32);
          EXPECT_LE(rel_error(fused64.param, reference64.param), 1e-11);
          expect_close_to_reference(fused32.param, reference32.param, reference64.param);
        }
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
      for (const auto& g : gradients({5, 43}, 4, 30)) {
        step(fused, g), step(reference, g);
        EXPECT_LE(rel_error(fused.param, reference.param), 1e-11);
        EXPECT_EQ(fused.opt->kept_details(), reference.opt->kept_details());
      }
      EXPECT_GT(fused.opt->kept_details().first, 0);
    }
}

TEST(Fused, GeneralWaveletsInHalfPrecision) {
  // {64, 100} in half: one block's approximation nearly cancels and its parameter moves from -0.26
  // to 175, where one half ulp is 0.125 (the case that showed the slack must follow the values).
  for (auto dtype : {at::kBFloat16, at::kHalf})
    for (const std::vector<int64_t>& shape : {std::vector<int64_t>{6, 77}, {64, 100}}) {
      SCOPED_TRACE(c10::str(dtype, " ", at::IntArrayRef(shape)));
      const auto o = base_options().wavelet("db2").level(2);
      const at::Tensor init = at::randn(shape, at::kDouble).to(dtype).to(at::kDouble);
      OptRun fused = make_run(init, dtype, o);
      OptRun reference = make_run(init, dtype, WaveletAdamOptions(o).fused(false));
      OptRun exact = make_run(init, at::kDouble, WaveletAdamOptions(o).fused(false));
      for (const auto& g : gradients(shape, 5, 29)) {
        const at::Tensor g_low = g.to(dtype).to(at::kDouble);
        step(fused, g_low), step(reference, g_low), step(exact, g_low);
        EXPECT_LE(max_abs_diff(fused.param, exact.param),
                  2 * max_abs_diff(reference.param, exact.param) + ulp_of(dtype, exact.param));
      }
    }
}

TEST(Fused, NonContiguousGradient) {
  const at::Tensor init = at::randn({8, 40}, at::kDouble);
  OptRun fused = make_run(init, at::kFloat, base_options());
  OptRun reference = make_run(init, at::kFloat, base_options().fused(false));
  OptRun exact = make_run(init, at::kDouble, base_options().fused(false));
  for (int t = 0; t < 4; ++t) {
    const at::Tensor g = at::randn({40, 8}).t();  // a transposed view
    ASSERT_FALSE(g.is_contiguous());
    fused.param.mutable_grad() = g;
    reference.param.mutable_grad() = g.clone();
    exact.param.mutable_grad() = g.to(at::kDouble);
    fused.opt->step(), reference.opt->step(), exact.opt->step();
    expect_close_to_reference(fused.param, reference.param, exact.param);
  }
}

// bf16/fp16: at most twice the reference's own error against float64 (plus one unit in the last
// place of the largest value, for cases where the reference happens to round exactly).
void check_low_precision(at::ScalarType dtype, const std::string& state_dtype) {
  const std::vector<int64_t> shape = {12, 70};
  const auto o = base_options().level(2).state_dtype(state_dtype);
  const at::Tensor init = at::randn(shape, at::kDouble).to(dtype).to(at::kDouble);
  OptRun fused = make_run(init, dtype, o);
  OptRun reference = make_run(init, dtype, WaveletAdamOptions(o).fused(false));
  OptRun exact =
      make_run(init, at::kDouble, WaveletAdamOptions(o).state_dtype("auto").fused(false));
  ASSERT_TRUE(fused.opt->is_fused_param(fused.param));
  for (const auto& g : gradients(shape, 5, 23)) {
    const at::Tensor g_low = g.to(dtype).to(at::kDouble);  // what the low-precision runs see
    step(fused, g_low), step(reference, g_low), step(exact, g_low);
    const double err_reference = max_abs_diff(reference.param, exact.param);
    const double err_fused = max_abs_diff(fused.param, exact.param);
    EXPECT_LE(err_fused, 2 * err_reference + ulp_of(dtype, exact.param))
        << dtype << " state " << state_dtype;
  }
  EXPECT_EQ(fused.opt->state_bytes(fused.param), reference.opt->state_bytes(reference.param));
}

TEST(Fused, BFloat16AndHalfParametersStayWithinTwiceTheReferenceError) {
  check_low_precision(at::kBFloat16, "auto");
  check_low_precision(at::kHalf, "auto");
}

TEST(Fused, BFloat16StateHalvesTheStateAndStaysWithinTwiceTheReferenceError) {
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
  const at::Tensor init = at::randn({64, 4096}, at::kDouble);
  std::vector<at::Tensor> results;
  for (int n : {1, 2}) {
    at::set_num_threads(n);
    OptRun r = make_run(init, at::kFloat, base_options());
    for (const auto& g : gradients({64, 4096}, 3, 24)) step(r, g);
    results.push_back(r.param.detach().clone());
  }
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(results[0], results[1]));
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
// (src/kernels/wavelet_row.h) with one lane, the Haar kernel's block bodies
// (src/kernels/haar_block.h) block after block. This is the arithmetic and control flow the GPU
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

  // SPEC 1.1's limiter from this step's norm pass.
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
        OptRun reference32 = make_run(init, at::kFloat, WaveletAdamOptions(o).fused(false));
        if (!reference.opt->is_wavelet_param(reference.param)) continue;  // 2-D, 5 rows < 2^3
        at::Tensor p = init.clone(), p32 = init.to(at::kFloat);
        EmulatedKernel emulated, emulated32;
        int64_t t = 0;
        for (const auto& g : gradients(shape, 5, 36)) {
          const at::Tensor g32 = g.to(at::kFloat);
          step(reference, g), step(reference32, g32.to(at::kDouble));
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
          // float32 by the fp32 rule.
          EXPECT_LE(rel_error(p, reference.param), 1e-10) << "step " << t;
          expect_close_to_reference(p32, reference32.param, reference.param);
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
          for (const auto& g : gradients(shape, 5, 31)) {
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
  // Half parameters and bfloat16 moments, math in float: the types the GPU body converts.
  const auto o = base_options().wavelet("db2").level(2).state_dtype("bfloat16");
  const std::vector<int64_t> shape = {4, 70};
  const at::Tensor init = at::randn(shape, at::kDouble).to(at::kHalf);
  OptRun fused = make_run(init, at::kHalf, o);
  ASSERT_TRUE(fused.opt->is_fused_param(fused.param));
  at::Tensor p = init.clone();
  EmulatedKernel emulated;
  int64_t t = 0;
  for (const auto& g : gradients(shape, 5, 32)) {
    const at::Tensor g16 = g.to(at::kHalf);
    step(fused, g16);
    emulated.general_step<c10::Half, c10::BFloat16, float>(p, g16, o, ++t);
    // Both round the same float math to half; a few values may land one half ulp apart.
    EXPECT_LE(max_abs_diff(p, fused.param), ulp_of(at::kHalf, fused.param));
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
          OptRun reference = make_run(init, dtype, WaveletAdamOptions(o).fused(false));
          OptRun exact = make_run(init, at::kDouble, WaveletAdamOptions(o).fused(false));
          for (const auto& g : gradients(shape, 5, 26)) {
            const at::Tensor g_cast = g.to(dtype);
            gpu.mutable_grad() = g_cast.cuda();
            gpu_opt.step();
            step(reference, g_cast.to(at::kDouble)), step(exact, g_cast.to(at::kDouble));
            if (dtype == at::kDouble) {  // float64 math on the device too
              EXPECT_LE(rel_error(gpu.cpu(), reference.param), 1e-10);
            } else if (dtype == at::kFloat) {
              expect_close_to_reference(gpu.cpu(), reference.param, exact.param);
            } else {
              EXPECT_LE(
                  max_abs_diff(gpu.cpu(), exact.param),
                  2 * max_abs_diff(reference.param, exact.param) + ulp_of(dtype, exact.param));
            }
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
      for (const auto& g : gradients(shape, 4, 33)) {
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
      for (const auto& g : gradients(shape, 4, 37)) {
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
  const auto grads = gradients({96, 16}, 6, 27);
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
      p.mutable_grad() = grads[t].to(at::kFloat).cuda().t();  // non-contiguous
      opt->step();
    }
    return p.detach().cpu();
  };
  OptRun reference = make_run(init, at::kFloat, base_options().fused(false));
  OptRun exact = make_run(init, at::kDouble, base_options().fused(false));
  for (const auto& g : grads) {
    const at::Tensor g32 = g.t().contiguous().to(at::kFloat).to(at::kDouble);
    step(reference, g32), step(exact, g32);
  }
  const at::Tensor straight = run(false);
  EXPECT_TRUE(at::equal(straight, run(true)));
  expect_close_to_reference(straight, reference.param, exact.param);
}

}  // namespace
