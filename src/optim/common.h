#pragma once

// Pieces shared by gwt's torch::optim optimizers (internal: not installed).

#include <ATen/ATen.h>
#include <torch/serialize/input-archive.h>

#include <cmath>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../plain_tensor.h"
#include "kernels/kernels.h"

namespace gwt {
namespace optim_detail {

/// Reads a saved value or fails naming the optimizer whose checkpoint it should have been.
inline c10::IValue read_value(torch::serialize::InputArchive& archive, const std::string& key,
                              const char* what, const char* who) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read(key, value), "gwt: ", what, " has no '", key,
              "' entry; it was not written by ", who, "::save");
  return value;
}

/// Reads a saved tensor or fails naming it. Into a fresh tensor each time: InputArchive::read into
/// a defined tensor overwrites that tensor in place.
inline at::Tensor read_tensor(torch::serialize::InputArchive& archive, const std::string& key,
                              const char* what) {
  at::Tensor tensor;
  TORCH_CHECK(archive.try_read(key, tensor), "gwt: ", what, " has no ", key);
  return tensor;
}

/// The Adam hyper-parameters every gwt optimizer shares.
inline void check_adam_options(const char* who, double lr, std::tuple<double, double> betas,
                               double eps, double weight_decay) {
  auto finite = [](double x) { return std::isfinite(x); };
  TORCH_CHECK(finite(lr) && lr >= 0, who, ": invalid learning rate ", lr,
              "; it must be finite and >= 0");
  const auto [beta1, beta2] = betas;
  TORCH_CHECK(finite(beta1) && beta1 >= 0 && beta1 < 1, who, ": invalid beta1 ", beta1,
              "; it must be in [0, 1)");
  TORCH_CHECK(finite(beta2) && beta2 >= 0 && beta2 < 1, who, ": invalid beta2 ", beta2,
              "; it must be in [0, 1)");
  // eps keeps m / (sqrt(v) + eps) defined where a coordinate's gradients were all zero (m = v = 0):
  // with eps = 0 that is 0 / 0. The math runs in float32 for all but float64 parameters, so eps
  // must survive the cast: at least the smallest normal float32 (denormals may be flushed).
  constexpr double min_eps = std::numeric_limits<float>::min();
  TORCH_CHECK(finite(eps) && eps >= min_eps, who, ": invalid eps ", eps,
              "; it must be finite and >= ", min_eps,
              " (the smallest normal float32; with eps = 0 a coordinate whose gradients "
              "were all zero makes 0 / 0)");
  TORCH_CHECK(finite(weight_decay) && weight_decay >= 0, who, ": invalid weight_decay ",
              weight_decay, "; it must be finite and >= 0");
}

