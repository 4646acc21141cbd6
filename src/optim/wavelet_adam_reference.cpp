// The readable rule of gwt::WaveletAdam: one parameter's step in ATen ops, which the fused kernels
// (wavelet_adam_fused.cpp) are tested against.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"
#include "gwt/optim/wavelet_adam.h"
#include "gwt/transform.h"
#include "gwt/wavelet.h"
#include "wavelet_adam_detail.h"
#include "wavelet_adam_step.h"

namespace gwt {
namespace wavelet_adam_detail {

namespace {

using optim_detail::compute_dtype;

// p -= lr * weight_decay * p, after the update (decoupled).
void apply_weight_decay(at::Tensor& param, const WaveletAdamOptions& o) {
  if (o.weight_decay() != 0) param.add_(param, -o.lr() * o.weight_decay());
}

template <typename T>
double sum_of_squares_in_fixed_chunks(const T* data, int64_t n) {
  constexpr int64_t chunk = 4096;
  std::vector<double> partial(static_cast<size_t>((n + chunk - 1) / chunk), 0.0);
  at::parallel_for(0, static_cast<int64_t>(partial.size()), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      double sum = 0;
      for (int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); ++i)
        sum += static_cast<double>(data[i]) * static_cast<double>(data[i]);
      partial[c] = sum;
    }
  });
  double sum = 0;
  for (double p : partial) sum += p;
  return sum;
}

// ||x||_F for the limiter (0-dim, x's dtype), summed in an order that does not depend on the
// number of threads (ATen's reduction splits between threads): on the CPU in fixed chunks, each
// summed in double in order and the partials in order, as the fused norm passes sum fixed tiles
// (kernels.h); on a GPU by ATen, whose reduction order is fixed for a given shape and device and
// which keeps the step free of host synchronisation.
at::Tensor limiter_norm(const at::Tensor& x) {
  if (!x.device().is_cpu()) return x.norm();
  const at::Tensor values = x.contiguous();
  TORCH_INTERNAL_ASSERT(values.scalar_type() == at::kFloat || values.scalar_type() == at::kDouble);
  const double sum = values.scalar_type() == at::kDouble
                         ? sum_of_squares_in_fixed_chunks(values.data_ptr<double>(), values.numel())
                         : sum_of_squares_in_fixed_chunks(values.data_ptr<float>(), values.numel());
  return at::scalar_tensor(std::sqrt(sum), x.options());
}

// The moments as the update computes them, in the compute dtype. Moments kept in a narrower dtype
// are updated in the compute dtype, stored, and read back as stored, so that what follows sees
// exactly what the next step will.
struct Moments {
  Moments(WaveletAdamParamState& s, at::ScalarType compute)
      : state(s),
        dtype(compute),
        narrow_state(s.exp_avg().scalar_type() != compute),
        exp_avg(narrow_state ? s.exp_avg().to(compute) : s.exp_avg()),
        exp_avg_sq(narrow_state ? s.exp_avg_sq().to(compute) : s.exp_avg_sq()) {}
  void store() {
    if (!narrow_state) return;
    state.exp_avg().copy_(exp_avg);
    state.exp_avg_sq().copy_(exp_avg_sq);
    exp_avg = state.exp_avg().to(dtype);
    exp_avg_sq = state.exp_avg_sq().to(dtype);
  }
  WaveletAdamParamState& state;
  const at::ScalarType dtype;
  const bool narrow_state;
  at::Tensor exp_avg, exp_avg_sq;
};

// A dense parameter (docs/algorithm.md#eligibility-and-the-dense-path): Adam's update.
void dense_reference(at::Tensor& param, const at::Tensor& grad, Moments& moments,
                     const WaveletAdamOptions& o, double step_size) {
  const auto [beta1, beta2] = o.betas();
  at::Tensor& exp_avg = moments.exp_avg;
  at::Tensor& exp_avg_sq = moments.exp_avg_sq;
  exp_avg.mul_(beta1).add_(grad, 1 - beta1);
  exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  moments.store();
  const at::Tensor denom = exp_avg_sq.sqrt().add_(o.eps());
  param.addcdiv_(exp_avg, denom, -step_size);
}

// Norm-growth limiter (Fira): the step's ||N|| may grow by at most gamma per step. Kept as a
// 0-dim tensor so the step never waits for the device. Returns the limit `normalized` was divided
// by (undefined = 1).
at::Tensor limit_norm_growth(at::Tensor& normalized, WaveletAdamParamState& state,
                             const WaveletAdamOptions& o) {
  at::Tensor limit;  // undefined = 1
  if (o.norm_growth_limit() > 0) {
    const at::Tensor norm = limiter_norm(normalized);
    if (!state.norm().defined()) {
      state.norm(norm);
    } else {
      limit = at::clamp_min(norm / (state.norm() + 1e-8), o.norm_growth_limit()) /
              o.norm_growth_limit();
      normalized = normalized / limit;
      state.norm(norm / limit);
    }
  }
  return limit;
}

