#pragma once

// AVX2/FMA loops of the fused FoamAdam pass (foam_adam_cpu_impl.h): 8 whole blocks of B = 2, 4 or
// 8 values of one row at a time (8 B values, B registers), parameters, gradients and moments each
// float, bfloat16 or float16, math in float. Compiled only into the AVX2 build of the body
// (foam_adam_cpu_avx2.cpp); the baseline build and every other case keep the plain loops, which
// the tests compare with the readable reference as these are.

#if defined(GWT_AVX2_BODY)  // avx2_target.h
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "kernels/avx2/haar_simd_avx2.h"  // prefetch_line, k_per_line
#include "kernels/avx2/values8_avx2.h"

namespace gwt {
namespace kernels {
namespace {
namespace foam_simd {

using simd::k_per_line;
using simd::prefetch_line;
using values8::load8;
using values8::store8;

/// The step's scalars, broadcast once per thread's run of groups.
struct Regs {
  __m256 b1, c1, b2, c2, eps, scale, rho, rho2, step, keep, inv_block;
  bool apply_decay;
  template <typename Consts>
  explicit Regs(const Consts& c)
      : b1(_mm256_set1_ps(c.b1)),
        c1(_mm256_set1_ps(c.c1)),
        b2(_mm256_set1_ps(c.b2)),
        c2(_mm256_set1_ps(c.c2)),
        eps(_mm256_set1_ps(c.eps)),
        scale(_mm256_set1_ps(c.scale)),
        rho(_mm256_set1_ps(c.rho)),
        rho2(_mm256_set1_ps(c.rho2)),
        step(_mm256_set1_ps(c.step)),
        keep(_mm256_set1_ps(c.keep)),
        inv_block(_mm256_set1_ps(c.inv_block)),
        apply_decay(c.apply_decay) {}
};

/// Lane j: the sum of block j of the 8 B values in x[0..B) (x[k] holds values 8k..8k+7).
template <int B>
inline __m256 block_sums8(const __m256* x) {
  static_assert(B == 2 || B == 4 || B == 8, "blocks of 2, 4 or 8 values");
  if constexpr (B == 2) {
    const __m256 h = _mm256_hadd_ps(x[0], x[1]);  // pairs (b0,b1) (b4,b5) | (b2,b3) (b6,b7)
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0xD8));
  } else if constexpr (B == 4) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
    return _mm256_permutevar8x32_ps(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  } else {
    const __m256 p = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
    const __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(p, q, 0x20), _mm256_permute2f128_ps(p, q, 0x31));
  }
}

/// Lane j of register K of a group (values 8K..8K+7): the block its value is in.
template <int B, int K>
inline __m256i block_of_lanes() {
  return _mm256_setr_epi32((8 * K) / B, (8 * K + 1) / B, (8 * K + 2) / B, (8 * K + 3) / B,
                           (8 * K + 4) / B, (8 * K + 5) / B, (8 * K + 6) / B, (8 * K + 7) / B);
}

/// The values of one register of the group (K: which of its B registers), from the group's block
/// means a and moments m, v (lane j: block j): r = g - a, x = p + step * ((m + rho r) scale /
/// (sqrt(v + rho^2 r^2) + eps)), then the decay.
template <int B, int K = 0, typename P>
inline void elements8(const Regs& c, const __m256* g, P* p, __m256 a, __m256 m, __m256 v) {
  const __m256i at = block_of_lanes<B, K>();
  const __m256 r = _mm256_sub_ps(g[K], _mm256_permutevar8x32_ps(a, at));
  const __m256 first = _mm256_fmadd_ps(c.rho, r, _mm256_permutevar8x32_ps(m, at));
  const __m256 second =
      _mm256_fmadd_ps(c.rho2, _mm256_mul_ps(r, r), _mm256_permutevar8x32_ps(v, at));
  const __m256 u =
      _mm256_div_ps(_mm256_mul_ps(first, c.scale), _mm256_add_ps(_mm256_sqrt_ps(second), c.eps));
  __m256 x = _mm256_fmadd_ps(c.step, u, load8(p + 8 * K));
  if (c.apply_decay) x = _mm256_fmadd_ps(c.keep, x, x);
  store8(p + 8 * K, x);
  if constexpr (K + 1 < B) elements8<B, K + 1>(c, g, p, a, m, v);
}

/// 8 whole blocks: their 8 B values at g and p, their moments at m and v.
template <int B, typename G, typename P, typename S>
inline void update8(const Regs& c, const G* g, P* p, S* m, S* v) {
  for (int e = 0; e < 8 * B; e += k_per_line<G>) prefetch_line(g + e);
  for (int e = 0; e < 8 * B; e += k_per_line<P>) prefetch_line(p + e);
  __m256 x[B], x2[B];
  for (int k = 0; k < B; ++k) {
    x[k] = load8(g + 8 * k);
    x2[k] = _mm256_mul_ps(x[k], x[k]);
  }
  const __m256 a = _mm256_mul_ps(block_sums8<B>(x), c.inv_block);
  const __m256 s = _mm256_mul_ps(block_sums8<B>(x2), c.inv_block);
  __m256 m_new = _mm256_fmadd_ps(c.b1, load8(m), _mm256_mul_ps(c.c1, a));
  __m256 v_new = _mm256_fmadd_ps(c.b2, load8(v), _mm256_mul_ps(c.c2, s));
  store8(m, m_new);
  store8(v, v_new);
  if constexpr (!std::is_same_v<S, float>) {
    // The moments as stored, read back (a bfloat16 state rounds them).
    m_new = load8(m);
    v_new = load8(v);
  }
  elements8<B>(c, x, p, a, m_new, v_new);
}

}  // namespace foam_simd
}  // namespace
}  // namespace kernels
}  // namespace gwt
#endif
