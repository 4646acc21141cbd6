#pragma once

// The general WaveletAdam step of eight rows at once, one row per AVX2 lane (issue 15, item 2).
// Parameters, gradients and moments are float32, bfloat16 or float16, each on its own; the math is
// float32 (16-bit values widened exactly on the way in, rounded as c10 rounds on the way out).
// Included by wavelet_adam_cpu_impl.h in the AVX2 build only (GWT_WAVELET_ROWS8).
//
// Why across rows: along one row the analysis reads every second sample (a stride-2 window per
// output), which AVX2 can only feed with a shuffle per tap pair, and the edges of every level run
// one coefficient at a time. Eight rows side by side ("interleaved": sample i of lane l at
// buf[8 i + l]) make every tap of every output one broadcast multiply-add on a whole register,
// edges included: the index pattern of a level is the same in every row, so the boundary mode's
// extension (extension_index) is evaluated once for all eight. The rows go in and out through
// 8x8 transposes (24 shuffles per 64 values), all in L1/L2: the gradient and the parameter are
// still read and written once each, row-major.
//
// The arithmetic is that of the one-row kernel (src/kernels/cpu/wavelet_adam_cpu_impl.h, PyWavelets'
// conventions, taps in the same order), so each lane computes its row's result within rounding of
// the one-row kernel; the tests hold both to the reference (tests/test_fused.cpp).

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "gwt/wavelet.h"
#include "kernels/cpu/taps.h"
#include "kernels/avx2/values8_avx2.h"
#include "kernels/shared/wavelet_row.h"

namespace gwt {
namespace kernels {
namespace rows8 {
namespace {  // internal linkage: this header is compiled for one instruction set only

constexpr int64_t k_lanes = 8;

// 8x8 transpose: out[c] holds column c of the rows in[0..7].
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// 8 consecutive values of a row as floats, and 8 floats stored in the row's type
// (values8_avx2.h).
using values8::load8;
using values8::store8;

// out[8 i + l] = base[l * stride + i] for i in [0, len): eight rows (float, bfloat16 or float16)
// into the interleaved layout, as floats.
template <typename T>
inline void interleave(const T* base, int64_t stride, int64_t len, float* out) {
  int64_t i = 0;
  for (; i + k_lanes <= len; i += k_lanes) {
    __m256 r[8];
    for (int l = 0; l < 8; ++l) r[l] = load8(base + l * stride + i);
    transpose8(r);
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out + (i + c) * k_lanes, r[c]);
  }
  for (; i < len; ++i)
    for (int l = 0; l < 8; ++l) out[i * k_lanes + l] = static_cast<float>(base[l * stride + i]);
}

// base[l * stride + i] = in[8 i + l]: the interleaved layout back into eight rows of T.
template <typename T>
inline void deinterleave(const float* in, int64_t len, T* base, int64_t stride) {
  int64_t i = 0;
  for (; i + k_lanes <= len; i += k_lanes) {
    __m256 r[8];
    for (int c = 0; c < 8; ++c) r[c] = _mm256_loadu_ps(in + (i + c) * k_lanes);
    transpose8(r);
    for (int l = 0; l < 8; ++l) store8(base + l * stride + i, r[l]);
  }
  for (; i < len; ++i)
    for (int l = 0; l < 8; ++l) base[l * stride + i] = static_cast<T>(in[i * k_lanes + l]);
}

inline __m256 load(const float* interleaved, int64_t i) {
  return _mm256_loadu_ps(interleaved + i * k_lanes);
}
inline void store(float* interleaved, int64_t i, __m256 x) {
  _mm256_storeu_ps(interleaved + i * k_lanes, x);
}

// Whether the eight-lane body runs: yes, unless the environment says GWT_NO_ROWS8 (set and not
// "0"), which gives every row the one-row body (to measure one against the other, or to test the
// one-row body on full groups). Read once per process.
inline bool enabled() {
  static const bool on = [] {
    const char* off = std::getenv("GWT_NO_ROWS8");
    return !(off != nullptr && *off != '\0' && std::string(off) != "0");
  }();
  return on;
}

// Per-thread scratch of one group of eight rows, all interleaved; grows to the largest row seen
// and is kept, so a steady-state step allocates nothing.
struct Scratch {
  std::vector<float> x, y0, y1, w, m, v, inv;
  void reserve(const row::RowPlan<float>& f, int64_t scratch_len) {
    auto grow = [](std::vector<float>& b, int64_t len) {
      if (static_cast<int64_t>(b.size()) < len * k_lanes)
        b.resize(static_cast<size_t>(len * k_lanes));
    };
    grow(x, scratch_len), grow(y0, scratch_len), grow(y1, scratch_len), grow(w, f.coeff_len);
    grow(m, f.approx_len), grow(v, f.approx_len), grow(inv, f.approx_len);
  }
};

// Software prefetch of up to four regions (eight rows, or a group's moments), 64-byte lines
// requested row after row, region after region, paced by pace() over the calls of next(). The body
// alternates between reading and writing rows (the transposes) and computing in L1/L2; a core
// here keeps too few misses in flight to hide DRAM's latency by itself, so without prefetching the
// memory and compute phases add up (measured: the db2 step took the Haar step's time plus its
// own arithmetic). Lines are requested while the filters run, into L2 (T1: L1 holds the scratch).
class Prefetcher {
 public:
  // Another region, prefetched once the earlier ones are (at most k_regions in all).
  Prefetcher& then(const void* first_row, int64_t row_bytes, int64_t stride_bytes, int rows) {
    if (first_row != nullptr && rows > 0 && row_bytes > 0) {
      TORCH_INTERNAL_ASSERT(count_ < k_regions);
      regions_[count_++] = Region{static_cast<const char*>(first_row), row_bytes, stride_bytes, rows};
    }
    return *this;
  }
  // Spreads the lines over about `calls` calls of next() (a line per call if there are fewer
  // calls than lines, the default). Requested one per call from the first loop on, a group's lines
  // were all in flight during its first analysis level, whose few operations per line then waited
  // on full miss buffers, and no line was asked for during the rest of the group: the step was
  // slower that way (docs/notes/general_kernel.md).
  void pace(int64_t calls) {
    int64_t lines = 0;
    for (int i = 0; i < count_; ++i) lines += regions_[i].rows * ((regions_[i].row_bytes + 63) / 64);
    step_ = calls <= lines ? k_whole : k_whole * lines / calls;
  }
  void next() {
    credit_ += step_;
    if (credit_ < k_whole) return;
    credit_ -= k_whole;
    if (at_ == count_) return;
    Region& r = regions_[at_];
    _mm_prefetch(r.row + offset_, _MM_HINT_T1);
    offset_ += 64;
    if (offset_ >= r.row_bytes) {
      offset_ = 0, r.row += r.stride;
      if (--r.rows == 0) ++at_;
    }
  }