// A wavelet parameter (docs/algorithm.md#the-update): the moments of the gradient's approximation
// coefficients, the update back through the inverse transform.
void wavelet_reference(const Work& work, WaveletAdamParamState& state, Moments& moments,
                       at::Tensor& param, const at::Tensor& grad, double step_size) {
  const WaveletAdamOptions& o = *work.options;
  const auto [beta1, beta2] = o.betas();
  const at::Tensor& exp_avg = moments.exp_avg;
  const at::Tensor& exp_avg_sq = moments.exp_avg_sq;
  const Wavelet& wavelet = wavelet_named(o.wavelet());
  const BoundaryMode mode = boundary_mode_from_string(o.boundary());
  // The transform dimension(s) last; the moments are updated through views of the state.
  const int64_t dim = work.plan.dim;
  const at::Tensor g = work.plan.two_d ? grad : grad.movedim(dim, -1);
  at::Tensor m = work.plan.two_d ? exp_avg : exp_avg.movedim(dim, -1);
  at::Tensor v = work.plan.two_d ? exp_avg_sq : exp_avg_sq.movedim(dim, -1);
  WaveletCoeffs coeffs;
  WaveletCoeffs2 coeffs2;
  if (work.plan.two_d)
    coeffs2 = wavedec2(g, wavelet, o.level(), mode);
  else
    coeffs = wavedec(g, wavelet, o.level(), -1, mode);
  const at::Tensor approx = work.plan.two_d ? coeffs2.approx : coeffs.approx;
  m.mul_(beta1).add_(approx, 1 - beta1);
  v.mul_(beta2).addcmul_(approx, approx, 1 - beta2);
  moments.store();
  m = work.plan.two_d ? exp_avg : exp_avg.movedim(dim, -1);
  v = work.plan.two_d ? exp_avg_sq : exp_avg_sq.movedim(dim, -1);
  const at::Tensor denom = v.sqrt().add_(o.eps());
  at::Tensor normalized = m / denom;
  const at::Tensor limit = limit_norm_growth(normalized, state, o);

  // Details pass through (thresholded first, when asked), divided by the approximation's
  // denominator: each coarse value covers 2^(L-k) detail coefficients at level k per transformed
  // axis (coarsest first).
  int64_t kept = 0, total = 0;
  auto normalize = [&](at::Tensor& detail, const at::Tensor& d) {
    if (o.threshold() > 0) {
      detail = threshold(detail, o.threshold(), o.threshold_mode());
      kept += detail.count_nonzero().item<int64_t>();
      total += detail.numel();
    }
    detail = limit.defined() ? detail / (d * limit) : detail / d;
  };
  at::Tensor detail_denom = denom;
  if (!work.plan.two_d) {
    for (at::Tensor& detail : coeffs.details) {
      normalize(detail, detail_denom.narrow(-1, 0, detail.size(-1)));
      detail_denom = detail_denom.repeat_interleave(2, -1);
    }
    coeffs.approx = normalized;
    const at::Tensor update = waverec(coeffs, wavelet, -1, mode, param.size(dim)).movedim(-1, dim);
    param.add_(update, -step_size * o.scale());
  } else {
    for (auto& level : coeffs2.details) {
      const at::Tensor d =
          detail_denom.narrow(-2, 0, level[0].size(-2)).narrow(-1, 0, level[0].size(-1));
      for (at::Tensor& detail : level) normalize(detail, d);
      detail_denom = detail_denom.repeat_interleave(2, -2).repeat_interleave(2, -1);
    }
    coeffs2.approx = normalized;
    const at::Tensor update = waverec2(coeffs2, wavelet, mode)
                                  .narrow(-2, 0, param.size(-2))
                                  .narrow(-1, 0, param.size(-1));
    param.add_(update, -step_size * o.scale());
  }
  if (o.threshold() > 0) state.kept_details(kept).total_details(total);
}

}  // namespace

// The reference update for one parameter, in readable ATen ops (docs/algorithm.md#the-update,
// docs/algorithm.md#eligibility-and-the-dense-path). The fused kernels are tested against it;
// WaveletAdamOptions::fused(false) selects it.
void reference_update(const Work& work, WaveletAdamParamState& state, double step_size) {
  const WaveletAdamOptions& o = *work.options;
  const at::ScalarType dtype = compute_dtype(work.param);
  at::Tensor param = work.param.scalar_type() == dtype ? work.param : work.param.to(dtype);
  const at::Tensor grad = work.param.grad().to(dtype);
  Moments moments(state, dtype);
  if (!work.plan.wavelet)
    dense_reference(param, grad, moments, o, step_size);
  else
    wavelet_reference(work, state, moments, param, grad, step_size);
  apply_weight_decay(param, o);
  if (!param.is_same(work.param)) work.param.copy_(param);
}

}  // namespace wavelet_adam_detail
}  // namespace gwt
