#pragma once

// The fused Haar step of one block (2^level elements of a row, or 2^level x 2^level for the 2-D
// transform; one approximation coefficient),
// written once for the CUDA body (cuda/haar_adam.cu: one thread per block) and for the host, where
// the tests run it block after block against the reference (tests/test_fused_kernel_rows.cpp, KernelRows).
// See src/kernels/kernels.h for the rule.

#include <cmath>
#include <cstdint>

#include "kernels/kernels.h"
#include "kernels/shared/wavelet_row.h"  // GWT_ROW_FN, row::to_acc

namespace gwt {
namespace kernels {
namespace haar_block {
namespace {  // internal linkage: see wavelet_row.h

/// The scalars of one step, by value (a CUDA kernel parameter).
struct Scalars {
  double beta1, beta2, eps, step_size, decay, approx_scale;
  int64_t rows, n, approx_len;
  // 2-D transform: blocks of B x B in matrices of `height` rows (1-D: height 1, block_rows 1).
  int64_t height, block_rows, state_rows;
};

inline Scalars scalars_of(const HaarAdamArgs& a) {
  Scalars s;
  s.beta1 = a.beta1, s.beta2 = a.beta2, s.eps = a.eps, s.step_size = a.step_size, s.decay = a.decay;
  s.approx_scale = std::pow(2.0, (a.two_d ? -1.0 : -0.5) * static_cast<double>(a.level));
  s.rows = a.rows, s.n = a.n, s.approx_len = a.approx_len;
  const int64_t block = int64_t{1} << a.level;
  s.height = a.two_d ? a.height : 1;
  s.block_rows = a.two_d ? (a.height + block - 1) / block : 1;
  s.state_rows = a.rows / s.height * s.block_rows;
  return s;
}

/// Coefficients in all: rows of the moments times their length.
GWT_ROW_FN int64_t coefficients(const Scalars& s) {
  return s.state_rows * s.approx_len;
}

/// The rows of p and g that coefficient k's block spans: [first, first + count).
template <int B>
GWT_ROW_FN void block_rows_of(const Scalars& s, int64_t k, int64_t& first, int64_t& count) {
  const int64_t state_row = k / s.approx_len;
  const int64_t top = (state_row % s.block_rows) * B;
  first = state_row / s.block_rows * s.height + (s.height == 1 ? 0 : top);
  count = s.height == 1 ? 1 : (s.height - top < B ? s.height - top : B);
}

/// The B values of a block starting at `begin`, zeros past n (PyWavelets' zero mode). On the GPU,
/// four float values are one aligned float4 load when vector_ok.
template <typename Acc, typename P, int B>
GWT_ROW_FN void load_block(const P* src, int64_t begin, int64_t n, Acc* out, bool vector_ok) {
#ifdef __CUDA_ARCH__
  if constexpr (B == 4 && sizeof(P) == 4) {
    if (vector_ok && begin + 4 <= n) {
      const float4 v = *reinterpret_cast<const float4*>(src + begin);
      out[0] = static_cast<Acc>(v.x), out[1] = static_cast<Acc>(v.y);
      out[2] = static_cast<Acc>(v.z), out[3] = static_cast<Acc>(v.w);
      return;
    }
  }
#endif
  (void)vector_ok;
  for (int q = 0; q < B; ++q) out[q] = begin + q < n ? row::to_acc<Acc>(src[begin + q]) : Acc(0);
}

template <typename Acc, typename P, int B>
GWT_ROW_FN void store_block(P* dst, int64_t begin, int64_t n, const Acc* in, bool vector_ok) {
#ifdef __CUDA_ARCH__
  if constexpr (B == 4 && sizeof(P) == 4) {
    if (vector_ok && begin + 4 <= n) {
      *reinterpret_cast<float4*>(dst + begin) =
          make_float4(static_cast<float>(in[0]), static_cast<float>(in[1]),
                      static_cast<float>(in[2]), static_cast<float>(in[3]));
      return;
    }
  }
#endif
  (void)vector_ok;
  for (int q = 0; q < B; ++q)
    if (begin + q < n) dst[begin + q] = static_cast<P>(in[q]);
}

/// New moments of coefficient k as stored (rounded to S), in the math type.
template <typename S, typename Acc>
GWT_ROW_FN void new_moments(const S* m, const S* v, int64_t k, Acc x, const Scalars& s, Acc& m_new,
                            Acc& v_new) {
  const Acc b1 = static_cast<Acc>(s.beta1), b2 = static_cast<Acc>(s.beta2);
  const Acc c1 = static_cast<Acc>(1 - s.beta1), c2 = static_cast<Acc>(1 - s.beta2);
  m_new = row::to_acc<Acc>(static_cast<S>(b1 * row::to_acc<Acc>(m[k]) + c1 * x));
  v_new = row::to_acc<Acc>(static_cast<S>(b2 * row::to_acc<Acc>(v[k]) + c2 * x * x));
}

/// Coefficient k's approximation: the sum over its block's rows, times the scale.
template <typename P, typename Acc, int B>
GWT_ROW_FN Acc approx_of(const P* grad, const Scalars& s, int64_t k, bool vector_ok) {
  int64_t first, count;
  block_rows_of<B>(s, k, first, count);
  const int64_t b = k % s.approx_len;
  Acc sum = 0;
  for (int64_t r = 0; r < count; ++r) {
    Acc g[B];
    load_block<Acc, P, B>(grad + (first + r) * s.n, b * B, s.n, g, vector_ok);
    for (int q = 0; q < B; ++q) sum += g[q];
  }
  return sum * static_cast<Acc>(s.approx_scale);
}

/// Norm pass, coefficient k: (m' / (sqrt(v') + eps))^2. Reads only.
template <typename P, typename S, typename Acc, int B>
GWT_ROW_FN Acc norm_term(const P* grad, const S* m, const S* v, const Scalars& s, int64_t k,
                         bool vector_ok) {
  using std::sqrt;
  const Acc a = approx_of<P, Acc, B>(grad, s, k, vector_ok);
  Acc m_new, v_new;
  new_moments(m, v, k, a, s, m_new, v_new);
  const Acc normalized = m_new / (sqrt(v_new) + static_cast<Acc>(s.eps));
  return normalized * normalized;
}

/// Update pass, coefficient k: m, v <- m', v';
/// p <- x + keep x,  x = p - step_size / ((sqrt(v') + eps) lim) * (g + (m' - A) 2^(-L/2)).
template <typename P, typename S, typename Acc, int B>
GWT_ROW_FN void update(P* param, const P* grad, S* m, S* v, const Scalars& s, Acc lim, int64_t k,
                       bool vector_ok) {
  using std::sqrt;
  const Acc a = approx_of<P, Acc, B>(grad, s, k, vector_ok);
  Acc m_new, v_new;
  new_moments(m, v, k, a, s, m_new, v_new);
  m[k] = static_cast<S>(m_new);
  v[k] = static_cast<S>(v_new);
  const Acc factor =
      static_cast<Acc>(s.step_size) / ((sqrt(v_new) + static_cast<Acc>(s.eps)) * lim);
  const Acc shift = (m_new - a) * static_cast<Acc>(s.approx_scale);
  const Acc keep = static_cast<Acc>(-s.decay);
  int64_t first, count;
  block_rows_of<B>(s, k, first, count);
  const int64_t b = k % s.approx_len;
  for (int64_t r = 0; r < count; ++r) {
    Acc g[B], p[B];
    load_block<Acc, P, B>(grad + (first + r) * s.n, b * B, s.n, g, vector_ok);
    load_block<Acc, P, B>(param + (first + r) * s.n, b * B, s.n, p, vector_ok);
    for (int q = 0; q < B; ++q) {
      const Acc x = p[q] - factor * (g[q] + shift);
      p[q] = x + keep * x;
    }
    store_block<Acc, P, B>(param + (first + r) * s.n, b * B, s.n, p, vector_ok);
  }
}

}  // namespace
}  // namespace haar_block
}  // namespace kernels
}  // namespace gwt
