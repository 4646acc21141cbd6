#pragma once

// What the CUDA bodies share: the block size, a block-wide sum, the lanes of a block, and the
// norm passes' per-block partials with their fixed-order sum.

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/shared/wavelet_row.h"

namespace gwt {
namespace kernels {
namespace {

constexpr int k_threads = 256;  // threads per block of every gwt kernel

/// Sum of `value` over the block (k_threads threads, all of which must call it); the result is
/// valid in thread 0. Two calls need a __syncthreads() between them. The order of the additions is
/// fixed (shuffles down a tree, then warp 0 over the warps' sums), so the result has the same bits
/// on every run.
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

/// The threads of one block as the lanes of the shared bodies (src/kernels/shared/wavelet_row.h).
struct BlockLanes {
  __host__ __device__ int64_t lane() const {
#ifdef __CUDA_ARCH__
    return threadIdx.x;
#else
    return 0;
#endif
  }
  __host__ __device__ int64_t lanes() const {
#ifdef __CUDA_ARCH__
    return blockDim.x;
#else
    return 1;
#endif
  }
  __host__ __device__ void sync() const {
#ifdef __CUDA_ARCH__
    __syncthreads();
#endif
  }
};

/// One block: *out += the sum of partials[0, count) in row::tree_sum's order (overwrites
/// partials).
template <typename Acc>
__global__ void add_partials(double* partials, int64_t count, Acc* out) {
  const double total = row::tree_sum(BlockLanes{}, partials, count);
  if (threadIdx.x == 0) *out += static_cast<Acc>(total);
}

/// The norm passes' per-block partial sums (double), one per block of the grid, in device memory
/// from LibTorch's caching allocator on the current stream. A float atomicAdd of the partials into
/// the result would add them in whatever order the blocks finish, so the limiter, and with it
/// training and resume, would differ from run to run; add_to() sums them in one fixed order
/// instead, for any grid.
class NormPartials {
 public:
  explicit NormPartials(int blocks)
      : blocks_(blocks),
        memory_(c10::cuda::CUDACachingAllocator::get()->allocate(static_cast<size_t>(blocks) *
                                                                 sizeof(double))) {}
  double* data() const { return static_cast<double*>(memory_.get()); }
  /// After the norm pass wrote every partial: *out += their sum, on `stream`.
  template <typename Acc>
  void add_to(Acc* out, cudaStream_t stream) const {
    add_partials<Acc><<<1, k_threads, 0, stream>>>(data(), blocks_, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

 private:
  int blocks_;
  // Freed when this goes out of scope: the caching allocator reuses the memory only for work
  // queued later on the same stream, after the kernels that read it.
  c10::DataPtr memory_;
};

}  // namespace
}  // namespace kernels
}  // namespace gwt
