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
