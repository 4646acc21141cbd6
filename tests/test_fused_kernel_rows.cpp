// The CUDA kernels' bodies run on the host against the ATen reference (KernelRows), on every
// machine (the kernels on a device: FusedCuda in test_fused.cpp).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "bound_expect.h"
#include "float_bound.h"
#include "fused_test_util.h"
#include "gwt/gwt.h"
#include "kernels/kernels.h"
#include "kernels/shared/haar_block.h"
#include "kernels/shared/wavelet_row.h"

namespace {

using gwt::WaveletAdamOptions;
using gwt_test::expect_within_bound;
using gwt_test::rel_error;
using namespace gwt_test::fused;

// The CUDA kernels' bodies run on the host: the general kernel's row bodies
// (src/kernels/shared/wavelet_row.h) with one lane, the Haar kernel's block bodies
// (src/kernels/shared/haar_block.h) block after block. This is the arithmetic and control flow the
// GPU runs, checked here against the ATen reference.
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

}  // namespace
