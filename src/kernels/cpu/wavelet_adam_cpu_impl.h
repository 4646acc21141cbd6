// Body of the general fused WaveletAdam passes on the CPU: any filter, zero / periodization /
// symmetric. Included by wavelet_adam_cpu.cpp (baseline ISA) and wavelet_adam_cpu_avx2.cpp
// (AVX2 and FMA, avx2_target.h), each with its own GWT_KERNEL_NS.
//
// Per row: the DWT cascade writes every level's coefficients into a scratch row (each pass); the
// update pass normalises them in place and runs the IDWT cascade into a per-thread scratch row.
// The formulas are those of src/transform.cpp (PyWavelets' conventions), written as loops.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "kernels/shared/dispatch.h"
#include "kernels/kernels.h"
#include "kernels/cpu/taps.h"
#include "kernels/shared/wavelet_row.h"

// The AVX2 build steps float32 or bfloat16 rows eight at a time, one per lane
// (wavelet_rows8_avx2.h).
#if defined(GWT_AVX2_BODY)  // avx2_target.h
#define GWT_WAVELET_ROWS8 1
#include "kernels/avx2/wavelet_rows8_avx2.h"
#endif

#ifndef GWT_KERNEL_NS
#error "define GWT_KERNEL_NS before including wavelet_adam_cpu_impl.h"
#endif

namespace gwt {
namespace kernels {
namespace GWT_KERNEL_NS {
namespace {  // internal linkage, as the row bodies it holds (wavelet_row.h)

// P: parameter type, G: gradient type (P, or float for a float16/bfloat16 parameter), S: moment
// type, Acc: math type.
template <typename P, typename G, typename S, typename Acc>
class GeneralAdam {
 public:
  using acc_t = Acc;

  explicit GeneralAdam(const WaveletAdamArgs& args)
      : a_(args), plan_(row::make_row_plan<Acc>(args)), taps_(args.filter_length) {
    for (int64_t k = 0; k < taps_; ++k) {
      dec_lo_.push_back(plan_.dec_lo[k]);
      dec_hi_.push_back(plan_.dec_hi[k]);
      rec_lo_.push_back(plan_.rec_lo[k]);
      rec_hi_.push_back(plan_.rec_hi[k]);
    }
    lengths_.assign(plan_.lengths, plan_.lengths + args.level + 1);
    detail_offset_.assign(plan_.detail_offset, plan_.detail_offset + args.level + 1);
    TORCH_INTERNAL_ASSERT(lengths_.back() == args.approx_len);
    TORCH_INTERNAL_ASSERT(plan_.detail_offset[1] + lengths_[1] == args.coeff_len);
    scratch_len_ = args.n + 2 * taps_ + 8;
#ifdef GWT_WAVELET_ROWS8
    if constexpr (k_rows8) {
      if (groups() > 0) body8_.emplace(a_, plan_);  // the taps broadcast once per pass
    }
#endif
  }
  // body8_ refers to plan_: never copied (with_kernel's temporary is built in place).
  GeneralAdam(const GeneralAdam&) = delete;
  GeneralAdam& operator=(const GeneralAdam&) = delete;

  // Rows per parallel chunk: threads only for about 16K elements or more (a parallel region costs
  // a few microseconds; this kernel does more work per element than Haar's). Results do not
  // depend on it: each row is summed on its own, the rows in order.
  int64_t grain() const {
    return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, a_.n));
  }

  // Work items: groups of eight rows for the eight-lane body (the first groups() * 8 rows), then
  // single rows. Which rows go in groups depends only on the shape, never on the thread count.
  int64_t groups() const {
#ifdef GWT_WAVELET_ROWS8
    if constexpr (k_rows8) {
      // Rows up to 32K values: the eight rows' scratch (about 40 n floats per thread, kept between
      // steps) then stays within a few MB, in L2/L3, where the transposes pay; longer rows take
      // the one-row body, whose scratch is freed after each pass.
      if (a_.threshold <= 0 && a_.n <= 32768 && rows8::enabled()) return a_.rows / rows8::k_lanes;
    }
#endif
    return 0;
  }
  int64_t items() const {
    return groups() + (a_.rows - groups() * 8);
  }
  int64_t item_grain() const {
    return groups() > 0 ? std::max<int64_t>(1, grain() / 8) : grain();
  }

