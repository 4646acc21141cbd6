// Body of the fused FoamAdam pass on the CPU (src/kernels/kernels.h, FoamAdamArgs, for the rule).
//
// Included by foam_adam_cpu.cpp (baseline ISA) and foam_adam_cpu_avx2.cpp (AVX2 and FMA,
// avx2_target.h), each with its own GWT_KERNEL_NS. The unit of work is a group of 8 consecutive
// blocks of one row; the AVX2 build takes a group whose 8 blocks are whole with the register loops
// of foam_simd_avx2.h (levels 1 to 3, float math), every other group the plain loops here. Which
// loop a group takes depends on its place in the row alone, and blocks never share a sum, so the
// result does not depend on the number of threads.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/kernels.h"
#include "kernels/shared/dispatch.h"

#if defined(GWT_AVX2_BODY)
#include "kernels/avx2/foam_simd_avx2.h"
#endif

#ifndef GWT_KERNEL_NS
#error "define GWT_KERNEL_NS before including foam_adam_cpu_impl.h"
#endif

namespace gwt {
namespace kernels {
namespace GWT_KERNEL_NS {
namespace foam {

constexpr int64_t k_group = 8;             // blocks per unit of work
constexpr int64_t k_grain_values = 32768;  // values per thread chunk, at least (as ATen's grain)

// The step's scalars in the math type.
template <typename Acc>
struct Consts {
  Acc b1, c1, b2, c2, eps, scale, rho, rho2, step, keep, inv_block;
  bool apply_decay;
  explicit Consts(const FoamAdamArgs& a)
      : b1(static_cast<Acc>(a.beta1)),
        c1(static_cast<Acc>(1 - a.beta1)),
        b2(static_cast<Acc>(a.beta2)),
        c2(static_cast<Acc>(1 - a.beta2)),
        eps(static_cast<Acc>(a.eps)),
        scale(static_cast<Acc>(a.scale)),
        rho(static_cast<Acc>(a.res_scale)),
        rho2(static_cast<Acc>(a.res_scale * a.res_scale)),
        step(static_cast<Acc>(-a.step_size)),
        keep(static_cast<Acc>(-a.decay)),
        // 2^-level, exact: dividing a sum by 2^level and multiplying it by this round alike.
        inv_block(static_cast<Acc>(std::ldexp(1.0, -static_cast<int>(a.level)))),
        apply_decay(a.apply_decay) {}
};

// P: parameter type, G: gradient type (P, or float for a float16/bfloat16 parameter), S: moment
// type, Acc: math type, B: block size 2^level (0: runtime).
template <typename P, typename G, typename S, typename Acc, int B>
class FoamAdam {
 public:
#if defined(GWT_AVX2_BODY)
  static constexpr bool k_simd =
      k_avx2_value_types<P, G, S> && std::is_same_v<Acc, float> && (B == 2 || B == 4 || B == 8);
#else
  static constexpr bool k_simd = false;
#endif

  explicit FoamAdam(const FoamAdamArgs& args)
      : a_(args),
        c_(args),
        block_(B > 0 ? B : int64_t{1} << args.level),
        groups_per_row_((args.approx_len + k_group - 1) / k_group) {}

  void update() const {
    const int64_t units = a_.rows * groups_per_row_;
    const int64_t grain = std::max<int64_t>(1, k_grain_values / (k_group * block_));
    at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
      // Unit u is group u % groups_per_row_ of row u / groups_per_row_ (one division per chunk,
      // not one per group).
      int64_t row = u0 / groups_per_row_, k = u0 % groups_per_row_;
#if defined(GWT_AVX2_BODY)
      if constexpr (k_simd) {
        const foam_simd::Regs regs(c_);
        for (int64_t u = u0; u < u1; ++u) {
          if (!simd_group(row, k, regs)) group(row, k);
          if (++k == groups_per_row_) k = 0, ++row;
        }
        return;
      }
#endif
      for (int64_t u = u0; u < u1; ++u) {
        group(row, k);
        if (++k == groups_per_row_) k = 0, ++row;
      }
    });
  }

