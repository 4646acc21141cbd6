#pragma once

// AVX2/FMA building blocks of the fused Haar kernel, 8 approximation coefficients (8 blocks of
// B = 2^level elements, level 1..3, in one row or, for the 2-D transform, in B rows) at a time.
// Parameters, gradients and moments may each be float, bfloat16 or float16 (math in float: the
// 16-bit types are widened on load and rounded as c10 rounds them on store, load8/store8).
// Compiled only into the AVX2 build of the body (haar_adam_cpu_avx2.cpp); the baseline build and
// every other type keep the plain loops of haar_adam_cpu_impl.h, which the tests compare against.

#if defined(GWT_AVX2_BODY)  // avx2_target.h
#define GWT_HAAR_SIMD 1
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/avx2/values8_avx2.h"

#ifndef GWT_HAAR_AHEAD
#define GWT_HAAR_AHEAD 1024
#endif

namespace gwt {
namespace kernels {
namespace {
namespace simd {

// 8 values at x as floats, and 8 floats stored in x's type (values8_avx2.h).
using values8::load8;
using values8::store8;

/// Sums of 8 consecutive blocks of B values starting at g: lane j holds block j.
template <int B, typename T>
inline __m256 block_sums8(const T* g) {
  static_assert(B == 2 || B == 4 || B == 8, "blocks of 2, 4 or 8 values");
  if constexpr (B == 2) {
    const __m256 h = _mm256_hadd_ps(load8(g), load8(g + 8));
    // h = [b0 b1 b4 b5 | b2 b3 b6 b7] in 64-bit pairs (b0,b1) (b4,b5) (b2,b3) (b6,b7).
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0xD8));
  } else if constexpr (B == 4) {
    const __m256 h1 = _mm256_hadd_ps(load8(g), load8(g + 8));
    const __m256 h2 = _mm256_hadd_ps(load8(g + 16), load8(g + 24));
    const __m256 h = _mm256_hadd_ps(h1, h2);  // [b0 b2 b4 b6 | b1 b3 b5 b7]
    return _mm256_permutevar8x32_ps(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  } else {
    // Two rounds of hadd leave each block's two half sums in the two 128-bit lanes.
    const __m256 p = _mm256_hadd_ps(_mm256_hadd_ps(load8(g), load8(g + 8)),
                                    _mm256_hadd_ps(load8(g + 16), load8(g + 24)));
    const __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(load8(g + 32), load8(g + 40)),
                                    _mm256_hadd_ps(load8(g + 48), load8(g + 56)));
    return _mm256_add_ps(_mm256_permute2f128_ps(p, q, 0x20), _mm256_permute2f128_ps(p, q, 0x31));
  }
}

/// The k-th group of 8 elements covered by 8 coefficients takes, in lane i, the value of
/// coefficient (8k + i) / B. The update passes spread each coefficient's factor and shift over
/// its elements so. A cross-lane permute (vpermps) per group and operand did it until
/// 2026-12-06; now the 8 values are stored once in lane order (lane_order()), and each group's
/// spread is one in-lane permute with an immediate (vpermilps), or for B = 8 a broadcast from
/// memory. The same values move, so the results are the same bits.
template <int B>
struct Spread {
  static_assert(B == 2 || B == 4 || B == 8, "blocks of 2, 4 or 8 values");
  /// x0..x7 in the order Spread reads them back: B = 2: [x0 x1 x4 x5 | x2 x3 x6 x7]; B = 4:
  /// [x0 x2 x4 x6 | x1 x3 x5 x7]; B = 8: as they are.
  static __m256 lane_order(__m256 x) {
    if constexpr (B == 2) {
      return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(x), 0xD8));
    } else if constexpr (B == 4) {
      return _mm256_permutevar8x32_ps(x, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    } else {
      return x;
    }
  }
  /// From 8 values stored in lane order.
  explicit Spread(const float* ordered) {
    if constexpr (B == 8) {
      lo = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(ordered));
      hi = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(ordered + 4));
    } else {
      lo = _mm256_loadu_ps(ordered);
    }
  }
  /// The values of group K's lanes.
  template <int K>
  __m256 group() const {
    if constexpr (B == 2) {
      return _mm256_permute_ps(lo, _MM_SHUFFLE(2 * K + 1, 2 * K + 1, 2 * K, 2 * K));
    } else if constexpr (B == 4) {
      return _mm256_permute_ps(lo, _MM_SHUFFLE(K, K, K, K));
    } else {
      return _mm256_permute_ps(K < 4 ? lo : hi, _MM_SHUFFLE(K % 4, K % 4, K % 4, K % 4));
    }
  }
  __m256 lo, hi;  // B = 8: lo = [x0..x3 | x0..x3], hi = [x4..x7 | x4..x7]
};