 private:
  static constexpr int k_regions = 4;
  static constexpr int64_t k_whole = 1 << 16;  // one line, in the fixed-point units of step_
  struct Region {
    const char* row;
    int64_t row_bytes, stride;
    int rows;
  };
  Region regions_[k_regions] = {};
  int count_ = 0, at_ = 0;
  int64_t offset_ = 0, step_ = k_whole, credit_ = 0;
};

// P, G, S: the parameters', gradients' and moments' types, each float, c10::BFloat16 or
// c10::Half; the math is in float.
template <typename P, typename G, typename S>
class Rows8 {
 public:
  // f: the kernel's plan; the rows it reads are those of args (no threshold).
  Rows8(const WaveletAdamArgs& args, const row::RowPlan<float>& f) : a_(args), f_(f) {
    for (int k = 0; k < f.taps; ++k) {
      rec_lo_[k] = _mm256_set1_ps(f.rec_lo[k]), rec_hi_[k] = _mm256_set1_ps(f.rec_hi[k]);
      dec_lo_[k] = _mm256_set1_ps(f.dec_lo[k]), dec_hi_[k] = _mm256_set1_ps(f.dec_hi[k]);
    }
  }

  // Norm pass of rows [r0, r0 + 8): sums[l] = sum over j of (m' / (sqrt(v') + eps))^2 of row r0 +
  // l. next: first row of the group that follows on this thread (-1: none); its gradient and
  // moments are prefetched while this group's analysis and moment loop run.
  void norm_sq(int64_t r0, int64_t next, Scratch& s, double sums[8]) const {
    Prefetcher grad_ahead;
    rows_of(static_cast<const G*>(a_.grad), next, grad_ahead);
    moments_of(next, grad_ahead);
    grad_ahead.pace(calls(false));
    dwt<false>(r0, s, grad_ahead);
    interleave(static_cast<const S*>(a_.exp_avg) + r0 * f_.approx_len, f_.approx_len, f_.approx_len,
               s.m.data());
    interleave(static_cast<const S*>(a_.exp_avg_sq) + r0 * f_.approx_len, f_.approx_len,
               f_.approx_len, s.v.data());
    __m256 sum = _mm256_setzero_ps();
    const __m256 eps = _mm256_set1_ps(f_.eps);
    const Moments moments(f_);
    const float *m_old = s.m.data(), *v_old = s.v.data(), *w = s.w.data();
    for (int64_t j = 0, len = f_.approx_len; j < len; ++j) {
      __m256 m, v;
      grad_ahead.next();
      moments.next(load(m_old, j), load(v_old, j), load(w, j), m, v);
      const __m256 normalized = _mm256_div_ps(m, _mm256_add_ps(_mm256_sqrt_ps(v), eps));
      sum = _mm256_fmadd_ps(normalized, normalized, sum);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum);
    for (int l = 0; l < 8; ++l) sums[l] = static_cast<double>(lanes[l]);
  }