 private:
  template <typename T>
  T* row_of(void* base, int64_t row, int64_t len) const {
    return static_cast<T*>(base) + row * len;
  }

#if defined(GWT_AVX2_BODY)
  // Group k of row `row` in the register loops, if its 8 blocks are whole; false: not taken.
  bool simd_group(int64_t row, int64_t k, const foam_simd::Regs& regs) const {
    if constexpr (k_simd) {
      const int64_t first = k * k_group;
      if (first + k_group > a_.approx_len || (first + k_group) * B > a_.n) return false;
      foam_simd::update8<B>(regs, static_cast<const G*>(a_.grad) + row * a_.n + first * B,
                            row_of<P>(a_.param, row, a_.n) + first * B,
                            row_of<S>(a_.exp_avg, row, a_.approx_len) + first,
                            row_of<S>(a_.exp_avg_sq, row, a_.approx_len) + first);
      return true;
    }
    return false;
  }
#endif

  // Blocks [8 k, 8 k + 8) of row `row` (fewer at the row's end), in the plain loops.
  void group(int64_t row, int64_t k) const {
    const int64_t first = k * k_group;
    const int64_t last = std::min(first + k_group, a_.approx_len);
    const G* g = static_cast<const G*>(a_.grad) + row * a_.n;
    P* p = row_of<P>(a_.param, row, a_.n);
    S* m = row_of<S>(a_.exp_avg, row, a_.approx_len);
    S* v = row_of<S>(a_.exp_avg_sq, row, a_.approx_len);
    for (int64_t j = first; j < last; ++j) {
      const int64_t begin = j * block_;
      block(g + begin, p + begin, std::min(block_, a_.n - begin), m + j, v + j);
    }
  }

  // One block of `count` values (2^level, or fewer for a row's last).
  void block(const G* g, P* p, int64_t count, S* m, S* v) const {
    const Consts<Acc>& c = c_;
    Acc sum = 0, sum_sq = 0;
    for (int64_t q = 0; q < count; ++q) {
      const Acc x = static_cast<Acc>(g[q]);
      sum += x;
      sum_sq += x * x;
    }
    const Acc a = sum * c.inv_block, s = sum_sq * c.inv_block;
    // The moments as stored, read back: what the next step reads is what this one used.
    *m = static_cast<S>(c.b1 * static_cast<Acc>(*m) + c.c1 * a);
    *v = static_cast<S>(c.b2 * static_cast<Acc>(*v) + c.c2 * s);
    const Acc m_new = static_cast<Acc>(*m), v_new = static_cast<Acc>(*v);
    for (int64_t q = 0; q < count; ++q) {
      const Acc r = static_cast<Acc>(g[q]) - a;
      const Acc first = m_new + c.rho * r;
      const Acc second = v_new + c.rho2 * (r * r);
      const Acc u = (first * c.scale) / (std::sqrt(second) + c.eps);
      Acc x = static_cast<Acc>(p[q]) + c.step * u;
      if (c.apply_decay) x = x + c.keep * x;
      p[q] = static_cast<P>(x);
    }
  }

  const FoamAdamArgs& a_;
  Consts<Acc> c_;
  int64_t block_;
  int64_t groups_per_row_;
};

template <typename P, typename G, typename S, typename Acc>
void update_at_level(const FoamAdamArgs& args) {
  switch (args.level) {
    case 1:
      return FoamAdam<P, G, S, Acc, 2>(args).update();
    case 2:
      return FoamAdam<P, G, S, Acc, 4>(args).update();
    case 3:
      return FoamAdam<P, G, S, Acc, 8>(args).update();
    default:
      return FoamAdam<P, G, S, Acc, 0>(args).update();
  }
}

}  // namespace foam

inline void foam_adam_update(const FoamAdamArgs& args) {
  with_kinds(args.param_kind, args.state_kind, args.math_f64, [&](auto types) {
    using T = decltype(types);
    using P = typename T::param_t;
    using S = typename T::state_t;
    using Acc = typename T::acc_t;
    if constexpr (std::is_same_v<P, c10::Half> || std::is_same_v<P, c10::BFloat16>) {
      if (args.grad_f32) return foam::update_at_level<P, float, S, Acc>(args);
    }
    foam::update_at_level<P, P, S, Acc>(args);
  });
}

}  // namespace GWT_KERNEL_NS
}  // namespace kernels
}  // namespace gwt
