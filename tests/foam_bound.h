#pragma once

// A forward error bound for FoamAdam in reduced precision, derived from the data: FOAM's rule
// (docs/algorithm.md#foam) as tests/float_bound.h bounds WaveletAdam's.
//
// Every computed sum of k terms is within k u (sum of |terms|) of the exact one, every product,
// quotient or square root within u relative (u: the math type's unit roundoff, 2^-24 in float32;
// a constant converted from double to the math type counts as one more rounding). The bound
// follows each quantity of one step through the rule with a shadow of its |terms|, in float64:
//   a = blockmean(g)        err <= (B + 1) u blockmean(|g|)
//   s = blockmean(g^2)      err <= (B + 2) u s
//   m, v                    err <= beta (last err) + (1 - beta) (err of a or s) + (4 u + u_state)
//   |.| r = g - a               err <= err(a) + u (|g| + |a|) M = m + rho r,  V = v + rho^2 r^2,  D
//   = sqrt(V) + eps,  U = scale M / D p <- p - step U, then the decay, then p's own dtype
//   (u_param).
// The constants over-count the operations of either implementation (the ATen reference, whose
// sums may be in any order, and the fused CPU loops, with or without fused multiply-adds: an FMA
// rounds once where the bound counts two), so the bound holds for any instruction set, thread
// count or summation order: it cannot be failed by chance, only by a computation that is not the
// rule. The analysis is first order; the products of two error terms it leaves out are below
// 2% of it for the state dtypes tested (bfloat16 moments after 10 steps: t u_state <= 0.04), and
// every step's share is taken 1.25 times to cover them.
//
// It is worth something only if it is small: the tests check that it stays below a small
// fraction of the parameters, so a real error (a dropped rho^2, a partial block divided by its own
// length, a moment read before it is rounded to the state's dtype) exceeds it.

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "float_bound.h"  // unit_roundoff
#include "gwt/gwt.h"

namespace gwt_test {

class FoamRoundingBound {
 public:
  /// For a parameter of `shape` (dim -1) under `o`; param_dtype and state_dtype as the run's.
  FoamRoundingBound(at::IntArrayRef shape, const gwt::FoamAdamOptions& o,
                    at::ScalarType param_dtype, at::ScalarType state_dtype)
      : o_(o),
        shape_(shape.vec()),
        u_(unit_roundoff(param_dtype == at::kDouble ? at::kDouble : at::kFloat)),
        u_param_(unit_roundoff(param_dtype)),
        u_state_(unit_roundoff(state_dtype)),
        // The float64 run's own error, which a reduced run's comparison with it must allow; two
        // float64 runs are each bounded on their own (the pair check doubles the bound).
        reference_rel_(param_dtype == at::kDouble ? 0.0 : 1e-13) {
    TORCH_CHECK(o.dim() == -1, "FoamRoundingBound: dim -1 only");
  }