/// The scalars of one step, broadcast.
struct StepConstants {
  __m256 b1, c1, b2, c2, eps, scale;
  StepConstants(float beta1, float one_minus_b1, float beta2, float one_minus_b2, float eps_,
                float approx_scale)
      : b1(_mm256_set1_ps(beta1)),
        c1(_mm256_set1_ps(one_minus_b1)),
        b2(_mm256_set1_ps(beta2)),
        c2(_mm256_set1_ps(one_minus_b2)),
        eps(_mm256_set1_ps(eps_)),
        scale(_mm256_set1_ps(approx_scale)) {}
};

/// New moments of 8 coefficients with approximations a, and their denominators.
struct Moments8 {
  __m256 m, v;
  template <typename S>
  Moments8(const StepConstants& c, const S* m_old, const S* v_old, __m256 a) {
    m = _mm256_fmadd_ps(c.b1, load8(m_old), _mm256_mul_ps(c.c1, a));
    v = _mm256_fmadd_ps(c.b2, load8(v_old), _mm256_mul_ps(c.c2, _mm256_mul_ps(a, a)));
  }
  static __m256 denom(const StepConstants& c, __m256 v) {
    return _mm256_add_ps(_mm256_sqrt_ps(v), c.eps);
  }
  __m256 denom(const StepConstants& c) const { return denom(c, v); }
};

/// Where a norm pass leaves each coefficient's approximation and denominator for the update pass
/// that follows (HaarAdamArgs::carry), the tile's coefficients from index 0; approx == nullptr:
/// none. The update then takes them from there, with the same bits as computing them again.
struct Carry {
  float* approx = nullptr;
  float* denom = nullptr;
};

/// Software prefetch of the 64-byte line k_ahead floats' bytes past x (into L1). A core
/// of the machines measured keeps too few DRAM misses in flight for the hardware prefetchers
/// alone to stream at the memory's speed (on one thread the Haar step moved 22 bytes per parameter
/// more slowly than at::_fused_adam_ moved 28); requests a few KB ahead raise the misses in
/// flight. Prefetching past the end of an array is harmless (a prefetch never faults).
constexpr int64_t k_ahead = GWT_HAAR_AHEAD;
template <typename T>
inline void prefetch_line(const T* x) {
  _mm_prefetch(reinterpret_cast<const char*>(x) + k_ahead * sizeof(float), _MM_HINT_T0);
}
/// Prefetch of the 64-byte line at x into L2 (not L1): data a later phase reads.
template <typename T>
inline void prefetch_line_l2(const T* x) {
  _mm_prefetch(reinterpret_cast<const char*>(x), _MM_HINT_T1);
}
/// Values of type T per 64-byte line: the loops prefetch one line per that many values.
template <typename T>
constexpr int k_per_line = static_cast<int>(64 / sizeof(T));

/// Sum of the 8 lanes, in a fixed order.
inline float lane_sum(__m256 x) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

/// p <- x + keep * x,  x = p - f * (g + s), over the 8 blocks (8 * B elements of one row) whose
/// factors and shifts are the lanes of factor and shift.
template <int B, int K = 0, typename G, typename P>
inline void update_elements8(const G* g, P* p, const Spread<B>& factor, const Spread<B>& shift,
                             __m256 keep) {
  const __m256 gs = _mm256_add_ps(load8(g + 8 * K), shift.template group<K>());
  const __m256 x = _mm256_fnmadd_ps(factor.template group<K>(), gs, load8(p + 8 * K));
  store8(p + 8 * K, _mm256_fmadd_ps(keep, x, x));
  if constexpr (K + 1 < B) update_elements8<B, K + 1>(g, p, factor, shift, keep);
}

/// acc + (m' / denom)^2 of coefficients j..j+7 with approximations a; their approximations and
/// denominators are left in carry (if any).
template <typename S>
inline __m256 add_norm_sq8(const StepConstants& c, const S* m, const S* v, int64_t j, __m256 a,
                           Carry carry, __m256 acc) {
  const Moments8 mv(c, m + j, v + j, a);
  const __m256 denom = mv.denom(c);
  if (carry.approx != nullptr) {
    _mm256_storeu_ps(carry.approx + j, a);
    _mm256_storeu_ps(carry.denom + j, denom);
  }
  const __m256 normalized = _mm256_div_ps(mv.m, denom);
  return _mm256_fmadd_ps(normalized, normalized, acc);
}

