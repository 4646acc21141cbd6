#pragma once

// A forward error bound for WaveletAdam in reduced precision, derived from the data.
//
// Why: comparing a float32 (or bf16/fp16) run with another float32 run by "at most twice its error"
// compares two chance outcomes: where a block's gradients nearly cancel, either implementation can
// be luckier, and which one is depends on the BLAS and instruction set (issue 12: a suite green on
// one CPU model failed on another with AVX-512). Instead, each low-precision run is held to a bound on
// its distance from the float64 run, computed here in float64 from the same inputs, by the usual
// first-order (Wilkinson-style) rounding analysis: every computed sum of k terms is within
// k * u * (sum of |terms|) of the exact one, every product or quotient within u relative. The
// "sum of |terms|" of each quantity is tracked alongside it (a shadow computation with absolute
// values and absolute filter taps), so the bound follows the data: it is large exactly where
// cancellation makes a result sensitive, and small elsewhere. Each constant below over-counts the
// operations of either implementation (the ATen reference, the fused CPU kernels, the CUDA bodies),
// so the bound holds for any summation order, BLAS, instruction set or thread count: it cannot be
// failed by chance, only by a computation that is not the rule.
//
// A bound is only worth something if it is small: tests build well-conditioned gradients
// (every row of one sign, so no approximation coefficient cancels: kappa, the ratio of an
// approximation's |terms| sum to its |value|, stays small; checked by the tests) and assert that
// the bound is a small fraction of the parameters, so that a real error (a wrong formula, a value
// read through the wrong type) exceeds it.

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "gwt/gwt.h"

namespace gwt_test {

/// Unit roundoff of a floating dtype: half the distance from 1 to the next value.
inline double unit_roundoff(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble:
      return std::ldexp(1.0, -53);
    case at::kFloat:
      return std::ldexp(1.0, -24);
    case at::kHalf:
      return std::ldexp(1.0, -11);
    case at::kBFloat16:
      return std::ldexp(1.0, -8);
    default:
      TORCH_CHECK(false, "unit_roundoff: not a floating dtype: ", dtype);
  }
}

/// Gradients whose every row (last dimension; for transform("2d") every matrix of the last two)
/// has one sign at each step, magnitudes in [0.5, 1.5) times (1 + 2t) so that the norm-growth
/// limiter acts, signs drawn per row and step. Values are rounded to `dtype` (what the
/// low-precision runs see) and returned in float64.
inline std::vector<at::Tensor> well_conditioned_gradients(at::IntArrayRef shape, int steps,
                                                          int64_t seed, at::ScalarType dtype,
                                                          bool two_d = false) {
  at::manual_seed(seed);
  std::vector<int64_t> sign_shape(shape.begin(), shape.end());
  sign_shape.back() = 1;
  if (two_d) sign_shape[sign_shape.size() - 2] = 1;
  std::vector<at::Tensor> out;
  for (int t = 0; t < steps; ++t) {
    const at::Tensor magnitude = (at::rand(shape, at::kDouble) + 0.5) * (1 + 2 * t);
    const at::Tensor sign = at::where(at::rand(sign_shape, at::kDouble) < 0.5, -1.0, 1.0);
    out.push_back((sign * magnitude).to(dtype).to(at::kDouble));
  }
  return out;
}

/// The bound, step by step, for one WaveletAdam parameter (dim -1, correct_bias on, no
/// threshold). `param_dtype`: the parameter's dtype; `state_dtype`: the moments' dtype; the math
/// runs in float32 for every reduced type (as both implementations do).
class RoundingBound {
 public:
  RoundingBound(at::IntArrayRef shape, const gwt::WaveletAdamOptions& o, at::ScalarType param_dtype,
                at::ScalarType state_dtype)
      : o_(o),
        shape_(shape.vec()),
        u_(unit_roundoff(param_dtype == at::kDouble ? at::kDouble : at::kFloat)),
        u_param_(unit_roundoff(param_dtype)),
        u_state_(unit_roundoff(state_dtype)),
        // A reduced-precision run is compared with the float64 run, whose own error (far below
        // the reduced run's) this term covers. A float64 run is compared with another float64
        // run, each bounded on its own (Float64Runs doubles the bound): no such term.
        reference_rel_(param_dtype == at::kDouble ? 0.0 : 1e-13),
        two_d_(o.transform() == "2d") {
    TORCH_CHECK(o.dim() == -1 || o.dim() == static_cast<int64_t>(shape.size()) - 1,
                "RoundingBound: dim -1 only");
    TORCH_CHECK(o.threshold() == 0 && o.correct_bias(), "RoundingBound: no threshold, bias on");
    TORCH_CHECK(!two_d_ || o.wavelet() == "haar" || o.wavelet() == "db1",
                "RoundingBound: 2-D Haar");
    if (!two_d_) build_linear_maps();
  }

