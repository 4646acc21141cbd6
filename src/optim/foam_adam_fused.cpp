// The fused paths of gwt::FoamAdam on the CPU: a folded parameter's step in one pass of
// src/kernels/cpu/foam_adam_cpu_impl.h, a dense one in the dense Adam loop WaveletAdam uses. They
// reproduce the readable reference (foam_adam.cpp) and are tested against it
// (tests/test_foam_fused.cpp).

#include <ATen/ATen.h>

#include <tuple>

#include "common.h"
#include "foam_adam_detail.h"
#include "kernels/kernels.h"

namespace gwt {
namespace foam_adam_detail {

using optim_detail::compute_dtype;
using optim_detail::kind_of;

Path path_for(const at::Tensor& param, const FoamAdamOptions& o, const Plan& plan,
              at::ScalarType moments) {
  const at::ScalarType t = param.scalar_type();
  const at::ScalarType math = compute_dtype(param);
  const bool floating = t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
  if (!o.fused() || !param.device().is_cpu() || !floating || !param.is_contiguous() ||
      param.numel() == 0)
    return Path::reference;
  if (plan.folded) {
    const bool along_last = plan.dim < 0 || plan.dim == param.dim() - 1;
    return along_last && (moments == math || moments == at::kBFloat16) ? Path::folded
                                                                       : Path::reference;
  }
  return (t == at::kFloat || t == at::kDouble) && moments == t ? Path::dense : Path::reference;
}

bool device_kernel_takes(const at::Tensor& param, const FoamAdamOptions& o, const Plan& plan,
                         at::ScalarType moments) {
  const at::ScalarType t = param.scalar_type();
  const bool floating = t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
  const bool moments_ok = moments == compute_dtype(param) || moments == at::kBFloat16;
  const bool along_last = !plan.folded || plan.dim < 0 || plan.dim == param.dim() - 1;
  return o.fused() && floating && moments_ok && along_last && param.numel() > 0 &&
         param.is_contiguous() && optim_detail::device_steps_run_on(param.device());
}

bool device_eligible(const at::Tensor& param, const FoamAdamOptions& o, const Plan& plan,
                     at::ScalarType moments) {
  const at::Tensor& g = param.grad();
  return device_kernel_takes(param, o, plan, moments) && g.device() == param.device() &&
         g.scalar_type() == param.scalar_type() && g.is_contiguous() && g.layout() == at::kStrided;
}

optim_detail::DeviceItem device_item(const at::Tensor& param, FoamAdamParamState& state,
                                     const FoamAdamOptions& o, const Plan& plan) {
  namespace mt = kernels::mt;
  optim_detail::DeviceItem item;
  item.param = param, item.exp_avg = state.exp_avg(), item.exp_avg_sq = state.exp_avg_sq();
  item.slots.step = &state.step(), item.slots.skipped = &state.skipped();
  mt::TensorMeta& t = item.meta;
  if (plan.folded) {  // along the last dimension (device_eligible); a 0-dim one: one value
    t.n = param.dim() == 0 ? 1 : param.size(-1);
    t.rows = param.numel() / t.n;
    mt::complete_foam_meta(t, o.level());
  } else {
    t.kind = mt::Kind::dense;
    t.n = param.numel();
    t.rows = 1;
  }
  std::tie(t.beta1, t.beta2) = o.betas();
  t.eps = o.eps(), t.lr = o.lr(), t.weight_decay = o.weight_decay();
  t.scale = o.scale(), t.res_scale = o.res_scale(), t.gamma = 0;
  t.correct_bias = o.correct_bias();
  t.skip_param = o.nonfinite() == "skip_param";
  return item;
}

namespace {

// The gradient as the reference reads it (param.grad().to(math)), contiguous: a float16/bfloat16
// parameter's gradient of its own dtype stays so (the kernel widens it exactly), one of any other
// dtype is converted to float32 (grad_f32).
at::Tensor kernel_grad(const at::Tensor& param) {
  const at::Tensor& grad = param.grad();
  const at::ScalarType own = param.scalar_type();
  return grad.to(grad.scalar_type() == own ? own : compute_dtype(param)).contiguous();
}

}  // namespace

void fused_update(const at::Tensor& param, FoamAdamParamState& state, const FoamAdamOptions& o,
                  Path path, double step_size) {
  TORCH_INTERNAL_ASSERT(path != Path::reference);
  const at::Tensor grad = kernel_grad(param);
  if (path == Path::dense) {
    kernels::DenseAdamArgs args;
    args.param = param.data_ptr();
    args.grad = grad.data_ptr();
    args.exp_avg = state.exp_avg().data_ptr();
    args.exp_avg_sq = state.exp_avg_sq().data_ptr();
    args.f64 = param.scalar_type() == at::kDouble;
    args.n = param.numel();
    std::tie(args.beta1, args.beta2) = o.betas();
    args.eps = o.eps();
    args.step_size = step_size;
    args.decay = o.lr() * o.weight_decay();
    args.apply_decay = o.weight_decay() > 0;  // as the reference: only a positive decay
    kernels::dense_adam_update_cpu(args);
    return;
  }
  kernels::FoamAdamArgs args;
  args.param = param.data_ptr();
  args.grad = grad.data_ptr();
  args.exp_avg = state.exp_avg().data_ptr();
  args.exp_avg_sq = state.exp_avg_sq().data_ptr();
  args.param_kind = kind_of(param.scalar_type());
  args.state_kind = kind_of(state.exp_avg().scalar_type());
  args.math_f64 = compute_dtype(param) == at::kDouble;
  args.grad_f32 = grad.scalar_type() != param.scalar_type();
  // Rows along the last dimension; a 0-dim parameter is one row of one value. Rows whose length
  // is a multiple of the block hold whole blocks, so the parameter is then one row of all its
  // values (and its moments one row), which the kernel splits into groups of 8 blocks evenly.
  args.n = param.dim() == 0 ? 1 : param.size(-1);
  args.rows = param.numel() / args.n;
  args.level = o.level();
  args.approx_len = state.exp_avg().numel() / args.rows;
  if (args.n % (int64_t{1} << args.level) == 0) {
    args.n *= args.rows, args.approx_len *= args.rows;
    args.rows = 1;
  }
  std::tie(args.beta1, args.beta2) = o.betas();
  args.eps = o.eps();
  args.scale = o.scale();
  args.res_scale = o.res_scale();
  args.step_size = step_size;
  args.decay = o.lr() * o.weight_decay();
  args.apply_decay = o.weight_decay() > 0;
  kernels::foam_adam_update_cpu(args);
}

}  // namespace foam_adam_detail
}  // namespace gwt
