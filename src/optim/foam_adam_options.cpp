// gwt::FoamAdamOptions and gwt::FoamAdamParamState: accessors, comparison, checkpoint form and
// validate_options; and what the options mean for one parameter (its plan, the state it needs).

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"
#include "foam_adam_detail.h"
#include "group_checks.h"
#include "gwt/optim/foam_adam.h"

namespace gwt {

namespace {
constexpr const char* k_who = "gwt::FoamAdam";
c10::IValue read_value(torch::serialize::InputArchive& archive, const std::string& key,
                       const char* what) {
  return optim_detail::read_value(archive, key, what, k_who);
}
}  // namespace

// ----------------------------------------------------------------------------------------------
// Options
// ----------------------------------------------------------------------------------------------

FoamAdamOptions::FoamAdamOptions(double lr) : lr_(lr) {}
double FoamAdamOptions::get_lr() const {
  return lr();
}
void FoamAdamOptions::set_lr(const double lr) {
  this->lr(lr);
}

bool operator==(const FoamAdamOptions& a, const FoamAdamOptions& b) {
  return a.lr() == b.lr() && a.betas() == b.betas() && a.eps() == b.eps() &&
         a.weight_decay() == b.weight_decay() && a.level() == b.level() && a.scale() == b.scale() &&
         a.res_scale() == b.res_scale() && a.correct_bias() == b.correct_bias() &&
         a.dim() == b.dim() && a.fused() == b.fused() && a.state_dtype() == b.state_dtype() &&
         a.nonfinite() == b.nonfinite() && a.min_size() == b.min_size();
}

void FoamAdamOptions::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr()));
  archive.write("beta1", c10::IValue(std::get<0>(betas())));
  archive.write("beta2", c10::IValue(std::get<1>(betas())));
  archive.write("eps", c10::IValue(eps()));
  archive.write("weight_decay", c10::IValue(weight_decay()));
  archive.write("level", c10::IValue(level()));
  archive.write("scale", c10::IValue(scale()));
  archive.write("res_scale", c10::IValue(res_scale()));
  archive.write("correct_bias", c10::IValue(correct_bias()));
  archive.write("dim", c10::IValue(dim()));
  archive.write("fused", c10::IValue(fused()));
  archive.write("state_dtype", c10::IValue(state_dtype()));
  archive.write("nonfinite", c10::IValue(nonfinite()));
  archive.write("min_size", c10::IValue(min_size()));
}

void FoamAdamOptions::serialize(torch::serialize::InputArchive& archive) {
  const char* what = "saved FoamAdamOptions";
  lr(read_value(archive, "lr", what).toDouble());
  betas(std::make_tuple(read_value(archive, "beta1", what).toDouble(),
                        read_value(archive, "beta2", what).toDouble()));
  eps(read_value(archive, "eps", what).toDouble());
  weight_decay(read_value(archive, "weight_decay", what).toDouble());
  level(read_value(archive, "level", what).toInt());
  scale(read_value(archive, "scale", what).toDouble());
  res_scale(read_value(archive, "res_scale", what).toDouble());
  correct_bias(read_value(archive, "correct_bias", what).toBool());
  dim(read_value(archive, "dim", what).toInt());
  fused(read_value(archive, "fused", what).toBool());
  state_dtype(read_value(archive, "state_dtype", what).toStringRef());
  nonfinite(read_value(archive, "nonfinite", what).toStringRef());
  min_size(read_value(archive, "min_size", what).toInt());
}

void validate_options(const FoamAdamOptions& o) {
  optim_detail::check_adam_options(k_who, o.lr(), o.betas(), o.eps(), o.weight_decay());
  // 2^30-element blocks are far beyond any tensor's rows; the limit keeps 2^level an int64.
  TORCH_CHECK(o.level() >= 0 && o.level() <= 30, k_who, ": invalid level ", o.level(),
              "; it must be in [0, 30] (0 = dense Adam)");
  TORCH_CHECK(std::isfinite(o.scale()), k_who, ": invalid scale ", o.scale(),
              "; it must be finite (the authors use 0.25)");
  TORCH_CHECK(std::isfinite(o.res_scale()), k_who, ": invalid res_scale ", o.res_scale(),
              "; it must be finite (1 = the whole residual, 0 = none)");
  TORCH_CHECK(o.min_size() >= 0, k_who, ": invalid min_size ", o.min_size(),
              "; it must be >= 0 (0 = off)");
  optim_detail::check_state_dtype_and_nonfinite(k_who, o.state_dtype(), o.nonfinite());
}

// ----------------------------------------------------------------------------------------------
// State
// ----------------------------------------------------------------------------------------------

void FoamAdamParamState::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("step", c10::IValue(step()));
  archive.write("exp_avg", exp_avg());
  archive.write("exp_avg_sq", exp_avg_sq());
  archive.write("skipped", c10::IValue(skipped()));
}