  double norm_sq() const {
    std::vector<double> partial(static_cast<size_t>(a_.rows), 0.0);
    const int64_t groups = this->groups();
    at::parallel_for(0, items(), item_grain(), [&](int64_t i0, int64_t i1) {
      std::vector<Acc> x, y, a;
      for (int64_t i = i0; i < i1; ++i) {
        if (i < groups) {
          norm_sq_group(i * 8, i + 1 < std::min(i1, groups) ? (i + 1) * 8 : -1,
                        partial.data() + i * 8);
          continue;
        }
        if (x.empty()) x.resize(scratch_len_), y.resize(scratch_len_), a.resize(a_.approx_len);
        const int64_t r = groups * 8 + (i - groups);
        partial[r] = row_norm_sq(r, x.data(), y.data(), a.data());
      }
    });
    double sum = 0;
    for (double p : partial) sum += p;
    return sum;
  }

  void update(Acc lim) const {
    const int64_t groups = this->groups();
    at::parallel_for(0, items(), item_grain(), [&](int64_t i0, int64_t i1) {
      std::vector<Acc> x, y, inv, even, odd, w;
      for (int64_t i = i0; i < i1; ++i) {
        if (i < groups) {
          update_group(i * 8, i + 1 < std::min(i1, groups) ? (i + 1) * 8 : -1, lim);
          continue;
        }
        if (x.empty()) {
          x.resize(scratch_len_), y.resize(scratch_len_), inv.resize(a_.approx_len);
          even.resize(scratch_len_), odd.resize(scratch_len_), w.resize(a_.coeff_len);
        }
        const int64_t r = groups * 8 + (i - groups);
        row_dwt(r, x.data(), y.data(), w.data());  // computed again: see kernels.h
        row_update(r, lim, x.data(), y.data(), inv.data(), even.data(), odd.data(), w.data());
      }
    });
  }

 private:
#ifdef GWT_WAVELET_ROWS8
  // float, bfloat16 or float16 parameters, gradients and moments, math in float.
  static constexpr bool k_rows8 = k_avx2_value_types<P, G, S> && std::is_same_v<Acc, float>;
  // Scratch of the eight-lane body, one per thread, reused across steps and tensors.
  rows8::Scratch& group_scratch() const {
    thread_local rows8::Scratch scratch;
    scratch.reserve(plan_, static_cast<int64_t>(scratch_len_));
    return scratch;
  }
#endif
  // Rows [r0, r0 + 8) through the eight-lane body; next: the first row of the group this thread
  // takes next (-1: none), whose rows the body prefetches while it computes.
  void norm_sq_group([[maybe_unused]] int64_t r0, [[maybe_unused]] int64_t next,
                     [[maybe_unused]] double* sums) const {
#ifdef GWT_WAVELET_ROWS8
    if constexpr (k_rows8) body8_->norm_sq(r0, next, group_scratch(), sums);
#endif
  }
  void update_group([[maybe_unused]] int64_t r0, [[maybe_unused]] int64_t next,
                    [[maybe_unused]] Acc lim) const {
#ifdef GWT_WAVELET_ROWS8
    if constexpr (k_rows8) body8_->update(r0, next, lim, group_scratch());
#endif
  }

  // One analysis level: coeff[o] = sum_k ext[2o + k + offset] * rec[k]. The interior, where no
  // tap leaves the row, runs tap by tap over all outputs (vectorisable); the edges use the mode.
  // Details = false: the approximations only (detail is not written; the norm pass needs none).
  template <bool Details = true, typename T>
  void dwt_level(const T* x, int64_t n, Acc* approx, Acc* detail) const {
    const int64_t len = dwt_coeff_len(n, taps_, a_.boundary);
    const int64_t offset = a_.boundary == BoundaryMode::periodization ? 1 - taps_ / 2 : 2 - taps_;
    // Interior outputs: 0 <= 2o + offset and 2o + offset + taps <= n.
    const int64_t first = std::min(len, std::max<int64_t>(0, (1 - offset) / 2));
    const int64_t span = n - taps_ - offset;  // < 0: no output has all its taps inside
    const int64_t last = span < 0 ? first : std::max(first, std::min(len, span / 2 + 1));
    auto edge = [&](int64_t o) {
      Acc unused;
      row::analyze(x, n, o, plan_, approx[o], Details ? detail[o] : unused);
    };
    for (int64_t o = 0; o < first; ++o) edge(o);
    with_taps(taps_, [&](auto taps) {
      dwt_interior<decltype(taps)::value, Details>(x, offset, first, last, approx, detail);
    });
    for (int64_t o = last; o < len; ++o) edge(o);
  }

