// CUDA body of the fused Haar WaveletAdam passes (see src/kernels/kernels.h for the rule).
//
// One thread per approximation coefficient (one Haar block of 2^level elements); the per-block
// body is src/kernels/shared/haar_block.h, which the tests also run on the host. Blocks of four fp32
// elements are read and written as one aligned float4 when the row length allows it, with a
// scalar fallback. Math in float (double for float64 parameters); half and bfloat16 converted in
// registers. Both passes run on the current stream and never wait for the host: the norm pass
// writes one partial sum (double) per block and a second one-block kernel adds them, in a fixed
// order (row::tree_sum), into a device scalar, so the norm has the same bits on every run; the
// update pass reads the limiter value from a device scalar.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>

#include "kernels/shared/dispatch.h"
#include "kernels/shared/haar_block.h"
#include "block_reduce.cuh"
#include "kernels/kernels.h"

namespace gwt {
namespace kernels {
namespace {

using haar_block::Scalars;

// partials[blockIdx.x] = this block's share of the sum of squares, summed in double in a fixed
// order (each thread's coefficients in ascending order, then block_reduce).
template <typename P, typename S, typename Acc, int B>
__global__ void norm_pass(const P* __restrict__ grad, const S* __restrict__ m,
                          const S* __restrict__ v, Scalars s, double* partials, bool vector_ok) {
  double sum = 0;
  const int64_t total = haar_block::coefficients(s);
  for (int64_t k = blockIdx.x * int64_t{k_threads} + threadIdx.x; k < total;
       k += int64_t{gridDim.x} * k_threads)
    sum += static_cast<double>(haar_block::norm_term<P, S, Acc, B>(grad, m, v, s, k, vector_ok));
  sum = block_reduce(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
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
    const NormPartials partials(grid);
    norm_pass<P, S, Acc, B><<<grid, k_threads, 0, stream>>>(
        static_cast<const P*>(a.grad), static_cast<const S*>(a.exp_avg),
        static_cast<const S*>(a.exp_avg_sq), s, partials.data(), vector_ok);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    partials.add_to(static_cast<Acc*>(norm_sq_out), stream);
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

#ifndef GWT_CUDA_ARCH_LIST
#define GWT_CUDA_ARCH_LIST "(unknown)"
#endif

// Whether device_index has an image of the kernels (or PTX its driver compiles), asking the CUDA
// runtime for a kernel's attributes; warns once where it has none. Both .cu files are compiled
// for the same architectures (one target), so one kernel answers for all of them.
bool ask_device(int device_index) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: clear the error, it is not the user's
    return false;
  }
  if (device_index < 0 || device_index >= count) return false;
  int previous = 0;
  C10_CUDA_CHECK(cudaGetDevice(&previous));
  C10_CUDA_CHECK(cudaSetDevice(device_index));
  cudaFuncAttributes attributes;
  const cudaError_t error = cudaFuncGetAttributes(&attributes, norm_pass<float, float, float, 4>);
  (void)cudaGetLastError();  // an image missing is not a sticky error: clear it for later checks
  cudaDeviceProp properties;
  const bool have_properties = cudaGetDeviceProperties(&properties, device_index) == cudaSuccess;
  (void)cudaGetLastError();
  C10_CUDA_CHECK(cudaSetDevice(previous));
  if (error == cudaSuccess) return true;
  TORCH_WARN("gwt: the CUDA kernels have no image for device ", device_index, " (",
             have_properties ? properties.name : "unknown", ", compute capability ",
             have_properties ? properties.major : -1, ".", have_properties ? properties.minor : -1,
             "): they were built for ", GWT_CUDA_ARCH_LIST, " (GWT_CUDA_ARCHITECTURES); ",
             "this device's parameters take the reference path (as with fused(false)). ",
             "CUDA said: ", cudaGetErrorString(error));
  return false;
}

}  // namespace

bool built_with_cuda() {
  return true;
}

bool cuda_kernels_run_on(int device_index) {
  // 0: not asked yet, 1: runs, 2: does not (or no such device). Devices past the table are
  // asked every time (no machine has that many).
  constexpr int k_devices = 64;
  static std::atomic<int8_t> known[k_devices] = {};
  if (device_index >= 0 && device_index < k_devices) {
    const int8_t answer = known[device_index].load(std::memory_order_acquire);
    if (answer != 0) return answer == 1;
  }
  static std::mutex mutex;
  const std::lock_guard<std::mutex> lock(mutex);
  if (device_index >= 0 && device_index < k_devices &&
      known[device_index].load(std::memory_order_relaxed) != 0)
    return known[device_index].load(std::memory_order_relaxed) == 1;
  const bool runs = ask_device(device_index);
  if (device_index >= 0 && device_index < k_devices)
    known[device_index].store(runs ? 1 : 2, std::memory_order_release);
  return runs;
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
