// Fuzz target: two GaLoreAdam steps on 1 to 3 parameters in 1 or 2 groups, for arbitrary shapes
// (0 to 3 dimensions, zero sizes, non-contiguous views), dtypes (float32, float64, bfloat16,
// float16), options (every one, drawn with invalid values too), gradients (NaN, Inf, denormals,
// huge values, wrong shape or dtype, sparse, missing), SVD failures (the test hook's convergence
// error and NaN result) and options or dtypes changed between steps.
//
// The properties every step is held to are fuzz_step.cpp's (optimizer_target.h), for GaLore's
// state: errors change nothing (parameters, moments, projectors, skipped_steps(), svd_fallbacks()),
// a non-finite gradient skips the step, finite inputs within `update_bound` below give finite
// parameters, moments and projectors. Finite inputs outside the bound that give a non-finite
// result, and steps with finite gradients skipped because their projection overflowed, are
// reported as notes (gwt_fuzz::note), not as failures.

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
#include "gwt/optim/galore_adam.h"
#include "optimizer_target.h"

namespace {

using gwt::GaLoreAdam;
using gwt::GaLoreAdamOptions;
using gwt::GaLoreAdamParamState;
using gwt_fuzz::Bound;
using gwt_fuzz::dtype_max;
using gwt_fuzz::pick;

constexpr double k_nan = std::numeric_limits<double>::quiet_NaN();
constexpr double k_inf = std::numeric_limits<double>::infinity();

GaLoreAdamOptions draw_options(FuzzedDataProvider& in) {
  GaLoreAdamOptions o;
  o.lr(pick(in, std::vector<double>{1e-3, 1e-2, 0.1, 1, 0, 10, 1e-300, 1e300, -1e-3, k_nan, k_inf,
                                    1e-3, 1e-3}));
  o.betas({pick(in, std::vector<double>{0.9, 0.9, 0.9, 0, 0.5, 0.999999, 1.0, -0.1, k_nan}),
           pick(in, std::vector<double>{0.999, 0.999, 0.999, 0, 0.9, 0.99999999, 1.0, -1, k_nan})});
  o.eps(pick(
      in, std::vector<double>{1e-6, 1e-6, 1e-8, 1e-12, 1e-30, 1e-38, 0, 1, -1e-8, k_nan, k_inf}));
  o.weight_decay(pick(in, std::vector<double>{0, 0, 0, 0.01, 0.1, 1, 1e10, -0.1, k_nan}));
  o.rank(pick(in, std::vector<int64_t>{1, 1, 2, 2, 3, 5, 0, 128, -1}));
  o.update_proj_gap(pick(in, std::vector<int64_t>{1, 1, 2, 200, 0, -3}));
  o.scale(pick(in, std::vector<double>{0.25, 0.25, 1, 0, -1, 1e300, k_nan, k_inf}));
  o.proj_type(
      pick(in, std::vector<std::string>{"std", "std", "reverse_std", "left", "right", "up"}));
  o.svd(pick(in, std::vector<std::string>{"exact", "exact", "randomized", "qr"}));
  o.oversample(pick(in, std::vector<int64_t>{8, 0, 2, 100, -1}));
  o.power_iters(pick(in, std::vector<int64_t>{2, 0, 1, -1}));
  o.correct_bias(in.ConsumeIntegral<uint8_t>() < 200);
  return o;
}

// An upper bound on |p| after this step, or Inf where none is derived (non-finite inputs). Every
// projector has orthonormal rows (right) or columns (left) up to rounding: the SVD's singular
// vectors, the coordinate vectors of the fallback, or either kept from an earlier step. So every
// element of the projection R is at most ||G||_F, and each element of N P (or P N) at most
// ||N row||_2 <= sqrt(r) max |N|. Moments are convex combinations of R's elements, denominators are
// >= eps, so |N| <= max |R| / eps; the decoupled decay multiplies by at most 1 + lr * weight_decay.
// Returns the bound on |R| too (its square feeds the second moment).
Bound update_bound(const GaLoreAdam& opt, const at::Tensor& param, const GaLoreAdamOptions& o,
                   const at::Tensor& grad, double max_coeff_before, int64_t step) {
  Bound b;
  if (!gwt_fuzz::all_finite(param) || !gwt_fuzz::all_finite(grad) || !(o.eps() > 0)) return b;
  // ||G||_F <= sqrt(numel) max |G| (ATen's norm of denormals underflows to 0: not a bound).
  const bool projected = opt.is_projected_param(param);
  const double g = gwt_fuzz::max_abs(grad.to(at::kDouble));
  const double coeff = projected ? std::sqrt(static_cast<double>(grad.numel())) * g : g;
  const double a = std::max(coeff, max_coeff_before);
  const auto [b1, b2] = o.betas();
  const double t = static_cast<double>(step);
  const double step_size =
      o.correct_bias() ? o.lr() * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t)) : o.lr();
  double update = std::abs(step_size) * a / o.eps();
  if (projected)
    update *= std::abs(o.scale()) * std::sqrt(static_cast<double>(std::max<int64_t>(o.rank(), 1)));
  const double p = gwt_fuzz::max_abs(param.to(at::kDouble));
  b.param = (p + update) * (1 + o.lr() * o.weight_decay());
  b.coeff = a;
  return b;
}

