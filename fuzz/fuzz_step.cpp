// Fuzz target: two WaveletAdam steps on 1 to 3 parameters in 1 or 2 groups, for arbitrary shapes
// (0 to 4 dimensions, zero sizes, non-contiguous views), dtypes (float32, float64, bfloat16,
// float16), options (every one, drawn with invalid values too), gradients (NaN, Inf, denormals,
// huge values, wrong shape or dtype, sparse, missing) and options or dtypes changed between steps.
//
// The properties every step is held to are in optimizer_target.h (errors change nothing, a
// non-finite gradient skips the step, finite inputs within `update_bound` below give finite
// parameters and moments). Finite inputs outside the bound that give a non-finite result are
// reported as notes (gwt_fuzz::note), not as failures: an update of lr * |g| / eps can overflow a
// float16 parameter by design.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "gwt/optim/wavelet_adam.h"
#include "gwt/wavelet.h"
#include "optimizer_target.h"

namespace {

using gwt::WaveletAdam;
using gwt::WaveletAdamOptions;
using gwt::WaveletAdamParamState;
using gwt_fuzz::Bound;
using gwt_fuzz::dtype_max;
using gwt_fuzz::pick;

constexpr double k_nan = std::numeric_limits<double>::quiet_NaN();
constexpr double k_inf = std::numeric_limits<double>::infinity();

WaveletAdamOptions draw_options(FuzzedDataProvider& in) {
  static const std::vector<std::string> wavelets = [] {
    auto w = gwt::Wavelet::available();
    w.push_back("db42");
    return w;
  }();
  WaveletAdamOptions o;
  o.lr(pick(in, std::vector<double>{1e-3, 1e-2, 0.1, 1, 0, 10, 1e-300, 1e300, -1e-3, k_nan, k_inf,
                                    1e-3, 1e-3, 1e-3}));
  o.betas({pick(in, std::vector<double>{0.9, 0.9, 0.9, 0, 0.5, 0.999999, 1.0, -0.1, k_nan}),
           pick(in, std::vector<double>{0.999, 0.999, 0.999, 0, 0.9, 0.99999999, 1.0, -1, k_nan})});
  o.eps(pick(in,
             std::vector<double>{1e-6, 1e-6, 1e-6, 1e-8, 1e-12, 1e-30, 0, 1, -1e-8, k_nan, k_inf}));
  o.weight_decay(pick(in, std::vector<double>{0, 0, 0, 0.01, 0.1, 1, 1e10, -0.1, k_nan}));
  o.wavelet(pick(in, wavelets));
  o.level(pick(in, std::vector<int64_t>{0, 1, 1, 2, 2, 3, 4, 5, 8, 30, -1, 31}));
  o.boundary(pick(in, std::vector<std::string>{"zero", "periodization", "symmetric", "reflect"}));
  o.scale(pick(in, std::vector<double>{1, 1, 0.25, 0, -1, 1e300, k_nan, k_inf}));
  o.norm_growth_limit(
      pick(in, std::vector<double>{1.01, 1.01, 1.01, 0, 1, 1e-300, 1e10, -1, k_nan, k_inf}));
  o.correct_bias(in.ConsumeIntegral<uint8_t>() < 200);
  o.dim(in.ConsumeIntegralInRange<int64_t>(-5, 4));
  o.fused(in.ConsumeBool());
  o.state_dtype(pick(in, std::vector<std::string>{"auto", "auto", "bfloat16", "bf16", "float32"}));
  o.transform(pick(in, std::vector<std::string>{"1d", "1d", "2d", "3d"}));
  o.threshold(pick(in, std::vector<double>{0, 0, 0, 1e-3, 0.1, 1e30, -1, k_nan, k_inf}));
  o.threshold_mode(pick(in, std::vector<std::string>{"soft", "hard", "firm"}));
  o.min_size(pick(in, std::vector<int64_t>{0, 0, 0, 4, 32, -1}));
  o.nonfinite(pick(
      in, std::vector<std::string>{"skip_step", "skip_step", "skip_param", "skip_param", "skip"}));
  return o;
}

// An upper bound on |p| after this step, or NaN/Inf where none is derived (non-finite inputs or
// eps = 0). The transform's analysis gain is at most sum |dec_lo| = L1 per level and axis, the
// synthesis gain at most 2 L1 (two filters) per level and axis; moments are convex combinations of
// coefficients, denominators are >= eps, the limiter only shrinks, thresholds only shrink, the
// decoupled decay multiplies by at most 1 + lr * weight_decay. Returns the bound on the
// coefficients squared too (they feed the second moment) and on the norm the limiter takes.
Bound update_bound(const WaveletAdam& opt, const at::Tensor& param, const WaveletAdamOptions& o,
                   const at::Tensor& grad, double max_coeff_before, int64_t step) {
  Bound b;
  if (!gwt_fuzz::all_finite(param) || !gwt_fuzz::all_finite(grad) || !(o.eps() > 0)) return b;
  const bool wavelet = opt.is_wavelet_param(param);
  double l1 = 0;
  const gwt::Wavelet wavelet_filters(o.wavelet());  // (a temporary's taps would dangle)
  for (double h : wavelet_filters.dec_lo()) l1 += std::abs(h);
  const double axes = o.transform() == "2d" ? 2.0 : 1.0;
  const double levels = wavelet ? static_cast<double>(o.level()) * axes : 0.0;
  const double g = gwt_fuzz::max_abs(grad.to(at::kDouble));
  const double coeff = g * std::pow(l1, levels);
  const double a = std::max(coeff, max_coeff_before);
  const auto [b1, b2] = o.betas();
  const double t = static_cast<double>(step);
  const double bias2 = o.correct_bias() ? std::sqrt(1 - std::pow(b2, t)) : 1.0;
  const double step_size = o.correct_bias() ? o.lr() * bias2 / (1 - std::pow(b1, t)) : o.lr();
  const double approx_term = o.lr() * bias2 * a / o.eps();  // step_size * m / denom
  const double detail_term = step_size * coeff / o.eps();
  double update = approx_term;
  if (wavelet)
    update =
        std::abs(o.scale()) * std::pow(2 * l1, levels) * (approx_term + 3 * levels * detail_term);
  const double p = gwt_fuzz::max_abs(param.to(at::kDouble));
  b.param = (p + update) * (1 + o.lr() * o.weight_decay());
  b.coeff = a;
  b.coeff_sq = a * a;
  const double normalized = std::max(a, coeff) / o.eps();
  b.norm_sq = normalized * normalized * static_cast<double>(std::max<int64_t>(param.numel(), 1));
  return b;
}

// `moments_before`: the state the step starts from (undefined before the first step). Existing
// moments keep their dtype when state_dtype changes mid-run, so their dtype bounds them.
bool within(const Bound& b, const at::Tensor& param, const WaveletAdamOptions& o,
            const at::Tensor& moments_before) {
  const double compute = dtype_max(param.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  const bool bf16 = moments_before.defined() ? moments_before.scalar_type() == at::kBFloat16
                                             : o.state_dtype() == "bfloat16";
  const double moments = bf16 ? dtype_max(at::kBFloat16) : compute;
  return 4 * b.param < std::min(dtype_max(param.scalar_type()), compute) &&
         4 * b.coeff_sq < moments && 4 * b.norm_sq < compute;
}

std::string describe(const std::vector<at::Tensor>& params, const WaveletAdam& opt) {
  std::string s;
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    const auto& o = opt.group_options(g);
    s += "group " + std::to_string(g) + ": lr=" + std::to_string(o.lr()) +
         " eps=" + std::to_string(o.eps()) + " wavelet=" + o.wavelet() +
         " level=" + std::to_string(o.level()) + " boundary=" + o.boundary() +
         " transform=" + o.transform() + " nonfinite=" + o.nonfinite() +
         " fused=" + std::to_string(o.fused()) + " state_dtype=" + o.state_dtype() +
         " threshold=" + std::to_string(o.threshold()) + "\n";
  }
  return s + gwt_fuzz::describe_params(params);
}

// Changes between the steps: an option, or a parameter's dtype in place.
void mutate(FuzzedDataProvider& in, WaveletAdam& opt, std::vector<at::Tensor>& params) {
  const uint8_t what = in.ConsumeIntegral<uint8_t>();
  if (what < 200) return;
  auto& o = static_cast<WaveletAdamOptions&>(
      opt.param_groups()[what % opt.param_groups().size()].options());
  switch (what % 11) {
    case 0:
      o.level(o.level() + 1);
      break;
    case 1:
      o.wavelet(o.wavelet() == "db2" ? "sym4" : "db2");
      break;
    case 2:
      o.dim(o.dim() == -1 ? 0 : -1);
      break;
    case 3:
      o.lr(k_nan);
      break;
    case 4:
      o.transform(o.transform() == "2d" ? "1d" : "2d");
      break;
    case 5:
      o.state_dtype(o.state_dtype() == "auto" ? "bfloat16" : "auto");
      break;
    case 6:
      o.boundary(o.boundary() == "zero" ? "symmetric" : "zero");
      break;
    case 7:
      o.fused(!o.fused());
      break;
    case 8:
      o.threshold(o.threshold() > 0 ? 0.0 : 0.05);
      break;
    case 9:
      o.min_size(o.min_size() > 0 ? 0 : 1000);
      break;
    default: {
      at::Tensor& p = params[what % params.size()];
      p.set_data(p.to(p.scalar_type() == at::kDouble ? at::kFloat : at::kDouble));
      break;
    }
  }
}
struct Target {
  using Optimizer = WaveletAdam;
  using Options = WaveletAdamOptions;
  using State = WaveletAdamParamState;
  static Options draw_options(FuzzedDataProvider& in) { return ::draw_options(in); }
  static int64_t draw_rank(FuzzedDataProvider& in) {
    return in.ConsumeIntegralInRange<int64_t>(0, 4);
  }
  static void mutate(FuzzedDataProvider& in, Optimizer& opt, std::vector<at::Tensor>& params) {
    ::mutate(in, opt, params);
  }
  static void before_step(FuzzedDataProvider&) {}
  static const Options& group_options(const Optimizer& opt, size_t g) {
    return opt.group_options(g);
  }
  static std::vector<at::Tensor> state_tensors(const State& s) {
    return {s.exp_avg(), s.exp_avg_sq(), s.norm()};
  }
  static std::vector<std::string> state_names() { return {"exp_avg", "exp_avg_sq", "norm"}; }
  static std::vector<int64_t> counters(const Optimizer& opt) { return {opt.skipped_steps()}; }
  static bool skips_alone(const Options& o) { return o.nonfinite() == "skip_param"; }
  static Bound bound(const Optimizer& opt, const at::Tensor& param, const Options& o,
                     const at::Tensor& grad, double coeff_before, int64_t step) {
    return update_bound(opt, param, o, grad, coeff_before, step);
  }
  static bool within(const Bound& b, const gwt_fuzz::ParamSnapshot& before, const Options& o) {
    return ::within(b, before.param, o, before.has_state ? before.state[1] : at::Tensor());
  }
  static std::string note_key(const Optimizer& opt, const at::Tensor& param, const Options& o) {
    return std::string("nonfinite-") + c10::toString(param.scalar_type()) +
           (opt.is_wavelet_param(param) ? "-wavelet" : "-dense") + (o.eps() > 0 ? "" : "-eps0") +
           (opt.is_fused_param(param) ? "-fused" : "-reference");
  }
  static std::string describe(const std::vector<at::Tensor>& params, const Optimizer& opt) {
    return ::describe(params, opt);
  }
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  gwt_fuzz::init();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return gwt_fuzz::run_case<Target>(data, size);
}