  /// Adds step t's rounding to the bound; `g`: the float64 gradient all runs saw, `p_exact`: the
  /// float64 run's parameter after the step.
  void step(const at::Tensor& g, const at::Tensor& p_exact) {
    ++t_;
    const auto [b1, b2] = o_.betas();
    const int64_t L = o_.level();
    at::Tensor approx, approx_abs, update_abs;  // A, its |terms| sum, and the update's
    double ops;                                 // roundings along one coefficient's sums
    std::vector<at::Tensor> detail_abs;
    if (two_d_) {
      const auto c = gwt::wavedec2(g, "haar", L, gwt::boundary_mode_from_string(o_.boundary()));
      const auto c_abs =
          gwt::wavedec2(g.abs(), "haar", L, gwt::boundary_mode_from_string(o_.boundary()));
      approx = c.approx, approx_abs = c_abs.approx;  // Haar's low-pass taps are positive
      ops = std::ldexp(1.0, 2 * L) + 2 * L;
    } else {
      const at::Tensor rows = g.reshape({-1, shape_.back()});
      approx = rows.mm(wa_), approx_abs = rows.abs().mm(wa_.abs());
      for (const auto& w : wd_) detail_abs.push_back(rows.abs().mm(w.abs()));
      ops = static_cast<double>(gwt::Wavelet(o_.wavelet()).length()) * L;
    }
    ops_ = ops;
    const double kappa = (approx_abs / approx.abs()).max().item<double>();
    kappa_ = std::max(kappa_, kappa);
    if (!m_abs_.defined()) m_abs_ = at::zeros_like(approx), v_ = at::zeros_like(approx);
    m_abs_ = b1 * m_abs_ + (1 - b1) * approx_abs;
    v_ = b2 * v_ + (1 - b2) * approx * approx;
    const at::Tensor den = v_.sqrt() + o_.eps();
    // Relative error of the denominator: A (ops * kappa), squaring, the moment's update and
    // storage, carried over t steps; then the square root and eps.
    const double den_rel = (ops * kappa_ + 3.0 * t_ + 4) * u_ + t_ * u_state_;
    // Relative error of every normalised coefficient against its |terms| bound below.
    const double coeff_rel = (ops * kappa_ + 3.0 * t_ + 4) * u_ + t_ * u_state_ + den_rel;
    // The limiter divides this step's norm (numel(A) squares of coefficients) by the stored one,
    // which is an earlier step's norm, or that norm times a power of gamma while the limiter acts:
    // the stored norm's error does not grow with t beyond the coefficients' (coeff_rel grows).
    if (o_.norm_growth_limit() > 0)
      limiter_rel_ = 2 * (coeff_rel + (static_cast<double>(approx.numel()) + 8) * u_);
    if (two_d_) {
      // Every term of the 2-D Haar reconstruction (N * 2^-L, each level's details times their
      // synthesis weights, or the fused kernels' g_ij + (m - A) 2^-L) is at most the block's
      // |g| sum, or |g_ij|, or |m| 2^-L, over the block's denominator.
      const int64_t block = int64_t{1} << L;
      const double area = std::ldexp(1.0, -L);  // the LL coefficient is the block sum times 2^-L
      auto spread = [&](const at::Tensor& x) {
        return at::repeat_interleave(at::repeat_interleave(x, block, -2), block, -1)
            .slice(-2, 0, g.size(-2))
            .slice(-1, 0, g.size(-1));
      };
      update_abs = g.abs() / spread(den) + spread((m_abs_ * area + approx_abs / area) / den);
    } else {
      // Normalised coefficients' |terms| bounds: approximation (m, and A for kernels that write
      // g + (m - A) terms), details over the denominator spread as docs/algorithm.md#the-update
      // spreads it.
      at::Tensor u = ((m_abs_ + approx_abs) / den).mm(ra_.abs());
      at::Tensor d = den;
      for (size_t k = 0; k < detail_abs.size(); ++k) {
        const int64_t len = detail_abs[k].size(-1);
        u = u + (detail_abs[k] / d.slice(-1, 0, len)).mm(rd_[k].abs());
        d = at::repeat_interleave(d, 2, -1);
      }
      update_abs = u.reshape(shape_);
    }
    const auto [beta1, beta2] = o_.betas();
    const double step_size =
        o_.lr() * std::sqrt(1 - std::pow(beta2, t_)) / (1 - std::pow(beta1, t_)) * o_.scale();
    // This step's error: the update's (coefficients, limiter, reconstruction of `ops` terms),
    // the subtraction and the decoupled decay (4 roundings of p), and storing p in its dtype.
    // Earlier errors carry over multiplied by 1 - lr * weight_decay <= 1.
    const at::Tensor p_abs = p_exact.abs();
    const at::Tensor add =
        step_size * (coeff_rel + limiter_rel_ + (2 * ops + 4) * u_) * update_abs +
        (4 * u_ + u_param_) * p_abs + reference_rel_ * (p_abs + step_size * update_abs);
    bound_ = bound_.defined() ? bound_ + add : add;
  }

