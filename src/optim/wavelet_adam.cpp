#include "gwt/optim/wavelet_adam.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common.h"
#include "kernels/kernels.h"
#include "gwt/transform.h"
#include "gwt/wavelet.h"
#include "wavelet_adam_detail.h"
#include "wavelet_adam_device.h"

namespace gwt {

// ----------------------------------------------------------------------------------------------
// Planning: what a parameter's step does, decided before anything changes
// ----------------------------------------------------------------------------------------------

namespace wavelet_adam_detail {

const Wavelet& wavelet_named(const std::string& name) {
  static const std::vector<Wavelet> all = [] {
    std::vector<Wavelet> out;
    for (const auto& n : Wavelet::available()) out.emplace_back(n);
    return out;
  }();
  const auto it =
      std::find_if(all.begin(), all.end(), [&](const Wavelet& w) { return w.name() == name; });
  if (it == all.end()) (void)Wavelet(name);  // throws, naming the valid wavelets
  TORCH_CHECK(it != all.end(), "gwt: unknown wavelet '", name, "'");
  return *it;
}

at::ScalarType state_dtype(const at::Tensor& param, const WaveletAdamOptions& o) {
  TORCH_INTERNAL_ASSERT(o.state_dtype() == "auto" || o.state_dtype() == "bfloat16", "state_dtype '",
                        o.state_dtype(), "' was not validated");
  return o.state_dtype() == "bfloat16" ? at::kBFloat16 : optim_detail::compute_dtype(param);
}

Plan plan_for(const at::Tensor& param, const WaveletAdamOptions& o) {
  Plan plan;
  plan.state_shape = param.sizes().vec();
  if (o.level() == 0 || param.dim() < 2) return plan;
  const int64_t block = int64_t{1} << o.level();
  const int64_t rows = param.size(-2), cols = param.size(-1);
  if (rows < o.min_size() || cols < o.min_size()) return plan;
  const Wavelet& wavelet = wavelet_named(o.wavelet());
  const BoundaryMode mode = boundary_mode_from_string(o.boundary());
  if (o.transform() == "2d") {
    if (rows < block || cols < block) return plan;
    plan.wavelet = plan.two_d = true;
    plan.dim = param.dim() - 1;
    plan.state_shape[param.dim() - 2] = approx_len(rows, wavelet, o.level(), mode);
    plan.state_shape[param.dim() - 1] = approx_len(cols, wavelet, o.level(), mode);
    return plan;
  }
  TORCH_CHECK(o.dim() >= -param.dim() && o.dim() < param.dim(), "gwt::WaveletAdam: dim ", o.dim(),
              " is out of range for a parameter of shape ", param.sizes(),
              " (valid: ", -param.dim(), " to ", param.dim() - 1, ")");
  const int64_t dim = o.dim() < 0 ? o.dim() + param.dim() : o.dim();
  if (param.size(dim) < block) return plan;
  plan.wavelet = true;
  plan.dim = dim;
  plan.state_shape[dim] = approx_len(param.size(dim), wavelet, o.level(), mode);
  return plan;
}

void check_state(const WaveletAdamParamState& state, const at::Tensor& param, const Plan& plan) {
  for (const at::Tensor* t : {&state.exp_avg(), &state.exp_avg_sq()}) {
    TORCH_CHECK(t->defined() && t->sizes().vec() == plan.state_shape,
                "gwt::WaveletAdam: the state of a parameter of shape ", param.sizes(),
                " has moments of shape ", t->defined() ? t->sizes() : c10::IntArrayRef{},
                " but its group's options need ", c10::IntArrayRef(plan.state_shape),
                " (were level, wavelet, boundary or dim changed after training started?)");
  }
  TORCH_CHECK(state.step() >= 0,
              "gwt::WaveletAdam: a saved step count is negative: ", state.step());
  TORCH_CHECK(!state.norm().defined() || state.norm().numel() == 1,
              "gwt::WaveletAdam: the limiter norm in the state must be a single value");
}

void check_options_fit(const at::Tensor& param, const WaveletAdamOptions& o, int64_t next_step) {
  const double step_size =
      optim_detail::adam_step_size(o.lr(), o.betas(), o.correct_bias(), next_step);
  optim_detail::check_options_fit("gwt::WaveletAdam", param,
                                  {{"eps", o.eps()},
                                   {"the step size (lr x bias correction)", step_size},
                                   {"the step size x scale", step_size * o.scale()},
                                   {"lr x weight_decay", o.lr() * o.weight_decay()},
                                   {"threshold", o.threshold()},
                                   {"norm_growth_limit", o.norm_growth_limit()}});
  // The fused kernels divide the step size x scale by a denominator of at least eps before they
  // multiply by the gradient's terms; where that quotient overflows, a zero gradient's update is
  // inf x 0 = NaN (lr 1e300 with eps 1e-10 on a float64 parameter, found by fuzz_step). Half the
  // math type's largest value leaves room for eps rounded to float32.
  const bool f64 = optim_detail::compute_dtype(param) == at::kDouble;
  const double max = f64 ? std::numeric_limits<double>::max() : std::numeric_limits<float>::max();
  const double factor = std::max(std::abs(step_size), std::abs(step_size * o.scale())) / o.eps();
  TORCH_CHECK(factor <= max / 2, "gwt::WaveletAdam: the step size (x scale) / eps = ", factor,
              " overflows ", f64 ? "float64" : "float32", ", the dtype the update of a ",
              param.scalar_type(), " parameter is computed in (the update divides the step size ",
              "by its denominator, at least eps, first); it must be at most ", max / 2,
              ": use a larger eps or a smaller lr or scale");
}

}  // namespace wavelet_adam_detail

namespace {

using optim_detail::compute_dtype;
using optim_detail::kind_of;
using wavelet_adam_detail::check_options_fit;
using wavelet_adam_detail::check_state;
using wavelet_adam_detail::options_of;
using wavelet_adam_detail::Plan;
using wavelet_adam_detail::plan_for;
using wavelet_adam_detail::state_dtype;
using wavelet_adam_detail::wavelet_named;

void check_param(const at::Tensor& param) {
  optim_detail::check_param("gwt::WaveletAdam", param);
}

const WaveletAdamOptions& options_of_defaults(const torch::optim::Optimizer& optimizer) {
  return static_cast<const WaveletAdamOptions&>(optimizer.defaults());
}

// Which implementation computes a parameter's step.
enum class Path { reference, haar, general };

struct Work {
  at::Tensor param;
  const WaveletAdamOptions* options;
  Plan plan;
  Path path = Path::reference;
  at::Tensor grad;  // fused: contiguous, in the param's dtype or (low precision) float32
  const Wavelet* wavelet = nullptr;                    // general kernel: the filters
  WaveletAdamParamState* state = nullptr;              // existing state, or fresh_state
  std::unique_ptr<WaveletAdamParamState> fresh_state;  // committed only if the step is taken
  at::Tensor norm_sq;        // fused on a device: result of the norm pass (0-dim, on the device)
  double norm_sq_host = 0;   // fused on the CPU: result of the norm pass
  bool per_param = false;    // nonfinite("skip_param")
  int64_t carry_floats = 0;  // HaarAdamArgs::carry's room (0: none)
  float* carry = nullptr;    // Haar on the CPU: HaarAdamArgs::carry, or none
};

// p -= lr * weight_decay * p, after the update (decoupled).
void apply_weight_decay(at::Tensor& param, const WaveletAdamOptions& o) {
  if (o.weight_decay() != 0) param.add_(param, -o.lr() * o.weight_decay());
}

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

double step_size_of(const WaveletAdamOptions& o, int64_t step) {
  return optim_detail::adam_step_size(o.lr(), o.betas(), o.correct_bias(), step);
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

// The reference update for one parameter, in readable ATen ops (docs/algorithm.md#the-update,
// docs/algorithm.md#eligibility-and-the-dense-path). The fused kernels are tested against it;
// WaveletAdamOptions::fused(false) selects it.
void reference_update(const Work& work, WaveletAdamParamState& state, double step_size) {
  const WaveletAdamOptions& o = *work.options;
  const at::ScalarType dtype = compute_dtype(work.param);
  at::Tensor param = work.param.scalar_type() == dtype ? work.param : work.param.to(dtype);
  const at::Tensor grad = work.param.grad().to(dtype);
  const auto [beta1, beta2] = o.betas();
  // Moments kept in a narrower dtype are updated in the compute dtype, stored, and read back as
  // stored, so that what follows sees exactly what the next step will.
  const bool narrow_state = state.exp_avg().scalar_type() != dtype;
  at::Tensor exp_avg = narrow_state ? state.exp_avg().to(dtype) : state.exp_avg();
  at::Tensor exp_avg_sq = narrow_state ? state.exp_avg_sq().to(dtype) : state.exp_avg_sq();
  auto store_moments = [&] {
    if (!narrow_state) return;
    state.exp_avg().copy_(exp_avg);
    state.exp_avg_sq().copy_(exp_avg_sq);
    exp_avg = state.exp_avg().to(dtype);
    exp_avg_sq = state.exp_avg_sq().to(dtype);
  };

  if (!work.plan.wavelet) {
    exp_avg.mul_(beta1).add_(grad, 1 - beta1);
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
    store_moments();
    const at::Tensor denom = exp_avg_sq.sqrt().add_(o.eps());
    param.addcdiv_(exp_avg, denom, -step_size);
  } else {
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
    store_moments();
    m = work.plan.two_d ? exp_avg : exp_avg.movedim(dim, -1);
    v = work.plan.two_d ? exp_avg_sq : exp_avg_sq.movedim(dim, -1);
    const at::Tensor denom = v.sqrt().add_(o.eps());
    at::Tensor normalized = m / denom;

    // Norm-growth limiter (Fira): the step's ||N|| may grow by at most gamma per step. Kept as a
    // 0-dim tensor so the step never waits for the device.
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
      const at::Tensor update =
          waverec(coeffs, wavelet, -1, mode, param.size(dim)).movedim(-1, dim);
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
  apply_weight_decay(param, o);
  if (!param.is_same(work.param)) work.param.copy_(param);
}

// Which implementation computes this parameter's step: the fused kernels where they reproduce the
// reference (transform along the last, contiguous dimension), the ATen reference elsewhere.
Path path_for(const at::Tensor& param, const WaveletAdamOptions& o, const Plan& plan) {
  if (!o.fused() || !plan.wavelet || plan.dim != param.dim() - 1 || !param.is_contiguous())
    return Path::reference;
  // A GPU the CUDA kernels have no image for (warned once): the reference. CPU tensors never ask.
  if (param.is_cuda() && !kernels::cuda_kernels_run_on(param.device().index()))
    return Path::reference;
  const bool haar = o.wavelet() == "haar" || o.wavelet() == "db1";
  // Haar's zero mode pads odd lengths with zeros, which keeps blocks local; the other modes agree
  // with it only when no padding is needed. Thresholded details break Haar's closed form: the
  // general kernels threshold them.
  const int64_t block = int64_t{1} << o.level();
  const bool haar_local =
      haar && o.threshold() == 0 &&
      (o.boundary() == "zero" ||
       (param.size(-1) % block == 0 && (!plan.two_d || param.size(-2) % block == 0)));
  // 2-D: Haar on the Haar kernels (CUDA: levels 1 to 3), everything else on the reference.
  if (plan.two_d) {
    if (!haar_local) return Path::reference;
    if (param.is_cuda())
      return kernels::built_with_cuda() && o.level() <= 3 ? Path::haar : Path::reference;
    return param.device().is_cpu() ? Path::haar : Path::reference;
  }
  if (param.is_cuda()) {
    if (!kernels::built_with_cuda()) return Path::reference;
    if (haar_local && o.level() <= 3) return Path::haar;
    // The general CUDA kernel keeps a row's scratch in shared memory (of the parameter's device).
    const c10::DeviceGuard device(param.device());
    const Wavelet& wavelet = wavelet_named(o.wavelet());
    const int64_t bytes = kernels::wavelet_row_scratch_bytes(
        param.size(-1), wavelet.length(), o.level(), boundary_mode_from_string(o.boundary()),
        compute_dtype(param) == at::kDouble);
    return bytes <= kernels::wavelet_adam_cuda_max_scratch_bytes() ? Path::general
                                                                   : Path::reference;
  }
  if (!param.device().is_cpu()) return Path::reference;
  return haar_local ? Path::haar : Path::general;
}

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

void update_param(const Work& work) {
  WaveletAdamParamState& state = *work.state;
  state.step(state.step() + 1);
  const double step_size = step_size_of(*work.options, state.step());
  if (work.path != Path::reference)
    fused_update(work, state, step_size);
  else if (dense_fusable(work, state))
    dense_update(work, state, step_size);
  else
    reference_update(work, state, step_size);
}

// Whether a parameter's step can run in the multi-tensor CUDA kernels (wavelet_adam_device.h):
// fused Haar or dense, contiguous, its gradient of its dtype, on `device`.
bool device_eligible(const Work& w, const c10::Device& device) {
  const at::Tensor& p = w.param;
  const at::Tensor& g = p.grad();
  const bool haar = w.path == Path::haar, dense = !w.plan.wavelet && w.options->fused();
  const bool general = w.path == Path::general;
  const bool runs = device.is_cpu() ? wavelet_adam_detail::device_steps_emulated()
                                    : device.is_cuda() && kernels::built_with_cuda() &&
                                          kernels::cuda_kernels_run_on(device.index());
  return p.device() == device && (haar || dense || general) && runs && p.is_contiguous() &&
         g.scalar_type() == p.scalar_type() && g.is_contiguous() && g.layout() == at::kStrided;
}

// Pass 1 of a step: checks everything a caller can get wrong (options, parameters, gradients, the
// state they meet) and says how each parameter with a gradient will be stepped. Reads only; `State`
// is the optimizer's state map.
template <typename State>
std::vector<Work> checked_work(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                               const State& state) {
  std::vector<Work> work;
  for (const auto i : c10::irange(groups.size())) {
    const auto& group = groups[i];
    const WaveletAdamOptions& options = options_of(group);
    validate_options(options);
    for (const auto& param : group.params()) {
      check_param(param);
      const at::Tensor& grad = param.grad();
      if (!grad.defined()) continue;
      optim_detail::check_grad("gwt::WaveletAdam", param, grad);
      Plan plan = plan_for(param, options);
      auto it = state.find(param.unsafeGetTensorImpl());
      check_options_fit(
          param, options,
          (it == state.end() ? 0 : static_cast<const WaveletAdamParamState&>(*it->second).step()) +
              1);
      if (it != state.end()) {
        const auto& saved = static_cast<const WaveletAdamParamState&>(*it->second);
        check_state(saved, param, plan);
        // The kernels take raw pointers: the moments must live where the parameter does, in a
        // type they read (the parameter's math type, or bfloat16).
        for (const at::Tensor* t : {&saved.exp_avg(), &saved.exp_avg_sq()}) {
          TORCH_CHECK(t->device() == param.device() && t->is_contiguous(),
                      "gwt::WaveletAdam: the moments of a parameter on ", param.device(),
                      " are on ", t->device(), t->is_contiguous() ? "" : " (not contiguous)",
                      "; move the model before the first step, or save the optimizer and load "
                      "it again after moving the model");
          TORCH_CHECK(t->scalar_type() == at::kBFloat16 || t->scalar_type() == compute_dtype(param),
                      "gwt::WaveletAdam: the moments of a ", param.scalar_type(), " parameter are ",
                      t->scalar_type(), " (valid: ", compute_dtype(param),
                      " or BFloat16); convert the model before the first step, or save the "
                      "optimizer and load it again after converting the model");
        }
      }
      Work w;
      w.param = param;
      w.options = &options;
      w.per_param = options.nonfinite() == "skip_param";
      w.path = path_for(param, options, plan);
      // The CUDA bodies read a gradient in its parameter's type: a float16/bfloat16 parameter with
      // a gradient of another type takes the reference there, which reads it in float32 (the CPU
      // bodies read such a gradient as float32 themselves: HaarAdamArgs::grad_f32).
      if (w.path != Path::reference && param.is_cuda() &&
          grad.scalar_type() != param.scalar_type() && compute_dtype(param) != param.scalar_type())
        w.path = Path::reference;
      w.plan = std::move(plan);
      if (it != state.end()) w.state = static_cast<WaveletAdamParamState*>(it->second.get());
      work.push_back(std::move(w));
    }
  }
  return work;
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// WaveletAdam
// ----------------------------------------------------------------------------------------------

// The groups go through our add_param_group, not LibTorch's (which would merge their options
// into the defaults field by field only for LibTorch's own optimizers).
WaveletAdam::WaveletAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                         WaveletAdamOptions defaults)
    : Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                std::make_unique<WaveletAdamOptions>(defaults)) {
  validate_options(defaults);
  for (const auto& group : param_groups) add_param_group(group);
}

void WaveletAdam::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  const size_t index = param_groups_.size();
  std::unique_ptr<WaveletAdamOptions> options;
  if (param_group.has_options()) {
    const auto* given = dynamic_cast<const WaveletAdamOptions*>(&param_group.options());
    TORCH_CHECK(given != nullptr, "gwt::WaveletAdam: parameter group ", index,
                " has options of another optimizer; give it gwt::WaveletAdamOptions");
    options = std::make_unique<WaveletAdamOptions>(*given);
  } else {
    options = std::make_unique<WaveletAdamOptions>(options_of_defaults(*this));
  }
  validate_options(*options);
  std::unordered_set<const void*> seen;
  for (const auto& group : param_groups_)
    for (const auto& param : group.params()) seen.insert(param.unsafeGetTensorImpl());
  for (const auto& param : param_group.params()) {
    check_param(param);
    TORCH_CHECK(param.is_leaf(), "gwt::WaveletAdam: parameter group ", index,
                " holds a non-leaf tensor of shape ", param.sizes(),
                "; optimize leaf tensors (e.g. detach().requires_grad_())");
    TORCH_CHECK(seen.insert(param.unsafeGetTensorImpl()).second,
                "gwt::WaveletAdam: a parameter of shape ", param.sizes(),
                " appears more than once (each parameter may be in one group once)");
    plan_for(param, *options);  // checks dim against the parameter's rank
  }
  // Everything checked: commit.
  torch::optim::OptimizerParamGroup group(param_group.params());
  group.set_options(std::move(options));
  param_groups_.push_back(std::move(group));
}

WaveletAdam::WaveletAdam(std::vector<at::Tensor> params, WaveletAdamOptions defaults)
    : WaveletAdam({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

const WaveletAdamOptions& WaveletAdam::group_options(size_t i) const {
  TORCH_CHECK(i < param_groups().size(), "gwt::WaveletAdam: group ", i,
              " does not exist (there are ", param_groups().size(), ")");
  return options_of(param_groups()[i]);
}

void WaveletAdam::check_step() const {
  at::NoGradGuard no_grad;
  checked_work(param_groups(), state_);
}

at::Tensor WaveletAdam::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }

  // Pass 1: check everything a caller can get wrong; nothing has changed yet.
  std::vector<Work> work = checked_work(param_groups(), state_);
  if (work.empty()) return loss;

  // Fresh state for first steps, committed only if the step is taken.
  for (auto& w : work) {
    if (w.state != nullptr) continue;
    w.fresh_state = std::make_unique<WaveletAdamParamState>();
    const auto options = w.param.options().dtype(state_dtype(w.param, *w.options));
    w.fresh_state->exp_avg(at::zeros(w.plan.state_shape, options));
    w.fresh_state->exp_avg_sq(at::zeros(w.plan.state_shape, options));
    w.state = w.fresh_state.get();
  }
  assign_carry(work, carry_);

  // CUDA: when every parameter of the step can take the multi-tensor kernels, one step of them,
  // deciding on the device what the loop below decides on the host (a skipped first step keeps
  // the fresh, zero state with step 0, as "skip_param" does). Otherwise the host's counts are
  // brought up to date and the step goes on below.
  const c10::Device first_device = work.front().param.device();
  if (std::all_of(work.begin(), work.end(),
                  [&](const Work& w) { return device_eligible(w, first_device); })) {
    std::vector<wavelet_adam_detail::DeviceItem> items;
    using Rule = wavelet_adam_detail::DeviceItem::Rule;
    for (auto& w : work) {
      if (w.fresh_state) state_[w.param.unsafeGetTensorImpl()] = std::move(w.fresh_state);
      wavelet_adam_detail::DeviceItem item;
      item.param = w.param, item.options = w.options, item.state = w.state;
      item.two_d = w.plan.two_d;
      item.rule = w.path == Path::haar ? Rule::haar : w.path == Path::general ? Rule::general
                                                                              : Rule::dense;
      if (item.rule == Rule::general) {
        w.grad = w.param.grad();  // of the parameter's dtype and contiguous (device_eligible)
        w.wavelet = &wavelet_named(w.options->wavelet());
        item.general = general_args(w, 0.0);
      }
      items.push_back(std::move(item));
    }
    if (!device_steps_) device_steps_ = std::make_shared<wavelet_adam_detail::DeviceSteps>();
    device_steps_->step(items);
    return loss;
  }
  if (device_steps_ && !device_steps_->empty()) {
    sync_device_steps();
    device_steps_->clear();
  }

  // A NaN or infinity in any gradient of a "skip_step" group skips the whole step. The fused norm
  // pass reads only and turns NaN on such a gradient, so it is the check for its parameters; other
  // CPU gradients take one read each, gradients on other devices one synchronisation for all of
  // them. Parameters of "skip_param" groups are checked one by one below.
  // check_of returns what is left to check: the gradient (reference path), the norm on the device,
  // or nothing when the CPU norm pass's result (a double) was checked already.
  bool host_nonfinite = false;
  auto check_of = [&host_nonfinite](Work& w) {
    if (w.path == Path::reference)
      return optim_detail::grad_for_finite_check(w.param, w.param.grad());
    fused_norm_pass(w);
    if (!w.param.is_cuda() && !std::isfinite(w.norm_sq_host)) host_nonfinite = true;
    return w.norm_sq;
  };
  std::vector<at::Tensor> to_check;
  for (auto& w : work) {
    if (w.per_param) continue;
    at::Tensor check = check_of(w);
    if (check.defined()) to_check.push_back(std::move(check));
  }
  if (host_nonfinite || !optim_detail::all_finite(to_check)) {
    ++skipped_steps_;
    return loss;
  }

  // "skip_param": the norm pass, the check and the update of one parameter back to back, while
  // its gradient is in the cache. A skipped parameter keeps its value and state (a first step's
  // fresh, zero state is kept with step 0: the same as none, and it holds the count).
  bool skipped_any = false;
  for (auto& w : work) {
    bool skip = false;
    if (w.per_param) {
      host_nonfinite = false;
      const at::Tensor check = check_of(w);
      skip = host_nonfinite || (check.defined() && !optim_detail::all_finite({check}));
    }
    if (w.fresh_state) state_[w.param.unsafeGetTensorImpl()] = std::move(w.fresh_state);
    if (skip) {
      w.state->skipped(w.state->skipped() + 1);
      skipped_any = true;
      continue;
    }
    update_param(w);
  }
  if (skipped_any) ++skipped_steps_;
  return loss;
}

// ----------------------------------------------------------------------------------------------
// Reports
// ----------------------------------------------------------------------------------------------

int64_t WaveletAdam::state_bytes(const at::Tensor& param) const {
  auto it = state_.find(param.unsafeGetTensorImpl());
  if (it == state_.end()) return 0;
  const auto& state = static_cast<const WaveletAdamParamState&>(*it->second);
  int64_t bytes = 0;
  for (const at::Tensor* t : {&state.exp_avg(), &state.exp_avg_sq(), &state.norm()})
    if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  return bytes;
}

int64_t WaveletAdam::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& group : param_groups())
    for (const auto& param : group.params()) bytes += state_bytes(param);
  return bytes;
}

