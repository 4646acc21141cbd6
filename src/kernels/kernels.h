#pragma once

/// \file
/// The kernel seam (internal, not installed): plain structs of pointers, sizes and scalars that
/// the torch-facing layer (src/optim/wavelet_adam_fused.cpp) fills after validating tensors, and
/// one entry point per body: src/kernels/cpu and avx2 for the CPU, cuda/*.cu for NVIDIA GPUs.
/// Kernels never see a torch type and never include an optimizer header.

#include <cstdint>

#include "gwt/cuda.h"  // built_with_cuda, cuda_kernels_run_on
#include "gwt/wavelet.h"

namespace gwt {
namespace kernels {

/// Element types the kernels read and write.
enum class ScalarKind : int8_t { f32, f64, f16, bf16 };

/// Haar, zero mode (or any mode when n is a multiple of 2^level), transform along contiguous rows.
///
/// Block locality (docs/algorithm.md#transforms-pywavelets-conventions): each run of 2^level
/// elements owns one approximation coefficient A and its own details, and since the inverse
/// transform is linear and orthogonal the whole update of the block is  u_i = (g_i + (m - A) *
/// 2^(-level/2)) / ((sqrt(v) + eps) * lim).
///
/// The 2-D transform (two_d) is block-local the same way, with blocks of 2^level x 2^level:
/// u_ij = (g_ij + (m - A) * 2^(-level)) / ((sqrt(v) + eps) * lim).
///
/// Two passes, no full-size temporaries:
/// - norm pass (reads g, m, v; writes nothing): sum of (m' / (sqrt(v') + eps))^2 over the new
///   moments m', v'. It is NaN when a gradient value is not finite, so the caller can skip the
///   whole step before anything changed.
/// - update pass (reads g, m, v, p; writes m', v', p): with the limiter's lim from the caller.
/// 22 bytes per fp32 parameter at level 2 (4 + 2 + 4 + 4 + 8), against Adam's 28.
struct HaarAdamArgs {
  void* param = nullptr;       ///< [rows, n], param_kind
  const void* grad = nullptr;  ///< [rows, n], param_kind (float32 when grad_f32)
  void* exp_avg = nullptr;     ///< [rows, approx_len], state_kind
  void* exp_avg_sq = nullptr;  ///< [rows, approx_len], state_kind
  ScalarKind param_kind = ScalarKind::f32;
  ScalarKind state_kind = ScalarKind::f32;
  bool math_f64 = false;  ///< compute in double (float64 parameters)
  int64_t rows = 0;       ///< rows of p and g (all leading dimensions)
  int64_t n = 0;
  int64_t approx_len = 0;  ///< ceil(n / 2^level)
  int64_t level = 1;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-6;
  double step_size = 0;  ///< lr * bias correction * scale
  double decay = 0;      ///< lr * weight_decay (applied after the update)
  /// transform "2d" (Haar kernels): blocks of 2^level x 2^level in each matrix of `height` rows,
  /// approximation sum * 2^(-level), state [rows / height, ceil(height / 2^level), approx_len].
  bool two_d = false;
  int64_t height = 1;
  /// The gradient is float32 although the parameter is float16/bfloat16: the reference reads a
  /// gradient in the float32 math type, so one of another type than its parameter is converted to
  /// float32, never rounded to the parameter's type. Read by the CPU bodies only: the CUDA bodies
  /// read the gradient as param_kind, and the caller gives them no such gradient.
  bool grad_f32 = false;
  /// CPU Haar bodies, optional: room for twice as many floats as the moments have values. The norm
  /// pass leaves there, for each approximation coefficient its float32 vector body computes, the
  /// approximation A and the denominator sqrt(v') + eps; an update pass given the same carry takes
  /// them from there instead of summing the gradient's blocks and taking the square roots again
  /// (the same bits either way). Only for an update that follows a norm pass with the same
  /// arguments, nothing written in between; nullptr: none. The general kernel ignores it.
  float* carry = nullptr;
};

/// CPU norm pass; at::parallel_for over fixed tiles, so the sum does not depend on the number of
/// threads. Returns the sum of squares (NaN if a gradient value is not finite).
double haar_adam_norm_sq_cpu(const HaarAdamArgs& args);

/// CPU update pass with limiter value lim (1 when the limiter is off or on the first step).
void haar_adam_update_cpu(const HaarAdamArgs& args, double lim);

/// Any orthogonal wavelet, any mode: the DWT of each row, the moment update on the approximation,
/// then the IDWT of the normalised coefficients into the parameter update. Same two passes as
/// Haar: the norm pass writes nothing, the update pass writes m, v and p. Each pass computes a
/// row's coefficients of every level in scratch (per CPU thread, per CUDA block in shared memory),
/// so the update pass reads the gradient again rather than a workspace, and no gradient-sized
/// buffer exists.
struct WaveletAdamArgs : HaarAdamArgs {
  const double* dec_lo = nullptr;  ///< decomposition filters (PyWavelets), filter_length each
  const double* dec_hi = nullptr;
  int64_t filter_length = 2;
  BoundaryMode boundary = BoundaryMode::zero;
  int64_t coeff_len = 0;  ///< per row: len(A_L) + len(D_L) + ... + len(D_1)
  /// PyWavelets' threshold on the details before normalisation (0 = off): soft or hard.
  double threshold = 0;
  bool threshold_soft = true;
  int64_t* kept_per_row = nullptr;  ///< with a threshold: [rows], details kept per row (on the
                                    ///< tensors' device)
};

/// Coefficients of every level of one row of length n: len(A_L) + len(D_L) + ... + len(D_1).
int64_t wavelet_workspace_len(int64_t n, int64_t filter_length, int64_t level,
                              BoundaryMode boundary);

/// CPU passes of the general kernel; rows in parallel, the norm summed in row order.
double wavelet_adam_norm_sq_cpu(const WaveletAdamArgs& args);
void wavelet_adam_update_cpu(const WaveletAdamArgs& args, double lim);

/// CUDA body of the general passes, one thread block per row, on the current stream; like the
/// Haar CUDA passes, the norm pass adds into *norm_sq_out and the update reads *lim (device
/// scalars of the math type). Each block keeps wavelet_row_scratch_bytes() in shared memory.
void wavelet_adam_norm_sq_cuda(const WaveletAdamArgs& args, void* norm_sq_out);
void wavelet_adam_update_cuda(const WaveletAdamArgs& args, const void* lim);

/// Shared memory the CUDA general kernel needs per block for rows of length n: the row's
/// coefficients, two scratch rows (an intermediate approximation or synthesis output) and the
/// denominators.
int64_t wavelet_row_scratch_bytes(int64_t n, int64_t filter_length, int64_t level,
                                  BoundaryMode boundary, bool math_f64);

/// The most shared memory one block may have on the current CUDA device (0 without CUDA).
int64_t wavelet_adam_cuda_max_scratch_bytes();

/// Adam's rule on a dense parameter (docs/algorithm.md#eligibility-and-the-dense-path) on the CPU:
/// n contiguous values of p, g, m and v, all float32 or all float64, in the order of the
/// reference's ATen ops, each product, sum, quotient and square root rounded on its own (no fused
/// multiply-add), so that the AVX2 and the baseline builds give the same bits:
///   m = m * beta1 + (1 - beta1) * g;   v = v * beta2 + ((1 - beta2) * g) * g;
///   p = p + (-step_size * m) / (sqrt(v) + eps);   then, with decay: p = p + (-decay) * p.
/// Parallel over chunks of at least 32768 values; every value takes the same operations wherever
/// a chunk starts, so the result does not depend on the number of threads.
struct DenseAdamArgs {
  void* param = nullptr;
  const void* grad = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  bool f64 = false;  ///< float64 tensors (float32 otherwise)
  int64_t n = 0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-6;
  double step_size = 0;      ///< lr * bias correction
  double decay = 0;          ///< lr * weight_decay
  bool apply_decay = false;  ///< weight_decay != 0 (decay may round to 0 and still be applied)
};

void dense_adam_update_cpu(const DenseAdamArgs& args);

/// FOAM's rule on a folded parameter (docs/algorithm.md#foam) on the CPU, in one pass: for each
/// block of 2^level values along contiguous rows of length n (the last block of a row may be
/// partial: its sums still divide by 2^level, the authors' zero padding),
///   a = sum(g) / 2^level;  s = sum(g * g) / 2^level;
///   m = beta1 * m + (1 - beta1) * a;  v = beta2 * v + (1 - beta2) * s  (rounded to the state type,
///   and read back as stored);  then for each of its values, with r = g - a,
///   x = p + (-step_size) * ((m + res_scale * r) * scale / (sqrt(v + res_scale^2 * (r * r)) +
///   eps)); p = x + (-decay) * x  (when apply_decay).
/// Reads g and p once, reads and writes the moments once, writes p: 16 bytes per float32
/// parameter at level 2. Parallel over fixed groups of 8 blocks, so the result does not depend
/// on the number of threads.
struct FoamAdamArgs {
  void* param = nullptr;       ///< [rows, n], param_kind, contiguous
  const void* grad = nullptr;  ///< [rows, n], param_kind (float32 when grad_f32), contiguous
  void* exp_avg = nullptr;     ///< [rows, approx_len], state_kind
  void* exp_avg_sq = nullptr;  ///< [rows, approx_len], state_kind
  ScalarKind param_kind = ScalarKind::f32;
  ScalarKind state_kind = ScalarKind::f32;
  bool math_f64 = false;  ///< compute in double (float64 parameters)
  bool grad_f32 = false;  ///< as HaarAdamArgs::grad_f32
  int64_t rows = 0, n = 0;
  int64_t approx_len = 0;  ///< ceil(n / 2^level)
  int64_t level = 2;       ///< 1..30
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double scale = 1, res_scale = 1;
  double step_size = 0;  ///< lr * bias correction
  double decay = 0;      ///< lr * weight_decay
  bool apply_decay = false;
};

void foam_adam_update_cpu(const FoamAdamArgs& args);

/// Whether every one of the n values at data is finite (no NaN, no infinity). CPU, parallel,
/// one read of the data.
bool all_finite_cpu(const void* data, int64_t n, ScalarKind kind);

/// CUDA body of the same two passes on the current stream. The norm pass adds its sum of squares
/// to *norm_sq_out (a zeroed device scalar of the math type: double for float64 parameters, float
/// otherwise); the update pass reads lim from *lim (device scalar, same type). Nothing waits for
/// the device. Present when gwt was built with CUDA (GWT_WITH_CUDA); elsewhere these throw.
void haar_adam_norm_sq_cuda(const HaarAdamArgs& args, void* norm_sq_out);
void haar_adam_update_cuda(const HaarAdamArgs& args, const void* lim);

}  // namespace kernels
}  // namespace gwt