  /// Adds step t's rounding; `g`: the float64 gradient every run saw, `p_exact`: the float64 run's
  /// parameter after the step.
  void step(const at::Tensor& g_in, const at::Tensor& p_exact_in) {
    ++t_;
    const at::Tensor g = rows(g_in), p_exact = rows(p_exact_in);
    const auto [b1, b2] = o_.betas();
    const bool folded = o_.level() > 0;
    const int64_t block = int64_t{1} << o_.level();
    const double B = static_cast<double>(block);
    const double rho = folded ? o_.res_scale() : 0.0, scale = folded ? o_.scale() : 1.0;
    const double u = u_;

    const at::Tensor a = block_mean(g, block), a_abs = block_mean(g.abs(), block);
    const at::Tensor s = block_mean(g * g, block);
    const at::Tensor err_a = (B + 1) * u * a_abs, err_s = (B + 2) * u * s;
    if (!m_.defined()) {
      m_ = at::zeros_like(a), v_ = at::zeros_like(a), m_abs_ = at::zeros_like(a);
      err_m_ = at::zeros_like(a), err_v_ = at::zeros_like(a);
    }
    m_ = b1 * m_ + (1 - b1) * a;
    m_abs_ = b1 * m_abs_ + (1 - b1) * a_abs;
    v_ = b2 * v_ + (1 - b2) * s;
    err_m_ = b1 * err_m_ + (1 - b1) * err_a + (4 * u + u_state_) * m_abs_;
    err_v_ = b2 * err_v_ + (1 - b2) * err_s + (4 * u + u_state_) * v_;

    const int64_t n = g.size(-1);
    auto unfold = [&](const at::Tensor& x) {
      return at::repeat_interleave(x, block, -1).narrow(-1, 0, n);
    };
    // The residual cancels where g is close to its block's mean; its error is a's plus one
    // rounding of the (computed) difference, r_mag bounds the computed |r|.
    const at::Tensor r = g - unfold(a);
    const at::Tensor err_r = unfold(err_a) * (1 + u) + u * r.abs();
    const at::Tensor r_mag = r.abs() + err_r;
    const at::Tensor M = unfold(m_) + rho * r, M_abs = unfold(m_abs_) + std::abs(rho) * r_mag;
    const at::Tensor err_M = unfold(err_m_) + std::abs(rho) * err_r + 3 * u * M_abs;
    const at::Tensor V = unfold(v_) + rho * rho * r * r;
    const at::Tensor err_V = unfold(err_v_) + rho * rho * (2 * r.abs() * err_r + err_r * err_r) +
                             4 * u * (unfold(v_) + rho * rho * r_mag * r_mag);
    TORCH_CHECK((V > 0).all().item<bool>(), "FoamRoundingBound: a zero second moment");
    const at::Tensor sq = V.sqrt();
    const at::Tensor err_sq = sq * (0.5 * err_V / V + u);
    const at::Tensor D = sq + o_.eps();
    const at::Tensor err_D = err_sq + u * D;
    const at::Tensor U_abs = std::abs(scale) * M_abs / D;
    const at::Tensor err_U =
        std::abs(scale) * (err_M + u * M_abs) / D + U_abs * (err_D / D + 3 * u);
    const double step_size =
        o_.correct_bias() ? o_.lr() * std::sqrt(1 - std::pow(b2, t_)) / (1 - std::pow(b1, t_))
                          : o_.lr();
    const at::Tensor p_abs = p_exact.abs();
    // The update (its error, the step size's rounding and the product's), the sum and the decay
    // (3 roundings of p), storing p in its dtype, and the float64 run's own error.
    const at::Tensor add =
        1.25 * (step_size * (err_U + 3 * u * U_abs) + (3 * u + u_param_) * p_abs +
                reference_rel_ * (p_abs + step_size * U_abs));
    bound_ = bound_.defined() ? bound_ + add : add;
  }

  /// Elementwise bound on |run - float64 run| after the steps so far, in the parameter's shape.
  at::Tensor bound() const { return bound_.reshape(shape_); }

 private:
  // [..., n] rows of a parameter (a 0-dim one is a row of one value).
  at::Tensor rows(const at::Tensor& x) const {
    const at::Tensor d = x.to(at::kDouble);
    return d.dim() == 0 ? d.reshape({1}) : d;
  }

  // The mean of each block of `block` values along the last dimension, the last block padded with
  // zeros (the authors' rule).
  static at::Tensor block_mean(const at::Tensor& x, int64_t block) {
    const int64_t n = x.size(-1), blocks = (n + block - 1) / block;
    at::Tensor padded = at::constant_pad_nd(x, {0, blocks * block - n});
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = blocks;
    shape.push_back(block);
    return padded.reshape(shape).sum(-1) / static_cast<double>(block);
  }

  gwt::FoamAdamOptions o_;
  std::vector<int64_t> shape_;
  double u_, u_param_, u_state_, reference_rel_;
  at::Tensor m_, v_, m_abs_, err_m_, err_v_, bound_;
  int64_t t_ = 0;
};

}  // namespace gwt_test
