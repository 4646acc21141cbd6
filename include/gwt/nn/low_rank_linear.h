#pragma once

/// \file
/// gwt::nn::LowRankLinear: a linear layer stored as two factors, built from a trained
/// torch::nn::Linear by truncated or randomized SVD, with the rank given as a count or as the share
/// of the spectrum's energy to keep.

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

namespace gwt {
namespace nn {

/// How to pick the rank and compute the factors.
struct LowRankOptions {
  /// A fixed rank (> 0), or 0 to use `energy`.
  int64_t rank = 0;
  /// With rank == 0: the smallest rank whose singular values keep this share of sum(s_i^2), in (0,
  /// 1].
  double energy = 0.99;
  /// Randomized SVD (range finder) instead of the exact one; needs rank > 0.
  bool randomized = false;
  int64_t oversample = 8;
  int64_t power_iters = 2;
};

/// The smallest r with s_1^2 + ... + s_r^2 >= energy * sum(s_i^2) (singular values descending).
int64_t rank_for_energy(const at::Tensor& singular_values, double energy);

/// y = x B^T A^T + bias, with A [out, r] and B [r, in] (A = U_r sqrt(S_r), B = sqrt(S_r) V_r^T).
class LowRankLinearImpl : public torch::nn::Module {
 public:
  /// Factors of a trained layer (see factorize()).
  LowRankLinearImpl(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias,
                    double reconstruction_error);

  at::Tensor forward(const at::Tensor& x);
  /// A B, the dense weight this layer stands for.
  at::Tensor weight() const;
  int64_t rank() const { return a.size(1); }
  /// Parameters held (A, B, bias) and those of the dense layer it replaces.
  int64_t parameter_count() const;
  int64_t dense_parameter_count() const;
  /// ||W - A B||_2 (spectral norm) of the layer it was built from, measured at construction.
  double reconstruction_error() const { return reconstruction_error_; }

  at::Tensor a, b, bias;

 private:
  double reconstruction_error_ = 0;
};
TORCH_MODULE(LowRankLinear);

/// Factorises `linear` (its weight [out, in] and bias) at the rank `options` ask for.
LowRankLinear factorize(const torch::nn::Linear& linear, const LowRankOptions& options);

}  // namespace nn
}  // namespace gwt