  // Update pass of rows [r0, r0 + 8): moments stored, coefficients normalised, IDWT, p updated.
  void update(int64_t r0, int64_t next, float lim, Scratch& s) const {
    // This group's moments (read first) and parameters, then the next group's gradient, spread
    // over the analysis, the moment loop and the synthesis. Without the moments in the list the
    // step was slower (docs/notes/general_kernel.md).
    Prefetcher ahead;
    moments_of(r0, ahead);
    rows_of(static_cast<const P*>(a_.param), r0, ahead);
    rows_of(static_cast<const G*>(a_.grad), next, ahead);
    ahead.pace(calls(true));
    dwt<true>(r0, s, ahead);
    S* m_rows = static_cast<S*>(a_.exp_avg) + r0 * f_.approx_len;
    S* v_rows = static_cast<S*>(a_.exp_avg_sq) + r0 * f_.approx_len;
    interleave(m_rows, f_.approx_len, f_.approx_len, s.m.data());
    interleave(v_rows, f_.approx_len, f_.approx_len, s.v.data());
    const __m256 eps = _mm256_set1_ps(f_.eps), lim8 = _mm256_set1_ps(lim);
    const __m256 one = _mm256_set1_ps(1.0f);
    const Moments moments(f_);
    // Locals, not s's or f_'s members, in every loop that stores (see analysis_interior).
    float *w = s.w.data(), *m_new = s.m.data(), *v_new = s.v.data(), *inv_all = s.inv.data();
    for (int64_t j = 0, len = f_.approx_len; j < len; ++j) {
      __m256 m, v;
      ahead.next();
      moments.next(load(m_new, j), load(v_new, j), load(w, j), m, v);
      store(m_new, j, m);
      store(v_new, j, v);
      // One division per coefficient: the approximation too is multiplied by the reciprocal
      // (within an ulp of the quotient; the tests' bound counts a rounding more than either).
      const __m256 inv =
          _mm256_div_ps(one, _mm256_mul_ps(_mm256_add_ps(_mm256_sqrt_ps(v), eps), lim8));
      store(w, j, _mm256_mul_ps(m, inv));
      store(inv_all, j, inv);
    }
    deinterleave(m_new, f_.approx_len, m_rows, f_.approx_len);
    deinterleave(v_new, f_.approx_len, v_rows, f_.approx_len);
    // IDWT cascade, coarsest first; an approximation one longer than its detail loses its last
    // sample (PyWavelets' waverec). The last level's samples go into s.x (the gradient's
    // interleaved copy is no longer needed), then into p row by row. Detail i of level l shares
    // the denominator of approximation coefficient i >> (L - l) and is multiplied by its
    // reciprocal as the synthesis reads it (ScaledDetails below); the one-row kernel scales them
    // in place first, the same product.
    const float* approx = w;
    int64_t len = f_.approx_len;
    float* out = s.y0.data();
    for (int l = f_.level; l >= 1; --l) {
      if (len == f_.lengths[l] + 1) len = f_.lengths[l];
      TORCH_INTERNAL_ASSERT(len == f_.lengths[l]);
      const int64_t pairs = row::synthesis_pairs(len, f_.taps, f_.mode);
      if (l == 1) out = s.x.data();
      const ScaledDetails details{w + f_.detail_offset[l] * k_lanes, inv_all, f_.level - l};
      idwt_level(approx, details, len, pairs, out, &ahead);
      approx = out;
      len = 2 * pairs;
      out = out == s.y0.data() ? s.y1.data() : s.y0.data();
    }
    TORCH_INTERNAL_ASSERT(len >= a_.n);
    update_params(r0, s.x.data());
  }

