#pragma once

/// \file
/// The kernel seam: plain structs of pointers, sizes and scalars that the torch-facing layer
/// (src/optim/wavelet_adam.cpp) fills after validating tensors, and one entry point per body:
/// src/kernels/*.cpp for the CPU, cuda/*.cu for NVIDIA GPUs. Kernels never see a torch type and
/// never include an optimizer header.

#include <cstdint>

namespace gwt {
namespace kernels {

/// Element types the kernels read and write.
enum class ScalarKind : int8_t { f32, f64, f16, bf16 };

/// Haar, zero mode (or any mode when n is a multiple of 2^level), transform along contiguous rows.
///
/// Block locality (SPEC 1.3): each run of 2^level elements owns one approximation coefficient A and
/// its own details, and since the inverse transform is linear and orthogonal the whole update of
/// the block is  u_i = (g_i + (m - A) * 2^(-level/2)) / ((sqrt(v) + eps) * lim).
/// Pass 1 reads g, m, v, writes m, v and sums ||m / (sqrt(v) + eps)||^2; pass 2 applies the
/// limiter and updates p. No full-size temporaries.
struct HaarAdamArgs {
  void* param = nullptr;           ///< [rows, n], param_kind
  const void* grad = nullptr;      ///< [rows, n], param_kind
  void* exp_avg = nullptr;         ///< [rows, approx_len], state_kind
  void* exp_avg_sq = nullptr;      ///< [rows, approx_len], state_kind
  void* saved_norm = nullptr;      ///< 0-dim limiter norm, f64 if math_f64 else f32 (may be null
                                   ///< when norm_growth_limit == 0)
  ScalarKind param_kind = ScalarKind::f32;
  ScalarKind state_kind = ScalarKind::f32;
  bool math_f64 = false;           ///< compute in double (float64 parameters)
  int64_t rows = 0;
  int64_t n = 0;
  int64_t approx_len = 0;          ///< ceil(n / 2^level)
  int64_t level = 1;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-6;
  double step_size = 0;            ///< lr * bias correction * scale
  double decay = 0;                ///< lr * weight_decay (applied after the update)
  double norm_growth_limit = 0;    ///< 0 disables the limiter
  bool has_saved_norm = false;     ///< false on the first step: the norm is recorded, lim = 1
};

/// CPU body: at::parallel_for over fixed chunks of blocks, so results do not depend on the number
/// of threads. Synchronous.
void haar_adam_step_cpu(const HaarAdamArgs& args);

/// CUDA body: two launches on the current stream, the limiter computed on the device (no host
/// synchronisation). Only present when gwt was built with CUDA (GWT_WITH_CUDA).
void haar_adam_step_cuda(const HaarAdamArgs& args);

/// Whether every one of the n values at data is finite (no NaN, no infinity). CPU, parallel,
/// one read of the data.
bool all_finite_cpu(const void* data, int64_t n, ScalarKind kind);

/// Whether this build of gwt contains the CUDA body.
bool built_with_cuda();

}  // namespace kernels
}  // namespace gwt
