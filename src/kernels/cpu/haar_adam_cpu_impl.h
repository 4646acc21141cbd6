// Body of the fused Haar WaveletAdam passes on the CPU (see src/kernels/kernels.h for the rule).
//
// Included by haar_adam_cpu.cpp (baseline ISA) and haar_adam_cpu_avx2.cpp (AVX2 and FMA), each
// with its own GWT_KERNEL_NS so the two instantiations never share a symbol; the entry points pick
// one at run time. The loops are written so the compiler vectorises them: a tile of one row at a
// time, block sums, then per-coefficient math, then per-element updates.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/avx2/haar_simd_avx2.h"
#include "kernels/kernels.h"
#include "kernels/shared/dispatch.h"

#ifndef GWT_KERNEL_NS
#error "define GWT_KERNEL_NS before including haar_adam_cpu_impl.h"
#endif

namespace gwt {
namespace kernels {
namespace GWT_KERNEL_NS {

// Approximation coefficients per tile: tiles are the unit of work and of the norm's reduction,
// fixed by the shape alone so that the summation order never depends on the number of threads.
constexpr int64_t k_tile = 512;
// 2-D transform: a tile spans the whole width of its block row where that keeps it within
// k_tile_2d_elements values (and k_tile_max coefficients), so that a tile's rows, which lie one
// after another in memory, are read as one stream (tiles that split a row jump between its rows).
constexpr int64_t k_tile_max = 2048;
constexpr int64_t k_tile_2d_elements = 32768;
constexpr int64_t k_parallel_grain = 32768;  // elements per thread chunk, at least

// P: parameter type, G: gradient type (P, or float for a float16/bfloat16 parameter), S: moment
// type, Acc: math type, B: block size 2^level (0: runtime).
template <typename P, typename G, typename S, typename Acc, int B>
class HaarAdam {
 public:
  using acc_t = Acc;
#ifdef GWT_HAAR_SIMD
  // float, bfloat16 or float16 parameters, gradients and moments, math in float, at level 1..3
  // take the AVX2 loops (haar_simd_avx2.h).
  static constexpr bool k_simd =
      k_avx2_value_types<P, G, S> && std::is_same_v<Acc, float> && (B == 2 || B == 4 || B == 8);
#else
  static constexpr bool k_simd = false;
#endif

  explicit HaarAdam(const HaarAdamArgs& args)
      : a_(args),
        block_(B > 0 ? B : int64_t{1} << args.level),
        // The orthonormal Haar approximation: 2^(-1/2) per level along each transformed axis.
        approx_scale_(static_cast<Acc>(approx_scale_of(args.two_d, args.level))),
        block_rows_(args.two_d ? (args.height + block_ - 1) / block_ : 1),
        state_rows_(args.two_d ? args.rows / args.height * block_rows_ : args.rows),
        tile_len_(tile_length(args, block_)),
        tiles_per_row_((args.approx_len + tile_len_ - 1) / tile_len_),
        // Threads only for work that pays for a parallel region (a few microseconds each): about
        // 32K elements per chunk, as ATen's own grain. Results do not depend on it (fixed tiles).
        grain_(std::max<int64_t>(
            1, k_parallel_grain /
                   std::max<int64_t>(1, args.rows * args.n /
                                            std::max<int64_t>(1, state_rows_ * tiles_per_row_)))) {}

  // std::pow(2, -level / 2) (1-D) or std::pow(2, -level) (2-D), for the levels the entry points
  // admit (1..30, check() in haar_adam_cpu.cpp). A tensor's step builds this class twice (norm and
  // update pass), so the powers are computed once.
  static double approx_scale_of(bool two_d, int64_t level) {
    static const auto table = [] {
      std::array<std::array<double, 31>, 2> t{};
      for (int d = 0; d < 2; ++d)
        for (int l = 0; l <= 30; ++l) t[d][l] = std::pow(2.0, (d == 1 ? -1.0 : -0.5) * l);
      return t;
    }();
    TORCH_INTERNAL_ASSERT(level >= 0 && level <= 30);
    return table[two_d ? 1 : 0][level];
  }

  // Norm pass over all tiles: fixed tiles, summed in order.
  double norm_sq() const {
    const int64_t tiles = state_rows_ * tiles_per_row_;
    std::vector<double> partial(static_cast<size_t>(tiles), 0.0);
    at::parallel_for(0, tiles, grain_, [&](int64_t t0, int64_t t1) {
      Acc approx[k_tile_max];
      for (int64_t t = t0; t < t1; ++t) partial[t] = tile_norm_sq(t, approx);
    });
    double sum = 0;
    for (double p : partial) sum += p;
    return sum;
  }

