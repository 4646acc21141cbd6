#pragma once

// Pieces shared by gwt's torch::optim optimizers (internal: not installed).

#include <ATen/ATen.h>
#include <torch/serialize/input-archive.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "gwt/kernels.h"

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
  TORCH_CHECK(finite(eps) && eps >= 0, who, ": invalid eps ", eps, "; it must be finite and >= 0");
  TORCH_CHECK(finite(weight_decay) && weight_decay >= 0, who, ": invalid weight_decay ",
              weight_decay, "; it must be finite and >= 0");
}

/// The dtype updates are computed in: float64 stays, everything else float32.
inline at::ScalarType compute_dtype(const at::Tensor& param) {
  return param.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

/// Whether the kernels (and so the optimizers) read and write this dtype.
inline bool is_supported_param_dtype(at::ScalarType t) {
  return t == at::kDouble || t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline void check_param(const char* who, const at::Tensor& param) {
  TORCH_CHECK(param.defined(), who, ": got an undefined parameter tensor");
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
  TORCH_CHECK(grad.sizes() == param.sizes(), who, ": gradient shape ", grad.sizes(),
              " does not match its parameter's shape ", param.sizes());
  TORCH_CHECK(grad.is_floating_point(), who, ": gradient dtype ", grad.scalar_type(),
              " is not floating point");
  TORCH_CHECK(grad.device() == param.device(), who, ": gradient on ", grad.device(),
              " but its parameter is on ", param.device());
}

/// lr, times sqrt(1 - b2^t) / (1 - b1^t) when correct_bias (SPEC 1.1, folded bias correction).
inline double adam_step_size(double lr, std::tuple<double, double> betas, bool correct_bias,
                             int64_t step) {
  const auto [beta1, beta2] = betas;
  const auto t = static_cast<double>(step);
  return correct_bias ? lr * std::sqrt(1 - std::pow(beta2, t)) / (1 - std::pow(beta1, t)) : lr;
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

/// Whether every tensor is finite: CPU tensors in one read each, others on their device with one
/// synchronisation for all of them.
inline bool all_finite(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> device_flags;
  for (const auto& t : tensors) {
    const auto s = t.scalar_type();
    const bool kernel_dtype =
        s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16;
    if (t.device().is_cpu() && t.is_contiguous() && kernel_dtype) {
      if (!kernels::all_finite_cpu(t.data_ptr(), t.numel(), kind_of(s))) return false;
    } else {
      device_flags.push_back(at::isfinite(t).all().to(tensors.front().device()));
    }
  }
  return device_flags.empty() || at::stack(device_flags).all().item<bool>();
}

}  // namespace optim_detail
}  // namespace gwt