std::pair<int64_t, int64_t> WaveletAdam::kept_details() const {
  sync_device_steps();
  int64_t kept = 0, total = 0;
  for (const auto& item : state_) {
    const auto& s = static_cast<const WaveletAdamParamState&>(*item.second);
    if (s.total_details() < 0) continue;
    kept += s.kept_details(), total += s.total_details();
  }
  return {kept, total};
}

void WaveletAdam::sync_device_steps() const {
  if (!device_steps_ || device_steps_->empty()) return;
  // Logically const: the host's copy of the counts catches up with the device's.
  auto& self = const_cast<WaveletAdam&>(*this);
  device_steps_->sync(
      [&self](const void* key) -> WaveletAdamParamState* {
        auto it = self.state_.find(const_cast<void*>(key));
        return it == self.state_.end() ? nullptr
                                       : static_cast<WaveletAdamParamState*>(it->second.get());
      },
      skipped_steps_);
}

int64_t WaveletAdam::skipped_steps() const {
  sync_device_steps();
  return skipped_steps_;
}

int64_t WaveletAdam::skipped_steps(const at::Tensor& param) const {
  sync_device_steps();
  auto it = state_.find(param.unsafeGetTensorImpl());
  return it == state_.end() ? 0 : static_cast<const WaveletAdamParamState&>(*it->second).skipped();
}

bool WaveletAdam::is_fused_param(const at::Tensor& param) const {
  for (const auto& group : param_groups())
    for (const auto& p : group.params())
      if (p.is_same(param)) {
        const auto& options = options_of(group);
        return path_for(param, options, plan_for(param, options)) != Path::reference;
      }
  TORCH_CHECK(false,
              "gwt::WaveletAdam::is_fused_param: the tensor is not a parameter of this optimizer");
}

bool WaveletAdam::is_wavelet_param(const at::Tensor& param) const {
  for (const auto& group : param_groups())
    for (const auto& p : group.params())
      if (p.is_same(param)) return plan_for(param, options_of(group)).wavelet;
  TORCH_CHECK(
      false, "gwt::WaveletAdam::is_wavelet_param: the tensor is not a parameter of this optimizer");
}

}  // namespace gwt