  void update(Acc lim) const {
    const int64_t tiles = state_rows_ * tiles_per_row_;
    at::parallel_for(0, tiles, grain_, [&](int64_t t0, int64_t t1) {
      Acc approx[k_tile_max];
      for (int64_t t = t0; t < t1; ++t) tile_update(t, lim, approx, t + 1 < t1 ? t + 1 : -1);
    });
  }

 private:
  struct Tile {
    int64_t row, first, count;    // approximation coefficients [first, first + count) of state row
    int64_t element_row, height;  // the rows of p and g its blocks span: [element_row, + height)
  };
  Tile tile(int64_t t) const {
    const int64_t row = t / tiles_per_row_;
    const int64_t first = (t % tiles_per_row_) * tile_len_;
    Tile tl{row, first, std::min(tile_len_, a_.approx_len - first), row, 1};
    if (a_.two_d) {  // state row = (matrix, block row); its blocks span up to 2^level rows
      const int64_t top = (row % block_rows_) * block_;
      tl.element_row = row / block_rows_ * a_.height + top;
      tl.height = std::min(block_, a_.height - top);
    }
    return tl;
  }

  // Blocks of the tile that lie wholly inside the row (all but the row's last, partial block).
  int64_t full_blocks(const Tile& tl) const {
    return (tl.first + tl.count) * block_ > a_.n ? tl.count - 1 : tl.count;
  }

  // Coefficients [0, simd_count) of a tile take the vector loops, the rest the plain ones.
  int64_t simd_count(const Tile& tl) const {
    if constexpr (k_simd) return full_blocks(tl) / 8 * 8;
    return 0;
  }

  // approx[j] = (sum of block first + j) * 2^(-L/2) for j in [from, count), zeros past n
  // (PyWavelets' zero mode).
  void block_sums(const Tile& tl, int64_t from, Acc* approx) const {
    const G* g = static_cast<const G*>(a_.grad) + tl.element_row * a_.n;
    const int64_t bs = block_;
    const int64_t full = full_blocks(tl);
    for (int64_t j = from; j < full; ++j) {
      Acc sum = 0;
      for (int64_t r = 0; r < tl.height; ++r) {
        const G* src = g + r * a_.n + (tl.first + j) * bs;
        for (int64_t q = 0; q < (B > 0 ? B : bs); ++q) sum += static_cast<Acc>(src[q]);
      }
      approx[j] = sum * approx_scale_;
    }
    if (full < tl.count) {
      Acc sum = 0;
      for (int64_t r = 0; r < tl.height; ++r)
        for (int64_t i = (tl.first + full) * bs; i < a_.n; ++i)
          sum += static_cast<Acc>(g[r * a_.n + i]);
      approx[full] = sum * approx_scale_;
    }
  }

#ifdef GWT_HAAR_SIMD
  // The tile's part of HaarAdamArgs::carry (coefficients from the tile's first), or none.
  simd::Carry carry_of(const Tile& tl) const {
    simd::Carry c;
    if (a_.carry == nullptr) return c;
    const int64_t at = tl.row * a_.approx_len + tl.first;
    c.approx = a_.carry + at;
    c.denom = a_.carry + state_rows_ * a_.approx_len + at;
    return c;
  }

  simd::StepConstants simd_constants() const {
    return simd::StepConstants(static_cast<float>(a_.beta1), static_cast<float>(1 - a_.beta1),
                               static_cast<float>(a_.beta2), static_cast<float>(1 - a_.beta2),
                               static_cast<float>(a_.eps), static_cast<float>(approx_scale_));
  }
#endif

  // Norm pass of one tile: sum of (m' / (sqrt(v') + eps))^2. Reads only.
  double tile_norm_sq(int64_t t, Acc* approx) const {
    const Tile tl = tile(t);
    const int64_t from = simd_count(tl);
    block_sums(tl, from, approx);
    const S* m = static_cast<const S*>(a_.exp_avg) + tl.row * a_.approx_len + tl.first;
    const S* v = static_cast<const S*>(a_.exp_avg_sq) + tl.row * a_.approx_len + tl.first;
    const Acc eps = static_cast<Acc>(a_.eps);
    Acc sum = 0;
#ifdef GWT_HAAR_SIMD
    if constexpr (k_simd) {
      if (from > 0) {
        const G* g = static_cast<const G*>(a_.grad) + tl.element_row * a_.n + tl.first * B;
        sum = tl.height == 1 ? simd::norm_sq<B>(simd_constants(), g, m, v, from, carry_of(tl))
                             : simd::norm_sq_by_rows<B>(simd_constants(), g, a_.n, tl.height, m, v,
                                                        from, approx, carry_of(tl));
      }
    }
#endif
    for (int64_t j = from; j < tl.count; ++j) {
      const NewMoments<S, Acc> mv(a_, m[j], v[j], approx[j]);
      const Acc normalized = mv.m / (std::sqrt(mv.v) + eps);
      sum += normalized * normalized;
    }
    return static_cast<double>(sum);
  }

