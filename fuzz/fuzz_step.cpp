// Fuzz target: two WaveletAdam steps on 1 to 3 parameters in 1 or 2 groups, for arbitrary shapes
// (0 to 4 dimensions, zero sizes, non-contiguous views), dtypes (float32, float64, bfloat16,
// float16), options (every one, drawn with invalid values too), gradients (NaN, Inf, denormals,
// huge values, wrong shape or dtype, sparse, missing) and options or dtypes changed between steps.
//
// Properties of every step:
// - nothing but a c10::Error escapes; after one, parameters, state and skipped_steps() are as
//   before (byte for byte);
// - a non-finite gradient skips the step: nothing changes and skipped_steps() grows by one;
// - a step taken advances the step count of exactly the parameters with a gradient, leaves the
//   others untouched, and, when its inputs are finite and bounded as in `update_bound` below, leaves
//   every parameter and moment finite. Finite inputs outside those bounds that give a non-finite
//   result are reported as notes (gwt_fuzz::note), not as failures: an update of lr * |g| / eps
//   can overflow a float16 parameter by design.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "gwt/optim/wavelet_adam.h"
#include "gwt/wavelet.h"

namespace {

using gwt::WaveletAdam;
using gwt::WaveletAdamOptions;
using gwt::WaveletAdamParamState;
using gwt_fuzz::fail;
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
  return o;
}

at::ScalarType draw_dtype(FuzzedDataProvider& in, bool allow_bad) {
  const uint8_t b = in.ConsumeIntegral<uint8_t>();
  if (allow_bad && b >= 250) return b % 2 ? at::kInt : at::kComplexFloat;
  return std::vector<at::ScalarType>{at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}[b % 4];
}

// A gradient for `param` drawn from the input: usually of its shape and dtype, sometimes missing,
// mis-shaped, of another dtype, non-contiguous or sparse.
at::Tensor draw_grad(FuzzedDataProvider& in, const at::Tensor& param) {
  const uint8_t kind = in.ConsumeIntegral<uint8_t>();
  const bool specials = in.ConsumeIntegral<uint8_t>() >= 200;
  const double typical = std::ldexp(1.0, in.ConsumeIntegralInRange<int>(-40, 40));
  if (kind < 8) return at::Tensor();
  if (kind < 12) {  // wrong shape
    auto shape = param.sizes().vec();
    if (shape.empty())
      shape.push_back(2);
    else
      shape.back() += 1;
    return gwt_fuzz::draw_tensor(in, shape, param.scalar_type(), specials, typical);
  }
  if (kind < 14) return at::ones(param.sizes(), at::kInt);
  if (kind < 16 && param.dim() > 0) {
    return gwt_fuzz::draw_tensor(in, param.sizes(), at::kDouble, specials, typical).to_sparse();
  }
  const at::ScalarType dtype = kind < 24 ? draw_dtype(in, false) : param.scalar_type();
  at::Tensor g = gwt_fuzz::draw_tensor(in, param.sizes(), dtype, specials, typical);
  if (kind < 30 && g.dim() >= 2) g = g.transpose(0, 1).contiguous().transpose(0, 1);
  return g;
}

struct ParamSnapshot {
  at::Tensor param;
  bool has_state = false;
  int64_t step = 0;
  at::Tensor exp_avg, exp_avg_sq, norm;
};

struct Snapshot {
  std::vector<ParamSnapshot> params;
  int64_t skipped = 0;
  size_t states = 0;
};

const WaveletAdamParamState* state_of(const WaveletAdam& opt, const at::Tensor& p) {
  auto it = opt.state().find(p.unsafeGetTensorImpl());
  return it == opt.state().end() ? nullptr
                                 : static_cast<const WaveletAdamParamState*>(it->second.get());
}

Snapshot snapshot(const WaveletAdam& opt, const std::vector<at::Tensor>& params) {
  Snapshot s;
  for (const auto& p : params) {
    ParamSnapshot ps;
    ps.param = gwt_fuzz::copy_of(p);
    if (const auto* st = state_of(opt, p)) {
      ps.has_state = true;
      ps.step = st->step();
      ps.exp_avg = gwt_fuzz::copy_of(st->exp_avg());
      ps.exp_avg_sq = gwt_fuzz::copy_of(st->exp_avg_sq());
      ps.norm = gwt_fuzz::copy_of(st->norm());
    }
    s.params.push_back(std::move(ps));
  }
  s.skipped = opt.skipped_steps();
  s.states = opt.state().size();
  return s;
}

bool same_param(const ParamSnapshot& a, const ParamSnapshot& b) {
  return gwt_fuzz::same_bytes(a.param, b.param) && a.has_state == b.has_state &&
         a.step == b.step && gwt_fuzz::same_bytes(a.exp_avg, b.exp_avg) &&
         gwt_fuzz::same_bytes(a.exp_avg_sq, b.exp_avg_sq) && gwt_fuzz::same_bytes(a.norm, b.norm);
}