  // Interior analysis outputs [first, last): each output's taps summed in registers (F > 0: the
  // tap loop unrolls and the compiler vectorises over outputs), tap order as in row::analyze.
  // x[2o + offset + k] for o >= first is never before x[0]. T: Acc, or the gradient's type at
  // level 1 when that is Acc's (read in place, no copy).
  template <int F, bool Details, typename T>
  void dwt_interior(const T* x, int64_t offset, int64_t first, int64_t last, Acc* approx,
                    Acc* detail) const {
    if constexpr (F > 0) {
      Acc lo_taps[F], hi_taps[F];
      for (int k = 0; k < F; ++k) lo_taps[k] = rec_lo_[k], hi_taps[k] = rec_hi_[k];
      for (int64_t o = first; o < last; ++o) {
        const T* window = x + (2 * o + offset);
        Acc lo = 0, hi = 0;
        for (int k = 0; k < F; ++k) {
          lo += lo_taps[k] * static_cast<Acc>(window[k]);
          if constexpr (Details) hi += hi_taps[k] * static_cast<Acc>(window[k]);
        }
        approx[o] = lo;
        if constexpr (Details) detail[o] = hi;
      }
    } else {
      for (int64_t o = first; o < last; ++o) {
        approx[o] = 0;
        if constexpr (Details) detail[o] = 0;
      }
      for (int64_t k = 0; k < taps_; ++k) {
        const Acc lo = rec_lo_[k], hi = rec_hi_[k];
        for (int64_t o = first; o < last; ++o) {
          approx[o] += lo * static_cast<Acc>(x[2 * o + offset + k]);
          if constexpr (Details) detail[o] += hi * static_cast<Acc>(x[2 * o + offset + k]);
        }
      }
    }
  }

  // One synthesis level from len coefficients each: output pairs m in [0, count) (count <=
  // row::synthesis_pairs) go to sink(m, out[2m], out[2m + 1]).
  // out[2m + e] = sum_q dec_lo[j] a[m + q] + dec_hi[j] d[m + q],  j = phase + 2q - e in [0, F);
  // zero/symmetric: q in [0, F/2), m in [0, len - F/2]; periodization: indices mod len.
  template <typename Sink>
  void idwt_level(const Acc* approx, const Acc* detail, int64_t len, int64_t count,
                  Sink&& sink) const {
    const bool periodic = a_.boundary == BoundaryMode::periodization;
    const int64_t q_lo = periodic ? -((taps_ / 2 + 1) / 2) : 0;
    const int64_t q_hi = periodic ? (taps_ / 2 + 1) / 2 : taps_ / 2 - 1;
    // Interior m: every index m + q inside [0, len) (always, outside periodization).
    const int64_t first = periodic ? std::min(count, std::max<int64_t>(0, -q_lo)) : 0;
    const int64_t last = periodic ? std::max(first, std::min(count, len - q_hi)) : count;
    auto edge = [&](int64_t m) {
      Acc even, odd;
      row::synthesize(approx, detail, len, m, plan_, even, odd);
      sink(m, even, odd);
    };
    for (int64_t m = 0; m < first; ++m) edge(m);
    with_taps(taps_, [&](auto taps) {
      constexpr int F = decltype(taps)::value;
      if constexpr (F > 0) {
        if (periodic)
          idwt_interior<F, true>(approx, detail, first, last, sink);
        else
          idwt_interior<F, false>(approx, detail, first, last, sink);
      } else {
        for (int64_t m = first; m < last; ++m) edge(m);
      }
    });
    for (int64_t m = last; m < count; ++m) edge(m);
  }

  // Interior synthesis pairs [first, last) for a filter of F taps: both outputs of a pair summed
  // in registers over q in ascending order, as row::synthesize does.
  template <int F, bool Periodic, typename Sink>
  void idwt_interior(const Acc* approx, const Acc* detail, int64_t first, int64_t last,
                     Sink& sink) const {
    constexpr int phase = Periodic ? F / 2 : 1;
    constexpr int q_lo = Periodic ? -((F / 2 + 1) / 2) : 0;
    constexpr int q_hi = Periodic ? (F / 2 + 1) / 2 : F / 2 - 1;
    Acc lo[F], hi[F];
    for (int k = 0; k < F; ++k) lo[k] = dec_lo_[k], hi[k] = dec_hi_[k];
    for (int64_t m = first; m < last; ++m) {
      Acc even = 0, odd = 0;
      for (int q = q_lo; q <= q_hi; ++q) {
        const Acc a = approx[m + q], d = detail[m + q];
        const int je = phase + 2 * q, jo = phase + 2 * q - 1;
        if (je >= 0 && je < F) even += lo[je] * a + hi[je] * d;
        if (jo >= 0 && jo < F) odd += lo[jo] * a + hi[jo] * d;
      }
      sink(m, even, odd);
    }
  }

