#pragma once

// The general (any filter, any mode) WaveletAdam step of one row, written once for the CUDA body
// and for the host: `Lanes` says which of the cooperating threads runs the code and how they
// wait for each other. cuda/wavelet_adam.cu runs these bodies with one thread block per row
// (`lanes()` = blockDim.x, `sync()` = __syncthreads()); the tests run them on the host with one
// lane (tests/test_fused_kernel_rows.cpp, KernelRows) and with several threads and a barrier
// (tests/test_kernel_lanes.cpp, KernelLanes), which is how the CUDA body's arithmetic, control flow
// and barriers are checked on a machine without a GPU. The CPU kernel uses the per-coefficient
// formulas too.
//
// Formulas are PyWavelets' conventions, as in src/transform.cpp:
//   analysis  A[o] = sum_k x~[2o + offset + k] rec_lo[k],  D[o] likewise with rec_hi,
//             offset = 1 - F/2 (periodization) or 2 - F (zero, symmetric), x~ the extended row;
//   synthesis out[2m + e] = sum_q dec_lo[j] A[m + q] + dec_hi[j] D[m + q],  j = phase + 2q - e.

#include <cmath>
#include <cstdint>

#include <c10/util/Exception.h>

#include "kernels/kernels.h"
#include "gwt/wavelet.h"

#if defined(__CUDACC__)
#define GWT_ROW_FN __host__ __device__ inline
#else
#define GWT_ROW_FN inline
#endif