  // Update pass of one tile: m, v <- m', v';
  // p -= step_size * (g + (m' - A) 2^(-L/2)) / ((sqrt(v') + eps) lim);  p -= decay * p.
  // `next`: the tile this thread updates after this one (-1: none), whose gradient the 2-D body
  // prefetches.
  void tile_update(int64_t t, Acc lim, Acc* approx, [[maybe_unused]] int64_t next) const {
    const Tile tl = tile(t);
    const int64_t from = simd_count(tl);
    block_sums(tl, from, approx);
    S* m = static_cast<S*>(a_.exp_avg) + tl.row * a_.approx_len + tl.first;
    S* v = static_cast<S*>(a_.exp_avg_sq) + tl.row * a_.approx_len + tl.first;
    const Acc eps = static_cast<Acc>(a_.eps), step = static_cast<Acc>(a_.step_size);
    const G* g = static_cast<const G*>(a_.grad) + tl.element_row * a_.n + tl.first * block_;
    P* p = static_cast<P*>(a_.param) + tl.element_row * a_.n + tl.first * block_;
    const Acc keep = static_cast<Acc>(-a_.decay);
#ifdef GWT_HAAR_SIMD
    if constexpr (k_simd) {
      if (from > 0 && tl.height == 1) {
        simd::update<B>(simd_constants(), g, p, m, v, from, step, lim, keep, carry_of(tl));
      } else if (from > 0) {
        Acc factor[k_tile_max];
        simd::NextRows<G> next_rows;
        if (next >= 0) {
          const Tile nt = tile(next);
          next_rows.g = static_cast<const G*>(a_.grad) + nt.element_row * a_.n + nt.first * block_;
          next_rows.height = nt.height;
          next_rows.elements = std::min(nt.count * block_, a_.n - nt.first * block_);
        }
        simd::update_by_rows<B>(simd_constants(), g, p, a_.n, tl.height, m, v, from, step, lim,
                                keep, approx, factor, next_rows, carry_of(tl));
      }
    }
#endif
    // approx[j] becomes the block's shift, factor[j] its step / denominator.
    Acc factor[k_tile_max];
    for (int64_t j = from; j < tl.count; ++j) {
      const NewMoments<S, Acc> mv(a_, m[j], v[j], approx[j]);
      m[j] = static_cast<S>(mv.m);
      v[j] = static_cast<S>(mv.v);
      factor[j] = step / ((std::sqrt(mv.v) + eps) * lim);
      approx[j] = (mv.m - approx[j]) * approx_scale_;
    }
    const int64_t bs = block_;
    const int64_t elements = std::min(tl.count * bs, a_.n - tl.first * bs);
    for (int64_t r = 0; r < tl.height; ++r) {
      const G* g_row = g + r * a_.n;
      P* p_row = p + r * a_.n;
      if (elements == tl.count * bs) {
        for (int64_t j = from; j < tl.count; ++j) {
          const Acc f = factor[j], s = approx[j];
          for (int64_t q = 0; q < (B > 0 ? B : bs); ++q) {
            const int64_t i = j * bs + q;
            Acc x = static_cast<Acc>(p_row[i]) - f * (static_cast<Acc>(g_row[i]) + s);
            x = x + keep * x;  // decoupled decay, as p.add_(p, -lr * wd)
            p_row[i] = static_cast<P>(x);
          }
        }
      } else {
        for (int64_t i = from * bs; i < elements; ++i) {
          const int64_t j = i / bs;
          Acc x = static_cast<Acc>(p_row[i]) - factor[j] * (static_cast<Acc>(g_row[i]) + approx[j]);
          x = x + keep * x;
          p_row[i] = static_cast<P>(x);
        }
      }
    }
  }

  static int64_t tile_length(const HaarAdamArgs& args, int64_t block) {
    if (!args.two_d) return k_tile;
    const int64_t budget = std::min(k_tile_max, k_tile_2d_elements / block / block);
    return std::max(k_tile, std::min(budget, args.approx_len));
  }

