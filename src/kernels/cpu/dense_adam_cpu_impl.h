// Body of the dense Adam loop on the CPU (src/kernels/kernels.h, DenseAdamArgs, for the rule).
//
// Included after haar_adam_cpu_impl.h by haar_adam_cpu.cpp (baseline ISA) and
// haar_adam_cpu_avx2.cpp (AVX2 and FMA, avx2_target.h), each with its own GWT_KERNEL_NS. The AVX2
// build steps 8 floats (4 doubles) per register; its products are kept out of fused multiply-adds (GCC contracts
// a multiply and an add of intrinsics as it does scalar ones), so both builds round every
// operation alike and give the same bits. The last n % 8 values go through the same register
// code from a padded copy.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/kernels.h"

#if defined(GWT_AVX2_BODY)
#include <immintrin.h>
#endif

#ifndef GWT_KERNEL_NS
#error "define GWT_KERNEL_NS before including dense_adam_cpu_impl.h"
#endif

namespace gwt {
namespace kernels {
namespace GWT_KERNEL_NS {
namespace dense {

constexpr int64_t k_grain = 32768;  // values per thread chunk (fewer: on the calling thread alone)

template <typename T>
struct Consts {
  T beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step, decay;
  bool apply_decay;
  explicit Consts(const DenseAdamArgs& a)
      : beta1(static_cast<T>(a.beta1)),
        beta2(static_cast<T>(a.beta2)),
        one_minus_beta1(static_cast<T>(1 - a.beta1)),
        one_minus_beta2(static_cast<T>(1 - a.beta2)),
        eps(static_cast<T>(a.eps)),
        step(static_cast<T>(-a.step_size)),
        decay(static_cast<T>(-a.decay)),
        apply_decay(a.apply_decay) {}
};

#if defined(GWT_AVX2_BODY)
// A register's worth of T and the operations the loop needs.
template <typename T>
struct Reg;
template <>
struct Reg<float> {
  using V = __m256;
  static constexpr int64_t lanes = 8;
  static V load(const float* x) { return _mm256_loadu_ps(x); }
  static void store(float* x, V v) { _mm256_storeu_ps(x, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }
};
template <>
struct Reg<double> {
  using V = __m256d;
  static constexpr int64_t lanes = 4;
  static V load(const double* x) { return _mm256_loadu_pd(x); }
  static void store(double* x, V v) { _mm256_storeu_pd(x, v); }
  static V set1(double x) { return _mm256_set1_pd(x); }
  static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
  static V div(V a, V b) { return _mm256_div_pd(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_pd(a); }
};

// The product as a rounded value in a register: the empty asm hides where it came from, so the
// add that follows cannot be fused with the multiply.
template <typename V>
inline V rounded(V x) {
  __asm__("" : "+x"(x));
  return x;
}

template <typename T>
void update_range(T* p, const T* g, T* m, T* v, int64_t begin, int64_t end, const Consts<T>& c) {
  using R = Reg<T>;
  using V = typename R::V;
  const V b1 = R::set1(c.beta1), b2 = R::set1(c.beta2), c1 = R::set1(c.one_minus_beta1),
          c2 = R::set1(c.one_minus_beta2), eps = R::set1(c.eps), step = R::set1(c.step),
          decay = R::set1(c.decay);
  const bool apply_decay = c.apply_decay;
  auto lanes = [&](T* pp, const T* gg, T* mm, T* vv) {
    const V gi = R::load(gg);
    const V mi = R::add(rounded(R::mul(R::load(mm), b1)), rounded(R::mul(c1, gi)));
    const V vi = R::add(rounded(R::mul(R::load(vv), b2)), rounded(R::mul(R::mul(c2, gi), gi)));
    R::store(mm, mi), R::store(vv, vi);
    V pi = R::add(R::load(pp), R::div(R::mul(step, mi), R::add(R::sqrt(vi), eps)));
    if (apply_decay) pi = R::add(pi, rounded(R::mul(decay, pi)));
    R::store(pp, pi);
  };
  int64_t i = begin;
  for (; i + R::lanes <= end; i += R::lanes) lanes(p + i, g + i, m + i, v + i);
  if (i == end) return;
  // The tail through the same code: zeros around it (denominator eps, nothing stored back).
  T tp[R::lanes] = {}, tg[R::lanes] = {}, tm[R::lanes] = {}, tv[R::lanes] = {};
  const int64_t k = end - i;
  std::copy(p + i, p + end, tp), std::copy(g + i, g + end, tg);
  std::copy(m + i, m + end, tm), std::copy(v + i, v + end, tv);
  lanes(tp, tg, tm, tv);
  std::copy(tp, tp + k, p + i), std::copy(tm, tm + k, m + i), std::copy(tv, tv + k, v + i);
}
#else
// The baseline build: plain operations (an x86-64 baseline has no fused multiply-add to contract
// into).
template <typename T>
void update_range(T* p, const T* g, T* m, T* v, int64_t begin, int64_t end, const Consts<T>& c) {
  for (int64_t i = begin; i < end; ++i) {
    const T gi = g[i];
    const T mi = m[i] * c.beta1 + c.one_minus_beta1 * gi;
    const T vi = v[i] * c.beta2 + c.one_minus_beta2 * gi * gi;
    m[i] = mi, v[i] = vi;
    T pi = p[i] + c.step * mi / (std::sqrt(vi) + c.eps);
    if (c.apply_decay) pi = pi + c.decay * pi;
    p[i] = pi;
  }
}
#endif

template <typename T>
void update(const DenseAdamArgs& a) {
  const Consts<T> c(a);
  T* p = static_cast<T*>(a.param);
  const T* g = static_cast<const T*>(a.grad);
  T* m = static_cast<T*>(a.exp_avg);
  T* v = static_cast<T*>(a.exp_avg_sq);
  at::parallel_for(0, a.n, k_grain,
                   [&](int64_t begin, int64_t end) { update_range(p, g, m, v, begin, end, c); });
}

}  // namespace dense

inline void dense_adam_update(const DenseAdamArgs& args) {
  if (args.f64)
    dense::update<double>(args);
  else
    dense::update<float>(args);
}

}  // namespace GWT_KERNEL_NS
}  // namespace kernels
}  // namespace gwt