/// Norm pass over `count` (a multiple of 8) coefficients of one row: sum of (m' / denom)^2.
template <int B, typename G, typename S>
inline float norm_sq(const StepConstants& c, const G* g, const S* m, const S* v, int64_t count,
                     Carry carry) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; j += 8) {
    for (int e = 0; e < 8 * B; e += k_per_line<G>) prefetch_line(g + j * B + e);
    const __m256 a = _mm256_mul_ps(block_sums8<B>(g + j * B), c.scale);
    acc = add_norm_sq8(c, m, v, j, a, carry, acc);
  }
  return lane_sum(acc);
}

/// Update pass over `count` (a multiple of 8) coefficients of one row and their count * B
/// elements: m, v <- m', v';  p <- x + keep * x  with  x = p - step / (denom lim) * (g + (m' - A)
/// scale).
template <int B, typename G, typename P, typename S>
inline void update(const StepConstants& c, const G* g, P* p, S* m, S* v, int64_t count, float step,
                   float lim, float keep, Carry carried) {
  const __m256 step_v = _mm256_set1_ps(step), lim_v = _mm256_set1_ps(lim);
  const __m256 keep_v = _mm256_set1_ps(keep);
  // In chunks of k_chunk coefficients: first their moments and shifts, then their factors (the
  // square roots and divisions in a loop of their own), then their elements. Done coefficient
  // group by coefficient group, each group's elements waited on a chain of about 20 dependent
  // operations (block sums, moments, square root, division), and the pass was slower in L1
  // (docs/notes/kernel_history.md).
  constexpr int64_t k_chunk = 64;
  alignas(32) float factor[k_chunk], shift[k_chunk];
  for (int64_t j0 = 0; j0 < count; j0 += k_chunk) {
    const int64_t j1 = std::min(count, j0 + k_chunk);
    for (int64_t j = j0; j < j1; j += 8) {
      for (int e = 0; e < 8 * B; e += k_per_line<G>) prefetch_line(g + j * B + e);
      const __m256 a = carried.approx != nullptr
                           ? _mm256_loadu_ps(carried.approx + j)
                           : _mm256_mul_ps(block_sums8<B>(g + j * B), c.scale);
      const Moments8 mv(c, m + j, v + j, a);
      store8(m + j, mv.m);
      store8(v + j, mv.v);
      _mm256_store_ps(factor + (j - j0), mv.v);  // v', as a float: its denominator next
      _mm256_store_ps(shift + (j - j0),
                      Spread<B>::lane_order(_mm256_mul_ps(_mm256_sub_ps(mv.m, a), c.scale)));
    }
    for (int64_t j = j0; j < j1; j += 8) {
      const __m256 denom = carried.approx != nullptr
                               ? _mm256_loadu_ps(carried.denom + j)
                               : Moments8::denom(c, _mm256_load_ps(factor + (j - j0)));
      _mm256_store_ps(factor + (j - j0),
                      Spread<B>::lane_order(_mm256_div_ps(step_v, _mm256_mul_ps(denom, lim_v))));
    }
    for (int64_t j = j0; j < j1; j += 8) {
      for (int e = 0; e < 8 * B; e += k_per_line<P>) prefetch_line(p + j * B + e);
      update_elements8<B>(g + j * B, p + j * B, Spread<B>(factor + (j - j0)),
                          Spread<B>(shift + (j - j0)), keep_v);
    }
  }
}

// The 2-D transform: a tile's blocks span `height` rows. Reading them block by block would jump
// between rows every 8 coefficients; these read each row's part from start to end instead, with
// the tile's coefficients (count <= 2048, a multiple of 8) in the caller's arrays. Where a tile
// spans its rows' whole width (haar_adam_cpu_impl.h), that is one stream through memory.

/// a[j] = (sum of block j over the rows) * scale, row after row.
template <int B, typename G>
inline void approx_by_rows(const StepConstants& c, const G* g, int64_t stride, int64_t height,
                           int64_t count, float* a) {
  for (int64_t j = 0; j < count; j += 8) {
    for (int e = 0; e < 8 * B; e += k_per_line<G>) prefetch_line(g + j * B + e);
    _mm256_storeu_ps(a + j, block_sums8<B>(g + j * B));
  }
  for (int64_t r = 1; r < height; ++r)
    for (int64_t j = 0; j < count; j += 8) {
      for (int e = 0; e < 8 * B; e += k_per_line<G>) prefetch_line(g + r * stride + j * B + e);
      _mm256_storeu_ps(
          a + j, _mm256_add_ps(_mm256_loadu_ps(a + j), block_sums8<B>(g + r * stride + j * B)));
    }
  for (int64_t j = 0; j < count; j += 8)
    _mm256_storeu_ps(a + j, _mm256_mul_ps(_mm256_loadu_ps(a + j), c.scale));
}

