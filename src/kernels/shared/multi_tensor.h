#pragma once

// The multi-tensor step (ATen's multi_tensor_apply design, our own code): for each group of
// tensors that share a parameter, moment and math type, three launches whatever the number of
// tensors in it:
//
//   1. norm:     one block per chunk (a fixed run of one tensor's work items: Haar coefficients,
//                or values of a dense tensor) writes the chunk's share of the tensor's sum of
//                squares, in double, to partials[chunk]. NaN when a gradient value is not finite.
//   2. finalize: one block per tensor adds its chunks' partials in a fixed order and computes,
//                from the device-resident state, the step size (bias correction from the step
//                count), the limiter's factor and the norm to save, and the non-finite flags: the
//                tensor's own (nonfinite "skip_param") or the step-wide found_inf ("skip_step").
//   3. update:   one block per chunk reads those results; a skipped tensor (or every tensor, when
//                found_inf) writes nothing but its skip count. The first chunk of a stepped tensor
//                advances its step count and saves its norm.
//
// Nothing here waits for the host, and the host never reads a result during a step: step counts,
// skip counts and saved norms live in device memory (TensorMeta::counts, TensorMeta::norm).
//
// A tensor's chunks depend on that tensor alone, each chunk's sum is a fixed tree over the block's
// threads, and the finalize sums the chunks in a fixed tree too: a tensor's result has the same
// bits whichever tensors share its launch.
//
// Everything below the planner is __host__ __device__ code: cuda/multi_tensor_adam.cu runs it on
// the GPU, and emulate_step() runs the same functions on the host over the same grid (every block,
// every thread, phases split where the kernels have a barrier), which the tests compare with the
// CPU reference. The rule is docs/algorithm.md's; src/kernels/kernels.h describes the Haar block.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/shared/wavelet_row.h"  // GWT_ROW_FN, row::to_acc