// Within the bound's reach of every dtype the step writes: the parameter, and its math type, which
// holds the moments (the square of the projection) and the projection itself.
bool within(const Bound& b, const at::Tensor& param) {
  const double compute = dtype_max(param.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  return 4 * b.param < std::min(dtype_max(param.scalar_type()), compute) &&
         4 * b.coeff * b.coeff < compute;
}

std::string describe(const std::vector<at::Tensor>& params, const GaLoreAdam& opt) {
  std::string s;
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    const auto& o = opt.group_options(g);
    s += "group " + std::to_string(g) + ": lr=" + c10::str(o.lr()) + " eps=" + c10::str(o.eps()) +
         " betas=" + c10::str(std::get<0>(o.betas())) + "," + c10::str(std::get<1>(o.betas())) +
         " weight_decay=" + c10::str(o.weight_decay()) +
         " correct_bias=" + std::to_string(o.correct_bias()) + " rank=" + std::to_string(o.rank()) +
         " gap=" + std::to_string(o.update_proj_gap()) + " scale=" + std::to_string(o.scale()) +
         " proj_type=" + o.proj_type() + " svd=" + o.svd() + "\n";
  }
  return s + gwt_fuzz::describe_params(params);
}

// Changes between the steps: an option, or a parameter's dtype in place.
void mutate(FuzzedDataProvider& in, GaLoreAdam& opt, std::vector<at::Tensor>& params) {
  const uint8_t what = in.ConsumeIntegral<uint8_t>();
  if (what < 200) return;
  auto& o = static_cast<GaLoreAdamOptions&>(
      opt.param_groups()[what % opt.param_groups().size()].options());
  switch (what % 8) {
    case 0:
      o.rank(o.rank() + 1);
      break;
    case 1:
      o.proj_type(o.proj_type() == "left" ? "right" : "left");
      break;
    case 2:
      o.svd(o.svd() == "exact" ? "randomized" : "exact");
      break;
    case 3:
      o.lr(k_nan);
      break;
    case 4:
      o.update_proj_gap(o.update_proj_gap() == 1 ? 2 : 1);
      break;
    case 5:
      o.rank(0);
      break;
    default: {
      at::Tensor& p = params[what % params.size()];
      p.set_data(p.to(p.scalar_type() == at::kDouble ? at::kFloat : at::kDouble));
      break;
    }
  }
}
struct Target {
  using Optimizer = GaLoreAdam;
  using Options = GaLoreAdamOptions;
  using State = GaLoreAdamParamState;
  static Options draw_options(FuzzedDataProvider& in) { return ::draw_options(in); }
  // Mostly matrices: they take the projected path.
  static int64_t draw_rank(FuzzedDataProvider& in) {
    return pick(in, std::vector<int64_t>{2, 2, 2, 2, 0, 1, 3});
  }
  static void mutate(FuzzedDataProvider& in, Optimizer& opt, std::vector<at::Tensor>& params) {
    ::mutate(in, opt, params);
  }
  static bool skips_alone(const Options&) {
    return false;
  }  // every non-finite gradient skips the step
  // The SVD's test hook: a convergence failure or a NaN result for the step's first SVD (none
  // is left armed for the next input: every step sets it).
  static void before_step(FuzzedDataProvider& in) {
    const uint8_t fault = in.ConsumeIntegral<uint8_t>();
    gwt::detail::inject_svd_fault(fault >= 240   ? gwt::detail::SvdFault::linalg_error
                                  : fault >= 224 ? gwt::detail::SvdFault::non_finite
                                                 : gwt::detail::SvdFault::none);
  }
  static const Options& group_options(const Optimizer& opt, size_t g) {
    return opt.group_options(g);
  }
  static std::vector<at::Tensor> state_tensors(const State& s) {
    return {s.exp_avg(), s.exp_avg_sq(), s.projector(), at::scalar_tensor(s.right(), at::kLong)};
  }
  static std::vector<std::string> state_names() {
    return {"exp_avg", "exp_avg_sq", "projector", "right"};
  }
  static std::vector<int64_t> counters(const Optimizer& opt) {
    return {opt.skipped_steps(), opt.svd_fallbacks()};
  }
  static Bound bound(const Optimizer& opt, const at::Tensor& param, const Options& o,
                     const at::Tensor& grad, double coeff_before, int64_t step) {
    return update_bound(opt, param, o, grad, coeff_before, step);
  }
  static bool within(const Bound& b, const gwt_fuzz::ParamSnapshot& before, const Options&) {
    return ::within(b, before.param);
  }
  static std::string note_key(const Optimizer& opt, const at::Tensor& param, const Options&) {
    return std::string("nonfinite-") + c10::toString(param.scalar_type()) +
           (opt.is_projected_param(param) ? "-projected" : "-dense");
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
