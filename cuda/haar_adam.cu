// CUDA body of the fused Haar WaveletAdam passes (see include/gwt/kernels.h for the rule).
//
// One thread per approximation coefficient (one Haar block of 2^level elements). Blocks of four
// fp32 elements are read and written as one aligned float4 when the row length allows it, with a
// scalar fallback. Math in float (double for float64 parameters); half and bfloat16 converted in
// registers. Both passes run on the current stream and never wait for the host: the norm pass
// adds into a device scalar, the update pass reads the limiter value from one.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../src/kernels/dispatch.h"
#include "block_reduce.cuh"
#include "gwt/kernels.h"

namespace gwt {
namespace kernels {
namespace {

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

template <typename Acc, typename P, int B>
__device__ __forceinline__ void load_block(const P* src, int64_t begin, int64_t n, Acc* out,
                                           bool vector_ok) {
  if constexpr (B == 4 && sizeof(P) == 4) {
    if (vector_ok && begin + 4 <= n) {
      const float4 v = *reinterpret_cast<const float4*>(src + begin);
      out[0] = static_cast<Acc>(v.x), out[1] = static_cast<Acc>(v.y);
      out[2] = static_cast<Acc>(v.z), out[3] = static_cast<Acc>(v.w);
      return;
    }
  }
#pragma unroll
  for (int q = 0; q < B; ++q)
    out[q] = begin + q < n ? static_cast<Acc>(static_cast<float>(src[begin + q])) : Acc(0);
}

template <typename Acc, typename P, int B>
__device__ __forceinline__ void store_block(P* dst, int64_t begin, int64_t n, const Acc* in,
                                            bool vector_ok) {
  if constexpr (B == 4 && sizeof(P) == 4) {
    if (vector_ok && begin + 4 <= n) {
      *reinterpret_cast<float4*>(dst + begin) =
          make_float4(static_cast<float>(in[0]), static_cast<float>(in[1]),
                      static_cast<float>(in[2]), static_cast<float>(in[3]));
      return;
    }
  }
#pragma unroll
  for (int q = 0; q < B; ++q)
    if (begin + q < n) dst[begin + q] = static_cast<P>(in[q]);
}

struct Scalars {
  double beta1, beta2, eps, step_size, decay, approx_scale;
  int64_t rows, n, approx_len;
};

// New moments of coefficient k as stored (rounded to S), in the math type.
template <typename S, typename Acc>
__device__ __forceinline__ void new_moments(const S* m, const S* v, int64_t k, Acc x,
                                            const Scalars& s, Acc& m_new, Acc& v_new) {
  const Acc b1 = static_cast<Acc>(s.beta1), b2 = static_cast<Acc>(s.beta2);
  m_new = static_cast<Acc>(static_cast<float>(
      static_cast<S>(b1 * static_cast<Acc>(static_cast<float>(m[k])) + (Acc(1) - b1) * x)));
  v_new = static_cast<Acc>(static_cast<float>(
      static_cast<S>(b2 * static_cast<Acc>(static_cast<float>(v[k])) + (Acc(1) - b2) * x * x)));
}

// The block's approximation coefficient: its sum times 2^(-L/2) (zeros past n already loaded).
template <typename Acc, int B>
__device__ __forceinline__ Acc block_approx(const Acc* g, const Scalars& s) {
  Acc sum = 0;
#pragma unroll
  for (int q = 0; q < B; ++q) sum += g[q];
  return sum * static_cast<Acc>(s.approx_scale);
}

template <typename P, typename S, typename Acc, int B>
__global__ void norm_pass(const P* __restrict__ grad, const S* __restrict__ m,
                          const S* __restrict__ v, Scalars s, Acc* norm_sq_out, bool vector_ok) {
  Acc sum = 0;
  const int64_t total = s.rows * s.approx_len;
  for (int64_t k = blockIdx.x * int64_t{k_threads} + threadIdx.x; k < total;
       k += int64_t{gridDim.x} * k_threads) {
    const int64_t row = k / s.approx_len, b = k % s.approx_len;
    Acc g[B];
    load_block<Acc, P, B>(grad + row * s.n, b * B, s.n, g, vector_ok);
    const Acc a = block_approx<Acc, B>(g, s);
    Acc m_new, v_new;
    new_moments(m, v, k, a, s, m_new, v_new);
    const Acc normalized = m_new / (sqrt(v_new) + static_cast<Acc>(s.eps));
    sum += normalized * normalized;
  }
  sum = block_reduce(sum);
  if (threadIdx.x == 0) atomicAdd(norm_sq_out, sum);
}

template <typename P, typename S, typename Acc, int B>
__global__ void update_pass(P* __restrict__ param, const P* __restrict__ grad, S* __restrict__ m,
                            S* __restrict__ v, Scalars s, const Acc* lim_ptr, bool vector_ok) {
  const Acc lim = *lim_ptr;
  const int64_t total = s.rows * s.approx_len;
  for (int64_t k = blockIdx.x * int64_t{k_threads} + threadIdx.x; k < total;
       k += int64_t{gridDim.x} * k_threads) {
    const int64_t row = k / s.approx_len, b = k % s.approx_len;
    Acc g[B], p[B];
    load_block<Acc, P, B>(grad + row * s.n, b * B, s.n, g, vector_ok);
    load_block<Acc, P, B>(param + row * s.n, b * B, s.n, p, vector_ok);
    const Acc a = block_approx<Acc, B>(g, s);
    Acc m_new, v_new;
    new_moments(m, v, k, a, s, m_new, v_new);
    m[k] = static_cast<S>(m_new);
    v[k] = static_cast<S>(v_new);
    const Acc factor =
        static_cast<Acc>(s.step_size) / ((sqrt(v_new) + static_cast<Acc>(s.eps)) * lim);
    const Acc shift = (m_new - a) * static_cast<Acc>(s.approx_scale);
    const Acc keep = static_cast<Acc>(-s.decay);
#pragma unroll
    for (int q = 0; q < B; ++q) {
      Acc x = p[q] - factor * (g[q] + shift);
      p[q] = x + keep * x;
    }
    store_block<Acc, P, B>(param + row * s.n, b * B, s.n, p, vector_ok);
  }
}

Scalars scalars_of(const HaarAdamArgs& a) {
  Scalars s;
  s.beta1 = a.beta1, s.beta2 = a.beta2, s.eps = a.eps, s.step_size = a.step_size, s.decay = a.decay;
  s.approx_scale = std::pow(2.0, -0.5 * static_cast<double>(a.level));
  s.rows = a.rows, s.n = a.n, s.approx_len = a.approx_len;
  return s;
}

int grid_for(int64_t total) {
  const int64_t blocks = (total + k_threads - 1) / k_threads;
  return static_cast<int>(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

template <typename P, typename S, typename Acc, int B>
void launch(const HaarAdamArgs& a, void* norm_sq_out, const void* lim) {
  const Scalars s = scalars_of(a);
  // float4 access needs 16-byte aligned rows: the base pointers and the row length.
  const bool vector_ok = B == 4 && sizeof(P) == 4 && a.n % 4 == 0 &&
                         reinterpret_cast<uintptr_t>(a.grad) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(a.param) % 16 == 0;
  const int grid = grid_for(a.rows * a.approx_len);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (norm_sq_out != nullptr) {
    norm_pass<P, S, Acc, B><<<grid, k_threads, 0, stream>>>(
        static_cast<const P*>(a.grad), static_cast<const S*>(a.exp_avg),
        static_cast<const S*>(a.exp_avg_sq), s, static_cast<Acc*>(norm_sq_out), vector_ok);
  } else {
    update_pass<P, S, Acc, B><<<grid, k_threads, 0, stream>>>(
        static_cast<P*>(a.param), static_cast<const P*>(a.grad), static_cast<S*>(a.exp_avg),
        static_cast<S*>(a.exp_avg_sq), s, static_cast<const Acc*>(lim), vector_ok);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename P, typename S, typename Acc>
void with_level(const HaarAdamArgs& a, void* out, const void* lim) {
  switch (a.level) {
    case 1:
      return launch<P, S, Acc, 2>(a, out, lim);
    case 2:
      return launch<P, S, Acc, 4>(a, out, lim);
    case 3:
      return launch<P, S, Acc, 8>(a, out, lim);
    default:
      TORCH_CHECK(false, "gwt: the CUDA Haar kernel supports levels 1 to 3, got ", a.level,
                  "; use fused(false) for deeper transforms");
  }
}

void dispatch(const HaarAdamArgs& a, void* out, const void* lim) {
  TORCH_INTERNAL_ASSERT(a.approx_len == (a.n + (int64_t{1} << a.level) - 1) >> a.level);
  if (a.rows == 0) return;
  with_types(a, [&](auto types) {
    using T = decltype(types);
    with_level<typename T::param_t, typename T::state_t, typename T::acc_t>(a, out, lim);
  });
}

}  // namespace

bool built_with_cuda() {
  return true;
}

void haar_adam_norm_sq_cuda(const HaarAdamArgs& args, void* norm_sq_out) {
  TORCH_INTERNAL_ASSERT(norm_sq_out != nullptr);
  dispatch(args, norm_sq_out, nullptr);
}

void haar_adam_update_cuda(const HaarAdamArgs& args, const void* lim) {
  TORCH_INTERNAL_ASSERT(lim != nullptr);
  dispatch(args, nullptr, lim);
}

}  // namespace kernels
}  // namespace gwt