namespace gwt {
namespace kernels {
namespace mt {

constexpr int k_threads = 256;                 // threads per block of every multi-tensor kernel
constexpr int64_t k_chunk_values = 32 * 1024;  // gradient values per chunk (128 per thread)

/// Haar blocks (one thread per coefficient), dense values (one thread per value), rows of any
/// other wavelet (one block per row, row::row_norm_sq / row_update in shared memory), or FoamAdam's
/// folded blocks (one thread per block of 2^level values along a row; docs/algorithm.md#foam).
enum class Kind : int32_t { haar = 0, dense = 1, general = 2, foam = 3 };

/// Per-tensor counters in device memory: [0] steps taken (bias correction), [1] steps skipped
/// (nonfinite "skip_param").
enum Count : int { k_steps = 0, k_skipped = 1 };

/// One tensor of a launch, as the kernels read it (device memory).
struct TensorMeta {
  void* param = nullptr;
  const void* grad = nullptr;  ///< the parameter's type, contiguous
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  void* norm = nullptr;       ///< limiter: saved norm, math type; < 0: none yet (gamma > 0 only)
  int64_t* counts = nullptr;  ///< [2]: Count
  Kind kind = Kind::haar;
  int32_t correct_bias = 1;
  int32_t skip_param = 0;  ///< nonfinite("skip_param"): skipped alone
  int32_t two_d = 0;
  int64_t rows = 0, n = 0;  ///< Haar: rows of length n; dense: n values (rows 1)
  int64_t approx_len = 0;   ///< Haar: ceil(n / block)
  int64_t block = 1;        ///< Haar: 2^level
  int64_t height = 1;       ///< 2-D: rows of each matrix
  int64_t block_rows = 1;   ///< 2-D: ceil(height / block)
  int64_t state_rows = 0;   ///< rows of the moments
  double approx_scale = 1;  ///< 2^(-level/2), 2-D: 2^(-level)
  double res_scale = 1;     ///< FOAM: rho, the residual's weight
  /// FOAM: scale multiplies its update inside (u = scale M / D), not the step size.
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, lr = 0, weight_decay = 0, scale = 1, gamma = 0;
  int64_t first_chunk = 0, chunks = 0;  ///< this tensor's chunks in the launch's chunk list
  int64_t plan = -1;                    ///< general: its row::RowPlan in the launch's plans
  int64_t* kept_per_row = nullptr;      ///< general with a threshold: details kept, per row
};

/// A run of one tensor's work items [begin, end): Haar coefficients or dense values.
struct Chunk {
  int64_t tensor = 0;
  int64_t begin = 0, end = 0;
};

/// What the finalize leaves for the update, per tensor (device memory).
struct TensorResult {
  double step_size;  ///< lr * bias correction (times scale on the wavelet path)
  double lim;        ///< the limiter's factor, 1 when off
  double new_norm;   ///< the norm to save when the tensor steps
  int32_t bad;       ///< a gradient value of this tensor is not finite
  int32_t step;      ///< unused padding
};

/// Step-wide flags and the optimizer's skip count (device memory, kept between steps).
struct StepFlags {
  int32_t found_inf;      ///< a "skip_step" tensor's gradient is not finite: nothing steps
  int32_t any_skipped;    ///< a "skip_param" tensor was skipped
  int64_t skipped_steps;  ///< steps with anything skipped (WaveletAdam::skipped_steps)
};

/// A launch's arguments, by value.
struct Launch {
  const TensorMeta* tensors = nullptr;
  const Chunk* chunks = nullptr;
  int64_t num_tensors = 0, num_chunks = 0;
  unsigned char* plans = nullptr;   ///< general groups: row::RowPlan<Acc> per general tensor
  int64_t shared_bytes = 0;         ///< general groups: dynamic shared memory per block
  double* partials = nullptr;       ///< [num_chunks]
  TensorResult* results = nullptr;  ///< [num_tensors]
  StepFlags* flags = nullptr;
  int32_t first_of_step = 0;  ///< the step's first norm launch clears the step-wide flags
  int32_t last_of_step = 0;   ///< the step's last update launch counts a skipped step
};

// ---------------------------------------------------------------------------------------------
// Per-thread bodies

// ---------------------------------------------------------------------------------------------

namespace {  // internal linkage: see wavelet_row.h

/// Rows of p and g that Haar coefficient k's block spans: [first, first + count).
GWT_ROW_FN void block_rows_of(const TensorMeta& t, int64_t k, int64_t& first, int64_t& count) {
  const int64_t state_row = k / t.approx_len;
  if (!t.two_d) {
    first = state_row, count = 1;
    return;
  }
  const int64_t top = (state_row % t.block_rows) * t.block;
  first = state_row / t.block_rows * t.height + top;
  count = t.height - top < t.block ? t.height - top : t.block;
}

/// FOAM block k (row k / approx_len, block k % approx_len): its values [begin, end) of the tensor
/// (the last block of a row may be partial).
GWT_ROW_FN void foam_block(const TensorMeta& t, int64_t k, int64_t& begin, int64_t& end) {
  const int64_t row = k / t.approx_len, j = k % t.approx_len;
  begin = row * t.n + j * t.block;
  end = row * t.n + (j * t.block + t.block < t.n ? j * t.block + t.block : t.n);
}

/// Haar coefficient k's approximation: its block's values summed row by row, in order (zeros past
/// n: PyWavelets' zero mode), times the scale.
template <typename P, typename Acc>
GWT_ROW_FN Acc approx_of(const TensorMeta& t, const P* grad, int64_t k) {
  int64_t first, count;
  block_rows_of(t, k, first, count);
  const int64_t begin = (k % t.approx_len) * t.block;
  const int64_t end = begin + t.block < t.n ? begin + t.block : t.n;
  Acc sum = 0;
  for (int64_t r = first; r < first + count; ++r)
    for (int64_t i = begin; i < end; ++i) sum += row::to_acc<Acc>(grad[r * t.n + i]);
  return sum * static_cast<Acc>(t.approx_scale);
}

/// The new moments of coefficient (or value) k from x, as stored (rounded to S), in the math type.
template <typename S, typename Acc>
GWT_ROW_FN void new_moments(const TensorMeta& t, const S* m, const S* v, int64_t k, Acc x,
                            Acc& m_new, Acc& v_new) {
  const Acc b1 = static_cast<Acc>(t.beta1), b2 = static_cast<Acc>(t.beta2);
  const Acc c1 = static_cast<Acc>(1 - t.beta1), c2 = static_cast<Acc>(1 - t.beta2);
  m_new = row::to_acc<Acc>(static_cast<S>(b1 * row::to_acc<Acc>(m[k]) + c1 * x));
  v_new = row::to_acc<Acc>(static_cast<S>(b2 * row::to_acc<Acc>(v[k]) + c2 * x * x));
}

/// Norm pass, thread `lane` of the block for chunk c: its share of the sum of squares, its work
/// items in ascending order. A dense tensor has no limiter: its share is 0, or NaN when a gradient
/// value is not finite.
template <typename P, typename S, typename Acc>
GWT_ROW_FN double norm_share(const Launch& l, int64_t c, int lane) {
  using std::sqrt;
  const Chunk chunk = l.chunks[c];
  const TensorMeta& t = l.tensors[chunk.tensor];
  const P* grad = static_cast<const P*>(t.grad);
  double sum = 0;
  if (t.kind == Kind::dense) {
    for (int64_t i = chunk.begin + lane; i < chunk.end; i += k_threads)
      sum += static_cast<double>(row::to_acc<Acc>(grad[i]) * Acc(0));
    return sum;
  }
  if (t.kind == Kind::foam) {  // no limiter either: the non-finite check alone
    for (int64_t k = chunk.begin + lane; k < chunk.end; k += k_threads) {
      int64_t begin, end;
      foam_block(t, k, begin, end);
      for (int64_t i = begin; i < end; ++i)
        sum += static_cast<double>(row::to_acc<Acc>(grad[i]) * Acc(0));
    }
    return sum;
  }
  const S* m = static_cast<const S*>(t.exp_avg);
  const S* v = static_cast<const S*>(t.exp_avg_sq);
  for (int64_t k = chunk.begin + lane; k < chunk.end; k += k_threads) {
    Acc m_new, v_new;
    new_moments<S, Acc>(t, m, v, k, approx_of<P, Acc>(t, grad, k), m_new, v_new);
    const Acc normalized = m_new / (sqrt(v_new) + static_cast<Acc>(t.eps));
    sum += static_cast<double>(normalized * normalized);
  }
  return sum;
}

/// Norm pass, thread 0 of block 0: the step's first norm launch clears the step-wide flags (no
/// finalize of the step has run yet, and no block of a norm launch reads them).
GWT_ROW_FN void norm_bookkeeping(const Launch& l, int64_t c) {
  if (c == 0 && l.first_of_step) l.flags->found_inf = 0, l.flags->any_skipped = 0;
}

/// One step of a tree sum over a block's shared values: s[lane] += s[lane + half] for the lanes
/// below half. Called for half = k_threads / 2, ..., 1, with a barrier between calls: a fixed
/// order, so the sum has the same bits on every run.
GWT_ROW_FN void tree_step(double* s, int lane, int half) {
  if (lane < half) s[lane] += s[lane + half];
}

/// Finalize, thread `lane` of tensor i's block: its share of the tensor's chunk partials.
GWT_ROW_FN double partials_share(const Launch& l, int64_t i, int lane) {
  const TensorMeta& t = l.tensors[i];
  double sum = 0;
  for (int64_t c = lane; c < t.chunks; c += k_threads) sum += l.partials[t.first_chunk + c];
  return sum;
}

/// Adam's bias-corrected step size for step number `step` (the host's optim_detail's formula).
GWT_ROW_FN double bias_corrected(const TensorMeta& t, int64_t step) {
  using std::pow;
  using std::sqrt;
  if (!t.correct_bias) return t.lr;
  const double s = static_cast<double>(step);
  return t.lr * sqrt(1 - pow(t.beta2, s)) / (1 - pow(t.beta1, s));
}

/// Finalize, thread 0 of tensor i's block, with the tensor's sum of squares (in the math type, as
/// the single-tensor passes leave it): the results the update reads, and the non-finite flags.
template <typename Acc>
GWT_ROW_FN void finalize_tensor(const Launch& l, int64_t i, double total) {
  using std::sqrt;
  const TensorMeta& t = l.tensors[i];
  TensorResult& r = l.results[i];
  const Acc norm_sq = static_cast<Acc>(total);
  r.bad = norm_sq == norm_sq && norm_sq - norm_sq == 0 ? 0 : 1;  // not NaN, not infinite
  if (r.bad) {
    // Stores of the same value: the order the blocks run in does not matter.
    if (t.skip_param)
      l.flags->any_skipped = 1;
    else
      l.flags->found_inf = 1;
  }
  const double step = bias_corrected(t, t.counts[k_steps] + 1);
  r.step_size = t.kind == Kind::dense || t.kind == Kind::foam ? step : step * t.scale;
  r.lim = 1, r.new_norm = -1;
  // The row bodies read the step size from the plan: this step's, written where the update reads.
  if (t.kind == Kind::general)
    reinterpret_cast<row::RowPlan<Acc>*>(l.plans)[t.plan].step_size = static_cast<Acc>(r.step_size);
  if (t.kind != Kind::dense && t.gamma > 0) {
    const double norm = sqrt(static_cast<double>(norm_sq));
    const double saved = static_cast<double>(*static_cast<const Acc*>(t.norm));
    if (saved >= 0) {
      const double ratio = norm / (saved + 1e-8);
      r.lim = (ratio > t.gamma ? ratio : t.gamma) / t.gamma;
    }
    r.new_norm = norm / r.lim;
  }
}

/// Whether tensor i steps (read by the update, after every finalize of the step).
GWT_ROW_FN bool steps(const Launch& l, int64_t i) {
  return !l.flags->found_inf && !(l.tensors[i].skip_param && l.results[i].bad);
}

/// FOAM's update of the blocks of chunk `chunk` that thread `lane` takes: the order of operations
/// of the CPU bodies (src/kernels/cpu/foam_adam_cpu_impl.h, FoamAdamArgs), a block's sums in
/// ascending order.
template <typename P, typename S, typename Acc>
GWT_ROW_FN void foam_update(const TensorMeta& t, const TensorResult& r, const Chunk& chunk,
                            int lane, P* param, const P* grad, S* m, S* v) {
  using std::sqrt;
  const Acc b1 = static_cast<Acc>(t.beta1), b2 = static_cast<Acc>(t.beta2);
  const Acc c1 = static_cast<Acc>(1 - t.beta1), c2 = static_cast<Acc>(1 - t.beta2);
  const Acc eps = static_cast<Acc>(t.eps), scale = static_cast<Acc>(t.scale);
  const Acc rho = static_cast<Acc>(t.res_scale);
  const Acc rho2 = static_cast<Acc>(t.res_scale * t.res_scale);
  const Acc step = static_cast<Acc>(-r.step_size);
  const Acc keep = static_cast<Acc>(-t.lr * t.weight_decay);
  const Acc inv_block = static_cast<Acc>(1.0 / static_cast<double>(t.block));  // exact: 2^-level
  for (int64_t k = chunk.begin + lane; k < chunk.end; k += k_threads) {
    int64_t begin, end;
    foam_block(t, k, begin, end);
    Acc sum = 0, sum_sq = 0;
    for (int64_t i = begin; i < end; ++i) {
      const Acc x = row::to_acc<Acc>(grad[i]);
      sum += x;
      sum_sq += x * x;
    }
    const Acc a = sum * inv_block, s = sum_sq * inv_block;
    m[k] = static_cast<S>(b1 * row::to_acc<Acc>(m[k]) + c1 * a);
    v[k] = static_cast<S>(b2 * row::to_acc<Acc>(v[k]) + c2 * s);
    const Acc m_new = row::to_acc<Acc>(m[k]), v_new = row::to_acc<Acc>(v[k]);
    for (int64_t i = begin; i < end; ++i) {
      const Acc res = row::to_acc<Acc>(grad[i]) - a;
      const Acc first = m_new + rho * res;
      const Acc second = v_new + rho2 * (res * res);
      Acc x = row::to_acc<Acc>(param[i]) + step * ((first * scale) / (sqrt(second) + eps));
      if (t.weight_decay > 0) x = x + keep * x;  // as the authors: only a positive decay
      param[i] = static_cast<P>(x);
    }
  }
}

/// Update pass, thread `lane` of the block for chunk c.
template <typename P, typename S, typename Acc>
GWT_ROW_FN void update_share(const Launch& l, int64_t c, int lane) {
  using std::sqrt;
  const Chunk chunk = l.chunks[c];
  const TensorMeta& t = l.tensors[chunk.tensor];
  const TensorResult& r = l.results[chunk.tensor];
  if (!steps(l, chunk.tensor)) return;
  P* param = static_cast<P*>(t.param);
  const P* grad = static_cast<const P*>(t.grad);
  S* m = static_cast<S*>(t.exp_avg);
  S* v = static_cast<S*>(t.exp_avg_sq);
  const Acc eps = static_cast<Acc>(t.eps);
  const double decay = t.lr * t.weight_decay;
  if (t.kind == Kind::dense) {
    // The CPU's dense order (DenseAdamArgs): each operation rounded on its own.
    const Acc step = static_cast<Acc>(-r.step_size), keep = static_cast<Acc>(-decay);
    for (int64_t i = chunk.begin + lane; i < chunk.end; i += k_threads) {
      const Acc g = row::to_acc<Acc>(grad[i]);
      Acc m_new, v_new;
      new_moments<S, Acc>(t, m, v, i, g, m_new, v_new);
      m[i] = static_cast<S>(m_new);
      v[i] = static_cast<S>(v_new);
      Acc p = row::to_acc<Acc>(param[i]) + (step * m_new) / (sqrt(v_new) + eps);
      if (t.weight_decay != 0) p = p + keep * p;
      param[i] = static_cast<P>(p);
    }
    return;
  }
  if (t.kind == Kind::foam) {
    foam_update<P, S, Acc>(t, r, chunk, lane, param, grad, m, v);
    return;
  }
  const Acc lim = static_cast<Acc>(r.lim), keep = static_cast<Acc>(-decay);
  const Acc step = static_cast<Acc>(r.step_size), scale = static_cast<Acc>(t.approx_scale);
  for (int64_t k = chunk.begin + lane; k < chunk.end; k += k_threads) {
    const Acc a = approx_of<P, Acc>(t, grad, k);
    Acc m_new, v_new;
    new_moments<S, Acc>(t, m, v, k, a, m_new, v_new);
    m[k] = static_cast<S>(m_new);
    v[k] = static_cast<S>(v_new);
    const Acc factor = step / ((sqrt(v_new) + eps) * lim);
    const Acc shift = (m_new - a) * scale;
    int64_t first, count;
    block_rows_of(t, k, first, count);
    const int64_t begin = (k % t.approx_len) * t.block;
    const int64_t end = begin + t.block < t.n ? begin + t.block : t.n;
    for (int64_t row_index = first; row_index < first + count; ++row_index)
      for (int64_t j = row_index * t.n + begin; j < row_index * t.n + end; ++j) {
        const Acc x = row::to_acc<Acc>(param[j]) - factor * (row::to_acc<Acc>(grad[j]) + shift);
        param[j] = static_cast<P>(x + keep * x);
      }
  }
}

/// Update, thread 0 of a block: the first chunk of a tensor that steps advances its step count
/// and saves its norm; one that is skipped alone counts the skip. The step's last update launch
/// counts a step in which anything was skipped.
template <typename Acc>
GWT_ROW_FN void update_bookkeeping(const Launch& l, int64_t c) {
  const Chunk chunk = l.chunks[c];
  const TensorMeta& t = l.tensors[chunk.tensor];
  if (c == t.first_chunk) {
    if (steps(l, chunk.tensor)) {
      t.counts[k_steps] += 1;
      if (t.kind != Kind::dense && t.gamma > 0)
        *static_cast<Acc*>(t.norm) = static_cast<Acc>(l.results[chunk.tensor].new_norm);
    } else if (!l.flags->found_inf) {
      t.counts[k_skipped] += 1;
    }
  }
  if (c == 0 && l.last_of_step && (l.flags->found_inf || l.flags->any_skipped))
    l.flags->skipped_steps += 1;
}

/// General rows: the block's shared memory as the row bodies use it (wavelet_row_scratch_bytes's
/// order: the row's coefficients, two scratch rows, the denominators).
template <typename Acc>
struct RowScratch {
  Acc *w, *buf0, *buf1, *den;
  GWT_ROW_FN RowScratch(const row::RowPlan<Acc>& f, Acc* shared)
      : w(shared),
        buf0(shared + f.coeff_len),
        buf1(shared + f.coeff_len + f.buffer_len),
        den(shared + f.coeff_len + 2 * f.buffer_len) {}
};

/// General norm pass, every lane of the block for chunk c (one row): this lane's share of the
/// row's sum of squares. Barriers inside: every lane calls it.
template <typename P, typename S, typename Acc, typename Lanes>
GWT_ROW_FN double general_norm_share(const Lanes& lanes, const Launch& l, int64_t c, Acc* shared) {
  const Chunk chunk = l.chunks[c];
  const TensorMeta& t = l.tensors[chunk.tensor];
  if (chunk.begin == chunk.end) return 0;  // a tensor without rows: the same for the whole block
  const row::RowPlan<Acc>& f = reinterpret_cast<const row::RowPlan<Acc>*>(l.plans)[t.plan];
  const RowScratch<Acc> x(f, shared);
  const int64_t r = chunk.begin;
  return static_cast<double>(row::row_norm_sq<P, S, Acc>(
      lanes, f, static_cast<const P*>(t.grad) + r * f.n,
      static_cast<const S*>(t.exp_avg) + r * f.approx_len,
      static_cast<const S*>(t.exp_avg_sq) + r * f.approx_len, x.w, x.buf0, x.buf1));
}

/// General update pass, every lane of the block for chunk c: the row's DWT and update (nothing
/// when the tensor does not step). Returns this lane's count of details kept by a threshold.
template <typename P, typename S, typename Acc, typename Lanes>
GWT_ROW_FN int64_t general_update_share(const Lanes& lanes, const Launch& l, int64_t c,
                                        Acc* shared) {
  const Chunk chunk = l.chunks[c];
  const TensorMeta& t = l.tensors[chunk.tensor];
  if (chunk.begin == chunk.end || !steps(l, chunk.tensor)) return 0;  // uniform over the block
  const row::RowPlan<Acc>& f = reinterpret_cast<const row::RowPlan<Acc>*>(l.plans)[t.plan];
  const RowScratch<Acc> x(f, shared);
  const int64_t r = chunk.begin;
  row::row_dwt<P, Acc>(lanes, f, static_cast<const P*>(t.grad) + r * f.n, x.w, x.buf0, x.buf1);
  return row::row_update<P, S, Acc>(
      lanes, f, static_cast<Acc>(l.results[chunk.tensor].lim), static_cast<P*>(t.param) + r * f.n,
      static_cast<S*>(t.exp_avg) + r * f.approx_len,
      static_cast<S*>(t.exp_avg_sq) + r * f.approx_len, x.w, x.buf0, x.buf1, x.den);
}

/// General update, thread 0 of the block, with the block's count of kept details: the row's
/// count when the tensor steps (a skipped step keeps the last one), then update_bookkeeping.
template <typename Acc>
GWT_ROW_FN void general_update_bookkeeping(const Launch& l, int64_t c, int64_t kept) {
  const Chunk chunk = l.chunks[c];
  const TensorMeta& t = l.tensors[chunk.tensor];
  if (t.kept_per_row != nullptr && chunk.begin < chunk.end && steps(l, chunk.tensor))
    t.kept_per_row[chunk.begin] = kept;
  update_bookkeeping<Acc>(l, c);
}
}  // namespace

}  // namespace mt
}  // namespace kernels
}  // namespace gwt

// The planner (the host's part: groups, chunks, the metadata's layout, the launches' order).
#include "kernels/shared/multi_tensor_plan.h"