  /// Elementwise bound on |exp_avg - float64 exp_avg| (shaped like the approximation, rows
  /// flattened for the 1-D transform): the moments' sums carry ops * kappa roundings of A and
  /// three per step, plus storage.
  at::Tensor exp_avg_bound() const {
    return ((ops_ * kappa_ + 3.0 * t_ + 4) * u_ + t_ * u_state_) * m_abs_;
  }

  /// Elementwise bound on |run - float64 run| after the steps so far.
  const at::Tensor& bound() const { return bound_; }
  /// Largest kappa seen: an approximation's |terms| sum over its |value|.
  double kappa() const { return kappa_; }

 private:
  // wavedec and waverec are linear along the last dimension: their matrices, from unit vectors.
  void build_linear_maps() {
    const int64_t n = shape_.back();
    const gwt::Wavelet wavelet(o_.wavelet());
    const auto mode = gwt::boundary_mode_from_string(o_.boundary());
    const auto c = gwt::wavedec(at::eye(n, at::kDouble), wavelet, o_.level(), -1, mode);
    wa_ = c.approx, wd_ = c.details;       // [n, len]: row i holds unit vector i's coefficients
    auto synthesis = [&](int64_t which) {  // -1: the approximation; k: details[k]
      const int64_t len = which < 0 ? c.approx.size(-1) : c.details[which].size(-1);
      gwt::WaveletCoeffs unit;
      unit.approx =
          which < 0 ? at::eye(len, at::kDouble) : at::zeros({len, c.approx.size(-1)}, at::kDouble);
      for (size_t k = 0; k < c.details.size(); ++k)
        unit.details.push_back(static_cast<int64_t>(k) == which
                                   ? at::eye(len, at::kDouble)
                                   : at::zeros({len, c.details[k].size(-1)}, at::kDouble));
      return gwt::waverec(unit, wavelet, -1, mode, n);  // [len, n]
    };
    ra_ = synthesis(-1);
    for (size_t k = 0; k < c.details.size(); ++k) rd_.push_back(synthesis(static_cast<int64_t>(k)));
  }

  gwt::WaveletAdamOptions o_;
  std::vector<int64_t> shape_;
  double u_, u_param_, u_state_, reference_rel_;
  bool two_d_;
  at::Tensor wa_, ra_;
  std::vector<at::Tensor> wd_, rd_;
  at::Tensor m_abs_, v_, bound_;
  double kappa_ = 0, limiter_rel_ = 0, ops_ = 0;
  int64_t t_ = 0;
};

/// Two float64 runs of one rule (fused and reference, device and CPU) after the same steps: each
/// lies within `bound` (built for float64 parameters and moments) of the exact result, so they lie
/// within twice it of each other. The rule means something only where the bound is small: at most
/// `max_relative` x max(1, kappa) of |other|'s largest value, with kappa at most 1e5 (a sum that
/// cancels outright would excuse any result). tests/test_fused.cpp (expect_float64_pair) says why.
inline bool float64_pair_holds(const at::Tensor& run, const at::Tensor& other,
                               const RoundingBound& bound, double max_relative) {
  const at::Tensor& b = bound.bound();
  return ((run.to(at::kDouble) - other).abs() <= 2 * b).all().item<bool>() &&
         b.max().item<double>() <=
             max_relative * std::max(1.0, bound.kappa()) * other.abs().max().item<double>() &&
         bound.kappa() <= 1e5;
}

}  // namespace gwt_test