void expect_unchanged(const Snapshot& before, const Snapshot& after, const std::string& why) {
  GWT_FUZZ_CHECK(before.skipped == after.skipped && before.states == after.states, why);
  for (size_t i = 0; i < before.params.size(); ++i)
    if (!same_param(before.params[i], after.params[i]))
      fail(why + ": parameter " + std::to_string(i) + " or its state changed");
}

double dtype_max(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return 65504.0;
    case at::kBFloat16:
      return 3.38e38;
    case at::kFloat:
      return 3.40e38;
    default:
      return std::numeric_limits<double>::max();
  }
}

// An upper bound on |p| after this step, or NaN/Inf where none is derived (non-finite inputs or
// eps = 0). The transform's analysis gain is at most sum |dec_lo| = L1 per level and axis, the
// synthesis gain at most 2 L1 (two filters) per level and axis; moments are convex combinations of
// coefficients, denominators are >= eps, the limiter only shrinks, thresholds only shrink, the
// decoupled decay multiplies by at most 1 + lr * weight_decay. Returns the bound on the
// coefficients squared too (they feed the second moment) and on the norm the limiter takes.
struct Bound {
  double param = k_inf, coeff = k_inf, coeff_sq = k_inf, norm_sq = k_inf;
};
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
    update = std::abs(o.scale()) * std::pow(2 * l1, levels) * (approx_term + 3 * levels * detail_term);
  const double p = gwt_fuzz::max_abs(param.to(at::kDouble));
  b.param = (p + update) * (1 + o.lr() * o.weight_decay());
  b.coeff = a;
  b.coeff_sq = a * a;
  const double normalized = std::max(a, coeff) / o.eps();
  b.norm_sq = normalized * normalized * static_cast<double>(std::max<int64_t>(param.numel(), 1));
  return b;
}

// `moments_before`: the state the step starts from (undefined before the first step). Existing
// moments keep their dtype when state_dtype changes mid-run, so their dtype bounds them, and a
// state that is already non-finite (an earlier, unbounded step) bounds nothing.
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
         " transform=" + o.transform() + " fused=" + std::to_string(o.fused()) +
         " state_dtype=" + o.state_dtype() + " threshold=" + std::to_string(o.threshold()) + "\n";
  }
  for (const auto& p : params) {
    s += "param " + std::string(c10::toString(p.scalar_type())) + " [";
    for (int64_t d = 0; d < p.dim(); ++d) s += (d ? "," : "") + std::to_string(p.size(d));
    s += std::string("]") + (p.is_contiguous() ? "" : " non-contiguous") + "\n";
  }
  return s;
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

