// CUDA launches of the multi-tensor step (src/kernels/shared/multi_tensor.h has the design and the
// bodies; multi_tensor_emulate.h runs the same bodies on the host for the tests). Three kernels
// per group of tensors sharing their types, each a thin shell: the block's threads run the shared
// per-thread body, a shared-memory tree sum where there is one, and thread 0 the bookkeeping.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "block_reduce.cuh"  // BlockLanes
#include "kernels/shared/dispatch.h"
#include "kernels/shared/multi_tensor.h"

namespace gwt {
namespace kernels {
namespace mt {
namespace {

// s[0] = the sum of the block's values in s, in tree_step's fixed order.
__device__ __forceinline__ void block_tree_sum(double* s) {
  __syncthreads();
  for (int half = k_threads / 2; half > 0; half /= 2) {
    tree_step(s, threadIdx.x, half);
    __syncthreads();
  }
}

template <typename P, typename S, typename Acc>
__global__ void __launch_bounds__(k_threads) norm_kernel(Launch l) {
  __shared__ double s[k_threads];
  s[threadIdx.x] = norm_share<P, S, Acc>(l, blockIdx.x, threadIdx.x);
  block_tree_sum(s);
  if (threadIdx.x == 0) {
    l.partials[blockIdx.x] = s[0];
    norm_bookkeeping(l, blockIdx.x);
  }
}

template <typename Acc>
__global__ void __launch_bounds__(k_threads) finalize_kernel(Launch l) {
  __shared__ double s[k_threads];
  s[threadIdx.x] = partials_share(l, blockIdx.x, threadIdx.x);
  block_tree_sum(s);
  if (threadIdx.x == 0) finalize_tensor<Acc>(l, blockIdx.x, s[0]);
}

template <typename P, typename S, typename Acc>
__global__ void __launch_bounds__(k_threads) update_kernel(Launch l) {
  update_share<P, S, Acc>(l, blockIdx.x, threadIdx.x);
  if (threadIdx.x == 0) update_bookkeeping<Acc>(l, blockIdx.x);
}

// General rows: one block per row, the row bodies in dynamic shared memory (Launch::shared_bytes).
template <typename P, typename S, typename Acc>
__global__ void __launch_bounds__(k_threads) general_norm_kernel(Launch l) {
  extern __shared__ __align__(16) unsigned char row_scratch[];
  __shared__ double s[k_threads];
  s[threadIdx.x] = general_norm_share<P, S, Acc>(BlockLanes{}, l, blockIdx.x,
                                                 reinterpret_cast<Acc*>(row_scratch));
  block_tree_sum(s);
  if (threadIdx.x == 0) {
    l.partials[blockIdx.x] = s[0];
    norm_bookkeeping(l, blockIdx.x);
  }
}

template <typename P, typename S, typename Acc>
__global__ void __launch_bounds__(k_threads) general_update_kernel(Launch l) {
  extern __shared__ __align__(16) unsigned char row_scratch[];
  __shared__ double s[k_threads];
  // Counts below 2^53 add exactly in double.
  s[threadIdx.x] = static_cast<double>(general_update_share<P, S, Acc>(
      BlockLanes{}, l, blockIdx.x, reinterpret_cast<Acc*>(row_scratch)));
  block_tree_sum(s);
  if (threadIdx.x == 0) general_update_bookkeeping<Acc>(l, blockIdx.x, static_cast<int64_t>(s[0]));
}

// `kernel` over the launch's chunks with its dynamic shared memory; the opt-in above the default
// 48 KiB is set each time (a property of the kernel, not of one launch).
template <typename Kernel>
void launch_rows(Kernel kernel, const Launch& l, cudaStream_t stream) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(l.shared_bytes)));
  kernel<<<static_cast<unsigned>(l.num_chunks), k_threads, static_cast<size_t>(l.shared_bytes),
           stream>>>(l);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Kernel>
void launch_chunks(Kernel kernel, unsigned blocks, const Launch& l, cudaStream_t stream) {
  kernel<<<blocks, k_threads, 0, stream>>>(l);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

struct CudaKernels {
  cudaStream_t stream;
  void norm(const GroupKey& key, const Launch& l) const {
    with_kinds(key.param_kind, key.state_kind, key.math_f64, [&](auto types) {
      using P = typename decltype(types)::param_t;
      using S = typename decltype(types)::state_t;
      using Acc = typename decltype(types)::acc_t;
      if (key.general)
        launch_rows(general_norm_kernel<P, S, Acc>, l, stream);
      else
        launch_chunks(norm_kernel<P, S, Acc>, static_cast<unsigned>(l.num_chunks), l, stream);
    });
  }
  void finalize(const GroupKey& key, const Launch& l) const {
    with_kinds(key.param_kind, key.state_kind, key.math_f64, [&](auto types) {
      launch_chunks(finalize_kernel<typename decltype(types)::acc_t>,
                    static_cast<unsigned>(l.num_tensors), l, stream);
    });
  }
  void update(const GroupKey& key, const Launch& l) const {
    with_kinds(key.param_kind, key.state_kind, key.math_f64, [&](auto types) {
      using P = typename decltype(types)::param_t;
      using S = typename decltype(types)::state_t;
      using Acc = typename decltype(types)::acc_t;
      if (key.general)
        launch_rows(general_update_kernel<P, S, Acc>, l, stream);
      else
        launch_chunks(update_kernel<P, S, Acc>, static_cast<unsigned>(l.num_chunks), l, stream);
    });
  }
};

}  // namespace

void multi_tensor_step_cuda(const std::vector<Group>& groups, const StepLayout& layout,
                            unsigned char* device_base, StepFlags* flags) {
  for (const Group& g : groups)
    TORCH_CHECK(g.chunks.size() < (size_t{1} << 31) && g.tensors.size() < (size_t{1} << 31),
                "gwt: a multi-tensor group of ", g.tensors.size(), " tensors in ", g.chunks.size(),
                " chunks is more than one launch's grid holds");
  run_step(groups, layout, device_base, flags, CudaKernels{c10::cuda::getCurrentCUDAStream()});
}

}  // namespace mt
}  // namespace kernels
}  // namespace gwt