  // The DWT cascade of row r's gradient into w ([A_L | D_L | ... | D_1]); Details = false: only
  // the approximations, A_L into w[0, approx_len) (the norm pass). Scratch rows x, y. A float
  // gradient of a float kernel is read in place at level 1; other types are converted into x first.
  template <bool Details = true>
  void row_dwt(int64_t r, Acc* x, Acc* y, Acc* w) const {
    const G* g = static_cast<const G*>(a_.grad) + r * a_.n;
    Acc* first_approx = a_.level == 1 ? w : y;
    if constexpr (std::is_same_v<G, Acc>) {
      dwt_level<Details>(g, a_.n, first_approx, w + detail_offset_[1]);
    } else {
      for (int64_t i = 0; i < a_.n; ++i) x[i] = static_cast<Acc>(g[i]);
      dwt_level<Details>(x, a_.n, first_approx, w + detail_offset_[1]);
    }
    Acc* in = y;
    Acc* out = x;
    for (int64_t l = 2; l <= a_.level; ++l) {
      Acc* approx = l == a_.level ? w : out;
      dwt_level<Details>(in, lengths_[l - 1], approx, w + detail_offset_[l]);
      std::swap(in, out);  // this level's approximation is the next one's input
    }
  }

  // Norm pass of a row: the approximations of the DWT cascade (a: approx_len values), then sum
  // (m' / (sqrt(v') + eps))^2.
  double row_norm_sq(int64_t r, Acc* x, Acc* y, Acc* a) const {
    row_dwt<false>(r, x, y, a);
    const Acc* w = a;
    const S* m = static_cast<const S*>(a_.exp_avg) + r * a_.approx_len;
    const S* v = static_cast<const S*>(a_.exp_avg_sq) + r * a_.approx_len;
    const Acc eps = static_cast<Acc>(a_.eps);
    Acc sum = 0;  // in lanes (a fixed order for a given build, whatever the thread count)
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < a_.approx_len; ++j) {
      const NewMoments<S, Acc> mv(a_, m[j], v[j], w[j]);
      const Acc normalized = mv.m / (std::sqrt(mv.v) + eps);
      sum += normalized * normalized;
    }
    return static_cast<double>(sum);
  }