// One step with every check in the file comment.
// coeff_bound[i]: a bound on every transform coefficient parameter i's moments have seen so far.
void checked_step(WaveletAdam& opt, const std::vector<at::Tensor>& params,
                  std::vector<double>& coeff_bound, const uint8_t* data, size_t size) {
  const Snapshot before = snapshot(opt, params);
  // The bound for each parameter with its options at this step.
  std::vector<Bound> bounds(params.size());
  std::vector<const WaveletAdamOptions*> options(params.size(), nullptr);
  bool grads_finite = true;
  for (size_t g = 0; g < opt.param_groups().size(); ++g)
    for (const auto& p : opt.param_groups()[g].params())
      for (size_t i = 0; i < params.size(); ++i)
        if (p.is_same(params[i])) options[i] = &opt.group_options(g);
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& grad = params[i].grad();
    if (!grad.defined() || grad.is_sparse() || !grad.is_floating_point()) continue;
    grads_finite = grads_finite && gwt_fuzz::all_finite(grad);
  }
  bool threw = false;
  std::string message;
  try {
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& grad = params[i].grad();
      if (!grad.defined() || grad.is_sparse() || grad.sizes() != params[i].sizes() ||
          !grad.is_floating_point())
        continue;
      bounds[i] = update_bound(opt, params[i], *options[i], grad, coeff_bound[i],
                               before.params[i].step + 1);
    }
  } catch (const c10::Error&) {
    // Options the step will reject (unknown wavelet, dim out of range): no bound needed.
  }
  try {
    opt.step();
  } catch (const c10::Error& e) {
    threw = true;
    message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    fail(std::string("an exception other than c10::Error: ") + e.what() + "\n" +
         describe(params, opt));
  } catch (...) {
    fail("a non-std exception\n" + describe(params, opt));
  }
  const Snapshot after = snapshot(opt, params);
  if (threw) {
    expect_unchanged(before, after, "after the error '" + message + "'\n" + describe(params, opt));
    return;
  }
  if (after.skipped != before.skipped) {
    GWT_FUZZ_CHECK(after.skipped == before.skipped + 1, describe(params, opt));
    Snapshot expected = before;
    expected.skipped += 1;
    expect_unchanged(expected, after, "after a skipped step\n" + describe(params, opt));
    if (grads_finite)
      gwt_fuzz::note("skip-finite-grads",
                     "a step with finite gradients was skipped as non-finite\n" +
                         describe(params, opt),
                     data, size);
    return;
  }
  if (!grads_finite) fail("a non-finite gradient did not skip the step\n" + describe(params, opt));
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSnapshot& b = before.params[i];
    const ParamSnapshot& a = after.params[i];
    if (!params[i].grad().defined()) {
      if (!same_param(b, a)) fail("a parameter without gradient changed\n" + describe(params, opt));
      continue;
    }
    GWT_FUZZ_CHECK(a.has_state && a.step == b.step + 1, describe(params, opt));
    coeff_bound[i] = std::max(coeff_bound[i], bounds[i].coeff);  // NaN-free: inf when unknown
    const bool finite = gwt_fuzz::all_finite(a.param) && gwt_fuzz::all_finite(a.exp_avg) &&
                        gwt_fuzz::all_finite(a.exp_avg_sq) && gwt_fuzz::all_finite(a.norm);
    if (finite) continue;
    const bool inputs_finite =
        gwt_fuzz::all_finite(b.param) && gwt_fuzz::all_finite(params[i].grad());
    const bool state_finite = gwt_fuzz::all_finite(b.exp_avg) &&
                              gwt_fuzz::all_finite(b.exp_avg_sq) && gwt_fuzz::all_finite(b.norm);
    if (options[i] != nullptr && state_finite && within(bounds[i], b.param, *options[i], b.exp_avg_sq))
      fail("finite, bounded inputs gave a non-finite parameter or moment (parameter " +
           std::to_string(i) + ", step " + std::to_string(a.step) + "; finite: param " +
           std::to_string(gwt_fuzz::all_finite(a.param)) + ", exp_avg " +
           std::to_string(gwt_fuzz::all_finite(a.exp_avg)) + ", exp_avg_sq " +
           std::to_string(gwt_fuzz::all_finite(a.exp_avg_sq)) + ", norm " +
           std::to_string(gwt_fuzz::all_finite(a.norm)) + " (" +
           (a.norm.defined() ? std::to_string(a.norm.to(at::kDouble).item<double>()) : "none") +
           "), norm before " +
           (b.norm.defined() ? std::to_string(b.norm.to(at::kDouble).item<double>()) : "none") +
           ")\n" + describe(params, opt));
    if (inputs_finite && options[i] != nullptr) {
      const auto& o = *options[i];
      const std::string key = std::string("nonfinite-") + c10::toString(b.param.scalar_type()) +
                              (opt.is_wavelet_param(params[i]) ? "-wavelet" : "-dense") +
                              (o.eps() > 0 ? "" : "-eps0") +
                              (opt.is_fused_param(params[i]) ? "-fused" : "-reference");
      gwt_fuzz::note(key,
                     "finite but unbounded inputs gave a non-finite parameter or moment\n" +
                         describe(params, opt),
                     data, size);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  gwt_fuzz::init();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const int64_t groups = in.ConsumeIntegralInRange<int64_t>(1, 2);
  const int64_t count = in.ConsumeIntegralInRange<int64_t>(groups, 3);
  std::vector<WaveletAdamOptions> options;
  for (int64_t g = 0; g < groups; ++g) options.push_back(draw_options(in));
  std::vector<at::Tensor> params;
  std::vector<std::vector<at::Tensor>> members(static_cast<size_t>(groups));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t rank = in.ConsumeIntegralInRange<int64_t>(0, 4);
    const auto shape = gwt_fuzz::draw_shape(in, rank, 12, 192);
    const at::ScalarType dtype = draw_dtype(in, true);
    const bool specials = in.ConsumeIntegral<uint8_t>() >= 250;
    at::Tensor p = gwt_fuzz::draw_tensor(in, shape, at::kDouble, specials).to(dtype);
    if (rank >= 2 && in.ConsumeIntegral<uint8_t>() >= 224)
      p = p.transpose(0, 1).contiguous().transpose(0, 1);  // a non-contiguous parameter
    params.push_back(p);
    members[static_cast<size_t>(i < groups ? i : in.ConsumeIntegralInRange<int64_t>(0, groups - 1))]
        .push_back(p);
  }
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  for (int64_t g = 0; g < groups; ++g)
    param_groups.emplace_back(members[static_cast<size_t>(g)],
                              std::make_unique<WaveletAdamOptions>(options[static_cast<size_t>(g)]));
  std::unique_ptr<WaveletAdam> opt;
  std::vector<at::Tensor> untouched;
  for (const auto& p : params) untouched.push_back(gwt_fuzz::copy_of(p));
  try {
    opt = std::make_unique<WaveletAdam>(std::move(param_groups), options.front());
  } catch (const c10::Error&) {
    for (size_t i = 0; i < params.size(); ++i)
      GWT_FUZZ_CHECK(gwt_fuzz::same_bytes(params[i], untouched[i]), "constructor changed a param");
    return 0;
  } catch (const std::exception& e) {
    fail(std::string("constructor: an exception other than c10::Error: ") + e.what());
  }
  std::vector<double> coeff_bound(params.size(), 0.0);
  for (int step = 0; step < 2; ++step) {
    if (step == 1) {
      try {
        mutate(in, *opt, params);
      } catch (const c10::Error&) {
        // set_data refused a dtype change (a view): the step runs without it.
      }
    }
    for (auto& p : params) p.mutable_grad() = draw_grad(in, p);
    checked_step(*opt, params, coeff_bound, data, size);
  }
  return 0;
}