  const HaarAdamArgs& a_;
  int64_t block_;
  Acc approx_scale_;
  int64_t block_rows_;  // 2-D: block rows per matrix (state rows per matrix)
  int64_t state_rows_;  // rows of exp_avg / exp_avg_sq
  int64_t tile_len_;    // approximation coefficients per tile (the last of a row may have fewer)
  int64_t tiles_per_row_;
  int64_t grain_;  // tiles per parallel chunk, at least
};

// Calls fn(kernel) with the HaarAdam instance for the argument's types and level.
template <typename P, typename G, typename S, typename Acc, typename Fn>
auto with_level(const HaarAdamArgs& args, Fn&& fn) {
  switch (args.level) {
    case 1:
      return fn(HaarAdam<P, G, S, Acc, 2>(args));
    case 2:
      return fn(HaarAdam<P, G, S, Acc, 4>(args));
    case 3:
      return fn(HaarAdam<P, G, S, Acc, 8>(args));
    default:
      return fn(HaarAdam<P, G, S, Acc, 0>(args));
  }
}

// Calls fn(kernel) with the HaarAdam instance for the argument's types and level.
template <typename Fn>
auto with_kernel(const HaarAdamArgs& args, Fn&& fn) {
  return with_grad_types(args, [&](auto types) {
    using T = decltype(types);
    return with_level<typename T::param_t, typename T::grad_t, typename T::state_t,
                      typename T::acc_t>(args, fn);
  });
}

inline double haar_adam_norm_sq(const HaarAdamArgs& args) {
  return with_kernel(args, [](const auto& kernel) { return kernel.norm_sq(); });
}

inline void haar_adam_update(const HaarAdamArgs& args, double lim) {
  with_kernel(args, [lim](const auto& kernel) {
    using Acc = typename std::decay_t<decltype(kernel)>::acc_t;
    kernel.update(static_cast<Acc>(lim));
  });
}

// A value is not finite exactly when its exponent bits are all ones, in float64, float32, float16
// and bfloat16 alike. Whether any value of a run has them is an OR of integer compares, which
// vectorises (`omp simd`: a float reduction would have to keep its order, one dependent add per
// value), and reads each value once, through an integer type that may alias the float one (GCC's
// and clang's may_alias; a memcpy per value defeated GCC 12's vectoriser). The result is the same
// as x's own finiteness: a finite double is checked in double, never as a float.
template <typename U, U Exponent>
U exponent_hits(const void* data, int64_t begin, int64_t end) {
  using Bits [[gnu::may_alias]] = U;
  const Bits* bits = static_cast<const Bits*>(data);
  U hit = 0;
#pragma omp simd reduction(| : hit)
  for (int64_t i = begin; i < end; ++i) hit |= static_cast<U>((bits[i] & Exponent) == Exponent);
  return hit;
}

// A read-only pass runs at the rate the memory answers one core's misses, which a single stream
// does not saturate: the chunk is read as 4 streams of 1 KB blocks taken in turn, each block's
// lines prefetched 4 KB ahead. Measured on 25M float32 values out of cache, 2 threads: 0.65x the
// time of one stream (docs/performance.md#foamadam-2026-12-07).
template <typename U, U Exponent>
bool any_not_finite(const void* data, int64_t begin, int64_t end) {
  const char* bytes = static_cast<const char*>(data);
  constexpr int k_streams = 4;
  constexpr int64_t k_block = 1024 / sizeof(U), k_line = 64 / sizeof(U), k_ahead = 4096 / sizeof(U);
  const int64_t per_stream = (end - begin) / (k_streams * k_block) * k_block;
  U hit = 0;
  for (int64_t i = 0; i < per_stream; i += k_block) {
    for (int s = 0; s < k_streams; ++s) {
      const int64_t b = begin + s * per_stream + i;
      // Past the data's end a prefetch is a hint that fetches nothing; it never faults.
      for (int64_t l = 0; l < k_block; l += k_line)
        __builtin_prefetch(bytes + (b + k_ahead + l) * static_cast<int64_t>(sizeof(U)), 0, 3);
      hit |= exponent_hits<U, Exponent>(data, b, b + k_block);
    }
  }
  hit |= exponent_hits<U, Exponent>(data, begin + k_streams * per_stream, end);
  return hit != 0;
}

template <typename U, U Exponent>
bool all_finite_bits(const void* data, int64_t n) {
  constexpr int64_t chunk = 1 << 16;
  if (n <= chunk) return !any_not_finite<U, Exponent>(data, 0, n);  // no flags, no parallel region
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::vector<unsigned char> bad(static_cast<size_t>(chunks), 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      bad[c] = any_not_finite<U, Exponent>(data, c * chunk, std::min(n, (c + 1) * chunk));
  });
  for (unsigned char b : bad)
    if (b != 0) return false;
  return true;
}

inline bool all_finite(const void* data, int64_t n, ScalarKind kind) {
  switch (kind) {
    case ScalarKind::f32:
      return all_finite_bits<uint32_t, 0x7F800000u>(data, n);
    case ScalarKind::f64:
      return all_finite_bits<uint64_t, 0x7FF0000000000000ull>(data, n);
    case ScalarKind::f16:
      return all_finite_bits<uint16_t, 0x7C00u>(data, n);
    case ScalarKind::bf16:
      return all_finite_bits<uint16_t, 0x7F80u>(data, n);
  }
  return false;
}

}  // namespace GWT_KERNEL_NS
}  // namespace kernels
}  // namespace gwt