void FoamAdamParamState::serialize(torch::serialize::InputArchive& archive) {
  const char* what = "saved FoamAdamParamState";
  step(read_value(archive, "step", what).toInt());
  exp_avg(optim_detail::read_tensor(archive, "exp_avg", what));
  exp_avg_sq(optim_detail::read_tensor(archive, "exp_avg_sq", what));
  skipped(read_value(archive, "skipped", what).toInt());
}

bool operator==(const FoamAdamParamState& a, const FoamAdamParamState& b) {
  auto same = [](const at::Tensor& x, const at::Tensor& y) {
    return x.defined() == y.defined() && (!x.defined() || at::equal(x, y));
  };
  return a.step() == b.step() && same(a.exp_avg(), b.exp_avg()) &&
         same(a.exp_avg_sq(), b.exp_avg_sq()) && a.skipped() == b.skipped();
}

// ----------------------------------------------------------------------------------------------
// What the options mean for one parameter
// ----------------------------------------------------------------------------------------------

namespace foam_adam_detail {

at::ScalarType state_dtype(const at::Tensor& param, const FoamAdamOptions& o) {
  return optim_detail::moment_dtype(param, o.state_dtype());
}

// docs/algorithm.md#foam: every parameter of a group with a level is folded, as the authors'
// FOAM does (it folds whatever has a last dimension), unless min_size keeps it dense.
Plan plan_for(const at::Tensor& param, const FoamAdamOptions& o) {
  Plan plan;
  plan.state_shape = param.sizes().vec();
  if (o.level() == 0) return plan;
  if (o.min_size() > 0 &&
      (param.dim() < 2 || param.size(-2) < o.min_size() || param.size(-1) < o.min_size()))
    return plan;
  // A 0-dim parameter is one row of one element; dim -1 and 0 name it, as ATen's ops accept.
  const int64_t dims = std::max<int64_t>(param.dim(), 1);
  TORCH_CHECK(o.dim() >= -dims && o.dim() < dims, k_who, ": dim ", o.dim(),
              " is out of range for a parameter of shape ", param.sizes(), " (valid: ", -dims,
              " to ", dims - 1, ")");
  plan.folded = true;
  if (param.dim() == 0) {
    plan.dim = -1;
    return plan;  // one block: the state is 0-dim too
  }
  plan.dim = o.dim() < 0 ? o.dim() + dims : o.dim();
  const int64_t block = int64_t{1} << o.level();
  plan.state_shape[plan.dim] = (param.size(plan.dim) + block - 1) / block;
  return plan;
}

void check_state(const FoamAdamParamState& state, const at::Tensor& param, const Plan& plan) {
  for (const at::Tensor* t : {&state.exp_avg(), &state.exp_avg_sq()})
    TORCH_CHECK(t->defined() && t->sizes().vec() == plan.state_shape, k_who,
                ": the state of a parameter of shape ", param.sizes(), " has moments of shape ",
                t->defined() ? t->sizes() : c10::IntArrayRef{}, " but its group's options need ",
                c10::IntArrayRef(plan.state_shape),
                " (were level, dim or min_size changed after training started?)");
  TORCH_CHECK(state.step() >= 0, k_who, ": a saved step count is negative: ", state.step(),
              "; steps are >= 0");
  TORCH_CHECK(state.skipped() >= 0, k_who, ": a saved skipped count is negative: ", state.skipped(),
              "; it counts steps (>= 0)");
}

void check_options_fit(const at::Tensor& param, const FoamAdamOptions& o, int64_t next_step) {
  const double step_size =
      optim_detail::adam_step_size(o.lr(), o.betas(), o.correct_bias(), next_step);
  optim_detail::check_options_fit(k_who, param,
                                  {{"eps", o.eps()},
                                   {"the step size (lr x bias correction)", step_size},
                                   {"scale", o.scale()},
                                   {"res_scale", o.res_scale()},
                                   {"res_scale^2", o.res_scale() * o.res_scale()},
                                   {"lr x weight_decay", o.lr() * o.weight_decay()}});
}

void prepare_loaded_state(FoamAdamParamState& state, const at::Tensor& param,
                          const FoamAdamOptions& options, const char* who, const std::string& where,
                          bool own_storage) {
  check_state(state, param, plan_for(param, options));
  const auto moments = param.options().dtype(state_dtype(param, options));
  using optim_detail::loaded_state_tensor;
  state.exp_avg(
      loaded_state_tensor(state.exp_avg(), moments, who, "exp_avg", where, false, own_storage));
  state.exp_avg_sq(loaded_state_tensor(state.exp_avg_sq(), moments, who, "exp_avg_sq", where, true,
                                       own_storage));
}

}  // namespace foam_adam_detail
}  // namespace gwt