namespace gwt {
namespace kernels {
namespace row {
// Internal linkage for everything here: the CPU kernels are compiled twice, for two instruction
// sets, and a shared inline symbol could hand the AVX2 copy to the baseline build.
namespace {

constexpr int k_max_taps = 32;    // the longest filter gwt has is 18 (coif3)
constexpr int k_max_levels = 62;  // rows are shorter than 2^62

/// Everything one row's step needs, by value (a CUDA kernel parameter).
template <typename Acc>
struct RowPlan {
  int taps = 2;
  int level = 1;
  BoundaryMode mode = BoundaryMode::zero;
  Acc rec_lo[k_max_taps] = {}, rec_hi[k_max_taps] = {};  // reversed decomposition filters
  Acc dec_lo[k_max_taps] = {}, dec_hi[k_max_taps] = {};  // synthesis filters
  int64_t rows = 0, n = 0, approx_len = 0, coeff_len = 0;
  int64_t lengths[k_max_levels + 1] = {};        // coefficients per subband at level l (0: n)
  int64_t detail_offset[k_max_levels + 1] = {};  // where D_l starts in a workspace row
  int64_t buffer_len = 0;                        // length of each of the two scratch rows
  Acc beta1 = 0, beta2 = 0, one_minus_beta1 = 0, one_minus_beta2 = 0, eps = 0;
  Acc step_size = 0, keep = 0;  // keep = -lr * weight_decay
  Acc threshold = 0;
  bool threshold_soft = true;
};

/// The plan of a WaveletAdamArgs (host).
template <typename Acc>
RowPlan<Acc> make_row_plan(const WaveletAdamArgs& a) {
  TORCH_INTERNAL_ASSERT(a.filter_length >= 2 && a.filter_length <= k_max_taps &&
                        a.filter_length % 2 == 0 && a.level >= 1 && a.level <= k_max_levels);
  RowPlan<Acc> f;
  f.taps = static_cast<int>(a.filter_length);
  f.level = static_cast<int>(a.level);
  f.mode = a.boundary;
  for (int k = 0; k < f.taps; ++k) {
    f.dec_lo[k] = static_cast<Acc>(a.dec_lo[k]);
    f.dec_hi[k] = static_cast<Acc>(a.dec_hi[k]);
    f.rec_lo[f.taps - 1 - k] = static_cast<Acc>(a.dec_lo[k]);
    f.rec_hi[f.taps - 1 - k] = static_cast<Acc>(a.dec_hi[k]);
  }
  f.rows = a.rows, f.n = a.n, f.approx_len = a.approx_len, f.coeff_len = a.coeff_len;
  f.lengths[0] = a.n;
  for (int l = 1; l <= f.level; ++l) f.lengths[l] = dwt_coeff_len(f.lengths[l - 1], f.taps, f.mode);
  // Workspace row: [A_L | D_L | D_{L-1} | ... | D_1].
  int64_t offset = f.approx_len;
  for (int l = f.level; l >= 1; --l) {
    f.detail_offset[l] = offset;
    offset += f.lengths[l];
  }
  // Scratch: an approximation of level >= 1 (at most lengths[1]) or a synthesis output from
  // level >= 2 (at most 2 * lengths[2] <= lengths[1] + F - 1).
  f.buffer_len = f.lengths[1] + f.taps;
  f.beta1 = static_cast<Acc>(a.beta1), f.beta2 = static_cast<Acc>(a.beta2);
  f.one_minus_beta1 = static_cast<Acc>(1 - a.beta1),
  f.one_minus_beta2 = static_cast<Acc>(1 - a.beta2);
  f.eps = static_cast<Acc>(a.eps);
  f.step_size = static_cast<Acc>(a.step_size);
  f.keep = static_cast<Acc>(-a.decay);
  f.threshold = static_cast<Acc>(a.threshold);
  f.threshold_soft = a.threshold_soft;
  return f;
}

template <typename Acc, typename T>
GWT_ROW_FN Acc to_acc(T x) {
  return static_cast<Acc>(static_cast<float>(x));
}
template <typename Acc>
GWT_ROW_FN Acc to_acc(double x) {
  return static_cast<Acc>(x);
}

/// Start of coefficient o's analysis window, minus 2o.
GWT_ROW_FN int64_t analysis_offset(int taps, BoundaryMode mode) {
  return mode == BoundaryMode::periodization ? 1 - taps / 2 : 2 - taps;
}

/// Approximation and detail coefficient o of one analysis level of x[0, n).
template <typename Acc, typename T>
GWT_ROW_FN void analyze(const T* x, int64_t n, int64_t o, const RowPlan<Acc>& f, Acc& lo, Acc& hi) {
  Acc sum_lo = 0, sum_hi = 0;  // locals: lo and hi may alias x
  const int64_t base = 2 * o + analysis_offset(f.taps, f.mode);
  for (int k = 0; k < f.taps; ++k) {
    const int64_t s = extension_index(base + k, n, f.mode);
    if (s < 0) continue;
    const Acc value = to_acc<Acc>(x[s]);
    sum_lo += value * f.rec_lo[k];
    sum_hi += value * f.rec_hi[k];
  }
  lo = sum_lo;
  hi = sum_hi;
}

/// Number of output pairs of one synthesis level from len coefficients each (PyWavelets' idwt:
/// 2 len - F + 2 samples in zero and symmetric mode, 2 len in periodization).
GWT_ROW_FN int64_t synthesis_pairs(int64_t len, int taps, BoundaryMode mode) {
  return mode == BoundaryMode::periodization ? len : len - taps / 2 + 1;
}

/// Output samples 2m (even) and 2m + 1 (odd) of one synthesis level from a[0, len), d[0, len).
template <typename Acc>
GWT_ROW_FN void synthesize(const Acc* a, const Acc* d, int64_t len, int64_t m,
                           const RowPlan<Acc>& f, Acc& even, Acc& odd) {
  const bool periodic = f.mode == BoundaryMode::periodization;
  const int phase = periodic ? f.taps / 2 : 1;
  const int q_lo = periodic ? -((f.taps / 2 + 1) / 2) : 0;
  const int q_hi = periodic ? (f.taps / 2 + 1) / 2 : f.taps / 2 - 1;
  Acc sums[2] = {0, 0};
  for (int q = q_lo; q <= q_hi; ++q) {
    int64_t i = m + q;
    if (periodic) i = ((i % len) + len) % len;
    for (int e = 0; e < 2; ++e) {
      const int j = phase + 2 * q - e;
      if (j >= 0 && j < f.taps) sums[e] += f.dec_lo[j] * a[i] + f.dec_hi[j] * d[i];
    }
  }
  even = sums[0];
  odd = sums[1];
}

/// PyWavelets' threshold of one detail: soft x * max(1 - t / |x|, 0) (0 stays 0), hard 0 where
/// |x| < t.
template <typename Acc>
GWT_ROW_FN Acc threshold_value(Acc x, Acc t, bool soft) {
  const Acc magnitude = x < 0 ? -x : x;
  if (soft) {
    if (magnitude == 0) return Acc(0);
    const Acc factor = Acc(1) - t / magnitude;
    return factor > 0 ? x * factor : Acc(0);
  }
  return magnitude < t ? Acc(0) : x;
}

/// Adam's moments of one coefficient after this step, rounded to the stored type S.
template <typename S, typename Acc>
GWT_ROW_FN void new_moments(const RowPlan<Acc>& f, S m_old, S v_old, Acc x, Acc& m, Acc& v) {
  m = to_acc<Acc>(static_cast<S>(f.beta1 * to_acc<Acc>(m_old) + f.one_minus_beta1 * x));
  v = to_acc<Acc>(static_cast<S>(f.beta2 * to_acc<Acc>(v_old) + f.one_minus_beta2 * x * x));
}

/// One lane on the host: the bodies below then run sequentially.
struct HostLanes {
  int64_t lane() const { return 0; }
  int64_t lanes() const { return 1; }
  void sync() const {}
};

/// Sum of x[0, count) in a fixed pairwise order that does not depend on the number of lanes: at
/// stride s = 1, 2, 4, ... every i that is a multiple of 2s gets x[i] += x[i + s] (where i + s <
/// count), so x[0] ends as ((x0 + x1) + (x2 + x3)) + ... Overwrites x; every lane must call it and
/// every lane gets the sum. The CUDA norm passes reduce their per-block partials with it (one
/// block, cuda/block_reduce.cuh), so the norm, and with it the limiter, has the same bits on every
/// run.
template <typename Lanes>
GWT_ROW_FN double tree_sum(const Lanes& lanes, double* x, int64_t count) {
  for (int64_t stride = 1; stride < count; stride *= 2) {
    for (int64_t i = 2 * stride * lanes.lane(); i + stride < count; i += 2 * stride * lanes.lanes())
      x[i] += x[i + stride];
    lanes.sync();
  }
  return count > 0 ? x[0] : 0.0;
}

/// The DWT cascade of one row's gradient g into w ([A_L | D_L | ... | D_1], coeff_len values;
/// scratch rows buf0, buf1). Starts with a barrier, so that the lanes may still be reading the
/// previous row's w when they call it.
template <typename P, typename Acc, typename Lanes>
GWT_ROW_FN void row_dwt(const Lanes& lanes, const RowPlan<Acc>& f, const P* g, Acc* w, Acc* buf0,
                        Acc* buf1) {
  lanes.sync();
  const Acc* previous = nullptr;
  for (int l = 1; l <= f.level; ++l) {
    Acc* approx = l == f.level ? w : (l % 2 == 1 ? buf0 : buf1);
    Acc* detail = w + f.detail_offset[l];
    for (int64_t o = lanes.lane(); o < f.lengths[l]; o += lanes.lanes()) {
      Acc lo, hi;
      if (l == 1)
        analyze(g, f.n, o, f, lo, hi);
      else
        analyze(previous, f.lengths[l - 1], o, f, lo, hi);
      approx[o] = lo;
      detail[o] = hi;
    }
    lanes.sync();
    previous = approx;
  }
}

/// Norm pass of one row: row_dwt into w, then this lane's share of sum (m' / (sqrt(v') + eps))^2.
/// Writes nothing but w and the scratch.
template <typename P, typename S, typename Acc, typename Lanes>
GWT_ROW_FN Acc row_norm_sq(const Lanes& lanes, const RowPlan<Acc>& f, const P* g, const S* m,
                           const S* v, Acc* w, Acc* buf0, Acc* buf1) {
  row_dwt(lanes, f, g, w, buf0, buf1);
  Acc sum = 0;
  for (int64_t j = lanes.lane(); j < f.approx_len; j += lanes.lanes()) {
    Acc m_new, v_new;
    new_moments(f, m[j], v[j], w[j], m_new, v_new);
    using std::sqrt;
    const Acc normalized = m_new / (sqrt(v_new) + f.eps);
    sum += normalized * normalized;
  }
  return sum;
}

/// Update pass of one row, w holding its coefficients (row_dwt): m, v <- m', v'; the approximation
/// becomes m' / (denominator lim), each detail (thresholded first when asked) is divided by its
/// coefficient's denominator times lim; the IDWT cascade (scratch buf0, buf1) gives the update,
/// p <- x + keep x with x = p - step_size * update. den: approx_len values of scratch. Returns
/// this lane's count of details kept by the threshold.
template <typename P, typename S, typename Acc, typename Lanes>
GWT_ROW_FN int64_t row_update(const Lanes& lanes, const RowPlan<Acc>& f, Acc lim, P* p, S* m, S* v,
                              Acc* w, Acc* buf0, Acc* buf1, Acc* den) {
  using std::sqrt;
  for (int64_t j = lanes.lane(); j < f.approx_len; j += lanes.lanes()) {
    Acc m_new, v_new;
    new_moments(f, m[j], v[j], w[j], m_new, v_new);
    m[j] = static_cast<S>(m_new);
    v[j] = static_cast<S>(v_new);
    den[j] = (sqrt(v_new) + f.eps) * lim;
    w[j] = m_new / den[j];
  }
  lanes.sync();
  int64_t kept = 0;
  for (int l = f.level; l >= 1; --l) {
    Acc* d = w + f.detail_offset[l];
    const int shift = f.level - l;
    for (int64_t i = lanes.lane(); i < f.lengths[l]; i += lanes.lanes()) {
      Acc value = d[i];
      if (f.threshold > 0) {
        value = threshold_value(value, f.threshold, f.threshold_soft);
        kept += value != 0;
      }
      d[i] = value / den[i >> shift];
    }
  }
  lanes.sync();
  // IDWT cascade, coarsest first; an approximation one longer than its detail loses its last
  // sample (PyWavelets' waverec).
  const Acc* approx = w;
  int64_t len = f.approx_len;
  bool into_buf0 = true;
  for (int l = f.level; l >= 1; --l) {
    if (len == f.lengths[l] + 1) len = f.lengths[l];
    const Acc* detail = w + f.detail_offset[l];
    const int64_t pairs = synthesis_pairs(len, f.taps, f.mode);
    if (l > 1) {
      Acc* out = into_buf0 ? buf0 : buf1;
      for (int64_t i = lanes.lane(); i < pairs; i += lanes.lanes()) {
        Acc even, odd;
        synthesize(approx, detail, len, i, f, even, odd);
        out[2 * i] = even;
        out[2 * i + 1] = odd;
      }
      lanes.sync();
      approx = out;
      len = 2 * pairs;
      into_buf0 = !into_buf0;
    } else {
      for (int64_t i = lanes.lane(); i < pairs && 2 * i < f.n; i += lanes.lanes()) {
        Acc even, odd;
        synthesize(approx, detail, len, i, f, even, odd);
        Acc x = to_acc<Acc>(p[2 * i]) - f.step_size * even;
        p[2 * i] = static_cast<P>(x + f.keep * x);
        if (2 * i + 1 < f.n) {
          x = to_acc<Acc>(p[2 * i + 1]) - f.step_size * odd;
          p[2 * i + 1] = static_cast<P>(x + f.keep * x);
        }
      }
    }
  }
  lanes.sync();
  return kept;
}

}  // namespace
}  // namespace row
}  // namespace kernels
}  // namespace gwt
