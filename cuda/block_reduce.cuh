#pragma once

// What the CUDA bodies share: the block size and a block-wide sum.

namespace gwt {
namespace kernels {
namespace {

constexpr int k_threads = 256;  // threads per block of every gwt kernel

/// Sum of `value` over the block (k_threads threads, all of which must call it); the result is
/// valid in thread 0. Two calls need a __syncthreads() between them.
template <typename T>
__device__ __forceinline__ T block_reduce(T value) {
  __shared__ T warp_sums[k_threads / 32];
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_down_sync(0xffffffffu, value, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  value = threadIdx.x < k_threads / 32 ? warp_sums[threadIdx.x] : T(0);
  if (warp == 0)
    for (int offset = 16; offset > 0; offset /= 2)
      value += __shfl_down_sync(0xffffffffu, value, offset);
  return value;
}

}  // namespace
}  // namespace kernels
}  // namespace gwt