 private:
  // Calls of Prefetcher::next() a group's pass makes, about: one per interior output of each
  // analysis level, per moment, and (update pass) per interior output pair of each synthesis level.
  int64_t calls(bool synthesis) const {
    int64_t c = f_.approx_len;
    for (int l = 1; l <= f_.level; ++l) c += (synthesis ? 2 : 1) * f_.lengths[l];
    return c;
  }
  // The moments of rows [r0, r0 + 8), both contiguous, as regions of ahead (none for r0 < 0).
  void moments_of(int64_t r0, Prefetcher& ahead) const {
    if (r0 < 0) return;
    const int64_t bytes = 8 * f_.approx_len * static_cast<int64_t>(sizeof(S));
    ahead.then(static_cast<const S*>(a_.exp_avg) + r0 * f_.approx_len, bytes, bytes, 1);
    ahead.then(static_cast<const S*>(a_.exp_avg_sq) + r0 * f_.approx_len, bytes, bytes, 1);
  }

  // Rows [r0, r0 + 8) of a [rows, n] array, as a region of ahead (none for r0 < 0).
  template <typename T>
  void rows_of(const T* data, int64_t r0, Prefetcher& ahead) const {
    if (r0 < 0) return;
    const int64_t row_bytes = a_.n * static_cast<int64_t>(sizeof(T));
    ahead.then(data + r0 * a_.n, row_bytes, row_bytes, 8);
  }

  // Adam's moment update, its four constants broadcast once per loop (a local of the loop).
  struct Moments {
    explicit Moments(const row::RowPlan<float>& f)
        : b1(_mm256_set1_ps(f.beta1)),
          b2(_mm256_set1_ps(f.beta2)),
          c1(_mm256_set1_ps(f.one_minus_beta1)),
          c2(_mm256_set1_ps(f.one_minus_beta2)) {}
    void next(__m256 m_old, __m256 v_old, __m256 x, __m256& m, __m256& v) const {
      m = _mm256_fmadd_ps(b1, m_old, _mm256_mul_ps(c1, x));
      v = _mm256_fmadd_ps(b2, v_old, _mm256_mul_ps(_mm256_mul_ps(c2, x), x));
    }
    __m256 b1, b2, c1, c2;
  };

  // The DWT cascade of the group's gradient rows into s.w ([A_L | D_L | ... | D_1], interleaved);
  // Details = false: the approximations only, A_L into s.w[0, approx_len).
  template <bool Details>
  void dwt(int64_t r0, Scratch& s, Prefetcher& ahead) const {
    interleave(static_cast<const G*>(a_.grad) + r0 * a_.n, a_.n, a_.n, s.x.data());
    const float* in = s.x.data();
    float* w = s.w.data();
    for (int l = 1; l <= f_.level; ++l) {
      float* approx = l == f_.level ? w : (l % 2 == 1 ? s.y0.data() : s.y1.data());
      dwt_level<Details>(in, f_.lengths[l - 1], approx, w + f_.detail_offset[l] * k_lanes, &ahead);
      in = approx;
    }
  }

  // One analysis level: coefficient o = sum_k x~[2o + offset + k] rec[k] (x~ the extended row).
  // ahead: the lines to prefetch, next() once per interior output of every level (Prefetcher::pace
  // spreads the list over all the calls of the pass).
  template <bool Details>
  void dwt_level(const float* x, int64_t n, float* approx, float* detail, Prefetcher* ahead) const {
    const int64_t len = dwt_coeff_len(n, f_.taps, f_.mode);
    const int64_t offset = row::analysis_offset(f_.taps, f_.mode);
    const int64_t first = std::min(len, std::max<int64_t>(0, (1 - offset) / 2));
    const int64_t span = n - f_.taps - offset;
    const int64_t last = span < 0 ? first : std::max(first, std::min(len, span / 2 + 1));
    auto edge = [&](int64_t o) {
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      for (int k = 0; k < f_.taps; ++k) {
        const int64_t t = extension_index(2 * o + offset + k, n, f_.mode);
        if (t < 0) continue;
        const __m256 value = load(x, t);
        lo = _mm256_fmadd_ps(rec_lo_[k], value, lo);
        if constexpr (Details) hi = _mm256_fmadd_ps(rec_hi_[k], value, hi);
      }
      store(approx, o, lo);
      if constexpr (Details) store(detail, o, hi);
    };
    for (int64_t o = 0; o < first; ++o) edge(o);
    with_taps(f_.taps, [&](auto taps) {
      constexpr int F = decltype(taps)::value;
      if constexpr (F > 0) {
        analysis_interior<F, Details>(x, offset, first, last, approx, detail, ahead);
      } else {
        for (int64_t o = first; o < last; ++o) edge(o);
      }
    });
    for (int64_t o = last; o < len; ++o) edge(o);
  }

