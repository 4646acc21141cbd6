// The fused paths of gwt::WaveletAdam: a parameter's step in the Haar and general wavelet kernels
// (a norm pass, then an update pass) and the dense rule in one CPU loop, on the CPU or a CUDA
// device. They reproduce reference_update (wavelet_adam_reference.cpp) and are tested against it.

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "common.h"
#include "gwt/optim/wavelet_adam.h"
#include "gwt/wavelet.h"
#include "kernels/kernels.h"
#include "wavelet_adam_detail.h"
#include "wavelet_adam_step.h"

namespace gwt {
namespace wavelet_adam_detail {

using optim_detail::compute_dtype;
using optim_detail::kind_of;

// Room for HaarAdamArgs::carry, for "skip_param" tensors: the Haar CPU norm pass leaves each
// coefficient's approximation and denominator (8 bytes per coefficient) for the update pass, which
// then neither sums the gradient's blocks nor takes the square roots again (same bits, faster in
// L1: docs/notes/kernel_history.md). A "skip_param"
// tensor's two passes run back to back, so its carry is still in the caches for the update: each
// such tensor whose carry fits 4 MB gets it, in one room they share, kept between steps (a
// steady-state step allocates nothing). Not for "skip_step", whose norm passes all run before any
// update: there it did not pay in the runs measured (the main job's model and 500x(64x64+64),
// everything in the caches).
void assign_carry(std::vector<Work>& work, std::vector<float>& room) {
  constexpr int64_t k_budget = int64_t{1} << 20;  // floats
  int64_t need = 0;
  for (Work& w : work) {
    if (!w.per_param || w.path != Path::haar || !w.param.is_cpu() ||
        compute_dtype(w.param) != at::kFloat || w.options->level() > 3)
      continue;  // the float32 vector body, which alone takes a carry, does not run
    const int64_t floats = 2 * w.state->exp_avg().numel();
    w.carry_floats = floats <= k_budget ? floats : 0;
    need = std::max(need, w.carry_floats);
  }
  if (need == 0) return;
  if (static_cast<int64_t>(room.size()) < need) room.resize(static_cast<size_t>(need));
  for (Work& w : work)
    if (w.carry_floats > 0) w.carry = room.data();
}

namespace {

kernels::HaarAdamArgs haar_args(const Work& work, double step_size) {
  const WaveletAdamOptions& o = *work.options;
  const WaveletAdamParamState& state = *work.state;
  kernels::HaarAdamArgs args;
  args.param = work.param.data_ptr();
  args.grad = work.grad.data_ptr();
  args.exp_avg = state.exp_avg().data_ptr();
  args.exp_avg_sq = state.exp_avg_sq().data_ptr();
  args.param_kind = kind_of(work.param.scalar_type());
  args.state_kind = kind_of(state.exp_avg().scalar_type());
  args.math_f64 = compute_dtype(work.param) == at::kDouble;
  args.grad_f32 = work.grad.scalar_type() != work.param.scalar_type();
  args.n = work.param.size(-1);
  args.rows = work.param.numel() / args.n;
  args.two_d = work.plan.two_d;
  if (args.two_d) args.height = work.param.size(-2);
  args.approx_len = state.exp_avg().size(-1);
  args.level = o.level();
  // Rows whose length is a multiple of the block hold whole blocks, so a contiguous [rows, n]
  // parameter is the same problem as one row of rows * n (and its moments, [rows, approx_len],
  // one row of rows * approx_len). On the CPU the kernel then tiles across rows, and narrow
  // matrices (64 wide: 16 coefficients a row at level 2) do not pay a tile's set-up per row.
  // (Not for a parameter without rows, [0, n]: it would become one row of 0, which no kernel
  // takes.)
  if (work.path == Path::haar && !args.two_d && work.param.is_cpu() && args.rows > 0 &&
      args.n % (int64_t{1} << args.level) == 0) {
    args.n *= args.rows, args.approx_len *= args.rows;
    args.rows = 1;
  }
  if (work.path == Path::haar && work.param.is_cpu()) args.carry = work.carry;
  std::tie(args.beta1, args.beta2) = o.betas();
  args.eps = o.eps();
  args.step_size = step_size * o.scale();
  args.decay = o.lr() * o.weight_decay();
  return args;
}

}  // namespace

kernels::WaveletAdamArgs general_args(const Work& work, double step_size) {
  kernels::WaveletAdamArgs args;
  static_cast<kernels::HaarAdamArgs&>(args) = haar_args(work, step_size);
  args.dec_lo = work.wavelet->dec_lo().data();
  args.dec_hi = work.wavelet->dec_hi().data();
  args.filter_length = work.wavelet->length();
  args.boundary = boundary_mode_from_string(work.options->boundary());
  args.coeff_len = kernels::wavelet_workspace_len(work.param.size(-1), args.filter_length,
                                                  args.level, args.boundary);
  args.threshold = work.options->threshold();
  args.threshold_soft = work.options->threshold_mode() == "soft";
  return args;
}

// Norm pass of the fused kernels: writes no optimizer state, so a non-finite gradient (which makes
// the result NaN) can still skip the step with nothing changed.
void fused_norm_pass(Work& work) {
  c10::OptionalDeviceGuard device;  // kernels launch on the current device: the parameter's
  if (work.param.is_cuda()) device.reset_device(work.param.device());
  // The gradient as the reference reads it: in the parameter's type when it has that type, else
  // converted to the math type. A float32 gradient of a bfloat16 parameter stays float32 (never
  // rounded to bfloat16), and the kernels read it as such (HaarAdamArgs::grad_f32).
  const at::Tensor& grad = work.param.grad();
  work.grad = grad.to(grad.scalar_type() == work.param.scalar_type() ? grad.scalar_type()
                                                                     : compute_dtype(work.param))
                  .contiguous();
  const auto acc = work.param.options().dtype(compute_dtype(work.param));
  if (work.path == Path::general) {
    work.wavelet = &wavelet_named(work.options->wavelet());
    if (work.param.is_cuda()) {
      work.norm_sq = at::zeros({}, acc);
      kernels::wavelet_adam_norm_sq_cuda(general_args(work, 0.0), work.norm_sq.data_ptr());
    } else {
      work.norm_sq_host = kernels::wavelet_adam_norm_sq_cpu(general_args(work, 0.0));
    }
    return;
  }
  const kernels::HaarAdamArgs args = haar_args(work, 0.0);
  if (work.param.is_cuda()) {
    work.norm_sq = at::zeros({}, acc);
    kernels::haar_adam_norm_sq_cuda(args, work.norm_sq.data_ptr());
  } else {
    work.norm_sq_host = kernels::haar_adam_norm_sq_cpu(args);
  }
}

namespace {

// The limiter's saved norm of a CPU parameter, read and written through its data: no dispatch and
// no allocation per parameter and step (with the norm pass's result kept as a double, a step over
// many small tensors spends a third of the host time it did through 0-dim tensors).
double saved_norm(const at::Tensor& norm) {
  if (norm.is_cpu() && norm.numel() == 1) {
    if (norm.scalar_type() == at::kDouble) return *norm.const_data_ptr<double>();
    if (norm.scalar_type() == at::kFloat) return *norm.const_data_ptr<float>();
  }
  return norm.item<double>();
}

// Written in place into a one-value CPU tensor of the math type; a norm of another kind (a
// checkpoint's of another dtype, say) is replaced by a 0-dim tensor of the math type.
void save_norm(WaveletAdamParamState& state, double value, at::ScalarType acc) {
  TORCH_INTERNAL_ASSERT(acc == at::kDouble || acc == at::kFloat);
  const at::Tensor& norm = state.norm();
  if (!(norm.defined() && norm.is_cpu() && norm.numel() == 1 && norm.is_contiguous() &&
        norm.scalar_type() == acc && !norm.requires_grad()))
    state.norm(at::empty({}, at::TensorOptions().dtype(acc)));
  if (acc == at::kDouble)
    *state.norm().mutable_data_ptr<double>() = value;
  else  // rounded to nearest, as at::scalar_tensor rounds a double into float
    *state.norm().mutable_data_ptr<float>() = static_cast<float>(value);
}

// Update pass of the general kernels (run_kernel calls the CPU or CUDA body), with the count of
// thresholded details kept; counting them is the one synchronisation with a device, and only
// with a threshold.
template <typename RunKernel>
void general_update(const Work& work, WaveletAdamParamState& state, double step_size,
                    RunKernel&& run_kernel) {
  kernels::WaveletAdamArgs args = general_args(work, step_size);
  at::Tensor kept;
  if (args.threshold > 0) {
    kept = at::zeros({args.rows}, work.param.options().dtype(at::kLong));
    args.kept_per_row = kept.data_ptr<int64_t>();
  }
  run_kernel(args);
  if (kept.defined())
    state.kept_details(kept.sum().item<int64_t>())
        .total_details(args.rows * (args.coeff_len - args.approx_len));
}

}  // namespace

// Update pass: the limiter (docs/algorithm.md#the-norm-growth-limiter) from the norm pass's result,
// then the kernel.
void fused_update(const Work& work, WaveletAdamParamState& state, double step_size) {
  c10::OptionalDeviceGuard device;
  if (work.param.is_cuda()) device.reset_device(work.param.device());
  const WaveletAdamOptions& o = *work.options;
  const double gamma = o.norm_growth_limit();
  if (!work.param.is_cuda()) {
    double lim = 1.0;
    if (gamma > 0) {
      const double norm = std::sqrt(work.norm_sq_host);
      const auto acc = compute_dtype(work.param);
      if (!state.norm().defined()) {
        save_norm(state, norm, acc);
      } else {
        lim = std::max(norm / (saved_norm(state.norm()) + 1e-8), gamma) / gamma;
        save_norm(state, norm / lim, acc);
      }
    }
    if (work.path == Path::general)
      general_update(work, state, step_size, [lim](const kernels::WaveletAdamArgs& args) {
        kernels::wavelet_adam_update_cpu(args, lim);
      });
    else
      kernels::haar_adam_update_cpu(haar_args(work, step_size), lim);
    return;
  }
  // On the device: 0-dim tensor arithmetic, no synchronisation with the host.
  at::Tensor lim = at::ones({}, work.norm_sq.options());
  if (gamma > 0) {
    const at::Tensor norm = work.norm_sq.sqrt();
    if (!state.norm().defined()) {
      state.norm(norm);
    } else {
      lim = at::clamp_min(norm / (state.norm() + 1e-8), gamma) / gamma;
      state.norm(norm / lim);
    }
  }
  if (work.path == Path::general)
    general_update(work, state, step_size, [&lim](const kernels::WaveletAdamArgs& args) {
      kernels::wavelet_adam_update_cuda(args, lim.data_ptr());
    });
  else
    kernels::haar_adam_update_cuda(haar_args(work, step_size), lim.data_ptr());
}

// The dense rule (docs/algorithm.md#eligibility-and-the-dense-path) in one pass over a CPU
// parameter whose gradient and moments share its dtype (float32 or float64) and are contiguous: the
// reference's ATen ops, element by element, in the same order, without the reference's temporary
// (sqrt(v) + eps, a parameter's size at every step). Tested against reference_update and, bit for
// bit, against a plain loop.
bool dense_fusable(const Work& work, const WaveletAdamParamState& state) {
  const at::Tensor& p = work.param;
  const at::Tensor& g = p.grad();
  const at::ScalarType t = p.scalar_type();
  return work.options->fused() && !work.plan.wavelet && p.device().is_cpu() &&
         (t == at::kFloat || t == at::kDouble) && p.is_contiguous() && g.scalar_type() == t &&
         g.is_contiguous() && state.exp_avg().scalar_type() == t &&
         state.exp_avg_sq().scalar_type() == t && state.exp_avg().is_contiguous() &&
         state.exp_avg_sq().is_contiguous();
}

void dense_update(const Work& work, WaveletAdamParamState& state, double step_size) {
  const WaveletAdamOptions& o = *work.options;
  kernels::DenseAdamArgs args;
  args.param = work.param.data_ptr();
  args.grad = work.param.grad().data_ptr();
  args.exp_avg = state.exp_avg().data_ptr();
  args.exp_avg_sq = state.exp_avg_sq().data_ptr();
  args.f64 = work.param.scalar_type() == at::kDouble;
  args.n = work.param.numel();
  std::tie(args.beta1, args.beta2) = o.betas();
  args.eps = o.eps();
  args.step_size = step_size;
  args.decay = o.lr() * o.weight_decay();
  args.apply_decay = o.weight_decay() != 0;
  kernels::dense_adam_update_cpu(args);
}

}  // namespace wavelet_adam_detail
}  // namespace gwt
