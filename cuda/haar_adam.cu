// CUDA body of the fused Haar WaveletAdam passes (see include/gwt/kernels.h for the rule).
//
// One thread per approximation coefficient (one Haar block of 2^level elements); the per-block
// body is src/kernels/haar_block.h, which the tests also run on the host. Blocks of four fp32
// elements are read and written as one aligned float4 when the row length allows it, with a
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
#include "../src/kernels/haar_block.h"
#include "block_reduce.cuh"
#include "gwt/kernels.h"

namespace gwt {
namespace kernels {
namespace {

using haar_block::Scalars;

template <typename P, typename S, typename Acc, int B>
__global__ void norm_pass(const P* __restrict__ grad, const S* __restrict__ m,
                          const S* __restrict__ v, Scalars s, Acc* norm_sq_out, bool vector_ok) {
  Acc sum = 0;
  const int64_t total = haar_block::coefficients(s);
  for (int64_t k = blockIdx.x * int64_t{k_threads} + threadIdx.x; k < total;
       k += int64_t{gridDim.x} * k_threads)
    sum += haar_block::norm_term<P, S, Acc, B>(grad, m, v, s, k, vector_ok);
  sum = block_reduce(sum);
  if (threadIdx.x == 0) atomicAdd(norm_sq_out, sum);
}

template <typename P, typename S, typename Acc, int B>
__global__ void update_pass(P* __restrict__ param, const P* __restrict__ grad, S* __restrict__ m,
                            S* __restrict__ v, Scalars s, const Acc* lim_ptr, bool vector_ok) {
  const Acc lim = *lim_ptr;
  const int64_t total = haar_block::coefficients(s);
  for (int64_t k = blockIdx.x * int64_t{k_threads} + threadIdx.x; k < total;
       k += int64_t{gridDim.x} * k_threads)
    haar_block::update<P, S, Acc, B>(param, grad, m, v, s, lim, k, vector_ok);
}

int grid_for(int64_t total) {
  const int64_t blocks = (total + k_threads - 1) / k_threads;
  return static_cast<int>(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

template <typename P, typename S, typename Acc, int B>
void launch(const HaarAdamArgs& a, void* norm_sq_out, const void* lim) {
  const Scalars s = haar_block::scalars_of(a);
  // float4 access needs 16-byte aligned rows: the base pointers and the row length.
  const bool vector_ok = B == 4 && sizeof(P) == 4 && a.n % 4 == 0 &&
                         reinterpret_cast<uintptr_t>(a.grad) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(a.param) % 16 == 0;
  const int grid = grid_for(haar_block::coefficients(s));
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
