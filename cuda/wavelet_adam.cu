// CUDA body of the general fused WaveletAdam passes: any orthogonal wavelet, zero / periodization /
// symmetric mode (see src/kernels/kernels.h for the seam).
//
// One thread block per row (grid-stride over rows): the threads of a block share the row's DWT
// and IDWT level by level. Everything a row needs lives in shared memory: its coefficients of
// every level, two scratch rows and the denominators; the update pass computes the coefficients
// again from the gradient, so no gradient-sized buffer exists and each pass reads the gradient
// once. The row bodies are src/kernels/shared/wavelet_row.h, which the tests also run on the host (one
// lane and with several threads), so the arithmetic here is the arithmetic tested there. Nothing
// waits for the host: the norm pass writes one partial sum (double) per block and a second
// one-block kernel adds them, in a fixed order (row::tree_sum), into a device scalar, so the norm
// has the same bits on every run; the update pass reads the limiter value from a device scalar.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/shared/dispatch.h"
#include "kernels/shared/wavelet_row.h"
#include "block_reduce.cuh"
#include "kernels/kernels.h"

namespace gwt {
namespace kernels {
namespace {

// Shared memory of a block, in the order of wavelet_row_scratch_bytes(): the row's coefficients,
// two scratch rows, the denominators.
template <typename Acc>
struct Scratch {
  Acc *w, *buf0, *buf1, *den;
  __device__ explicit Scratch(const row::RowPlan<Acc>& f) {
    extern __shared__ __align__(16) unsigned char shared[];
    w = reinterpret_cast<Acc*>(shared);
    buf0 = w + f.coeff_len;
    buf1 = buf0 + f.buffer_len;
    den = buf1 + f.buffer_len;
  }
};

template <typename P, typename S, typename Acc>
__global__ void general_norm_pass(const P* __restrict__ grad, const S* __restrict__ m,
                                  const S* __restrict__ v,
                                  const __grid_constant__ row::RowPlan<Acc> f, double* partials) {
  // partials[blockIdx.x]: this block's rows, each thread's share summed in double in row order,
  // then block_reduce; a fixed order.
  const Scratch<Acc> scratch(f);
  const BlockLanes lanes{};
  double sum = 0;
  for (int64_t r = blockIdx.x; r < f.rows; r += gridDim.x)
    sum += static_cast<double>(
        row::row_norm_sq<P, S, Acc>(lanes, f, grad + r * f.n, m + r * f.approx_len,
                                    v + r * f.approx_len, scratch.w, scratch.buf0, scratch.buf1));
  sum = block_reduce(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

template <typename P, typename S, typename Acc>
__global__ void general_update_pass(P* __restrict__ param, const P* __restrict__ grad,
                                    S* __restrict__ m, S* __restrict__ v,
                                    const __grid_constant__ row::RowPlan<Acc> f, const Acc* lim_ptr,
                                    int64_t* kept_per_row) {
  const Scratch<Acc> scratch(f);
  const BlockLanes lanes{};
  const Acc lim = *lim_ptr;
  for (int64_t r = blockIdx.x; r < f.rows; r += gridDim.x) {
    row::row_dwt<P, Acc>(lanes, f, grad + r * f.n, scratch.w, scratch.buf0, scratch.buf1);
    int64_t kept = row::row_update<P, S, Acc>(lanes, f, lim, param + r * f.n, m + r * f.approx_len,
                                              v + r * f.approx_len, scratch.w, scratch.buf0,
                                              scratch.buf1, scratch.den);
    if (kept_per_row != nullptr) {  // the same for every thread of the block
      kept = block_reduce(kept);
      if (threadIdx.x == 0) kept_per_row[r] = kept;
    }
  }
}

template <typename P, typename S, typename Acc>
void launch(const WaveletAdamArgs& a, void* norm_sq_out, const void* lim) {
  const row::RowPlan<Acc> f = row::make_row_plan<Acc>(a);
  const int64_t bytes =
      (f.coeff_len + 2 * f.buffer_len + f.approx_len) * static_cast<int64_t>(sizeof(Acc));
  TORCH_INTERNAL_ASSERT(
      bytes == wavelet_row_scratch_bytes(a.n, a.filter_length, a.level, a.boundary, a.math_f64));
  TORCH_CHECK(bytes <= wavelet_adam_cuda_max_scratch_bytes(), "gwt: a row of length ", a.n,
              " needs ", bytes,
              " bytes of shared memory in the CUDA wavelet kernel, more than the ",
              "device has; use fused(false)");
  const int grid = static_cast<int>(std::min<int64_t>(a.rows, 8192));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (norm_sq_out != nullptr) {
    auto kernel = general_norm_pass<P, S, Acc>;
    // Always: the default cap (48 KiB less the kernel's static shared memory) is not ours to guess.
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
    const NormPartials partials(grid);
    kernel<<<grid, k_threads, bytes, stream>>>(
        static_cast<const P*>(a.grad), static_cast<const S*>(a.exp_avg),
        static_cast<const S*>(a.exp_avg_sq), f, partials.data());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    partials.add_to(static_cast<Acc*>(norm_sq_out), stream);
  } else {
    auto kernel = general_update_pass<P, S, Acc>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
    kernel<<<grid, k_threads, bytes, stream>>>(
        static_cast<P*>(a.param), static_cast<const P*>(a.grad), static_cast<S*>(a.exp_avg),
        static_cast<S*>(a.exp_avg_sq), f, static_cast<const Acc*>(lim), a.kept_per_row);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dispatch(const WaveletAdamArgs& a, void* norm_sq_out, const void* lim) {
  if (a.rows == 0) return;
  TORCH_INTERNAL_ASSERT(a.level >= 1 && a.n >= 1);
  with_types(a, [&](auto types) {
    using T = decltype(types);
    launch<typename T::param_t, typename T::state_t, typename T::acc_t>(a, norm_sq_out, lim);
  });
}

}  // namespace

int64_t wavelet_adam_cuda_max_scratch_bytes() {
  // The opt-in limit covers static shared memory too (block_reduce's: 8 double or 8 int64
  // values); 256 bytes leave room for it.
  return static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin) - 256;
}

void wavelet_adam_norm_sq_cuda(const WaveletAdamArgs& args, void* norm_sq_out) {
  TORCH_INTERNAL_ASSERT(norm_sq_out != nullptr);
  dispatch(args, norm_sq_out, nullptr);
}

void wavelet_adam_update_cuda(const WaveletAdamArgs& args, const void* lim) {
  TORCH_INTERNAL_ASSERT(lim != nullptr);
  dispatch(args, nullptr, lim);
}

}  // namespace kernels
}  // namespace gwt