template <int B, typename G, typename S>
inline float norm_sq_by_rows(const StepConstants& c, const G* g, int64_t stride, int64_t height,
                             const S* m, const S* v, int64_t count, float* a, Carry carry) {
  approx_by_rows<B>(c, g, stride, height, count, a);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; j += 8)
    acc = add_norm_sq8(c, m, v, j, _mm256_loadu_ps(a + j), carry, acc);
  return lane_sum(acc);
}

/// The next tile's gradient, which the update of this one prefetches into L2 as it goes (nullptr:
/// none): `height` rows of `elements` values, the rows update_by_rows' `stride` apart.
template <typename G>
struct NextRows {
  const G* g = nullptr;
  int64_t height = 0, elements = 0;
};

/// As update(), the blocks' factors and shifts first (into a and factor), then row after row.
/// The row loop reads one DRAM stream (p) where update() reads two (g and p), and the block sums
/// before it read only g: a core keeps too few misses in flight on one stream to reach the
/// memory's rate. So while the rows of p stream, the next tile's gradient is prefetched at the
/// same pace (a line of it per line of p), and that tile's block sums then read it from L2.
template <int B, typename G, typename P, typename S>
inline void update_by_rows(const StepConstants& c, const G* g, P* p, int64_t stride, int64_t height,
                           S* m, S* v, int64_t count, float step, float lim, float keep, float* a,
                           float* factor, const NextRows<G>& next, Carry carried) {
  // With the norm pass's approximations carried, the tile's rows are read once here, not twice.
  const bool carry = carried.approx != nullptr;
  if (!carry) approx_by_rows<B>(c, g, stride, height, count, a);
  const __m256 step_v = _mm256_set1_ps(step), lim_v = _mm256_set1_ps(lim);
  const __m256 keep_v = _mm256_set1_ps(keep);
  for (int64_t j = 0; j < count; j += 8) {
    const __m256 aj = _mm256_loadu_ps((carry ? carried.approx : a) + j);
    const Moments8 mv(c, m + j, v + j, aj);
    store8(m + j, mv.m);
    store8(v + j, mv.v);
    const __m256 denom = carry ? _mm256_loadu_ps(carried.denom + j) : mv.denom(c);
    // Both in Spread's lane order; a now holds the shifts.
    _mm256_storeu_ps(factor + j,
                     Spread<B>::lane_order(_mm256_div_ps(step_v, _mm256_mul_ps(denom, lim_v))));
    _mm256_storeu_ps(a + j, Spread<B>::lane_order(_mm256_mul_ps(_mm256_sub_ps(mv.m, aj), c.scale)));
  }
  // A cursor over the next tile's gradient, a line at a time, row after row. Each group of 8
  // blocks of this tile moves it on by one group's share of the lines (rounded up), so that it
  // keeps pace with this tile's rows; no division in the loop.
  const int64_t lines_per_row = next.elements / k_per_line<G>;  // whole lines
  const int64_t row_values = lines_per_row * k_per_line<G>;
  const int64_t groups = height * (count / 8);
  const int64_t per_group =
      next.g == nullptr ? 0 : (next.height * lines_per_row + groups - 1) / groups;
  const G* next_row = next.g;
  int64_t next_col = 0, rows_left = row_values == 0 ? 0 : next.height;
  for (int64_t r = 0; r < height; ++r)
    for (int64_t j = 0; j < count; j += 8) {
      for (int e = 0; e < 8 * B; e += k_per_line<P>) prefetch_line(p + r * stride + j * B + e);
      for (int64_t k = 0; k < per_group && rows_left > 0; ++k) {
        prefetch_line_l2(next_row + next_col);
        next_col += k_per_line<G>;
        if (next_col == row_values) next_col = 0, next_row += stride, --rows_left;
      }
      update_elements8<B>(g + r * stride + j * B, p + r * stride + j * B, Spread<B>(factor + j),
                          Spread<B>(a + j), keep_v);
    }
}

}  // namespace simd
}  // namespace
}  // namespace kernels
}  // namespace gwt
#endif