/// The dtype updates are computed in: float64 stays, everything else float32.
inline at::ScalarType compute_dtype(const at::Tensor& param) {
  return param.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

/// The option values enter a parameter's update as scalars of its math dtype (`compute_dtype`):
/// for all but float64 parameters each must fit float32, or the step would fail half-way (ATen's
/// "value cannot be converted to type float without overflow") or write infinities. Checked for
/// every parameter before anything changes.
inline void check_options_fit(const char* who, const at::Tensor& param,
                              std::initializer_list<std::pair<const char*, double>> values) {
  // A float64 parameter's math is float64: its values fit unless a product of two finite options
  // overflowed to infinity (lr 1e300 x scale 1e300 made a zero gradient's update inf x 0 = NaN,
  // found by fuzz_step).
  if (compute_dtype(param) == at::kDouble) {
    for (const auto& [name, value] : values)
      TORCH_CHECK(std::isfinite(value), who, ": ", name, " = ", value, " overflows float64, ",
                  "the dtype the update of a Double parameter is computed in; it must be at most ",
                  std::numeric_limits<double>::max(), " in magnitude");
    return;
  }
  constexpr double max = std::numeric_limits<float>::max();
  for (const auto& [name, value] : values)
    TORCH_CHECK(std::abs(value) <= max, who, ": ", name, " = ", value, " does not fit float32, ",
                "the dtype the update of a ", param.scalar_type(), " parameter is computed in; it ",
                "must be at most ", max, " in magnitude (or make the parameter float64)");
}

/// The gradient as the finite check must see it: in the math dtype when the gradient is wider (a
/// float64 gradient of a float32 parameter can be finite and still overflow float32, which the
/// update converts it to).
inline at::Tensor grad_for_finite_check(const at::Tensor& param, const at::Tensor& grad) {
  const auto math = compute_dtype(param);
  if (grad.scalar_type() == at::kDouble && math != at::kDouble) return grad.to(math);
  return grad;
}

/// "parameter j of group i (shape [..])": how a message names a parameter.
inline std::string param_where(size_t group, size_t position, const at::Tensor& param) {
  std::ostringstream out;
  out << "parameter " << position << " of group " << group << " (shape " << param.sizes() << ")";
  return out.str();
}

/// Whether the kernels (and so the optimizers) read and write this dtype.
inline bool is_supported_param_dtype(at::ScalarType t) {
  return t == at::kDouble || t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline void check_param(const char* who, const at::Tensor& param) {
  TORCH_CHECK(param.defined(), who, ": got an undefined parameter tensor");
  detail::check_plain_tensor(who, "a parameter", param);
  // float8 and the other narrow floating types pass is_floating_point() but have no kernel type.
  TORCH_CHECK(is_supported_param_dtype(param.scalar_type()), who,
              ": parameters must be float64, float32, float16 or bfloat16, got a ",
              param.scalar_type(), " parameter of shape ", param.sizes(),
              " (integer, bool, complex and float8 parameters are not supported)");
  TORCH_CHECK(param.layout() == at::kStrided, who,
              ": parameters must be dense (strided) tensors, got layout ", param.layout());
}

/// Checks a parameter's gradient; nothing has changed when this throws.
inline void check_grad(const char* who, const at::Tensor& param, const at::Tensor& grad) {
  TORCH_CHECK(!grad.is_sparse() && grad.layout() == at::kStrided, who,
              " does not support sparse gradients (parameter of shape ", param.sizes(),
              "); use a dense gradient, e.g. nn::Embedding without sparse=true");
  detail::check_plain_tensor(who, "a gradient", grad);
  TORCH_CHECK(grad.sizes() == param.sizes(), who, ": gradient shape ", grad.sizes(),
              " does not match its parameter's shape ", param.sizes());
  TORCH_CHECK(grad.is_floating_point(), who, ": gradient dtype ", grad.scalar_type(),
              " is not floating point");
  TORCH_CHECK(grad.device() == param.device(), who, ": gradient on ", grad.device(),
              " but its parameter is on ", param.device());
}

/// lr, times sqrt(1 - b2^t) / (1 - b1^t) when correct_bias (docs/algorithm.md#the-update, folded
/// bias correction). The two powers of the last betas and step asked on this thread are kept: a
/// step asks the same ones for every parameter (two std::pow per parameter otherwise). The result
/// is computed in the same order either way.
inline double adam_step_size(double lr, std::tuple<double, double> betas, bool correct_bias,
                             int64_t step) {
  if (!correct_bias) return lr;
  const auto [beta1, beta2] = betas;
  struct Last {
    double beta1 = 0, beta2 = 0;
    int64_t step = -1;
    double root = 0, denom = 0;  // sqrt(1 - b2^t), 1 - b1^t
  };
  thread_local Last last;
  if (last.step != step || last.beta1 != beta1 || last.beta2 != beta2) {
    const auto t = static_cast<double>(step);
    last = {beta1, beta2, step, std::sqrt(1 - std::pow(beta2, t)), 1 - std::pow(beta1, t)};
  }
  return lr * last.root / last.denom;
}

inline kernels::ScalarKind kind_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kernels::ScalarKind::f32;
    case at::kDouble:
      return kernels::ScalarKind::f64;
    case at::kHalf:
      return kernels::ScalarKind::f16;
    case at::kBFloat16:
      return kernels::ScalarKind::bf16;
    default:
      TORCH_INTERNAL_ASSERT(false, "no kernel dtype for ", t);
  }
}

/// Whether the CPU kernels check `t`'s values for finiteness (all_finite_cpu): a contiguous CPU
/// tensor of a dtype they read.
inline bool host_checkable(const at::Tensor& t) {
  const auto s = t.scalar_type();
  return t.device().is_cpu() && t.is_contiguous() &&
         (s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16);
}

/// Whether every tensor is finite: CPU tensors in one read each, others on their device with one
/// synchronisation for all of them.
inline bool all_finite(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> device_flags;
  for (const auto& t : tensors) {
    if (host_checkable(t)) {
      if (!kernels::all_finite_cpu(t.data_ptr(), t.numel(), kind_of(t.scalar_type()))) return false;
    } else {
      device_flags.push_back(at::isfinite(t).all().to(tensors.front().device()));
    }
  }
  return device_flags.empty() || at::stack(device_flags).all().item<bool>();
}

/// A loaded state tensor (`name`, of the parameter `where` names) as an optimizer keeps it:
/// floating point, in `target`'s dtype and on its device, contiguous; with `own_storage` in
/// storage of its own (the steps update the moments in place: a Python state_dict's tensors stay
/// the caller's). Its values are checked in the target dtype (a finite float64 value can
/// overflow float32): finite, and >= 0 where `non_negative`. An undefined tensor stays undefined.
/// What WaveletAdam::load and GaLoreAdam::load do with a checkpoint's tensors, and the Python
/// package's load_state_dict with a state_dict's.
inline at::Tensor loaded_state_tensor(const at::Tensor& t, const at::TensorOptions& target,
                                      const char* who, const char* name, const std::string& where,
                                      bool non_negative, bool own_storage) {
  if (!t.defined()) return t;
  const std::string what = std::string("the saved ") + name + " for " + where;
  detail::check_plain_tensor(who, what.c_str(), t);
  TORCH_CHECK(t.is_floating_point(), who, ": ", what, " is a ", t.scalar_type(),
              " tensor (moments, limiter norm and projector are floating point)");
  at::Tensor out = t.to(target).contiguous();
  if (own_storage && out.is_alias_of(t)) out = out.clone();
  auto corrupt = [&](const char* problem) {
    TORCH_CHECK(false, who, ": ", what, " ", problem,
                "; the saved state is corrupt (or from a diverged run)");
  };
  if (!all_finite({out})) corrupt("holds a NaN or an infinity");
  // min(), not (out < 0).any(): no mask as large as the tensor (the values are finite).
  if (non_negative && out.numel() > 0 && out.min().item<double>() < 0)
    corrupt("holds a negative value");
  return out;
}

}  // namespace optim_detail
}  // namespace gwt