  // Interior outputs [first, last) of one analysis level, every tap inside the row. Pointers, taps
  // and the prefetcher's position are locals of this function: the stores go through __m256_u,
  // which may alias anything, so whatever the loop read through `this`, a reference or a lambda's
  // capture would be loaded again after every store (measured with callgrind: 45 instructions per
  // output of db2, where its multiply-adds, loads and stores are 14).
  template <int F, bool Details>
  void analysis_interior(const float* x, int64_t offset, int64_t first, int64_t last, float* approx,
                         float* detail, Prefetcher* ahead) const {
    __m256 lo_taps[F], hi_taps[F];
    for (int k = 0; k < F; ++k) lo_taps[k] = rec_lo_[k], hi_taps[k] = rec_hi_[k];
    Prefetcher prefetch = ahead != nullptr ? *ahead : Prefetcher();
    if (first >= last) return;
    // The window's samples are kept from one output to the next, which reads two new ones: each
    // sample is loaded once, not F / 2 times (in registers for short filters; long ones spill).
    __m256 window[F];
    for (int k = 0; k < F - 2; ++k) window[k] = load(x, 2 * first + offset + k);
    for (int64_t o = first; o < last; ++o) {
      prefetch.next();
      window[F - 2] = load(x, 2 * o + offset + F - 2);
      window[F - 1] = load(x, 2 * o + offset + F - 1);
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      for (int k = 0; k < F; ++k) {
        lo = _mm256_fmadd_ps(lo_taps[k], window[k], lo);
        if constexpr (Details) hi = _mm256_fmadd_ps(hi_taps[k], window[k], hi);
      }
      store(approx, o, lo);
      if constexpr (Details) store(detail, o, hi);
      for (int k = 0; k + 2 < F; ++k) window[k] = window[k + 2];
    }
    if (ahead != nullptr) *ahead = prefetch;
  }

  // The details of one level as the synthesis reads them: detail i is d[i] * inv[i >> shift], the
  // same product, bit for bit, as a pass that scaled them in place before the synthesis, without
  // that pass's stores and loads of every detail.
  struct ScaledDetails {
    const float* d;
    const float* inv;
    int shift;
    __m256 operator()(int64_t i) const { return _mm256_mul_ps(load(d, i), load(inv, i >> shift)); }
  };

  // One synthesis level from len coefficients each: pairs [0, count), out[2m], out[2m + 1] =
  // sum_q dec_lo[j] a[m + q] + dec_hi[j] d[m + q], j = phase + 2q - e (row::synthesize).
  void idwt_level(const float* a, const ScaledDetails& d, int64_t len, int64_t count, float* out,
                  Prefetcher* ahead) const {
    const bool periodic = f_.mode == BoundaryMode::periodization;
    const int phase = periodic ? f_.taps / 2 : 1;
    const int q_lo = periodic ? -((f_.taps / 2 + 1) / 2) : 0;
    const int q_hi = periodic ? (f_.taps / 2 + 1) / 2 : f_.taps / 2 - 1;
    auto pair = [&](int64_t m, bool wrap) {
      __m256 sums[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int q = q_lo; q <= q_hi; ++q) {
        int64_t i = m + q;
        if (wrap) i = ((i % len) + len) % len;
        const __m256 av = load(a, i), dv = d(i);
        for (int e = 0; e < 2; ++e) {
          const int j = phase + 2 * q - e;
          if (j >= 0 && j < f_.taps)
            sums[e] = _mm256_fmadd_ps(dec_hi_[j], dv, _mm256_fmadd_ps(dec_lo_[j], av, sums[e]));
        }
      }
      store(out, 2 * m, sums[0]);
      store(out, 2 * m + 1, sums[1]);
    };
    // Interior pairs: every m + q inside [0, len) (always, outside periodization).
    const int64_t first = periodic ? std::min(count, std::max<int64_t>(0, -q_lo)) : 0;
    const int64_t last = periodic ? std::max(first, std::min(count, len - q_hi)) : count;
    for (int64_t m = 0; m < first; ++m) pair(m, true);
    with_taps(f_.taps, [&](auto taps) {
      constexpr int F = decltype(taps)::value;
      if constexpr (F > 0) {
        if (periodic)
          idwt_interior<F, true>(a, d, first, last, out, ahead);
        else
          idwt_interior<F, false>(a, d, first, last, out, ahead);
      } else {
        for (int64_t m = first; m < last; ++m) pair(m, false);
      }
    });
    for (int64_t m = last; m < count; ++m) pair(m, periodic);
  }