  // Update pass of a row: moments stored, coefficients normalised in place, IDWT, p updated.
  // inv, even, odd: scratch (approx_len and scratch_len_ values).
  void row_update(int64_t r, Acc lim, Acc* x, Acc* y, Acc* inv, Acc* even, Acc* odd, Acc* w) const {
    S* m = static_cast<S*>(a_.exp_avg) + r * a_.approx_len;
    S* v = static_cast<S*>(a_.exp_avg_sq) + r * a_.approx_len;
    const Acc eps = static_cast<Acc>(a_.eps);
    for (int64_t j = 0; j < a_.approx_len; ++j) {
      const NewMoments<S, Acc> mv(a_, m[j], v[j], w[j]);
      m[j] = static_cast<S>(mv.m);
      v[j] = static_cast<S>(mv.v);
      const Acc den = (std::sqrt(mv.v) + eps) * lim;
      w[j] = mv.m / den;
      inv[j] = Acc(1) / den;
    }
    // Details thresholded first when asked (PyWavelets' rules: soft x * max(1 - t / |x|, 0) with
    // 0 kept 0, hard 0 where |x| < t), then normalised: detail i at level l shares the denominator
    // of coefficient i >> (L - l), and is multiplied by its reciprocal (one division per
    // approximation coefficient instead of one per coefficient; within an ulp of the reference's
    // quotient). The reciprocals are spread level by level (each covers 2 finer details, as
    // repeat_interleave in the reference) into the even/odd scratch rows, so that every loop runs
    // over contiguous arrays.
    const Acc t = static_cast<Acc>(a_.threshold);
    int64_t kept = 0;
    const Acc* level_inv = inv;
    for (int64_t l = a_.level; l >= 1; --l) {
      Acc* d = w + detail_offset_[l];
      const int64_t len = lengths_[l];
      if (a_.threshold > 0) {
        for (int64_t i = 0; i < len; ++i) {
          d[i] = row::threshold_value(d[i], t, a_.threshold_soft);
          kept += d[i] != 0;
        }
      }
      for (int64_t i = 0; i < len; ++i) d[i] *= level_inv[i];
      if (l > 1) {  // lengths_[l - 1] <= 2 * len
        Acc* finer = level_inv == even ? odd : even;
        for (int64_t i = 0; i < len; ++i) finer[2 * i] = finer[2 * i + 1] = level_inv[i];
        level_inv = finer;
      }
    }
    if (a_.kept_per_row != nullptr) a_.kept_per_row[r] = kept;
    // IDWT cascade, coarsest first, dropping a trailing sample when one longer than the detail;
    // each level writes into the scratch row the previous one did not. The last level's samples
    // update p as they come: p <- x + keep x with x = p - step_size * sample.
    const Acc* approx = w;
    int64_t len = a_.approx_len;
    for (int64_t l = a_.level; l >= 2; --l) {
      const int64_t detail_len = lengths_[l];
      if (len == detail_len + 1) len = detail_len;
      TORCH_INTERNAL_ASSERT(len == detail_len);
      const int64_t pairs = row::synthesis_pairs(len, static_cast<int>(taps_), a_.boundary);
      Acc* out = x;
      idwt_level(approx, w + detail_offset_[l], len, pairs, [out](int64_t i, Acc e, Acc o) {
        out[2 * i] = e;
        out[2 * i + 1] = o;
      });
      len = 2 * pairs;
      approx = x;
      std::swap(x, y);
    }
    if (len == lengths_[1] + 1) len = lengths_[1];
    TORCH_INTERNAL_ASSERT(len == lengths_[1]);
    TORCH_INTERNAL_ASSERT(2 * row::synthesis_pairs(len, static_cast<int>(taps_), a_.boundary) >=
                          a_.n);
    P* p = static_cast<P*>(a_.param) + r * a_.n;
    const Acc step = static_cast<Acc>(a_.step_size), keep = static_cast<Acc>(-a_.decay);
    auto updated = [step, keep](P old, Acc sample) {
      Acc value = static_cast<Acc>(old) - step * sample;
      return static_cast<P>(value + keep * value);
    };
    const Acc* detail = w + detail_offset_[1];
    idwt_level(approx, detail, len, a_.n / 2, [p, &updated](int64_t i, Acc e, Acc o) {
      p[2 * i] = updated(p[2 * i], e);
      p[2 * i + 1] = updated(p[2 * i + 1], o);
    });
    if (a_.n % 2 == 1) {  // the last pair's even sample is p's last value
      Acc e, o;
      row::synthesize(approx, detail, len, a_.n / 2, plan_, e, o);
      p[a_.n - 1] = updated(p[a_.n - 1], e);
    }
  }

  const WaveletAdamArgs& a_;
  row::RowPlan<Acc> plan_;
  int64_t taps_;
  std::vector<Acc> dec_lo_, dec_hi_, rec_lo_, rec_hi_;
  std::vector<int64_t> lengths_;        // lengths_[l]: coefficients per subband at level l
  std::vector<int64_t> detail_offset_;  // where D_l starts in a workspace row
  size_t scratch_len_;
#ifdef GWT_WAVELET_ROWS8
  std::optional<rows8::Rows8<P, G, S>> body8_;  // the eight-lane body, where groups() > 0
#endif
};

// Calls fn(kernel) with the GeneralAdam instance for the argument's types.
template <typename Fn>
auto with_kernel(const WaveletAdamArgs& args, Fn&& fn) {
  TORCH_INTERNAL_ASSERT(args.level >= 1 && args.n >= 1 && args.filter_length >= 2 &&
                        args.filter_length % 2 == 0);
  TORCH_INTERNAL_ASSERT(!args.grad_f32 || args.param_kind == ScalarKind::f16 ||
                        args.param_kind == ScalarKind::bf16);
  return with_grad_types(args, [&](auto types) {
    using T = decltype(types);
    return fn(GeneralAdam<typename T::param_t, typename T::grad_t, typename T::state_t,
                          typename T::acc_t>(args));
  });
}

inline double wavelet_adam_norm_sq(const WaveletAdamArgs& args) {
  return with_kernel(args, [](const auto& kernel) { return kernel.norm_sq(); });
}

inline void wavelet_adam_update(const WaveletAdamArgs& args, double lim) {
  with_kernel(args, [lim](const auto& kernel) {
    using Acc = typename std::decay_t<decltype(kernel)>::acc_t;
    kernel.update(static_cast<Acc>(lim));
  });
}

}  // namespace
}  // namespace GWT_KERNEL_NS
}  // namespace kernels
}  // namespace gwt
