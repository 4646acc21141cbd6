#include "gwt/nn/low_rank_linear.h"

#include <ATen/ATen.h>

#include <cmath>

#include "gwt/optim/galore_adam.h"

namespace gwt {
namespace nn {

int64_t rank_for_energy(const at::Tensor& singular_values, double energy) {
  TORCH_CHECK(std::isfinite(energy) && energy > 0 && energy <= 1,
              "gwt::nn::rank_for_energy: energy must be in (0, 1], got ", energy);
  TORCH_CHECK(singular_values.dim() == 1 && singular_values.numel() > 0,
              "gwt::nn::rank_for_energy needs a non-empty 1-D tensor of singular values");
  const at::Tensor squares = singular_values.to(at::kDouble).pow(2);
  const double total = squares.sum().item<double>();
  if (total == 0) return 1;
  const at::Tensor cumulative = squares.cumsum(0) / total;
  // Small relative slack so that an exact share (e.g. energy 1) is found despite rounding.
  const int64_t below = (cumulative < energy - 1e-12).sum().item<int64_t>();
  return std::min<int64_t>(below + 1, singular_values.numel());
}

LowRankLinearImpl::LowRankLinearImpl(const at::Tensor& a_, const at::Tensor& b_,
                                     const at::Tensor& bias_, double reconstruction_error)
    : reconstruction_error_(reconstruction_error) {
  TORCH_CHECK(a_.dim() == 2 && b_.dim() == 2 && a_.size(1) == b_.size(0),
              "gwt::nn::LowRankLinear needs A [out, r] and B [r, in], got ", a_.sizes(), " and ",
              b_.sizes());
  a = register_parameter("a", a_.detach().clone());
  b = register_parameter("b", b_.detach().clone());
  if (bias_.defined()) bias = register_parameter("bias", bias_.detach().clone());
}

at::Tensor LowRankLinearImpl::forward(const at::Tensor& x) {
  at::Tensor y = at::matmul(at::matmul(x, b.t()), a.t());
  return bias.defined() ? y + bias : y;
}

at::Tensor LowRankLinearImpl::weight() const {
  return at::matmul(a, b);
}

int64_t LowRankLinearImpl::parameter_count() const {
  return a.numel() + b.numel() + (bias.defined() ? bias.numel() : 0);
}

int64_t LowRankLinearImpl::dense_parameter_count() const {
  return a.size(0) * b.size(1) + (bias.defined() ? bias.numel() : 0);
}

LowRankLinear factorize(const torch::nn::Linear& linear, const LowRankOptions& options) {
  TORCH_CHECK(!linear.is_empty(), "gwt::nn::factorize: the Linear module is empty");
  const at::Tensor w = linear->weight.detach();
  const int64_t full = std::min(w.size(0), w.size(1));
  TORCH_CHECK(options.rank >= 0 && options.rank <= full, "gwt::nn::factorize: rank must be in [0, ",
              full, "] for a weight of shape ", w.sizes(), ", got ", options.rank);
  TORCH_CHECK(!options.randomized || options.rank > 0,
              "gwt::nn::factorize: the randomized SVD needs a fixed rank (the energy rule needs "
              "every singular value)");
  // Factor in float64 (exact to the last bit that float32 weights can hold), store in w's dtype.
  const at::Tensor w64 = w.to(at::kDouble);
  at::Tensor u, s, vh;
  if (options.rank == 0) {
    std::tie(u, s, vh) = at::linalg_svd(w64, /*full_matrices=*/false);
    const int64_t r = rank_for_energy(s, options.energy);
    u = u.narrow(1, 0, r), s = s.narrow(0, 0, r), vh = vh.narrow(0, 0, r);
  } else {
    std::tie(u, s, vh) = truncated_svd(w64, options.rank, options.randomized, options.oversample,
                                       options.power_iters);
  }
  const at::Tensor root = s.sqrt();
  const at::Tensor a = u * root.unsqueeze(0), b = root.unsqueeze(1) * vh;
  const double error = at::linalg_matrix_norm(w64 - at::matmul(a, b), 2).item<double>();
  const at::Tensor bias = linear->bias.defined() ? linear->bias.detach() : at::Tensor();
  return LowRankLinear(a.to(w.dtype()), b.to(w.dtype()), bias, error);
}

}  // namespace nn
}  // namespace gwt