  // Interior pairs [first, last): every m + q inside the level. The scaled details of a window
  // (q_lo..q_hi) are kept from one pair to the next, so each is computed once.
  template <int F, bool Periodic>
  void idwt_interior(const float* a, const ScaledDetails& details, int64_t first, int64_t last,
                     float* out, Prefetcher* ahead) const {
    constexpr int phase = Periodic ? F / 2 : 1;
    constexpr int q_lo = Periodic ? -((F / 2 + 1) / 2) : 0;
    constexpr int q_hi = Periodic ? (F / 2 + 1) / 2 : F / 2 - 1;
    constexpr int W = q_hi - q_lo + 1;
    if (first >= last) return;
    __m256 lo[F], hi[F];  // locals, as in analysis_interior
    for (int k = 0; k < F; ++k) lo[k] = dec_lo_[k], hi[k] = dec_hi_[k];
    const float *d = details.d, *inv = details.inv;
    const int shift = details.shift;
    Prefetcher prefetch = ahead != nullptr ? *ahead : Prefetcher();
    // [q - q_lo]: approximation m + q, and detail m + q scaled
    __m256 approx[W], detail[W];
    for (int q = q_lo; q < q_hi; ++q) {
      approx[q - q_lo] = load(a, first + q);
      detail[q - q_lo] = _mm256_mul_ps(load(d, first + q), load(inv, (first + q) >> shift));
    }
    for (int64_t m = first; m < last; ++m) {
      prefetch.next();
      approx[W - 1] = load(a, m + q_hi);
      detail[W - 1] = _mm256_mul_ps(load(d, m + q_hi), load(inv, (m + q_hi) >> shift));
      __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
      for (int q = q_lo; q <= q_hi; ++q) {
        const __m256 av = approx[q - q_lo], dv = detail[q - q_lo];
        const int je = phase + 2 * q, jo = phase + 2 * q - 1;
        // Two multiply-adds per tap pair (the one-row kernel adds lo a + hi d as one term; the
        // same terms, another rounding order, within the tests' bound).
        if (je >= 0 && je < F)
          even = _mm256_fmadd_ps(hi[je], dv, _mm256_fmadd_ps(lo[je], av, even));
        if (jo >= 0 && jo < F) odd = _mm256_fmadd_ps(hi[jo], dv, _mm256_fmadd_ps(lo[jo], av, odd));
      }
      store(out, 2 * m, even);
      store(out, 2 * m + 1, odd);
      for (int k = 0; k + 1 < W; ++k) approx[k] = approx[k + 1], detail[k] = detail[k + 1];
    }
    if (ahead != nullptr) *ahead = prefetch;
  }

  // p <- x + keep x with x = p - step_size * sample, for the group's rows; samples interleaved.
  void update_params(int64_t r0, const float* samples) const {
    P* p = static_cast<P*>(a_.param) + r0 * a_.n;
    const int64_t n = a_.n;
    const __m256 step = _mm256_set1_ps(f_.step_size), keep = _mm256_set1_ps(f_.keep);
    int64_t i = 0;
    for (; i + k_lanes <= n; i += k_lanes) {
      __m256 r[8];
      for (int c = 0; c < 8; ++c) r[c] = load(samples, i + c);
      transpose8(r);  // r[l]: samples i..i+7 of row l
      for (int l = 0; l < 8; ++l) {
        P* dst = p + l * n + i;
        const __m256 x = _mm256_fnmadd_ps(step, r[l], load8(dst));
        store8(dst, _mm256_fmadd_ps(keep, x, x));
      }
    }
    for (; i < n; ++i)
      for (int l = 0; l < 8; ++l) {
        const float x = static_cast<float>(p[l * n + i]) - f_.step_size * samples[i * k_lanes + l];
        p[l * n + i] = static_cast<P>(x + f_.keep * x);
      }
  }

  const WaveletAdamArgs& a_;
  const row::RowPlan<float>& f_;
  __m256 rec_lo_[row::k_max_taps], rec_hi_[row::k_max_taps];
  __m256 dec_lo_[row::k_max_taps], dec_hi_[row::k_max_taps];
};

}  // namespace
}  // namespace rows8
}  // namespace kernels
}  // namespace gwt
